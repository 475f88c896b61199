"""Fuzzing the HTTP edge with hypothesis-generated bodies: every field of every endpoint gets
valid values, wrong types, out-of-range numbers, nulls and junk, plus unknown fields and bodies
that are not JSON at all. The server must answer each within a deadline, never with a 5xx,
with an OpenAI-shaped error for anything it refuses, and a well-framed stream when it streams."""
from __future__ import annotations

import http.client as http_client
import json
import time
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from server import Server

pytestmark = pytest.mark.slow

# One compute thread: on a shared 2-core machine, two spinning torch threads per step make
# every step several times slower, and these tests are about the API, not throughput.
SERVER_ARGS = ("--threads", "1")

DEADLINE_S = 60.0        # per request: a hang fails the test, it does not stall the suite
FUZZ = settings(max_examples=150, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def server():
    s = Server(*SERVER_ARGS)
    yield s
    s.stop()


def post(server: Server, path: str, body: bytes) -> tuple[int, dict[str, str], bytes, float]:
    conn = http_client.HTTPConnection(urlsplit(server.url).netloc, timeout=DEADLINE_S)
    start = time.monotonic()
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data, time.monotonic() - start
    finally:
        conn.close()


def check(server: Server, path: str, body: bytes) -> int:
    status, headers, data, took = post(server, path, body)
    assert took < DEADLINE_S
    event(f"HTTP {status}")
    assert status < 500, (status, body[:500], data[:500])
    if status >= 400:
        err = json.loads(data)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], data
        assert status in (400, 404, 413), (status, data)
    elif headers.get("content-type", "").startswith("text/event-stream"):
        text = data.decode()
        assert text.endswith("data: [DONE]\n\n"), text[-300:]
        for block in text.split("\n\n")[:-2]:
            payload = json.loads(block.removeprefix("data: "))
            assert "error" not in payload, payload
    else:
        json.loads(data)
    return status


# -- strategies ----------------------------------------------------------------------------------
junk = st.recursive(
    st.none() | st.booleans() | st.text(max_size=8) | st.floats(allow_nan=False, allow_infinity=False)
    | st.integers(min_value=-(2 ** 70), max_value=-1) | st.integers(min_value=10 ** 5, max_value=2 ** 70),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6)
small_text = st.text(max_size=12)
token_ids = st.lists(st.integers(min_value=0, max_value=60000), min_size=0, max_size=6)


COMMON = {   # valid values (junk is mixed in by ``with_junk``)
    "max_tokens": st.integers(-1, 4), "temperature": st.floats(-0.5, 2.5),
    "top_p": st.floats(0, 1), "top_k": st.integers(-2, 50), "min_p": st.floats(0, 1.2),
    "n": st.integers(0, 2), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "stop": st.one_of(small_text, st.lists(small_text, max_size=3)),
    "stop_token_ids": token_ids, "seed": st.integers(-(2 ** 64), 2 ** 65),
    "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3),
    "logit_bias": st.dictionaries(st.integers(-5, 60000).map(str), st.floats(-150, 150), max_size=3),
    "ignore_eos": st.booleans(), "min_tokens": st.integers(-1, 6),
    "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
    "user": small_text, "priority": st.integers(-2, 2),
}
MESSAGE = {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool"]),
           "content": st.one_of(small_text, st.lists(st.fixed_dictionaries(
               {"type": st.sampled_from(["text", "image_url"]), "text": small_text}), max_size=2))}
CHAT = {**COMMON, "max_completion_tokens": st.integers(-1, 4), "logprobs": st.booleans(),
        "top_logprobs": st.integers(-1, 21), "add_generation_prompt": st.booleans(),
        "continue_final_message": st.booleans(),
        "chat_template_kwargs": st.dictionaries(st.sampled_from(["x", "messages", "bos_token"]), junk)}
COMPLETION = {**COMMON, "prompt": st.one_of(small_text, token_ids, st.lists(small_text, max_size=2),
                                            st.lists(token_ids, max_size=2)),
              "logprobs": st.integers(-1, 6), "echo": st.booleans(), "add_special_tokens": st.booleans()}
TOKENIZE = {"prompt": small_text, "add_special_tokens": st.booleans(), "return_token_strs": st.booleans(),
            "add_generation_prompt": st.booleans()}


def with_junk(fields: dict[str, st.SearchStrategy]) -> dict[str, st.SearchStrategy]:
    """Each field: mostly valid, sometimes junk."""
    return {k: st.one_of(v, v, junk) for k, v in fields.items()}


def messages(junky: bool) -> st.SearchStrategy:
    fields = with_junk(MESSAGE) if junky else MESSAGE
    one = st.fixed_dictionaries(fields, optional={"name": small_text, "surprise": junk} if junky else {})
    many = st.lists(one, min_size=0 if junky else 1, max_size=3)
    return st.one_of(many, many, junk) if junky else many


def bodies(fields: dict[str, st.SearchStrategy], required: str, junky: bool = True) -> st.SearchStrategy:
    """Bodies with a random subset of the fields (junky: with junk values and unknown fields);
    generation kept short (a body that would run for long gets a small max_tokens)."""
    chat = "max_completion_tokens" in fields
    fields = with_junk(fields) if junky else dict(fields)
    if junky:
        fields["model"] = st.none() | st.none() | small_text   # mostly none: the rest gets checked
    if chat or "messages" in fields:
        fields["messages"] = messages(junky)

    def shape(d: dict) -> dict:
        limit = d.get("max_tokens")
        if chat and d.get("max_completion_tokens") is not None:
            limit = d["max_completion_tokens"]
        if limit is None:
            d["max_completion_tokens" if chat else "max_tokens"] = 3
        return d
    extra = st.dictionaries(st.text(min_size=1, max_size=6).filter(lambda k: k not in fields), junk,
                            max_size=1) if junky else st.just({})
    return st.builds(
        lambda picked, unknown: shape({**picked, **unknown}),
        st.fixed_dictionaries({required: fields[required]},
                              optional={k: v for k, v in fields.items() if k != required}),
        extra | st.just({}))


def encoded(body: dict) -> bytes:
    return json.dumps(body).encode()


# -- tests ---------------------------------------------------------------------------------------
@FUZZ
@given(body=bodies(CHAT, "messages"))
def test_fuzz_chat_completions(server, body):
    check(server, "/v1/chat/completions", encoded(body))


@FUZZ
@given(body=bodies(COMPLETION, "prompt"))
def test_fuzz_completions(server, body):
    check(server, "/v1/completions", encoded(body))


@settings(FUZZ, max_examples=40)
@given(body=bodies(CHAT, "messages", junky=False) | bodies(COMPLETION, "prompt", junky=False))
def test_fuzz_well_typed_bodies_reach_the_engine(server, body):
    """Only well-typed values (ranges may still be off): combinations of n, stream, echo,
    logprobs, stop and penalties that get admitted and run."""
    check(server, "/v1/chat/completions" if "messages" in body else "/v1/completions", encoded(body))


@settings(FUZZ, max_examples=60)
@given(body=bodies(TOKENIZE, "prompt") | bodies({**TOKENIZE, "messages": messages(True)}, "messages")
       | st.fixed_dictionaries({"tokens": st.one_of(token_ids, junk)}))
def test_fuzz_tokenize_and_detokenize(server, body):
    check(server, "/detokenize" if "tokens" in body else "/tokenize", encoded(body))


@settings(FUZZ, max_examples=60)
@given(raw=st.binary(max_size=64) | junk.map(lambda v: json.dumps(v).encode()),
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]))
def test_fuzz_bodies_that_are_not_requests(server, raw, path):
    assert check(server, path, raw) == 400


def test_server_still_serves_after_fuzzing(server):
    status, _, data, _ = post(server, "/v1/completions", encoded({"prompt": "Hello", "max_tokens": 2}))
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 2
