"""LoRA through the offline API on a tiny random Llama: a batch whose rows run with five different
adapters (more than --max-loras, and more than the host keeps) and without any gives each row
the greedy tokens it gets alone; an adapter whose B is zero gives the base model's tokens; a
bad adapter is refused with its reason."""
from __future__ import annotations

import pytest

from actors.api import LLM, LoRARequest, SamplingParams
from models.lora import InvalidAdapter
from tests.helpers import save_tiny_llama, save_tiny_lora, save_tiny_tokenizer

VOCAB = 128
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-offline")
    path = save_tiny_llama(root / "base", VOCAB, 64, 96, 4, 2, 16, 256)
    save_tiny_tokenizer(path, VOCAB)
    loras = []
    for i in range(5):
        save_tiny_lora(path, root / f"a{i}", 16, ALL if i % 2 == 0 else ["q_proj", "v_proj", "down_proj"],
                       seed=10 + i, scale=0.2)
        loras.append(LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")))
    save_tiny_lora(path, root / "zero", 8, ALL, seed=99, zero_b=True)
    zero = LoRARequest("zero", 99, str(root / "zero"))
    llm = LLM(path, enable_lora=True, max_loras=4, max_cpu_loras=4, max_lora_rank=16, block_size=4)
    yield llm, loras, zero, root
    llm.close()


PROMPTS = [[5, 17, 99, 3, 64], [7, 7, 9], [100, 2, 30, 40, 50, 60, 70], [1, 2, 3, 4], [88, 11],
           [42, 43, 44, 45, 46, 47], [9, 8, 7, 6, 5], [120, 121, 3]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_a_mixed_batch_gives_each_row_its_tokens_alone(setup):
    llm, loras, _, _ = setup
    row_loras = [loras[0], None, loras[1], loras[2], None, loras[3], loras[4], loras[0]]
    together = llm.generate(PROMPTS, GREEDY, lora_request=row_loras, use_tqdm=False)
    alone = [llm.generate([p], GREEDY, lora_request=[lr], use_tqdm=False)[0] for p, lr in zip(PROMPTS, row_loras)]
    base = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert all(len(r.token_ids) == 8 for r in together)
    changed = [t.token_ids != b.token_ids for t, b in zip(together, base)]
    assert changed == [lr is not None for lr in row_loras]     # every adapter changes its row, no other


def test_an_adapter_with_zero_b_gives_the_base_tokens(setup):
    llm, _, zero, _ = setup
    base = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    with_zero = llm.generate(PROMPTS, GREEDY, lora_request=zero, use_tqdm=False)
    assert [r.token_ids for r in with_zero] == [r.token_ids for r in base]


def test_a_bad_adapter_is_refused_with_its_reason(setup, tmp_path):
    llm, _, _, root = setup
    with pytest.raises(InvalidAdapter, match="no adapter directory"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("missing", 50, str(tmp_path / "none")))
    big = save_tiny_lora(str(root / "base"), tmp_path / "big", 32, ALL, seed=3)
    del big
    with pytest.raises(InvalidAdapter, match="more than --max-lora-rank 16"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("big", 51, str(tmp_path / "big")))
    out = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)     # the engine goes on
    assert len(out[0].token_ids) == 8


def test_an_adapter_whose_files_went_away_fails_only_its_own_prompts(setup):
    """Read once, dropped from the worker's host cache (max_cpu_loras 4) by four others, then its
    directory removed: its prompt ends with an error naming it, the other prompts of the same
    batch get their tokens, and the engine goes on."""
    import shutil
    llm, loras, _, root = setup
    shutil.copytree(root / "a0", root / "vanish")
    vanish = LoRARequest("vanish", 60, str(root / "vanish"))
    llm.generate(PROMPTS[:1], GREEDY, lora_request=vanish, use_tqdm=False)
    llm.generate(PROMPTS[:4], GREEDY, lora_request=loras[:4], use_tqdm=False)
    shutil.rmtree(root / "vanish")
    base = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    out = llm.generate(PROMPTS[:3], GREEDY, lora_request=[None, vanish, None], use_tqdm=False)
    assert out[1].finish_reason == "error" and "LoRA adapter 'vanish' could not be loaded" in out[1].error
    assert [out[0].token_ids, out[2].token_ids] == [base[0].token_ids, base[2].token_ids]
    assert llm.generate(PROMPTS[:1], GREEDY, lora_request=loras[0], use_tqdm=False)[0].finish_reason == "length"


def test_adapters_over_two_tensor_parallel_ranks_give_one_workers_tokens(setup):
    """Each rank keeps its share of an adapter (B's rows of q|k|v and gate|up, A's columns of o and
    down, whose partial deltas the layers' all-reduce sums): a mixed batch over two ranks gives
    the tokens of one worker."""
    llm, loras, _, root = setup
    row_loras = [loras[0], None, loras[1], loras[4]]
    want = [r.token_ids for r in llm.generate(PROMPTS[:4], GREEDY, lora_request=row_loras, use_tqdm=False)]
    with LLM(str(root / "base"), enable_lora=True, max_loras=4, max_cpu_loras=4, max_lora_rank=16, block_size=4,
             tensor_parallel_size=2) as tp:
        got = [r.token_ids for r in tp.generate(PROMPTS[:4], GREEDY, lora_request=row_loras, use_tqdm=False)]
        assert tp.get_world_size() == tp.get_world_size(include_dp=False) == 2        # vLLM's
    assert got == want


def test_adapters_over_two_pipeline_stages_give_one_workers_tokens(setup):
    """Each stage applies an adapter to its own layers (the others' weights are the other stage's).
    (The LLM is made as vLLM's ``LLM.from_engine_args(EngineArgs(...))`` makes one.)"""
    from actors.engine.args import EngineArgs
    llm, loras, _, root = setup
    row_loras = [loras[1], loras[2], None, loras[3]]
    want = [r.token_ids for r in llm.generate(PROMPTS[:4], GREEDY, lora_request=row_loras, use_tqdm=False)]
    args = EngineArgs.from_options(str(root / "base"), dict(enable_lora=True, max_loras=4, max_cpu_loras=4,
                                                            max_lora_rank=16, block_size=4, pipeline_parallel_size=2))
    with LLM.from_engine_args(args) as pp:
        assert pp.get_world_size() == 2
        got = [r.token_ids for r in pp.generate(PROMPTS[:4], GREEDY, lora_request=row_loras, use_tqdm=False)]
    assert got == want


def test_async_llm_adds_lists_and_removes_adapters_by_id_as_vllms_does(setup):
    """vLLM's AsyncLLM.add_lora / list_loras / remove_lora: an added adapter is listed by its id
    and serves its tokens; removed, it is no longer listed (a second removal is False)."""
    import asyncio

    from actors.api import AsyncLLM
    _, loras, _, root = setup

    async def scenario() -> tuple:
        llm = await AsyncLLM.create(str(root / "base"), enable_lora=True, max_lora_rank=16, block_size=4)
        try:
            added = await llm.add_lora(loras[1])
            listed = await llm.list_loras()
            out = await llm.complete(PROMPTS[0], GREEDY, lora_request=loras[1])
            base = await llm.complete(PROMPTS[0], GREEDY)
            removed = await llm.remove_lora(loras[1].lora_int_id), await llm.remove_lora(loras[1].lora_int_id)
            return added, listed, out.token_ids, base.token_ids, removed, await llm.list_loras()
        finally:
            await llm.shutdown()

    added, listed, with_adapter, base, removed, after = asyncio.run(scenario())
    assert added and listed == {loras[1].lora_int_id}
    assert len(with_adapter) == 8 and with_adapter != base
    assert removed == (True, False) and after == set()


def test_async_llm_pins_an_adapter_which_then_outlives_the_host_caches_least_recently_used_order(setup):
    """vLLM's AsyncLLM.pin_lora: a pinned adapter is read at once and evicted last, so with room
    for two adapters on the host (max_cpu_loras 2) three others run after it and it is still
    there once its directory is gone: its prompt gets the tokens it got before. An unpinned one
    in its place is dropped and then fails; an unknown id is vLLM's ValueError."""
    import asyncio
    import shutil

    from actors.api import AsyncLLM
    _, loras, _, root = setup
    for name in ("pinned", "unpinned"):
        shutil.copytree(root / "a0", root / name)
    pinned, unpinned = LoRARequest("pinned", 70, str(root / "pinned")), LoRARequest("unpinned", 71, str(root / "unpinned"))

    async def scenario() -> tuple:
        llm = await AsyncLLM.create(str(root / "base"), enable_lora=True, max_loras=1, max_cpu_loras=2,
                                    max_lora_rank=16, block_size=4)
        try:
            with pytest.raises(ValueError, match="Pinning failed. LoRA 70 is not registered."):
                await llm.pin_lora(70)
            await llm.add_lora(pinned)
            assert await llm.pin_lora(70)
            first = await llm.complete(PROMPTS[0], GREEDY, lora_request=pinned)
            before = await llm.complete(PROMPTS[0], GREEDY, lora_request=unpinned)
            for lora in loras[1:4]:
                await llm.complete(PROMPTS[1], GREEDY, lora_request=lora)
            shutil.rmtree(root / "pinned")
            shutil.rmtree(root / "unpinned")
            return first, before, (await llm.complete(PROMPTS[0], GREEDY, lora_request=pinned),
                                   await llm.complete(PROMPTS[0], GREEDY, lora_request=unpinned))
        finally:
            await llm.shutdown()

    first, before, (kept, dropped) = asyncio.run(scenario())
    assert kept.finish_reason == "length" and kept.token_ids == first.token_ids == before.token_ids
    assert dropped.finish_reason == "error" and "LoRA adapter 'unpinned' could not be loaded" in dropped.error


def test_a_pinned_adapter_is_pinned_again_on_the_worker_that_replaces_a_killed_one(setup):
    """The engine restarts a worker killed with SIGKILL; the adapters pinned before are read again
    by the new worker with its first step, so once their directory is gone a pinned adapter still
    answers with the tokens it gave before the kill, while one only used before the kill (the new
    worker never read it) fails."""
    import asyncio
    import os
    import shutil
    import signal
    import time

    import psutil

    from actors.api import AsyncLLM
    _, _, _, root = setup
    for name in ("repinned", "used"):
        shutil.copytree(root / "a2", root / name)
    pinned, used = LoRARequest("repinned", 80, str(root / "repinned")), LoRARequest("used", 81, str(root / "used"))

    async def scenario() -> tuple:
        before = {p.pid for p in psutil.Process().children()}
        llm = await AsyncLLM.create(str(root / "base"), multiprocess=True, enable_lora=True, max_loras=2,
                                    max_cpu_loras=2, max_lora_rank=16, block_size=4)
        try:
            await llm.add_lora(pinned)
            assert await llm.pin_lora(80)
            first = await llm.complete(PROMPTS[0], GREEDY, lora_request=pinned)
            await llm.complete(PROMPTS[0], GREEDY, lora_request=used)
            (engine,) = [p for p in psutil.Process().children() if p.pid not in before]     # this engine's
            (worker,) = engine.children()
            os.kill(worker.pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while True:                     # the first request the new worker serves carries the pin
                assert time.monotonic() < deadline, "the worker was not restarted"
                base = await llm.complete(PROMPTS[1], GREEDY)
                if base.finish_reason == "length":
                    break
                await asyncio.sleep(0.5)
            assert [p.pid for p in engine.children()] != [worker.pid]
            shutil.rmtree(root / "repinned")
            shutil.rmtree(root / "used")
            return first, (await llm.complete(PROMPTS[0], GREEDY, lora_request=pinned),
                           await llm.complete(PROMPTS[0], GREEDY, lora_request=used))
        finally:
            await llm.shutdown()

    first, (kept, lost) = asyncio.run(scenario())
    assert kept.finish_reason == "length" and kept.token_ids == first.token_ids
    assert lost.finish_reason == "error" and "LoRA adapter 'used' could not be loaded" in lost.error
