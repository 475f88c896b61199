"""LoRA on our model against peft on transformers' model, on the same tiny random weights: logits of
the base model plus an adapter match (plain lora_alpha / r scaling and rsLoRA, all seven target
modules or a few); an adapter whose B is zero gives the base model's tokens exactly; rows of different adapters and rows without one in
one step each get the logits they get alone; the native kernel matches the torch version."""
from __future__ import annotations

import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")   # before any kernel module

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from actors.engine.lora import LoRAConfig, LoRARequest  # noqa: E402
from actors.worker.lora_manager import LoRAModelManager  # noqa: E402
from kernels.attention import allocate_kv_caches  # noqa: E402
from kernels.cpu import lora as lora_ops  # noqa: E402
from kernels.cpu.native import available  # noqa: E402
from models.native_decode import attach  # noqa: E402
from models.packed import prepack_linears  # noqa: E402
from models.registry import load_model  # noqa: E402
from models.resolve import resolve_model  # noqa: E402
from tests.helpers import save_tiny_llama, save_tiny_lora  # noqa: E402

VOCAB, BLOCK = 128, 4
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    path = save_tiny_llama(root / "base", VOCAB, 64, 96, 4, 2, 16, 256)
    adapters = {
        "all16": save_tiny_lora(path, str(root / "all16"), 16, ALL, 1),
        "qv8_rs": save_tiny_lora(path, str(root / "qv8_rs"), 8, ["q_proj", "v_proj"], 2, rslora=True),
        "mlp4": save_tiny_lora(path, str(root / "mlp4"), 4, ["gate_proj", "down_proj"], 3),
        "attn8": save_tiny_lora(path, str(root / "attn8"), 8, ["k_proj", "o_proj", "up_proj"], 4),
        "zero": save_tiny_lora(path, str(root / "zero"), 8, ALL, 5, zero_b=True),
    }
    model, config = load_model(resolve_model(path))
    prepack_linears(model)        # as the worker does: packed layers, the native decode stack
    attach(model)
    manager = LoRAModelManager(model, LoRAConfig(max_loras=4, max_cpu_loras=5, max_lora_rank=16), config,
                               torch.device("cpu"))
    requests = {name: LoRARequest(name, i + 1, str(root / name)) for i, name in enumerate(adapters)}
    return model, config, manager, adapters, requests


def _run(tiny, prompts: list[list[int]], loras: list[str | None], decode_steps: int = 3) -> list[torch.Tensor]:
    """Per request, the logits (rows, vocab) of its prompt then of ``decode_steps`` greedy decode
    steps, all requests in the same steps, each with its adapter (None: the base model)."""
    model, config, manager, _, requests = tiny
    caches = allocate_kv_caches(config, num_blocks=1 + 16 * len(prompts), block_size=BLOCK)
    tables = [list(range(1 + 16 * i, 1 + 16 * (i + 1))) for i in range(len(prompts))]
    reqs = [requests[n] if n else None for n in loras]
    steps = [[torch.tensor(p) for p in prompts]]
    out = [[] for _ in prompts]
    done = [0] * len(prompts)
    for s in range(decode_steps + 1):
        new = steps[-1]
        manager.set_adapter_mapping(reqs, np.array([len(n) for n in new]))
        caches_done = done
        logits = _step(model, caches, tables, new, caches_done)
        done = [d + len(n) for d, n in zip(done, new)]
        rows = np.cumsum([len(n) for n in new])
        start = 0
        nxt = []
        for i, end in enumerate(rows):
            out[i].append(logits[start:end])
            nxt.append(logits[end - 1].argmax().view(1))
            start = end
        steps.append(nxt)
    manager.mapping.clear()
    return [torch.cat(o) for o in out]


def _step(model, caches, tables, new, done):
    from kernels.attention import build_attention_metadata
    ids = torch.cat(new)
    pos = torch.cat([torch.arange(d, d + len(n)) for d, n in zip(done, new)])
    meta = build_attention_metadata([len(n) for n in new], [d + len(n) for d, n in zip(done, new)], tables, BLOCK)
    with torch.inference_mode():
        return model.compute_logits(model(ids, pos, caches, meta))


def _peft_logits(peft_model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return peft_model(torch.tensor([tokens])).logits[0].float()


PROMPT = [5, 17, 99, 3, 64, 21, 8, 120, 44]


@pytest.mark.parametrize("name", ["all16", "qv8_rs", "mlp4", "attn8"])
def test_logits_with_an_adapter_match_peft_on_transformers(tiny, name):
    ours = _run(tiny, [PROMPT], [name])[0]                      # prompt then 3 greedy decode steps
    tokens = PROMPT + ours[len(PROMPT) - 1:-1].argmax(-1).tolist()
    ref = _peft_logits(tiny[3][name], tokens)
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-4)
    base = _run(tiny, [PROMPT], [None])[0]
    assert (base - ours).abs().max() > 1e-2                     # the adapter does change the logits


def test_an_adapter_with_zero_b_gives_the_base_logits_exactly(tiny):
    """Its delta is exactly zero, and a step with LoRA tokens runs the same kernels (the native
    decode stack included, with the deltas added after each linear)."""
    base = _run(tiny, [PROMPT, PROMPT[:4]], [None, None], decode_steps=6)
    zero = _run(tiny, [PROMPT, PROMPT[:4]], ["zero", None], decode_steps=6)
    for b, z in zip(base, zero):
        assert torch.equal(b, z)


def test_rows_of_four_adapters_and_base_rows_in_one_step_get_their_logits_alone(tiny):
    prompts = [PROMPT, PROMPT[:5], [7, 7, 9, 100], PROMPT[2:], [1, 2, 3], [60, 61, 62, 63, 64, 65]]
    loras = ["all16", None, "qv8_rs", "mlp4", None, "attn8"]
    together = _run(tiny, prompts, loras)
    for p, name, got in zip(prompts, loras, together):
        alone = _run(tiny, [p], [name])[0]
        torch.testing.assert_close(got, alone, rtol=0, atol=1e-5)
        assert torch.equal(got.argmax(-1), alone.argmax(-1))


@pytest.mark.skipif(not available()[0], reason="native CPU kernels unavailable")
def test_native_shrink_expand_matches_the_torch_version():
    g = torch.Generator().manual_seed(0)
    S, R, inp, sizes = 3, 8, 40, [24, 8, 8]
    a = torch.randn(S, inp, len(sizes) * R, generator=g)
    b = torch.randn(S, R, sum(sizes), generator=g)
    ranks = torch.tensor([8, 5, 0])
    a[1, :, 5:R] = a[1, :, R + 5:2 * R] = a[1, :, 2 * R + 5:] = 0       # slot 1 holds a rank-5 adapter
    b[1, 5:] = 0
    offsets = torch.tensor([0, 24, 32, 40])
    x = torch.randn(11, inp, generator=g)
    slots = np.array([0, -1, 1, 1, 0, -1, 2, 0, 1, -1, 0])
    y0 = torch.randn(11, 40, generator=g)
    y_native, y_ref = y0.clone(), y0.clone()
    lora_ops.lora_shrink_expand(y_native, x, a, b, torch.from_numpy(slots), ranks, offsets)
    lora_ops.lora_shrink_expand_ref(y_ref, x, a, b, lora_ops.token_segments(slots), ranks.tolist(), offsets.tolist())
    torch.testing.assert_close(y_native, y_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(y_native[slots < 0], y0[slots < 0])
    assert not torch.allclose(y_native[slots == 1], y0[slots == 1])


def test_the_manager_keeps_lru_adapters_in_slots_and_on_the_host(tiny):
    """Two slots, three adapters on the host: a step's adapters take free slots, then the least
    recently used slot not needed by the step; the host drops its least recently used adapter."""
    model, config, _, _, requests = tiny
    fresh, _ = load_model(resolve_model(str(Path(requests["all16"].lora_path).parent / "base")))
    m = LoRAModelManager(fresh, LoRAConfig(max_loras=2, max_cpu_loras=3, max_lora_rank=16), config,
                         torch.device("cpu"))
    one = np.array([1])
    a, b, c, d = (requests[n] for n in ("all16", "qv8_rs", "mlp4", "attn8"))
    m.set_adapter_mapping([a], one)
    m.set_adapter_mapping([b, None], np.array([1, 1]))
    assert m.lora_index_to_id == [a.lora_int_id, b.lora_int_id]
    m.set_adapter_mapping([b], one)                 # a is now the least recently used slot
    m.set_adapter_mapping([c], one)
    assert m.lora_index_to_id == [c.lora_int_id, b.lora_int_id]
    assert list(m._registered) == [a.lora_int_id, b.lora_int_id, c.lora_int_id]
    m.set_adapter_mapping([d, c], np.array([1, 1]))      # the host drops a; d takes b's slot
    assert list(m._registered) == [b.lora_int_id, d.lora_int_id, c.lora_int_id]
    assert sorted(m.lora_index_to_id) == sorted([c.lora_int_id, d.lora_int_id])
    assert m.mapping.token_slots.tolist() == [m.lora_index_to_id.index(d.lora_int_id),
                                              m.lora_index_to_id.index(c.lora_int_id)]


def test_the_per_layer_torch_path_gives_the_native_decode_stacks_logits(tiny, monkeypatch):
    """LoRA steps through the native decode stack (deltas by the native kernel after each linear)
    and through the per-layer path with the segmented torch ops give the same logits."""
    prompts, loras = [PROMPT, PROMPT[:5], [7, 7, 9, 100]], ["all16", None, "mlp4"]
    native = _run(tiny, prompts, loras)
    assert tiny[0].native_decode.words is not None          # the stack took the LoRA steps
    monkeypatch.setattr(tiny[0].native_decode, "words", None)
    monkeypatch.setattr(lora_ops, "native_supports", lambda *a: False)
    for got, want in zip(_run(tiny, prompts, loras), native):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_an_adapter_whose_files_are_gone_fails_only_its_rows_and_unloading_frees_its_slot(tiny, tmp_path):
    """Read once, then dropped from the host (max_cpu_loras): once its directory is removed, or
    its weights corrupted, a step with it leaves its rows without an adapter and names it in
    ``failed``, the other rows keep theirs; removing an adapter empties its slot at once."""
    import shutil
    model, config, _, _, requests = tiny
    fresh, _ = load_model(resolve_model(str(Path(requests["all16"].lora_path).parent / "base")))
    m = LoRAModelManager(fresh, LoRAConfig(max_loras=2, max_cpu_loras=2, max_lora_rank=16), config,
                         torch.device("cpu"))
    gone, bad = tmp_path / "gone", tmp_path / "bad"
    shutil.copytree(requests["all16"].lora_path, gone)
    shutil.copytree(requests["mlp4"].lora_path, bad)
    g, b = LoRARequest("gone", 40, str(gone)), LoRARequest("bad", 41, str(bad))
    ok = requests["qv8_rs"]
    one = np.array([1])
    m.set_adapter_mapping([g, b], np.array([1, 1]))
    m.set_adapter_mapping([ok], one)
    m.set_adapter_mapping([requests["attn8"]], one)                      # g and b leave the host
    assert g.lora_int_id not in m._registered and b.lora_int_id not in m._registered
    shutil.rmtree(gone)
    (bad / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    assert m.set_adapter_mapping([g, ok, None], np.array([2, 1, 1]))
    assert list(m.failed) == [g.lora_int_id]
    assert "'gone'" in m.failed[g.lora_int_id] and "no adapter directory" in m.failed[g.lora_int_id]
    ok_slot = m.lora_index_to_id.index(ok.lora_int_id)
    assert m.mapping.token_slots.tolist() == [-1, -1, ok_slot, -1]
    assert not m.set_adapter_mapping([b, None], np.array([1, 1]))        # no row keeps an adapter
    assert list(m.failed) == [b.lora_int_id] and "'bad'" in m.failed[b.lora_int_id]
    assert m.remove_adapter(ok.lora_int_id)
    assert ok.lora_int_id not in m.lora_index_to_id and ok.lora_int_id not in m._registered
    assert m.lora_index_to_id.count(None) == 1                          # its slot is free again
    m.set_adapter_mapping([ok], one)
    assert not m.failed


def test_an_adapter_on_glms_reordered_q_and_k_rows_matches_peft(tmp_path):
    """GLM's q and k rows are reordered at load (its interleaved rotary served half-split): an
    adapter's B rows for them are reordered alike, so the engine's greedy tokens with an adapter
    on q, k, v and o equal peft's on transformers' GLM, and differ from the base model's."""
    from peft import LoraConfig, get_peft_model
    from transformers import GlmConfig, GlmForCausalLM

    from actors.api import LLM, SamplingParams
    from tests.helpers import randomize_lora, save_tiny_tokenizer
    torch.manual_seed(0)
    hf = GlmForCausalLM(GlmConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, num_hidden_layers=2, partial_rotary_factor=0.5,
                                  attention_bias=True, tie_word_embeddings=False, pad_token_id=0, eos_token_id=[1],
                                  bos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.15)
    hf.save_pretrained(tmp_path / "glm")
    save_tiny_tokenizer(tmp_path / "glm", VOCAB)
    peft = get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                         lora_dropout=0.0, init_lora_weights=False))
    randomize_lora(peft, seed=1, scale=0.2)
    peft.save_pretrained(tmp_path / "adapter")
    with torch.inference_mode():
        expected = peft.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False)[0, len(PROMPT):].tolist()
        with peft.disable_adapter():
            plain = peft.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False)[0, len(PROMPT):].tolist()
    assert expected != plain
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    with LLM(str(tmp_path / "glm"), multiprocess=False, enable_lora=True, max_lora_rank=8, max_model_len=128) as llm:
        got = llm.generate([{"prompt_token_ids": PROMPT}], greedy, lora_request=LoRARequest("a", 1, str(tmp_path / "adapter")),
                           use_tqdm=False)[0].outputs[0].token_ids
    assert got == expected
