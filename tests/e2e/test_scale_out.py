"""vLLM's scale-out endpoints (--enable-scale-out) on the real server: a request rendered to
token ids and sampling parameters, then generated from them and derendered, gives what the
OpenAI endpoints give; vLLM 0.32's own render output, generate answer and stream state are taken
as they are; hostile bodies get 4xx answers in the one error shape, never a 5xx."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server import Server
from test_openai_fuzz import check, encoded, junk

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
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": 5}]     # as vLLM answers


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
    ({"request_id": "\u0000"}, 400, "request_id"),          # it would become a header
])
def test_a_generate_request_the_server_cannot_serve_is_refused_saying_why(server, change, status, param):
    resp = _post(server, "/inference/v1/generate", {**VLLM_RENDERED, **change})
    assert resp.status_code == status, resp.text
    if param is not None:
        assert resp.json()["error"]["param"] == param
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


# vLLM 0.32's /inference/v1/generate answer to VLLM_RENDERED (log-probs left out)
VLLM_GENERATED = {
    "request_id": "generate-tokens-chatcmpl-b03298957ffb1bd9", "model": "smol", "created": 1796399574,
    "usage": {"prompt_tokens": 31, "total_tokens": 36, "completion_tokens": 5, "prompt_tokens_details": None,
              "completion_tokens_details": None},
    "prompt_logprobs": None, "prompt_token_id_logprobs": None, "prompt_token_ids": None, "mm_placeholders": None,
    "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None, "output_mode": "tokens",
    "choices": [{"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": [19556, 17, 1073, 416, 339],
                 "routed_experts": None, "sampling_mask": None,
                 "weight_versions": [{"version": "default", "start": 0, "end": 5}], "logprobs": None}]}


def test_vllms_generate_answer_derenders_to_the_chat_message(server):
    out = _post(server, "/v1/chat/completions/derender", {
        "generate_response": VLLM_GENERATED, "prompt_tokens": 31, "prompt_token_ids": VLLM_RENDERED["token_ids"],
        "chat_request": CHAT}).json()
    assert out["id"] == VLLM_GENERATED["request_id"] and out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "Hello! How can I"}
    assert out["usage"] == {"prompt_tokens": 31, "completion_tokens": 5, "total_tokens": 36}


def test_render_generate_derender_gives_the_answer_of_the_completions_endpoint(server):
    request = {"model": "smol", "prompt": ["The sky is", "Roses are"], "max_tokens": 12, "temperature": 0,
               "stop": [" the"], "logprobs": 2}
    direct = _post(server, "/v1/completions", request).json()
    rendered = _post(server, "/v1/completions/render", request).json()
    generated = [_post(server, "/inference/v1/generate", r).json() for r in rendered]
    out = _post(server, "/v1/completions/derender", {
        "generate_responses": generated, "prompt_tokens": [len(r["token_ids"]) for r in rendered],
        "prompt_token_ids": [r["token_ids"] for r in rendered], "completion_request": request}).json()
    assert [c["text"] for c in out["choices"]] == [c["text"] for c in direct["choices"]]
    assert [c["finish_reason"] for c in out["choices"]] == [c["finish_reason"] for c in direct["choices"]]
    assert [c["logprobs"] for c in out["choices"]] == [c["logprobs"] for c in direct["choices"]]
    assert out["usage"] == direct["usage"]


def test_a_chat_derender_with_a_stop_string_cuts_the_text_there(server):
    chat = {**CHAT, "max_tokens": 20, "stop": ["can"]}
    direct = _post(server, "/v1/chat/completions", chat).json()["choices"][0]
    rendered = _post(server, "/v1/chat/completions/render", chat).json()
    generated = _post(server, "/inference/v1/generate", rendered).json()
    out = _post(server, "/v1/chat/completions/derender", {
        "generate_response": generated, "prompt_token_ids": rendered["token_ids"], "chat_request": chat}).json()
    assert direct["finish_reason"] == "stop" and direct["stop_reason"] == "can"
    assert out["choices"][0]["message"]["content"] == direct["message"]["content"]


def test_a_derender_of_text_mode_or_foreign_tokens_is_refused(server):
    text_mode = {**VLLM_GENERATED, "output_mode": "text"}
    resp = _post(server, "/v1/chat/completions/derender", {"generate_response": text_mode})
    assert resp.status_code == 400
    bad = {**VLLM_GENERATED, "choices": [{**VLLM_GENERATED["choices"][0], "token_ids": [10 ** 8]}]}
    resp = _post(server, "/v1/chat/completions/derender", {"generate_response": bad})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "token_ids"


def _generate_stream(server, body: dict) -> list[dict]:
    with requests.post(server.url + "/inference/v1/generate", json={**body, "stream": True}, stream=True,
                       timeout=120) as resp:
        return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith(b"data: {")]


def test_a_streamed_chat_derendered_chunk_by_chunk_reads_as_the_chat_endpoint(server):
    chat = {**CHAT, "max_tokens": 12}
    direct = _post(server, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    rendered = _post(server, "/v1/chat/completions/render", chat).json()
    state, deltas = None, []
    for chunk in _generate_stream(server, rendered):
        out = _post(server, "/v1/chat/completions/derender", {
            "stream": True, "generate_chunk": chunk, "stream_state": state,
            "prompt_token_ids": rendered["token_ids"], "chat_request": chat}).json()
        state = out["stream_state"]
        deltas += [c["delta"] for c in out["chunk"]["choices"]]
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
    assert "".join(d.get("content") or "" for d in deltas) == direct
    choices = [c for chunk in _generate_stream(server, rendered) for c in chunk["choices"]]
    n = sum(len(c["token_ids"]) for c in choices)
    assert choices[-1]["weight_versions"] == [{"version": "default", "start": 0, "end": n}]    # the last chunk's
    assert not any(c["weight_versions"] for c in choices[:-1])


def test_vllms_stream_state_is_taken_mid_stream(server):
    # the state vLLM 0.32 answered after the derender of "Hello" (its own fields included)
    state = {"prev_tokens": ["Hello"], "prefix_offset": 0, "read_offset": 1, "role_sent": True,
             "logprob_context_token_ids": [19556], "logprob_text_offset": 0, "output_token_ids": [],
             "output_chunk_lens": [], "tools_streamed": False, "last_tool_call_ids": []}
    chunk = {"request_id": "generate-tokens-x", "usage": None, "output_mode": "tokens",
             "choices": [{"index": 0, "finish_reason": None, "stop_reason": None, "token_ids": [17, 1073]}]}
    out = _post(server, "/v1/chat/completions/derender",
                {"stream": True, "generate_chunk": chunk, "stream_state": state}).json()
    assert out["chunk"]["choices"][0]["delta"] == {"content": "! How"}
    assert out["stream_state"]["output_chunk_lens"] == [] and out["stream_state"]["role_sent"]


def test_a_streamed_completion_derender_carries_the_logprob_text_offsets(server):
    request = {"model": "smol", "prompt": "The sky is", "max_tokens": 8, "temperature": 0, "logprobs": 1}
    direct = _post(server, "/v1/completions", request).json()["choices"][0]
    rendered = _post(server, "/v1/completions/render", request).json()[0]
    state, text, offsets = None, "", []
    for chunk in _generate_stream(server, rendered):
        out = _post(server, "/v1/completions/derender", {
            "stream": True, "generate_chunk": chunk, "stream_state": state,
            "prompt_token_ids": rendered["token_ids"], "completion_request": request}).json()
        state = out["stream_state"]
        for c in out["chunk"]["choices"]:
            text += c["text"]
            offsets += (c["logprobs"] or {}).get("text_offset", [])
    assert text == direct["text"] and offsets == direct["logprobs"]["text_offset"]


def test_a_rendered_responses_request_generates_the_responses_endpoints_text(server):
    request = {"model": "smol", "input": "Name a colour.", "max_output_tokens": 8, "temperature": 0}
    direct = _post(server, "/v1/responses", request).json()
    rendered = _post(server, "/v1/responses/render", request).json()
    assert rendered["request_id"].startswith("resp_") and rendered["sampling_params"]["max_tokens"] == 8
    out = _post(server, "/inference/v1/generate", {**rendered, "output_mode": "text"}).json()
    assert out["choices"][0]["text"] == direct["output"][0]["content"][0]["text"]
    resp = _post(server, "/v1/responses/render", {**request, "previous_response_id": direct["id"]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "previous_response_id"


def test_a_rendered_anthropic_messages_request_generates_the_messages_endpoints_text(server):
    """vLLM's /v1/messages/render: the chat /v1/messages answers with, rendered to token ids."""
    request = {"model": "smol", "max_tokens": 8, "temperature": 0, "system": "Answer briefly.",
               "messages": [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]}
    direct = _post(server, "/v1/messages", request).json()
    rendered = _post(server, "/v1/messages/render", request).json()
    assert rendered["request_id"].startswith("chatcmpl-") and rendered["sampling_params"]["max_tokens"] == 8
    assert len(rendered["token_ids"]) == direct["usage"]["input_tokens"] + direct["usage"].get("cache_read_input_tokens", 0)
    out = _post(server, "/inference/v1/generate", {**rendered, "output_mode": "text"}).json()
    assert out["choices"][0]["text"] == direct["content"][0]["text"]
    resp = _post(server, "/v1/messages/render", {"model": "smol", "messages": []})
    assert resp.status_code == 400, resp.text


# -- hostile bodies: each a valid body with one field (at the top, in sampling_params, in a choice)
# replaced by generated junk; the answers come in time, never a 5xx, errors in the one shape
VLLM_STREAM_STATE = {"prev_tokens": ["Hello"], "prefix_offset": 0, "read_offset": 1, "role_sent": True}
FUZZ_BASES = [
    ("/inference/v1/generate", VLLM_RENDERED, ("sampling_params",)),
    ("/inference/v1/generate", {**VLLM_RENDERED, "stream": True, "output_mode": "text"}, ("sampling_params",)),
    ("/v1/chat/completions/render", CHAT, ()),
    ("/v1/chat/completions/derender", {"generate_response": VLLM_GENERATED, "prompt_token_ids": [1, 2],
                                       "chat_request": CHAT}, ("generate_response",)),
    ("/v1/completions/derender", {"generate_responses": [VLLM_GENERATED], "prompt_tokens": [3]}, ()),
    ("/v1/chat/completions/derender", {"stream": True, "stream_state": VLLM_STREAM_STATE, "generate_chunk": {
        "request_id": "x", "choices": [{"index": 0, "token_ids": [17, 1073]}]}}, ("stream_state", "generate_chunk")),
]


@st.composite
def hostile(draw) -> tuple[str, bytes]:
    path, base, inner = draw(st.sampled_from(FUZZ_BASES))
    body = json.loads(json.dumps(base))
    target = body
    where = draw(st.sampled_from((None, *inner)))
    if where is not None:
        target = body[where]
        if where == "generate_response" and draw(st.booleans()):
            target = target["choices"][0]
    key = draw(st.sampled_from(sorted(target) + ["no_such_field"]))
    target[key] = draw(junk)
    return path, encoded(body)


@settings(max_examples=25, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(sent=st.lists(hostile(), min_size=4, max_size=4))
def test_fuzz_hostile_scale_out_bodies(server, sent):
    for path, body in sent:
        check(server, path, body)


def test_the_server_is_healthy_and_idle_after_the_hostile_bodies(server):
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 10
    while True:
        stats = requests.get(server.url + "/debug/engine", timeout=10).json()
        if stats["num_requests_running"] == stats["num_requests_waiting"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0 and stats["kv_cache_usage"] == 0


def test_render_gives_each_prompt_tokens_characters_as_vllm_does(server):
    prompt = "Hi there, é!"
    rendered = _post(server, "/v1/completions/render", {"model": "smol", "prompt": prompt, "max_tokens": 5,
                                                         "return_token_offsets": True}).json()[0]
    offsets = rendered["token_offsets"]
    assert len(offsets) == len(rendered["token_ids"])
    assert "".join(prompt[a:b] for a, b in offsets) == prompt
    # vLLM 0.32's answer with truncate_prompt_tokens 3: the last three tokens' characters
    last3 = _post(server, "/v1/completions/render", {"model": "smol", "prompt": prompt, "max_tokens": 5,
                                                      "return_token_offsets": True, "truncate_prompt_tokens": 3}).json()[0]
    assert (last3["token_ids"], last3["token_offsets"]) == ([28, 26411, 17], [[8, 9], [9, 11], [11, 12]])
    chat = _post(server, "/v1/chat/completions/render", {**CHAT, "return_token_offsets": True}).json()
    assert len(chat["token_offsets"]) == len(chat["token_ids"]) == 31 and chat["token_offsets"][-1] == [149, 150]   # as vLLM 0.32
    assert _post(server, "/v1/chat/completions", {**CHAT, "return_token_offsets": True}).status_code == 200
    assert _post(server, "/v1/chat/completions/render", CHAT).json()["token_offsets"] is None


def test_generate_answers_prompt_logprobs_and_scores_chosen_prompt_token_ids(server):
    """vLLM's scoring fields on /inference/v1/generate: prompt_logprobs as the completions endpoint
    gives them, and prompt_logprob_token_ids' scores as a base64 .npy array (rows from
    prompt_logprob_start): each row's first id, the prompt's own next token, scores what
    prompt_logprobs reads for it; -1 pads with -inf; a wrong row count is a 400 naming the field."""
    import base64
    import io

    import numpy as np
    ids = VLLM_RENDERED["token_ids"]
    start = 20
    rows = [[ids[i + 1], 5, -1] for i in range(start, len(ids) - 1)]
    body = {**VLLM_RENDERED, "sampling_params": {"max_tokens": 1, "temperature": 0, "prompt_logprobs": 0,
                                                 "prompt_logprob_token_ids": rows, "prompt_logprob_start": start}}
    out = _post(server, "/inference/v1/generate", body).json()
    completion = _post(server, "/v1/completions", {"model": "smol", "prompt": ids, "max_tokens": 1,
                                                   "prompt_logprobs": 0}).json()
    assert out["prompt_logprobs"] == completion["choices"][0]["prompt_logprobs"]
    scores = np.load(io.BytesIO(base64.b64decode(out["prompt_token_id_logprobs"])), allow_pickle=False)
    assert scores.shape == (len(ids) - 1 - start, 3) and np.isneginf(scores[:, 2]).all()
    own = [next(iter(p.values()))["logprob"] for p in out["prompt_logprobs"][start + 1:]]
    assert np.allclose(scores[:, 0], own, atol=1e-4)
    bad = _post(server, "/inference/v1/generate", {**body, "sampling_params": {
        "max_tokens": 1, "prompt_logprob_token_ids": rows[:2], "prompt_logprob_start": start}})
    assert bad.status_code == 400 and "prompt_logprob_token_ids has 2 rows" in bad.json()["error"]["message"]


def test_with_return_sampling_mask_generate_answers_each_tokens_support_and_refuses_greedy():
    masked = Server(*SERVER_ARGS, "--enable-scale-out", "--return-sampling-mask")
    try:
        body = {"token_ids": [504, 3658, 314], "model": "smol", "stream": False,
                "sampling_params": {"temperature": 0.8, "top_k": 6, "max_tokens": 5, "seed": 3, "ignore_eos": True}}
        out = _post(masked, "/inference/v1/generate", body).json()
        (choice,) = out["choices"]
        mask = choice["sampling_mask"]
        assert len(mask) == len(choice["token_ids"]) == 5
        assert all(tok in ids and 1 <= len(ids) <= 6 for tok, ids in zip(choice["token_ids"], mask))
        greedy = _post(masked, "/inference/v1/generate", {**body, "sampling_params": {"temperature": 0, "max_tokens": 2}})
        assert greedy.status_code == 400 and "requires temperature > 0" in greedy.json()["error"]["message"]
    finally:
        masked.stop()
