"""vLLM's scale-out endpoints (--enable-scale-out) on the real server: a request rendered to
token ids and sampling parameters, then generated from them, gives what the OpenAI endpoints
give; vLLM 0.32's own render output is taken as it is."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import requests

from server import Server

pytestmark = pytest.mark.slow

SERVER_ARGS = ("--threads", "1", "--served-model-name", "smol")
CHAT = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0}

# vLLM 0.32's answer to POST /v1/chat/completions/render with CHAT plus logprobs, top_logprobs 2
# (the default model's Hugging Face export): the body a vLLM frontend sends to /inference/v1/generate
VLLM_RENDERED = {
    "request_id": "chatcmpl-a97e22a4a696da6f",
    "token_ids": [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
                  19712, 8182, 2, 198, 1, 4093, 198, 26843, 2, 198, 1, 520, 9531, 198],
    "token_offsets": None, "features": None, "content_parts": None,
    "sampling_params": {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                        "temperature": 0.0, "stop": [], "stop_token_ids": [], "max_tokens": 5, "logprobs": 2,
                        "output_kind": 2, "skip_clone": True, "bad_words": [], "skip_reading_prefix_cache": False},
    "model": "smol", "reasoning_ended": None, "reasoning_parser_kwargs": None, "return_token_ids": None,
    "output_mode": "tokens", "stream": False, "stream_options": None, "cache_salt": None, "priority": 0,
    "kv_transfer_params": None, "ec_transfer_params": None}


@pytest.fixture(scope="module")
def server():
    s = Server(*SERVER_ARGS, "--enable-scale-out")
    yield s
    s.stop()


def _post(server, path: str, body: dict) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=120)


def test_a_rendered_chat_generates_the_tokens_the_chat_endpoint_gives(server):
    chat = _post(server, "/v1/chat/completions", {**CHAT, "return_token_ids": True}).json()
    rendered = _post(server, "/v1/chat/completions/render", CHAT).json()
    assert rendered["token_ids"] == chat["prompt_token_ids"]
    assert rendered["request_id"].startswith("chatcmpl-") and rendered["output_mode"] == "tokens"
    assert rendered["sampling_params"]["max_tokens"] == 5 and rendered["sampling_params"]["temperature"] == 0
    out = _post(server, "/inference/v1/generate", rendered).json()
    assert out["request_id"] == "generate-tokens-" + rendered["request_id"]
    (choice,) = out["choices"]
    assert choice["token_ids"] == chat["choices"][0]["token_ids"] and choice["finish_reason"] == "length"
    assert out["usage"]["prompt_tokens"] == len(rendered["token_ids"]) and out["usage"]["completion_tokens"] == 5


def test_vllms_own_render_output_is_generated_as_it_is(server):
    out = _post(server, "/inference/v1/generate", VLLM_RENDERED).json()
    (choice,) = out["choices"]
    chat = _post(server, "/v1/chat/completions", {**CHAT, "return_token_ids": True}).json()
    assert choice["token_ids"] == chat["choices"][0]["token_ids"]
    content = choice["logprobs"]["content"]
    assert [e["token_id"] for e in content] == choice["token_ids"]
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["rank"] == 1 for e in content)


def test_a_completion_render_gives_one_request_per_prompt_with_its_n(server):
    rendered = _post(server, "/v1/completions/render", {"model": "smol", "prompt": ["The sky is", "One, two,"],
                                                         "max_tokens": 4, "n": 2, "seed": 11, "stop": ["."]}).json()
    assert [r["request_id"][-2:] for r in rendered] == ["-0", "-1"]
    tok = _post(server, "/tokenize", {"prompt": "One, two,"}).json()["tokens"]
    assert rendered[1]["token_ids"] == tok
    sp = rendered[1]["sampling_params"]
    assert (sp["n"], sp["seed"], sp["stop"]) == (2, 11, ["."])
    out = _post(server, "/inference/v1/generate", rendered[1]).json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    done = _post(server, "/v1/completions", {"model": "smol", "prompt": "One, two,", "max_tokens": 4, "n": 2,
                                             "seed": 11, "stop": ["."], "return_token_ids": True}).json()
    assert [c["token_ids"] for c in out["choices"]] == [c["token_ids"] for c in done["choices"]]


def test_a_streamed_generation_in_text_mode_carries_tokens_text_and_usage(server):
    body = {**VLLM_RENDERED, "stream": True, "stream_options": {"include_usage": True}, "output_mode": "text",
            "return_token_ids": True}
    body["sampling_params"] = {k: v for k, v in body["sampling_params"].items() if k != "logprobs"}
    with requests.post(server.url + "/inference/v1/generate", json=body, stream=True, timeout=120) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[0]["prompt_token_ids"] == VLLM_RENDERED["token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    tokens = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    text = "".join(ch["text"] for c in chunks for ch in c["choices"])
    whole = _post(server, "/inference/v1/generate", {**VLLM_RENDERED, "output_mode": "text"}).json()["choices"][0]
    assert tokens == whole["token_ids"] and text == whole["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_abort_requests_ends_a_generation_named_by_its_request_id(server):
    async def run():
        body = {**VLLM_RENDERED, "request_id": "rl-rollout-7", "stream": True,
                "sampling_params": {"max_tokens": 500, "ignore_eos": True}}
        reasons = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            async with s.post(server.url + "/inference/v1/generate", json=body) as resp:
                await resp.content.readline()
                async with s.post(server.url + "/inference/v1/abort_requests",
                                  json={"request_ids": ["rl-rollout-7"]}) as ab:
                    assert ab.status == 200
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        reasons += [c["finish_reason"] for c in json.loads(line[6:])["choices"]]
        return reasons
    reasons = asyncio.run(run())
    assert reasons[-1] == "abort" and len(reasons) < 500


@pytest.mark.parametrize("change, status, param", [
    ({"sampling_params": {"max_tokens": 2, "guided_json": {}}}, 400, "sampling_params.guided_json"),
    ({"sampling_params": {"top_k": 10 ** 9}}, 400, None),
    ({"token_ids": [1, 10 ** 7]}, 400, "prompt"),
    ({"features": {"mm_hashes": {}, "mm_placeholders": {}}}, 400, "features"),
    ({"model": "other"}, 404, "model"),
    ({"no_such_field": 1}, 400, None),
])
def test_a_generate_request_the_server_cannot_serve_is_refused_saying_why(server, change, status, param):
    resp = _post(server, "/inference/v1/generate", {**VLLM_RENDERED, **change})
    assert resp.status_code == status, resp.text
    if param is not None:
        assert resp.json()["error"]["param"] == param
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
