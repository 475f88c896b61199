"""The HTTP edge without a server: request decoding, range checks, chat messages and the one
error shape. Whatever ``to_sampling_params`` accepts must be something the engine can carry and
sample with: a value out of range there would fail a whole engine step."""
from __future__ import annotations

import asyncio
import json
import math

import msgspec
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.frontend.app import OpenAIServer, ServerOptions
from actors.frontend.errors import MAX_MESSAGE_CHARS, error_body, error_response, error_type
from actors.frontend.params import cache_salt, chat_messages, check_priority, for_choice, request_timeout
from actors.frontend.protocol import (BadRequest, ChatCompletionRequest, CompletionRequest,
                                      TokenizeRequest, decode_body)
from models.sampler import Sampler, SamplingMetadata

VOCAB = 64
MAX_MODEL_LEN = 128


def completion(**fields) -> CompletionRequest:
    return msgspec.convert({"prompt": "x", **fields}, CompletionRequest)


def chat(messages: list[dict], **fields) -> ChatCompletionRequest:
    return msgspec.convert({"messages": messages, **fields}, ChatCompletionRequest)


def refused(req, param: str) -> str:
    with pytest.raises(BadRequest) as exc:
        req.to_sampling_params(VOCAB, MAX_MODEL_LEN)
    assert exc.value.param == param, str(exc.value)
    return str(exc.value)


# -- numbers ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("top_k", [2 ** 63, 2 ** 64, 2 ** 70, VOCAB + 1, -2, -(2 ** 63)])
def test_top_k_beyond_the_vocabulary_is_refused(top_k):
    assert f"[1, {VOCAB}]" in refused(completion(top_k=top_k), "top_k")


@pytest.mark.parametrize("top_k", [-1, 0, 1, VOCAB])
def test_top_k_off_or_within_the_vocabulary_is_accepted(top_k):
    assert completion(top_k=top_k).to_sampling_params(VOCAB, MAX_MODEL_LEN).top_k == max(top_k, 0)


@pytest.mark.parametrize("field, value", [
    ("temperature", math.nan), ("temperature", math.inf), ("top_p", math.nan), ("top_p", -math.inf),
    ("min_p", math.nan), ("presence_penalty", math.inf), ("frequency_penalty", -math.inf),
    ("repetition_penalty", math.nan), ("repetition_penalty", math.inf)])
def test_non_finite_floats_are_refused(field, value):
    refused(completion(**{field: value}), field)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 100.5])
def test_non_finite_or_large_logit_bias_values_are_refused(value):
    refused(completion(logit_bias={"5": value}), "logit_bias")


@pytest.mark.parametrize("key", ["1_0", " 5", "+5", "٣", "5.0", "-1", str(VOCAB), "9" * 5000, ""])
def test_logit_bias_keys_must_be_plain_token_ids_in_the_vocabulary(key):
    message = refused(completion(logit_bias={key: 1.0}), "logit_bias")
    assert len(message) < 200 + len(key)


def test_max_tokens_beyond_the_context_is_refused_with_the_context_length_message():
    """Named as the Tokenizer's context-length error names it (OpenAI's param: the prompt)."""
    for value in (MAX_MODEL_LEN, 2 ** 63, 2 ** 64, 2 ** 70):
        message = refused(completion(max_tokens=value), "prompt")
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in message and "max_tokens" in message
        message = refused(chat([{"role": "user", "content": "x"}], max_completion_tokens=value), "messages")
        assert "maximum context length" in message and "max_completion_tokens" in message
    assert completion(max_tokens=MAX_MODEL_LEN - 1).to_sampling_params(VOCAB, MAX_MODEL_LEN).max_tokens \
        == MAX_MODEL_LEN - 1


def test_min_tokens_is_bounded_even_when_max_tokens_is_unset():
    user = [{"role": "user", "content": "x"}]
    refused(chat(user, min_tokens=2 ** 70), "min_tokens")
    refused(chat(user, min_tokens=MAX_MODEL_LEN), "min_tokens")
    assert chat(user, min_tokens=MAX_MODEL_LEN - 1).to_sampling_params(VOCAB, MAX_MODEL_LEN).min_tokens \
        == MAX_MODEL_LEN - 1


def test_seeds_stay_within_64_bits_for_every_choice():
    refused(completion(seed=2 ** 64), "seed")
    refused(completion(seed=-(2 ** 63) - 1), "seed")
    top = completion(seed=2 ** 64 - 1 - 128).to_sampling_params(VOCAB, MAX_MODEL_LEN)
    assert for_choice(top, 127).seed == 2 ** 64 - 2


def test_priority_must_fit_in_64_bits():
    with pytest.raises(BadRequest) as exc:
        check_priority(completion(priority=2 ** 63), "priority")
    assert exc.value.param == "priority"
    assert check_priority(completion(priority=-(2 ** 63)), "priority") == -(2 ** 63)


def test_token_id_lists_stay_in_the_vocabulary():
    refused(completion(stop_token_ids=[2 ** 64]), "stop_token_ids")
    refused(completion(stop_token_ids=[VOCAB]), "stop_token_ids")


# Values as JSON may carry them: any int, any float, and the field types' wrong neighbours.
wide_ints = st.one_of(st.integers(-3, VOCAB + 3), st.integers(-(2 ** 70), 2 ** 70),
                      st.sampled_from([2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, 2 ** 64, -(2 ** 63), -(2 ** 63) - 1]))
wide_floats = st.one_of(st.floats(-3, 3), st.floats(allow_nan=True, allow_infinity=True),
                        st.sampled_from([5e-324, 1e-45, 1e-300, 1e-6, 2.0 + 1e-15]))
NUMERIC = {"max_tokens": wide_ints, "temperature": wide_floats, "top_p": wide_floats, "top_k": wide_ints,
           "min_p": wide_floats, "seed": wide_ints, "presence_penalty": wide_floats,
           "frequency_penalty": wide_floats, "repetition_penalty": wide_floats, "min_tokens": wide_ints,
           "logprobs": wide_ints, "stop_token_ids": st.lists(wide_ints, max_size=3),
           "logit_bias": st.dictionaries(wide_ints.map(str), wide_floats, max_size=3)}


@settings(max_examples=300, deadline=None, derandomize=True)
@given(fields=st.fixed_dictionaries({}, optional=NUMERIC), echo=st.booleans())
def test_whatever_is_accepted_can_be_encoded_and_sampled_in_a_shared_batch(fields, echo):
    req = msgspec.convert({"prompt": "x", "echo": echo, **fields}, CompletionRequest)
    try:
        params = req.to_sampling_params(VOCAB, MAX_MODEL_LEN)
    except BadRequest:
        return
    msgspec.msgpack.encode(params)                 # what the engine's messages carry
    rows = [params, msgspec.convert({}, type(params))]
    generators = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in rows]
    meta = SamplingMetadata.from_params(rows, generators, eos_token_ids=[0],
                                        output_token_ids=lambda: [[1, 2], [3]],
                                        prompt_token_ids=lambda: [[4], [5, 6]])
    out = Sampler()(torch.randn(2, VOCAB), meta)
    assert out.sampled_token_ids.shape == (2,) and 0 <= int(out.sampled_token_ids.max()) < VOCAB


# -- bodies ----------------------------------------------------------------------------------------
def deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("lenient", [False, True])
@pytest.mark.parametrize("typ, body", [
    (CompletionRequest, b'{"prompt": ' + deep(1000) + b"}"),
    (CompletionRequest, b'{"prompt": ' + deep(100_000) + b"}"),
    (ChatCompletionRequest, b'{"messages": ' + deep(1000) + b"}"),
    (ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": '
                            b'{"a": ' + deep(1000) + b"}}"),
    (CompletionRequest, b'{"prompt": "x", "unknown": ' + deep(1000) + b"}"),
    (TokenizeRequest, b'{"prompt": ' + deep(5000) + b"}"),
])
def test_bodies_nested_too_deeply_are_bad_requests(typ, body, lenient):
    with pytest.raises(BadRequest):
        decode_body(body, typ, lenient)


def test_nesting_is_refused_whatever_the_recursion_limit_and_brackets_in_strings_do_not_count():
    """torch.compile raises the interpreter's recursion limit (to 2000) in the process it runs in:
    a body nested 1,000 deep is refused all the same; 600 brackets inside a prompt are text."""
    import sys
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(5000)
    try:
        with pytest.raises(BadRequest, match="nested too deeply"):
            decode_body(b'{"prompt": ' + deep(1000) + b"}", CompletionRequest)
    finally:
        sys.setrecursionlimit(limit)
    text = "[" * 600 + '\\"{' * 10
    req = decode_body(msgspec.json.encode({"prompt": text}), CompletionRequest)
    assert req.prompt == text


@pytest.mark.parametrize("body", [b"", b"{", b"\xff\xfe", b'{"prompt": "\\ud800"}', b'{"prompt": NaN}',
                                  b'{"prompt": "x", "temperature": 1e400}', b'{"prompt": [1' + b"0" * 5000 + b"]}"])
def test_bodies_that_do_not_decode_are_bad_requests(body):
    with pytest.raises(BadRequest):
        decode_body(body, CompletionRequest)


# -- chat messages ---------------------------------------------------------------------------------
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.mark.parametrize("role", ["user", "system", "developer", "tool", "assistant"])
@pytest.mark.parametrize("missing", [{}, {"content": None}])
def test_a_message_without_content_is_refused_naming_it(role, missing):
    req = chat([{"role": "user", "content": "hi"}, {"role": role, **missing}])
    with pytest.raises(BadRequest) as exc:
        chat_messages(req.messages)
    assert exc.value.param == "messages[1].content"


def test_an_assistant_tool_call_may_leave_content_null_and_a_tool_answers_it():
    req = chat([{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                {"role": "tool", "content": "22 C", "tool_call_id": "call_1"}])
    user, call, answer = chat_messages(req.messages)
    assert call == {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]}
    assert answer == {"role": "tool", "content": "22 C", "tool_call_id": "call_1"}


@pytest.mark.parametrize("message, param", [
    ({"role": "user", "content": "x", "tool_calls": [TOOL_CALL]}, "messages[0].tool_calls"),
    ({"role": "assistant", "content": "x", "tool_call_id": "call_1"}, "messages[0].tool_call_id"),
])
def test_tool_fields_belong_to_their_roles(message, param):
    with pytest.raises(BadRequest) as exc:
        chat_messages(chat([message]).messages)
    assert exc.value.param == param


def test_tool_calls_must_have_openai_shape():
    for bad in ({**TOOL_CALL, "type": "retrieval"}, {"id": "1"}, {**TOOL_CALL, "function": {"name": "f"}}):
        body = json.dumps({"messages": [{"role": "assistant", "tool_calls": [bad]}]}).encode()
        with pytest.raises(BadRequest) as exc:
            decode_body(body, ChatCompletionRequest)
        assert exc.value.param.startswith("messages[0].tool_calls[0]"), exc.value.param


# -- cache_salt and request_timeout ----------------------------------------------------------------
def test_cache_salt_is_a_non_empty_string():
    assert cache_salt(completion()) is None
    with pytest.raises(BadRequest, match="non-empty") as exc:
        cache_salt(completion(cache_salt=""))
    assert exc.value.param == "cache_salt"
    assert cache_salt(completion(cache_salt="tenant-a")) == "tenant-a"
    with pytest.raises(BadRequest):
        decode_body(b'{"prompt": "x", "cache_salt": 5}', CompletionRequest)


def test_request_timeout_is_positive_and_bounded():
    assert request_timeout(completion()) is None and request_timeout(completion(request_timeout=2.5)) == 2.5
    for bad in (0, -1, 1e9, float("inf"), float("nan")):
        with pytest.raises(BadRequest) as exc:
            request_timeout(completion(request_timeout=bad))
        assert exc.value.param == "request_timeout"


# -- the error shape -------------------------------------------------------------------------------
def test_error_body_is_vllms_shape_with_the_status_as_code():
    assert error_body("boom", code=504) == {"error": {
        "message": "boom", "type": "InternalServerError", "param": None, "code": 504}}
    assert [error_type(s) for s in (400, 401, 404, 405, 413, 500, 503)] == [
        "BadRequestError", "AuthenticationError", "NotFoundError", "MethodNotAllowedError",
        "RequestEntityTooLargeError", "InternalServerError", "InternalServerError"]
    body = json.loads(error_response(400, "x" * 10 ** 6, "prompt").body)
    assert body["error"]["code"] == 400 and body["error"]["param"] == "prompt"
    assert len(body["error"]["message"]) < MAX_MESSAGE_CHARS + 100


async def _errors_from_the_middleware() -> list[tuple[int, dict]]:
    server = OpenAIServer(None, ServerOptions(api_key="k"))
    async with TestClient(TestServer(server.app())) as client:
        calls = [client.get("/v1/models"),                                        # no key: 401
                 client.get("/v1/models", headers={"Authorization": "Bearer k"}),  # loading: 503
                 client.get("/no/such/path"), client.get("/tokenize"),            # 404, 405
                 client.get("/health")]                                           # loading: 503
        out = []
        for call in calls:
            resp = await call
            out.append((resp.status, await resp.json()))
        return out


def test_every_error_the_middleware_writes_has_the_one_shape():
    seen = asyncio.run(_errors_from_the_middleware())
    assert [status for status, _ in seen] == [401, 503, 404, 405, 503]
    for status, body in seen:
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], body
        assert err["code"] == status and err["type"] == error_type(status), body
