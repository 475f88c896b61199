"""Tensor and pipeline parallelism on the real default model, against one worker's greedy answers:
--tensor-parallel-size 2 (SmolLM2's 9 query and 3 KV heads split 6 + 3 and 2 + 1 over two worker
processes in a gloo group), --pipeline-parallel-size 2 (its 30 layers in two stages of 15, hidden
states and residual sent from one to the other, prompts chunked and several steps in flight at
once), and two stages of two tensor-parallel ranks each (four processes). A worker killed
mid-request brings its whole group back, the request recomputed and answered in full."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from actors.api import LLM, SamplingParams
from kernels.cpu.panels import int8_available
from server import Server, alive, children, streamed_text_in_thread
from tools.quantize import quantize_checkpoint

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
           "Write a poem about the sea."]
TOKENS = [12, 12, 12, 48]


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def one_worker() -> list[str]:
    with LLM(multiprocess=False) as llm:
        results = llm.generate(PROMPTS, [_params(n) for n in TOKENS], use_tqdm=False)
    return [r.text for r in results]


@pytest.fixture(scope="module", params=["tensor", "pipeline"])
def server(request):
    if request.param == "tensor":
        s = Server("--tensor-parallel-size", "2")
    else:      # a small token budget chunks the prompts and splits the requests into micro-batches
        s = Server("--pipeline-parallel-size", "2", "--max-num-batched-tokens", "8")
    try:
        yield request.param, s
    finally:
        s.stop()


async def _complete(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=240)) as r:
        assert r.status == 200, await r.text()
        choice = (await r.json())["choices"][0]
    assert choice["finish_reason"] == "length"
    return choice["text"]


def _texts(server: Server, prompts: list[str], tokens: list[int]) -> list[str]:
    async def main():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(_complete(session, server.url, p, n) for p, n in zip(prompts, tokens)))
    return asyncio.run(main())


def test_two_workers_answer_as_one_worker_does(server, one_worker):
    kind, s = server
    (engine,) = children(s.pid)
    assert len(children(engine)) == 2                   # a worker process per rank or stage
    assert _texts(s, PROMPTS[:3], TOKENS[:3]) == one_worker[:3]
    if kind == "pipeline":
        assert any("pipeline stage 1 of 2: layers 15 to 29" in line for line in s.lines)


def test_a_killed_worker_brings_both_back_and_the_request_is_recomputed(server, one_worker):
    _, s = server
    (engine,) = children(s.pid)
    before = children(engine)
    result: dict = {}
    thread, streaming = streamed_text_in_thread(s.url, PROMPTS[3], TOKENS[3], result)
    assert streaming.wait(120), "no token streamed"
    os.kill(before[1], signal.SIGKILL)                  # mid-request: its first token is out
    thread.join(240)
    assert result.get("text") == one_worker[3]
    deadline = time.monotonic() + 60
    while not any("workers restarted" in line for line in s.lines) and time.monotonic() < deadline:
        time.sleep(0.2)
    after = children(engine)
    assert len(after) == 2 and not set(after) & set(before) and not any(alive(p) for p in before)
    assert any("workers restarted" in line for line in s.lines)


def test_two_stages_of_two_tensor_parallel_ranks_answer_as_one_worker_does(one_worker):
    with LLM(tensor_parallel_size=2, pipeline_parallel_size=2) as llm:     # processes of their own
        results = llm.generate(PROMPTS[:3], [_params(n) for n in TOKENS[:3]], use_tqdm=False)
    assert [r.text for r in results] == one_worker[:3]


@pytest.mark.skipif(not int8_available(), reason="the gguf-i8 mode needs AVX2 or AVX512-VNNI")
def test_gguf_weights_over_two_ranks_and_over_two_stages_answer_as_one_worker_does():
    """gguf-i8: each rank's share of the checkpoint's blocks (output rows, or whole blocks of 32
    inputs), each stage's layers, split before the blocks are packed."""
    params = [_params(n) for n in TOKENS[:3]]
    with LLM(quantization="gguf-i8", multiprocess=False) as llm:
        want = [r.text for r in llm.generate(PROMPTS[:3], params, use_tqdm=False)]
    for layout in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        with LLM(quantization="gguf-i8", **layout) as llm:
            assert [r.text for r in llm.generate(PROMPTS[:3], params, use_tqdm=False)] == want, layout


def _smollm2_adapter(out) -> str:
    """A random rank-8 PEFT adapter on every projection of the default model, saved at ``out``."""
    import copy

    from peft import LoraConfig, get_peft_model

    from helpers import randomize_lora, transformers_model_from_gguf
    from models.resolve import default_gguf_path
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    # a copy: peft changes the model it wraps, and the helper's model is shared by the process's tests
    peft_model = get_peft_model(copy.deepcopy(transformers_model_from_gguf(default_gguf_path())),
                                LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0,
                                           init_lora_weights=False))
    randomize_lora(peft_model, seed=0, scale=0.05)
    peft_model.save_pretrained(out)
    return str(out)


def test_an_awq_checkpoint_over_two_ranks_and_over_two_stages_answers_as_one_worker_does(tmp_path):
    """The default model quantized to AWQ 4-bit (groups of 64) by tools.quantize: each rank takes its
    words of packed codes, zero points and scales (output features in words of 8, inputs by whole
    groups), each stage its layers, before they are processed; a LoRA adapter on the quantized
    projections is split alike."""
    from actors.engine.lora import LoRARequest
    out = str(tmp_path / "awq")
    quantize_checkpoint(None, "awq", False, out, 64)
    adapter = LoRARequest("random", 1, _smollm2_adapter(tmp_path / "adapter"))
    prompts, params = PROMPTS[:3] + PROMPTS[:1], [_params(n) for n in TOKENS[:3] + TOKENS[:1]]
    loras = [None, None, None, adapter]
    with LLM(out, multiprocess=False, enable_lora=True, max_lora_rank=8) as llm:
        want = [r.text for r in llm.generate(prompts, params, use_tqdm=False, lora_request=loras)]
    assert all(want) and want[3] != want[0]                       # the adapter changes the answer
    for layout in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        with LLM(out, enable_lora=True, max_lora_rank=8, **layout) as llm:
            got = [r.text for r in llm.generate(prompts, params, use_tqdm=False, lora_request=loras)]
        assert got == want, layout


@pytest.mark.skipif(not int8_available(), reason="the gguf-i8 mode needs AVX2 or AVX512-VNNI")
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_a_quantized_self_draft_over_two_ranks_or_stages_keeps_exact_greedy_tokens(one_worker, layout):
    """self_draft's gguf-i8 copy of the weights, split over the ranks as the target is, or whole on
    the last stage: drafts accepted, the tokens those of one exact worker."""
    spec = {"method": "self_draft", "quantization": "gguf-i8", "num_speculative_tokens": 4}
    with LLM(speculative_config=spec, **layout) as llm:
        texts = [r.text for r in llm.generate(PROMPTS[:3], [_params(n) for n in TOKENS[:3]], use_tqdm=False)]
        stats = llm.client.stats.last
    assert texts == one_worker[:3] and stats.spec_num_accepted_tokens > 0


def test_ngram_drafts_over_two_stages_keep_one_workers_greedy_tokens(one_worker):
    """The last stage verifies the drafts and proposes the next ones; the stage before it computes
    the drafts' KV with the step's tokens and learns the accepted tokens from the next step."""
    counting = "List the numbers from 1 to 20: 1, 2, 3,"
    with LLM(multiprocess=False) as llm:
        want = llm.generate([counting], [_params(40)], use_tqdm=False)[0].text
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    with LLM(pipeline_parallel_size=2, speculative_config=spec) as llm:
        texts = [r.text for r in llm.generate(PROMPTS[:3] + [counting], [_params(n) for n in TOKENS[:3]] + [_params(40)],
                                              use_tqdm=False)]
        stats = llm.client.stats.last
    assert texts == one_worker[:3] + [want] and stats.spec_num_accepted_tokens > 0


def test_two_compiled_stages_answer_as_one_worker_does(one_worker):
    """-O2: torch.compile of each stage's pieces between attention calls (its missing layers
    left out)."""
    with LLM(pipeline_parallel_size=2, compilation_config=2) as llm:
        texts = [r.text for r in llm.generate(PROMPTS[:3], [_params(n) for n in TOKENS[:3]], use_tqdm=False)]
    assert texts == one_worker[:3]
