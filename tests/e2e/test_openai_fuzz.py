"""Fuzzing the HTTP edge with 1,260 generated hostile bodies: every field of every endpoint gets
valid values, wrong types, out-of-range and non-finite numbers, nulls, deep nesting and junk,
plus unknown fields, empty and 100,000-message conversations, 5 MB bodies and bodies that are
not JSON (or not UTF-8) at all. Bodies go five at a time, so hostile values share engine steps
with valid requests. The server must answer each within a deadline, never with a 5xx, with an
error in the one shape (vLLM's) for anything it refuses, and a well-framed stream when it
streams; afterwards it must be healthy with its KV cache idle."""
from __future__ import annotations

import http.client as http_client
import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from server import Server

pytestmark = pytest.mark.slow

# One compute thread: on a shared 2-core machine, two spinning torch threads per step make
# every step several times slower, and these tests are about the API, not throughput.
SERVER_ARGS = ("--threads", "1")

DEADLINE_S = 30.0        # per request: a hang fails the test, it does not stall the suite
BATCH = 5                # bodies per generated example, sent at once
FUZZ = settings(max_examples=30, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestEntityTooLargeError"}
SENT: Counter[str] = Counter()          # bodies sent, by test
STATUSES: Counter[int] = Counter()      # answers, by HTTP status


@pytest.fixture(scope="module")
def server():
    s = Server(*SERVER_ARGS)
    yield s
    s.stop()


def request(server: Server, method: str, path: str, body: bytes | None = None) -> tuple[int, dict, bytes]:
    conn = http_client.HTTPConnection(urlsplit(server.url).netloc, timeout=DEADLINE_S)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def check(server: Server, path: str, body: bytes) -> int:
    """Send one body; the answer came in time, is not a 5xx, and is well-shaped."""
    start = time.monotonic()
    status, headers, data = request(server, "POST", path, body)
    assert time.monotonic() - start < DEADLINE_S
    assert status < 500, (status, body[:500], data[:500])
    if path.startswith(MESSAGES_PATH):               # Anthropic's shapes
        check_anthropic(status, headers, data)
    elif status >= 400:
        err = json.loads(data)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], data[:500]
        assert err["code"] == status and err["type"] == ERROR_TYPES[status], data[:500]
        assert err["param"] is None or isinstance(err["param"], str), data[:500]
    elif headers.get("content-type", "").startswith("text/event-stream") and path == RESPONSES_PATH:
        text = data.decode()                    # named events, no [DONE]
        assert text.endswith("\n\n"), text[-300:]
        for block in text.split("\n\n")[:-1]:
            name, payload = block.split("\n", 1)
            assert json.loads(payload.removeprefix("data: "))["type"] == name.removeprefix("event: ") != "error"
    elif headers.get("content-type", "").startswith("text/event-stream"):
        text = data.decode()
        assert text.endswith("data: [DONE]\n\n"), text[-300:]
        for block in text.split("\n\n")[:-2]:
            payload = json.loads(block.removeprefix("data: "))
            assert "error" not in payload, payload
    else:
        json.loads(data)
    return status


def check_anthropic(status: int, headers: dict, data: bytes) -> None:
    """An error as ``{"type": "error", "error": {"type", "message"}}``; a stream as named events
    from message_start to message_stop, none of them an error."""
    if status >= 400:
        body = json.loads(data)
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, data[:500]
        assert body["error"]["type"] == ERROR_TYPES[status] and body["error"]["message"], data[:500]
    elif headers.get("content-type", "").startswith("text/event-stream"):
        text = data.decode()
        assert text.endswith("\n\n"), text[-300:]
        names = []
        for block in text.split("\n\n")[:-1]:
            name, payload = block.split("\n", 1)
            names.append(name.removeprefix("event: "))
            assert json.loads(payload.removeprefix("data: "))["type"] == names[-1] != "error", block
        assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    else:
        body = json.loads(data)
        assert body.get("type") == "message" or "input_tokens" in body, data[:500]


def check_all(server: Server, test: str, sends: list[tuple[str, bytes]]) -> list[int]:
    """Send the bodies at once (they share engine steps)."""
    SENT[test] += len(sends)
    with ThreadPoolExecutor(len(sends)) as pool:
        statuses = list(pool.map(lambda s: check(server, *s), sends))
    for status in statuses:
        event(f"HTTP {status}")
    STATUSES.update(statuses)
    return statuses


# -- raw JSON: what json.dumps cannot write ------------------------------------------------------
class Raw:
    """A JSON fragment put into a body as is: non-finite or huge numbers, deep nesting, escapes
    of lone surrogates."""

    def __init__(self, text: str) -> None:
        self.text = text


def encoded(body) -> bytes:
    raws: list[str] = []

    def placeholder(value):
        if isinstance(value, Raw):
            raws.append(value.text)
            return f"@@raw{len(raws) - 1}@@"
        raise TypeError(type(value).__name__)
    text = json.dumps(body, default=placeholder)
    for i, raw in enumerate(raws):
        text = text.replace(f'"@@raw{i}@@"', raw, 1)
    return text.encode()


def nested(depth: int) -> Raw:
    return Raw("[" * depth + "]" * depth)


raw_numbers = st.sampled_from(["1e400", "-1e400", "1e-400", "NaN", "Infinity", "-Infinity",
                               str(2 ** 63), str(2 ** 64), str(-(2 ** 63) - 1), "1" + "0" * 5000,
                               "-0", "0.0", "1E2"]).map(Raw)
raw_junk = raw_numbers | st.integers(2, 3000).map(nested) | st.just(Raw('"\\ud800"'))

# -- strategies ----------------------------------------------------------------------------------
junk = st.recursive(
    st.none() | st.booleans() | st.text(max_size=8) | st.floats(allow_nan=False, allow_infinity=False)
    | st.integers(min_value=-(2 ** 70), max_value=-1) | st.integers(min_value=10 ** 5, max_value=2 ** 70)
    | raw_junk,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6)
small_text = st.text(max_size=12)
token_ids = st.lists(st.integers(min_value=0, max_value=60000), min_size=0, max_size=6)
huge_ints = st.sampled_from([2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, 2 ** 64, 10 ** 30, -(2 ** 63) - 1])

COMMON = {   # valid values (junk is mixed in by ``with_junk``)
    "max_tokens": st.integers(-1, 4), "temperature": st.floats(-0.5, 2.5),
    "top_p": st.floats(0, 1), "top_k": st.integers(-2, 50) | huge_ints, "min_p": st.floats(0, 1.2),
    "n": st.integers(0, 2), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "stop": st.one_of(small_text, st.lists(small_text, max_size=3)),
    "stop_token_ids": token_ids, "seed": st.integers(-(2 ** 64), 2 ** 65),
    "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3),
    "logit_bias": st.dictionaries(st.integers(-5, 60000).map(str), st.floats(-150, 150), max_size=3),
    "ignore_eos": st.booleans(), "min_tokens": st.integers(-1, 6) | huge_ints,
    "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
    "user": small_text, "priority": st.integers(-2, 2) | huge_ints, "cache_salt": small_text,
}
TOOL_CALL = st.fixed_dictionaries({"id": small_text, "type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": small_text, "arguments": st.sampled_from(['{"city": "Paris"}', "{", "[]", ""]) | small_text})})
MESSAGE = {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool"]),
           "content": st.one_of(small_text, small_text, st.none(), st.lists(st.fixed_dictionaries(
               {"type": st.sampled_from(["text", "image_url"]), "text": small_text}), max_size=2))}
MESSAGE_OPTIONAL = {"name": small_text, "tool_calls": st.lists(TOOL_CALL, max_size=2), "tool_call_id": small_text}
CHAT = {**COMMON, "max_completion_tokens": st.integers(-1, 4), "logprobs": st.booleans(),
        "top_logprobs": st.integers(-1, 21), "add_generation_prompt": st.booleans(),
        "continue_final_message": st.booleans(),
        "chat_template_kwargs": st.dictionaries(st.sampled_from(["x", "messages", "bos_token"]), junk)}
COMPLETION = {**COMMON, "prompt": st.one_of(small_text, token_ids, st.lists(small_text, max_size=2),
                                            st.lists(token_ids, max_size=2)),
              "logprobs": st.integers(-1, 6), "echo": st.booleans(), "add_special_tokens": st.booleans()}
IN_RANGE = {   # values the server accepts: more bodies reach the engine beside hostile ones
    "max_tokens": st.integers(1, 4), "max_completion_tokens": st.integers(1, 4),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1), "n": st.integers(1, 2), "seed": st.integers(0, 2 ** 32),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "min_tokens": st.integers(0, 1), "priority": st.just(0),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
    "stop": st.lists(small_text.filter(bool), max_size=2), "continue_final_message": st.just(False),
    "chat_template_kwargs": st.dictionaries(st.just("x"), small_text),
    "messages": st.lists(st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                               "content": small_text}, optional={"name": small_text}),
        st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none(),
                               "tool_calls": st.lists(TOOL_CALL, min_size=1, max_size=2)}),
        st.fixed_dictionaries({"role": st.just("tool"), "content": small_text, "tool_call_id": small_text})),
        min_size=1, max_size=3),
}
NOT_IN_RANGE = {"cache_salt", "stream_options", "top_logprobs"}   # each refused in some combinations


def in_range(fields: dict[str, st.SearchStrategy]) -> dict[str, st.SearchStrategy]:
    out = {k: IN_RANGE.get(k, v) for k, v in fields.items() if k not in NOT_IN_RANGE}
    if "prompt" in fields:
        out.update(logprobs=st.integers(0, 5), prompt=st.one_of(
            small_text.filter(bool), st.lists(st.integers(0, 49151), min_size=1, max_size=6)))
    else:
        out["messages"] = IN_RANGE["messages"]
    return out


ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer", "tool"]),
                           "content": st.one_of(small_text, st.lists(st.fixed_dictionaries(
                               {"type": st.sampled_from(["input_text", "output_text", "input_image"]),
                                "text": small_text}), max_size=2))}, optional={"type": st.just("message")}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": small_text, "name": small_text,
                           "arguments": small_text}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": small_text, "output": small_text}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "web_search_call", "x"])}))
RESPONSES = {**{k: v for k, v in COMMON.items() if k not in ("max_tokens", "n", "stream_options", "min_tokens")},
             "input": st.one_of(small_text, st.lists(ITEM, max_size=3)), "instructions": small_text,
             "max_output_tokens": st.integers(-1, 4), "store": st.booleans(), "previous_response_id": small_text,
             "text": st.fixed_dictionaries({"format": st.sampled_from([
                 {"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "name": "x", "schema": {
                     "type": "object"}}, {"type": "json_schema"}, {"type": "grammar"}])}),
             "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]),
                                                      "name": small_text}), max_size=2),
             "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "name": "f"},
                                             {"type": "x"}]),
             "include": st.lists(st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content"]),
                                 max_size=2),
             "top_logprobs": st.integers(-1, 21), "truncation": st.sampled_from(["disabled", "auto"]),
             "background": st.booleans(), "reasoning": st.fixed_dictionaries({}, optional={"effort": small_text}),
             "metadata": st.dictionaries(small_text, small_text, max_size=2)}


RESPONSES_OK = {   # values the server accepts
    **{k: v for k, v in IN_RANGE.items() if k in RESPONSES}, "stream": st.booleans(),
    "input": st.one_of(small_text.filter(bool), st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "developer"]), "content": small_text}), min_size=1, max_size=2)),
    "instructions": small_text, "max_output_tokens": st.integers(1, 4), "store": st.booleans(),
    "text": st.fixed_dictionaries({"format": st.sampled_from([{"type": "text"}, {"type": "json_object"}])}),
    "include": st.just(["message.output_text.logprobs"]), "top_logprobs": st.integers(0, 5),
    "truncation": st.just("disabled"), "metadata": st.dictionaries(small_text, small_text, max_size=2)}


def short_response(body: dict) -> dict:
    """A Responses body never left to run to the end of the context."""
    if body.get("max_output_tokens") is None:
        body["max_output_tokens"] = 3
    return body


TOKENIZE = {"prompt": small_text, "add_special_tokens": st.booleans(), "return_token_strs": st.booleans(),
            "add_generation_prompt": st.booleans()}


def with_junk(fields: dict[str, st.SearchStrategy]) -> dict[str, st.SearchStrategy]:
    """Each field: mostly valid, sometimes junk."""
    return {k: st.one_of(v, v, junk) for k, v in fields.items()}


def messages(junky: bool) -> st.SearchStrategy:
    fields = with_junk(MESSAGE) if junky else MESSAGE
    optional = {**with_junk(MESSAGE_OPTIONAL), "surprise": junk} if junky else MESSAGE_OPTIONAL
    one = st.fixed_dictionaries(fields, optional=optional)
    many = st.lists(one, min_size=0 if junky else 1, max_size=3)
    return st.one_of(many, many, junk) if junky else many


def bodies(fields: dict[str, st.SearchStrategy], required: str, junky: bool = True) -> st.SearchStrategy:
    """Bodies with a random subset of the fields (junky: with junk values and unknown fields);
    generation kept short (a body that would run for long gets a small max_tokens)."""
    chat = "max_completion_tokens" in fields
    generation = "max_tokens" in fields
    fields = with_junk(fields) if junky else dict(fields)
    if junky:
        fields["model"] = st.none() | st.none() | small_text   # mostly none: the rest gets checked
    if chat or "messages" in fields:
        fields.setdefault("messages", messages(junky))

    def shape(d: dict) -> dict:
        if not generation:
            return d
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


def batch(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(strategy, min_size=BATCH, max_size=BATCH)


CHAT_PATH, COMPLETION_PATH, RESPONSES_PATH = "/v1/chat/completions", "/v1/completions", "/v1/responses"
MESSAGES_PATH, COUNT_TOKENS_PATH = "/v1/messages", "/v1/messages/count_tokens"


def path_of(body: dict) -> str:
    return CHAT_PATH if "messages" in body else RESPONSES_PATH if "input" in body else COMPLETION_PATH


# -- generated bodies: 45 x 5 + 45 x 5 + 20 x 5 + 20 x 5 + 30 x 5 + 12 x 5 + 20 x 5 + 30 x 5 + 24 x 5 = 1,230 --
@FUZZ
@given(sent=batch(bodies(CHAT, "messages")))
def test_fuzz_chat_completions(server, sent):
    check_all(server, "chat", [(CHAT_PATH, encoded(b)) for b in sent])


@FUZZ
@given(sent=batch(bodies(COMPLETION, "prompt")))
def test_fuzz_completions(server, sent):
    check_all(server, "completions", [(COMPLETION_PATH, encoded(b)) for b in sent])


@settings(FUZZ, max_examples=20)
@given(sent=batch(bodies(RESPONSES, "input").map(short_response)))
def test_fuzz_responses(server, sent):
    check_all(server, "responses", [(RESPONSES_PATH, encoded(b)) for b in sent])


BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": small_text}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": small_text, "signature": small_text}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": small_text, "name": small_text,
                           "input": st.dictionaries(small_text, small_text, max_size=2)}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": small_text, "content": st.one_of(
        small_text, st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]), "text": small_text}),
                             max_size=2))}),
    st.fixed_dictionaries({"type": st.sampled_from(["image", "redacted_thinking", "document", "x"])}))
ANTHROPIC = {
    "max_tokens": st.integers(-1, 4), "temperature": st.floats(-0.5, 2.5), "top_p": st.floats(0, 1),
    "top_k": st.integers(-2, 50), "stream": st.booleans(), "stop_sequences": st.lists(small_text, max_size=2),
    "system": st.one_of(small_text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": small_text}),
                                             max_size=2)),
    "messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "assistant", "system"]),
        "content": st.one_of(small_text, st.lists(BLOCK, max_size=3))}), max_size=3),
    "tools": st.lists(st.fixed_dictionaries({"name": small_text, "input_schema": st.sampled_from([
        {"type": "object"}, {"properties": {"a": {"type": "integer"}}}, {"type": "array"}, {}])}), max_size=2),
    "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"}, {"type": "tool"},
                                    {"type": "tool", "name": "f"}, {"type": "x"}]),
    "thinking": st.sampled_from([{"type": "disabled"}, {"type": "adaptive"}, {"type": "enabled"},
                                 {"type": "enabled", "budget_tokens": 1024}, {"type": "enabled", "budget_tokens": 5}]),
    "output_config": st.fixed_dictionaries({}, optional={
        "effort": st.sampled_from(["low", "max", "huge"]),
        "format": st.sampled_from([{"type": "json_schema", "schema": {"type": "object"}}, {"type": "x"}, {}])}),
    "metadata": st.dictionaries(small_text, small_text, max_size=2), "service_tier": small_text,
}


def anthropic_body(body: dict) -> dict:
    """Messages bodies that run short (a max_tokens of at most 3 unless it is junk), naming the
    served model unless the model is what was generated (Anthropic's ``model`` is required)."""
    if body.get("model") is None:
        body["model"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    limit = body.get("max_tokens")
    if limit is None or (isinstance(limit, int) and not isinstance(limit, bool) and limit > 3):
        body["max_tokens"] = 3
    return body


@settings(FUZZ, max_examples=20)
@given(sent=batch(bodies(ANTHROPIC, "messages").map(anthropic_body)
                  | bodies(ANTHROPIC, "messages", junky=False).map(anthropic_body)))
def test_fuzz_anthropic_messages_and_count_tokens(server, sent):
    """vLLM's Anthropic endpoints: Anthropic's error shape for what is refused, Anthropic's
    events when streamed (count_tokens gets every other body)."""
    check_all(server, "anthropic", [(COUNT_TOKENS_PATH if i % 2 else MESSAGES_PATH, encoded(b))
                                    for i, b in enumerate(sent)])


@settings(FUZZ, max_examples=30)
@given(sent=batch(bodies(CHAT, "messages", junky=False) | bodies(COMPLETION, "prompt", junky=False)
                  | bodies(in_range(CHAT), "messages", junky=False)
                  | bodies(in_range(COMPLETION), "prompt", junky=False)
                  | bodies(RESPONSES_OK, "input", junky=False).map(short_response)))
def test_fuzz_well_typed_bodies_reach_the_engine(server, sent):
    """Only well-typed values, half of them in range: combinations of n, stream, echo,
    logprobs, stop and penalties that get admitted and run."""
    check_all(server, "well-typed", [(path_of(b), encoded(b)) for b in sent])


def batch_chat(body: dict) -> dict:
    """A chat body whose messages become one to three conversations (the batch endpoint's)."""
    convs = body.get("messages")
    body["messages"] = [convs, convs] if isinstance(convs, list) else convs
    return body


SCORING = {"query": st.one_of(small_text, token_ids), "items": st.one_of(
    st.lists(small_text, max_size=3), st.lists(token_ids, max_size=3), st.lists(st.one_of(small_text, token_ids),
                                                                               max_size=3)),
    "label_token_ids": st.one_of(token_ids, st.lists(st.integers(0, 49151), min_size=1, max_size=3)),
    "apply_softmax": st.booleans(), "item_first": st.booleans(), "add_special_tokens": st.booleans(),
    "priority": st.integers(-2, 2), "cache_salt": small_text}
SCORING_OK = {**SCORING, "query": st.text(min_size=1, max_size=12), "items": st.lists(small_text, min_size=1,
                                                                                        max_size=3)}


@settings(FUZZ, max_examples=12)
@given(sent=batch(bodies(CHAT, "messages").map(batch_chat) | bodies(SCORING, "label_token_ids")
                  | bodies(CHAT, "messages", junky=False).map(batch_chat)
                  | st.fixed_dictionaries({k: SCORING_OK[k] for k in ("query", "items", "label_token_ids")},
                                          optional={k: v for k, v in SCORING_OK.items()
                                                    if k not in ("query", "items", "label_token_ids")})))
def test_fuzz_chat_batches_and_generative_scoring(server, sent):
    """vLLM's /v1/chat/completions/batch and /generative_scoring take hostile bodies as the
    other endpoints do: refused in the one error shape, never a 5xx, nothing left running."""
    check_all(server, "batch and scoring", [("/generative_scoring" if "label_token_ids" in b
                                             else "/v1/chat/completions/batch", encoded(b)) for b in sent])


@settings(FUZZ, max_examples=20)
@given(sent=batch(bodies(TOKENIZE, "prompt") | bodies({**TOKENIZE, "messages": messages(True)}, "messages")
                  | st.fixed_dictionaries({"tokens": st.one_of(token_ids, junk)})))
def test_fuzz_tokenize_and_detokenize(server, sent):
    check_all(server, "tokenize", [("/detokenize" if "tokens" in b else "/tokenize", encoded(b)) for b in sent])


not_json = (st.binary(max_size=64)                                            # mostly not UTF-8
            | st.text(max_size=32).map(lambda t: t.encode("utf-16"))
            | st.builds(lambda head, bad: b'{"prompt": "' + head + bad + b'"}',
                        st.binary(max_size=8), st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80"]))
            | junk.map(encoded)
            | st.integers(900, 200_000).map(lambda d: b"[" * d + b"]" * d)
            | st.integers(900, 50_000).map(lambda d: b'{"prompt": ' + b"[" * d + b"]" * d + b"}"))


@settings(FUZZ, max_examples=30)
@given(sent=batch(st.tuples(not_json, st.sampled_from([CHAT_PATH, COMPLETION_PATH, "/tokenize", "/detokenize"]))))
def test_fuzz_bodies_that_are_not_requests(server, sent):
    assert check_all(server, "not requests", [(path, raw) for raw, path in sent]) == [400] * BATCH


NUMERIC_FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "min_tokens", "priority", "logprobs"]
extreme = raw_numbers | huge_ints | st.sampled_from([-1, 0, 1, 5e-324, 1e-300, 2.0000001, 129, 8192])


@st.composite
def extreme_number_bodies(draw) -> dict:
    """A valid request with one or two numbers pushed to the edges of what JSON can say."""
    chat = draw(st.booleans())
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    body["max_tokens"] = 2
    for name in draw(st.lists(st.sampled_from(NUMERIC_FIELDS + ["logit_bias", "stop_token_ids", "top_logprobs"]),
                              min_size=1, max_size=2, unique=True)):
        value = draw(extreme)
        if name == "logit_bias":
            body[name] = {str(draw(st.integers(0, 60000) | huge_ints)): value}
        elif name == "stop_token_ids":
            body[name] = [value]
        elif name == "top_logprobs":
            body.update(logprobs=True, top_logprobs=value) if chat else body.update(logprobs=value)
        elif name == "logprobs" and chat:
            body.update(logprobs=True, top_logprobs=value)
        else:
            body[name] = value
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 4:
        body["ignore_eos"] = False           # an accepted long max_tokens still ends at EOS soon
        body["stop"] = ["."]
    return body


@settings(FUZZ, max_examples=24)
@given(sent=batch(extreme_number_bodies()))
def test_fuzz_extreme_numbers_in_every_field(server, sent):
    check_all(server, "extreme numbers", [(path_of(b), encoded(b)) for b in sent])


# -- named hostile bodies: 30 --------------------------------------------------------------------
MB5 = 5 << 20
HI = [{"role": "user", "content": "hi"}]
CONVERSATION_100K = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(100_000)]
HOSTILE = [   # (id, path, body, expected status)
    ("5MB-prompt", COMPLETION_PATH, {"prompt": "hello world " * (MB5 // 12), "max_tokens": 1}, 400),
    ("5MB-message", CHAT_PATH, {"messages": [{"role": "user", "content": "a " * (MB5 // 2)}]}, 400),
    ("5MB-stop-string", COMPLETION_PATH, {"prompt": "x", "max_tokens": 1, "stop": ["s" * MB5]}, 200),
    ("5MB-logit-bias-key", COMPLETION_PATH, {"prompt": "x", "logit_bias": {"7" * MB5: 1}}, 400),
    ("5MB-model-name", COMPLETION_PATH, {"prompt": "x", "model": "m" * MB5}, 404),
    ("5MB-of-unknown-fields", COMPLETION_PATH, {"prompt": "x", **{f"f{i}": i for i in range(400_000)}}, 400),
    ("9MB-body", COMPLETION_PATH, {"prompt": "x" * (9 << 20)}, 413),
    ("100k-messages", CHAT_PATH, {"messages": CONVERSATION_100K, "max_tokens": 1}, 400),
    ("100k-messages-tokenize", "/tokenize", {"messages": CONVERSATION_100K}, 200),
    ("empty-conversation", CHAT_PATH, {"messages": []}, 400),
    ("empty-conversation-tokenize", "/tokenize", {"messages": []}, 400),
    ("empty-message", CHAT_PATH, {"messages": [{"role": "user", "content": ""}], "max_tokens": 1}, 200),
    ("no-content", CHAT_PATH, {"messages": [{"role": "user"}]}, 400),
    ("null-content", CHAT_PATH, {"messages": [{"role": "user", "content": None}]}, 400),
    ("deep-prompt-1000", COMPLETION_PATH, {"prompt": nested(1000)}, 400),
    ("deep-prompt-1M", COMPLETION_PATH, {"prompt": nested(1_000_000)}, 400),
    ("deep-messages", CHAT_PATH, {"messages": nested(1000)}, 400),
    ("deep-content", CHAT_PATH, {"messages": [{"role": "user", "content": nested(1000)}]}, 400),
    ("deep-template-kwargs", CHAT_PATH, {"messages": HI, "chat_template_kwargs": {"x": nested(1000)}}, 400),
    ("deep-but-decodable-kwargs", CHAT_PATH,
     {"messages": HI, "max_tokens": 1, "chat_template_kwargs": {"x": nested(900)}}, 200),
    ("deep-tool-arguments", CHAT_PATH, {"messages": [*HI, {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}]}],
        "max_tokens": 1}, 200),
    ("deep-detokenize", "/detokenize", {"tokens": nested(1000)}, 400),
    ("n-huge", COMPLETION_PATH, {"prompt": "x", "n": 10 ** 6}, 400),
    ("n-prompts-over-choices", COMPLETION_PATH, {"prompt": ["x"] * 200, "n": 2, "max_tokens": 1}, 400),
    ("max-tokens-2^64", CHAT_PATH, {"messages": HI, "max_tokens": 2 ** 64}, 400),
    ("max-tokens-1e30", COMPLETION_PATH, {"prompt": "x", "max_tokens": 10 ** 30}, 400),
    ("min-tokens-unbounded", CHAT_PATH, {"messages": HI, "min_tokens": 2 ** 64}, 400),
    ("top-k-2^63", COMPLETION_PATH, {"prompt": "x", "max_tokens": 1, "top_k": 2 ** 63}, 400),
    ("lone-surrogate", COMPLETION_PATH, {"prompt": Raw('"a\\udc00b"')}, 400),
    ("invalid-utf8-key", COMPLETION_PATH, Raw('{"prompt": "x", "\xff": 1}'), 400),
]


@pytest.mark.parametrize("path, body, status", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_bodies(server, path, body, status):
    raw = body.text.encode("latin-1") if isinstance(body, Raw) else encoded(body)
    SENT["hostile"] += 1
    STATUSES[status] += 1
    assert check(server, path, raw) == status


def test_server_is_healthy_and_idle_after_fuzzing(server):
    assert request(server, "GET", "/health")[0] == 200
    deadline = time.monotonic() + 10
    while True:
        stats = json.loads(request(server, "GET", "/debug/engine")[2])
        idle = (stats["kv_cache_usage"] == 0 and stats["num_requests_running"] == 0
                and stats["num_requests_waiting"] == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, stats
    status, _, data = request(server, "POST", COMPLETION_PATH, encoded({"prompt": "Hello", "max_tokens": 2}))
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 2
    print(f"\nfuzzed bodies: {sum(SENT.values())} {dict(SENT)}; answers: {dict(sorted(STATUSES.items()))}; "
          f"engine: {stats}")
