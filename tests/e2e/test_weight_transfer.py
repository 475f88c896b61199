"""vLLM's weight transfer for RL loops (--weight-transfer-config): a trainer process opens a
process group with the engine's workers and broadcasts its parameters; at the round's end the
engine serves them, all or nothing. Offline (an LLM in the trainer's process) and on the real
server with two tensor-parallel workers (HTTP routes, VLLM_SERVER_DEV_MODE=1), with vLLM's
weight version and weight checker."""
from __future__ import annotations

import json
import re
import shutil
import urllib.error
import urllib.request

import pytest
import torch
from safetensors.torch import load_file, save_file

from actors.api import LLM, SamplingParams
from actors.worker.weight_transfer import (HTTPWeightSyncClient, LLMWeightSyncClient, TrainerWeightTransferEngine,
                                           update_info_of)
from server import Server, free_port
from tests.helpers import save_tiny_llama, save_tiny_tokenizer

pytestmark = pytest.mark.slow

VOCAB = 128
PROMPT = [5, 17, 42, 9, 77, 3]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
GLOO = {"backend": "gloo", "timeout_s": 60}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One tiny Llama checkpoint on disk (a), and other weights for it (b) as a trainer holds them."""
    root = tmp_path_factory.mktemp("weight-transfer")
    a = save_tiny_llama(root / "a", VOCAB, 64, 96, 4, 2, 16, 256)
    save_tiny_tokenizer(a, VOCAB)
    weights_a = load_file(f"{a}/model.safetensors")
    gen = torch.Generator().manual_seed(1)
    weights_b = {k: (v + 0.15 * torch.randn(v.shape, generator=gen)).contiguous() for k, v in weights_a.items()}
    b = root / "b"
    shutil.copytree(a, b)
    save_file(weights_b, b / "model.safetensors", metadata={"format": "pt"})
    return a, str(b), weights_a, weights_b


def _tokens(llm: LLM) -> list[int]:
    return llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _init_info(world_size: int, **more) -> dict:
    return {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": world_size, **GLOO, **more}


def test_a_trainer_pushes_weights_into_a_running_llm_which_then_answers_as_one_started_on_them(checkpoints):
    a, b, weights_a, weights_b = checkpoints
    with LLM(b) as started_on_b:
        from_b = _tokens(started_on_b)
        with pytest.raises(ValueError, match="Weight transfer not configured"):
            started_on_b.start_weight_update()
    with LLM(a, weight_transfer_config={"backend": "gloo", "timeout_s": 5}) as llm:
        from_a = _tokens(llm)
        assert from_a != from_b and llm.get_weight_version() == "default"
        client = LLMWeightSyncClient(llm)
        trainer = TrainerWeightTransferEngine.trainer_init(_init_info(2), client=client, source=weights_b)
        trainer.send_weights(weight_version="step-1")
        assert _tokens(llm) == from_b                   # exactly what an engine started on b answers
        assert llm.get_weight_version() == "step-1"

        # out of order calls are refused without waiting for a trainer (the next round starts afresh)
        with pytest.raises(ValueError, match="start_weight_update must be called before update_weights"):
            llm.update_weights({"update_info": {"names": [], "dtype_names": [], "shapes": []}})
        with pytest.raises(ValueError, match="finish_weight_update called without a matching start_weight_update"):
            llm.finish_weight_update()
        with pytest.raises(ValueError, match="dtype_names.*same size"):
            llm.start_weight_update()
            llm.update_weights({"update_info": {"names": ["x"], "dtype_names": [], "shapes": [[1]]}})

        # a round without layer 1 is refused whole: nothing changes, the missing tensors named
        partial = {k: v for k, v in weights_a.items() if ".layers.1." not in k}
        with pytest.raises(ValueError, match=r"left \d+ parameters unloaded.*layers\.1\.") as refused:
            trainer.send_weights(partial, weight_version="step-2")
        assert "no weight was changed" in str(refused.value)
        assert _tokens(llm) == from_b and llm.get_weight_version() == "step-1"
        unknown = {**weights_a, "model.layers.7.mlp.up_proj.weight": torch.zeros(96, 64)}
        with pytest.raises(ValueError, match="model.layers.7.mlp.up_proj.weight"):
            trainer.send_weights(unknown)
        assert _tokens(llm) == from_b

        # a trainer that announces tensors and never sends them: the round fails after timeout_s,
        # the group is closed, and the engine serves on with its weights
        llm.start_weight_update()
        with pytest.raises(ValueError, match="the trainer's broadcast failed.*init again"):
            llm.update_weights({"update_info": update_info_of([("model.norm.weight", torch.float32, (64,))])})
        assert _tokens(llm) == from_b
        with pytest.raises(ValueError, match="weight transfer not initialized"):
            llm.start_weight_update()

        # the trainer's own dtype (bfloat16), each tensor broadcast alone; then packed into small buffers
        trainer.shutdown()
        trainer = TrainerWeightTransferEngine.trainer_init(_init_info(2, packed=False), client=client, source=weights_b)
        trainer.send_weights({k: v.to(torch.bfloat16) for k, v in weights_a.items()})
        assert _tokens(llm) == from_a
        trainer.shutdown()
        trainer = TrainerWeightTransferEngine.trainer_init(_init_info(2, packed_buffer_size_bytes=20_000),
                                                           client=client, source=weights_b)
        trainer.send_weights()
        assert _tokens(llm) == from_b
        trainer.shutdown()


def _request(method: str, url: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def server(checkpoints):
    s = Server("--model", checkpoints[0], "--served-model-name", "tiny", "-tp", "2", "--threads", "1",
               "--weight-transfer-config", json.dumps(GLOO), env={"VLLM_SERVER_DEV_MODE": "1"})
    yield s
    s.stop()


def _complete(url: str) -> list[int]:
    status, body = _request("POST", url + "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 12,
                                                               "temperature": 0, "ignore_eos": True,
                                                               "return_token_ids": True})
    assert status == 200, body
    return body["choices"][0]["token_ids"]


def test_a_trainer_updates_a_tensor_parallel_server_over_http_and_the_weight_checker_sees_it(checkpoints, server):
    _, _, weights_a, weights_b = checkpoints
    url = server.url
    from_a = _complete(url)
    status, body = _request("POST", url + "/weight_checker", {"action": "checksum"})
    assert status == 200
    baseline = body["checksums"]
    assert any(k.startswith("dp0:pp0:pcp0:tp1:") for k in baseline) and any(k.startswith("dp0:pp0:pcp0:tp0:")
                                                                             for k in baseline)

    trainer = TrainerWeightTransferEngine.trainer_init(_init_info(3), client=HTTPWeightSyncClient(url),
                                                       source=weights_b)
    trainer.send_weights(weight_version="v1")
    assert _request("GET", url + "/weight_info") == (200, {"weight_version": "v1"})
    from_b = _complete(url)
    assert from_b != from_a
    status, body = _request("POST", url + "/weight_checker", {"action": "compare", "baseline": baseline})
    assert status == 200 and body["match"] is False and body["mismatches"]

    assert _request("POST", url + "/weight_checker", {"action": "reset"}) == (200, {"status": "reset"})
    assert _complete(url) != from_a                     # zeroed weights answer otherwise (the cache was emptied)
    trainer.send_weights(weights_a, weight_version="v2")
    assert _request("POST", url + "/weight_checker", {"action": "compare", "baseline": baseline}) == \
        (200, {"match": True, "mismatches": []})
    assert _complete(url) == from_a
    assert _request("POST", url + "/update_weight_version", {"new_version": "v3"}) == \
        (200, {"success": True, "new_version": "v3"})
    assert _request("GET", url + "/weight_info") == (200, {"weight_version": "v3"})

    # refusals are 400s that say why, and leave the weights as they are
    status, body = _request("POST", url + "/update_weights", {"update_info": {"names": [], "dtype_names": [],
                                                                              "shapes": []}})
    assert status == 400 and "start_weight_update must be called before update_weights" in body["error"]["message"]
    status, body = _request("POST", url + "/init_weight_transfer_engine", {})
    assert status == 400 and "init_info" in body["error"]["message"]
    status, body = _request("POST", url + "/weight_checker", {"action": "compare"})
    assert status == 400 and "baseline" in body["error"]["message"]
    status, body = _request("POST", url + "/start_draft_weight_update")
    assert status == 400 and "no draft model" in body["error"]["message"]
    trainer.shutdown()
    assert _complete(url) == from_a

    # vLLM's metrics of the weight operations (the refused ones counted too)
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        metrics = r.read().decode()
    count = {op: float(re.search(rf'vllm:rl_weight_update_operation_duration_seconds_count{{[^}}]*operation="{op}"}} '
                                 rf'(\S+)', metrics).group(1)) for op in ("init", "start", "update", "finish", "shutdown")}
    assert count == {"init": 1, "start": 2, "update": 3, "finish": 2, "shutdown": 1}
    assert re.findall(r'vllm:rl_weight_update_operations_in_flight{[^}]*} (\S+)', metrics) == ["0"] * 6


def test_a_finished_output_names_the_weight_versions_that_sampled_its_tokens(checkpoints):
    """vLLM's CompletionOutput.weight_versions: spans of output tokens per version, the version
    changed here while the request was frozen by a pause (mode keep) halfway."""
    from actors.api import AsyncLLM, RequestOutputKind, WeightVersionSpan

    async def body():
        llm = await AsyncLLM.create(checkpoints[0], weight_transfer_config=GLOO)
        try:
            params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            plain = [out async for out in llm.generate({"prompt_token_ids": PROMPT}, params, request_id="plain")]
            assert plain[-1].outputs[0].weight_versions == [WeightVersionSpan("default", 0, 200)]
            assert all(out.outputs[0].weight_versions is None for out in plain[:-1])   # on the last output only
            stream = llm.generate({"prompt_token_ids": PROMPT}, params, request_id="across")
            first = await anext(stream)
            await llm.pause_generation(mode="keep")
            await llm.update_weight_version("v2")
            assert await llm.get_weight_version() == "v2"
            await llm.resume_generation()
            outs = [first] + [out async for out in stream]
            spans = outs[-1].outputs[0].weight_versions
            assert [s.version for s in spans] == ["default", "v2"]
            assert spans[0].start == 0 and 0 < spans[0].end == spans[1].start < 200 and spans[1].end == 200
            assert sum(len(o.outputs[0].token_ids) for o in outs) == 200
        finally:
            await llm.shutdown()
    import asyncio
    asyncio.run(asyncio.wait_for(body(), 120))


def test_a_draft_round_goes_into_the_speculative_draft_model_and_the_target_answers_the_same(checkpoints):
    """/start_draft_weight_update's round: the target drafting with a copy of itself has every
    draft accepted; other weights pushed into the draft lower the acceptance but not the tokens;
    its own weights pushed back restore it."""
    a, _, weights_a, weights_b = checkpoints
    spec = {"method": "draft_model", "model": a, "num_speculative_tokens": 3}
    with LLM(a, speculative_config=spec, weight_transfer_config=GLOO) as llm:
        def run() -> tuple[list[int], int, int]:
            before = llm.client.stats.last
            drafted0, accepted0 = before.spec_num_draft_tokens, before.spec_num_accepted_tokens
            tokens = _tokens(llm)
            after = llm.client.stats.last
            return tokens, after.spec_num_draft_tokens - drafted0, after.spec_num_accepted_tokens - accepted0
        tokens, drafted, accepted = run()
        assert drafted > 0 and accepted == drafted
        trainer = TrainerWeightTransferEngine.trainer_init(_init_info(2), client=LLMWeightSyncClient(llm),
                                                           source=weights_b)
        checksums = llm.collective_rpc("compute_weight_checksums")
        trainer.send_weights(draft=True)
        assert llm.collective_rpc("compute_weight_checksums") == checksums      # the target's weights stay
        other, drafted, accepted = run()
        assert other == tokens and drafted > 0 and accepted < drafted
        trainer.send_weights(weights_a, draft=True)
        again, drafted, accepted = run()
        assert again == tokens and drafted > 0 and accepted == drafted
        trainer.shutdown()


DYING_TRAINER = """
import os, sys, threading, time
import torch
from actors.worker.weight_transfer import HTTPWeightSyncClient, open_group, update_info_of
url, port = sys.argv[1], int(sys.argv[2])
client = HTTPWeightSyncClient(url, timeout=60)
init = threading.Thread(target=client.init_weight_transfer_engine, daemon=True, args=(
    {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 3, "packed": True},))
init.start()
group = open_group("gloo", "127.0.0.1", port, 0, 3, 60, torch.device("cpu"))
init.join()
client.start_weight_update()
threading.Thread(target=client.update_weights, daemon=True,
                 args=(update_info_of([("model.norm.weight", torch.float32, (64,))]),)).start()
time.sleep(1.0)                       # the workers wait in the broadcast
os.kill(os.getpid(), 9)
"""


def test_a_trainer_killed_mid_round_fails_the_round_and_the_next_trainer_is_served(checkpoints, server):
    """The workers' broadcast ends when the trainer's connections close (not at the timeout):
    the round is dropped, the server serves on with its weights, and a new trainer's round lands."""
    import subprocess
    import sys
    _, _, weights_a, weights_b = checkpoints
    url = server.url
    before = _complete(url)
    dying = subprocess.run([sys.executable, "-c", DYING_TRAINER, url, str(free_port())], capture_output=True,
                           text=True, timeout=120, cwd=str(__import__("pathlib").Path(__file__).parents[2]))
    assert dying.returncode == -9, dying.stderr
    assert _complete(url) == before
    assert "the trainer's broadcast failed" in server.log_when(lambda log: "the trainer's broadcast failed" in log)
    trainer = TrainerWeightTransferEngine.trainer_init(_init_info(3), client=HTTPWeightSyncClient(url, timeout=60),
                                                       source=weights_b)
    trainer.send_weights(weight_version="after-a-death")
    assert _complete(url) != before
    trainer.send_weights(weights_a)
    assert _complete(url) == before
    trainer.shutdown()
