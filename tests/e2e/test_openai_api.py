"""OpenAI conformance, part 1: every endpoint and every parameter's effect, driven with the
official openai client against the real server (raw HTTP where the client hides details)."""
from __future__ import annotations

import http.client as http_client
import json
import math
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import openai
import pytest

from server import Server

pytestmark = pytest.mark.slow

# One compute thread: on a shared 2-core machine, two spinning torch threads per step make
# every step several times slower, and these tests are about the API, not throughput.
SERVER_ARGS = ("--threads", "1")

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    s = Server(*SERVER_ARGS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status_code, self.headers, self.content = status, headers, body

    @property
    def text(self) -> str:
        return self.content.decode()

    def json(self):
        return json.loads(self.content)


class Http:
    """Raw HTTP (one connection per call): what the openai client hides."""

    def __init__(self, url: str) -> None:
        self.netloc = urlsplit(url).netloc

    def request(self, method: str, path: str, json_body=None, content: bytes | None = None,
                headers: dict[str, str] | None = None) -> Response:
        conn = http_client.HTTPConnection(self.netloc, timeout=120)
        try:
            body = content if json_body is None else json.dumps(json_body).encode()
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=body, headers=hdrs)
            resp = conn.getresponse()
            return Response(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
        finally:
            conn.close()

    def get(self, path: str, **kw) -> Response:
        return self.request("GET", path, **kw)

    def post(self, path: str, json=None, **kw) -> Response:
        return self.request("POST", path, json_body=json, **kw)


@pytest.fixture(scope="module")
def http(server):
    return Http(server.url)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def sse(http: Http, path: str, body: dict) -> list[dict]:
    """A streamed request's events, checking the framing: data lines, one [DONE], last."""
    resp = http.post(path, json={**body, "stream": True})
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    raw = resp.text
    assert raw.endswith("data: [DONE]\n\n")
    blocks = raw.split("\n\n")[:-1]
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks), blocks
    assert [b for b in blocks if b == "data: [DONE]"] == ["data: [DONE]"]
    return [json.loads(b[6:]) for b in blocks[:-1]]


def stream_text(events: list[dict], index: int = 0) -> str:
    return "".join(c["text"] for e in events for c in e["choices"] if c["index"] == index)


# -- models, probes, version, tokenize ----------------------------------------------------------
def test_models_list_retrieve_and_unknown_model(client, model):
    models = client.models.list()
    assert [m.id for m in models.data] == [model] and models.data[0].object == "model"
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("no-such-model")
    assert exc.value.body == {"message": "The model `no-such-model` does not exist.", "type": "NotFoundError",
                              "param": "model", "code": 404}
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert exc.value.body["param"] == "model" and exc.value.body["code"] == exc.value.status_code == 404


def test_a_generative_model_refuses_embedding_requests_naming_the_runner(http):
    for path in ("/v1/embeddings", "/pooling", "/score", "/v1/rerank"):
        r = http.post(path, json={"input": "hello"})
        assert r.status_code == 404 and "--runner pooling" in r.json()["error"]["message"], r.text


def test_a_model_that_takes_no_audio_answers_the_audio_api_with_404(client, model):
    from helpers import audio_file, tone
    for create in (client.audio.transcriptions.create, client.audio.translations.create):
        with pytest.raises(openai.NotFoundError, match="The model does not support (Transcriptions|Translations) API"):
            create(model=model, file=("clip.wav", audio_file(tone(0.2))))


def test_probes_and_version(http):
    assert http.get("/health").status_code == 200
    assert http.get("/ping").status_code == 200
    version = http.get("/version").json()["version"]
    assert version and version[0].isdigit()


def test_tokenize_and_detokenize_agree_with_usage(client, http, model):
    tok = http.post("/tokenize", json={"model": model, "prompt": "The sky is blue",
                                       "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] > 0
    back = http.post("/detokenize", json={"model": model, "tokens": tok["tokens"]}).json()
    assert back == {"prompt": "The sky is blue"}
    done = client.completions.create(model=model, prompt="The sky is blue", max_tokens=1)
    assert done.usage.prompt_tokens == tok["count"]
    chat_tok = http.post("/tokenize", json={"messages": CAPITAL}).json()
    chat = client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=1)
    assert chat.usage.prompt_tokens == chat_tok["count"]
    for body in ({}, {"prompt": "x", "messages": CAPITAL}, {"prompt": 3}):
        r = http.post("/tokenize", json=body)
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = http.post("/detokenize", json={"tokens": [10 ** 9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert http.get("/tokenizer_info").status_code == 404     # only with --enable-tokenizer-info-endpoint


def test_a_custom_role_reaches_the_chat_template_as_vllm_lets_it(client, http, model):
    """vLLM's custom roles: a role the template knows (ChatML writes any) is rendered, not refused."""
    messages = [{"role": "narrator", "content": "It was a dark night."}, *CAPITAL]
    tok = http.post("/tokenize", json={"messages": messages, "return_token_strs": True}).json()
    assert "narrator" in "".join(tok["token_strs"])
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    assert chat.usage.prompt_tokens == tok["count"]


# -- chat ---------------------------------------------------------------------------------------
def test_chat_plain_usage_and_request_id_header(client, http, model):
    resp = client.chat.completions.with_raw_response.create(
        model=model, messages=CAPITAL, temperature=0, max_tokens=10,
        extra_headers={"X-Request-Id": "my-request-7"})
    assert resp.headers["x-request-id"] == "my-request-7"
    chat = resp.parse()
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    (choice,) = chat.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert "Paris" in choice.message.content and choice.finish_reason in ("stop", "length")
    u = chat.usage
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens and 0 < u.completion_tokens <= 10
    three = client.chat.completions.create(model=model, messages=CAPITAL, n=3, max_tokens=2, seed=1)
    assert [c.index for c in three.choices] == [0, 1, 2] and three.usage.completion_tokens == 6
    assert three.usage.prompt_tokens == u.prompt_tokens          # the prompt counts once
    streamed = http.post("/v1/chat/completions", headers={"X-Request-Id": "abc"},
                         json={"messages": CAPITAL, "max_tokens": 2, "stream": True})
    assert streamed.headers["x-request-id"] == "abc"


def test_chat_stream_framing_role_first_finish_then_usage(client, http, model):
    events = sse(http, "/v1/chat/completions", {"messages": CAPITAL, "temperature": 0, "n": 2,
                                                "max_tokens": 6, "stream_options": {"include_usage": True}})
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert len({e["id"] for e in events}) == 1
    roles = [c["index"] for e in events[:2] for c in e["choices"] if c["delta"].get("role") == "assistant"]
    assert sorted(roles) == [0, 1]                      # a role chunk per choice, first
    *chunks, usage = events
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    for i in (0, 1):
        mine = [c for e in chunks for c in e["choices"] if c["index"] == i]
        finishes = [c for c in mine if c["finish_reason"] is not None]
        assert len(finishes) == 1 and mine[-1] is finishes[0] and finishes[0]["finish_reason"] == "length"
        text = "".join(c["delta"].get("content", "") for c in mine)
        plain = client.chat.completions.create(model=model, messages=CAPITAL, temperature=0, max_tokens=6)
        assert text == plain.choices[0].message.content
    # the openai client parses the same stream
    got = list(client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=3, stream=True,
                                              stream_options={"include_usage": True}))
    assert got[0].choices[0].delta.role == "assistant" and got[-1].usage.completion_tokens == 3


def test_chat_content_parts_max_completion_tokens_and_template_options(client, http, model):
    # text parts joined by newlines (vLLM's "string" content format, which SmolLM2's template reads)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Answer in one word."},
                                          {"type": "text", "text": "What is the capital of France?"}]}]
    joined = [{"role": "user", "content": "Answer in one word.\nWhat is the capital of France?"}]
    a = client.chat.completions.create(model=model, messages=parts, temperature=0, max_completion_tokens=5)
    b = client.chat.completions.create(model=model, messages=joined, temperature=0, max_tokens=5)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    assert a.usage.completion_tokens == 5 and a.choices[0].finish_reason == "length"
    partial = CAPITAL + [{"role": "assistant", "content": "The capital of France is"}]
    cont = client.chat.completions.create(
        model=model, messages=partial, temperature=0, max_tokens=4,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert "Paris" in cont.choices[0].message.content
    no_gen = http.post("/tokenize", json={"messages": CAPITAL, "add_generation_prompt": False}).json()
    gen = http.post("/tokenize", json={"messages": CAPITAL}).json()
    assert gen["count"] > no_gen["count"]
    kw = client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=1, user="u-1",
                                        extra_body={"chat_template_kwargs": {"custom_flag": True}})
    assert kw.usage.completion_tokens == 1
    r = http.post("/v1/chat/completions", json={"messages": CAPITAL, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_chat_logprobs_shape(client, model):
    chat = client.chat.completions.create(model=model, messages=CAPITAL, temperature=0, max_tokens=5,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token            # greedy picks the top one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                  reverse=True)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token or entry.token.startswith("bytes:")
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    plain = client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=2, logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    assert client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=1).choices[0].logprobs is None


# -- completions ----------------------------------------------------------------------------------
def test_completion_prompt_forms_and_choice_indices(client, http, model):
    ids = http.post("/tokenize", json={"prompt": "The sky is"}).json()["tokens"]
    texts = {}
    for prompt in ("The sky is", ids, ["The sky is"], [ids]):
        out = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=3)
        assert out.object == "text_completion" and out.id.startswith("cmpl-") and len(out.choices) == 1
        texts[json.dumps(prompt)] = out.choices[0].text
        assert out.usage.prompt_tokens == len(ids)
    assert len(set(texts.values())) == 1
    many = client.completions.create(model=model, prompt=["The sky is", "One, two,", ids], n=2,
                                     temperature=0, max_tokens=3)
    assert [c.index for c in many.choices] == list(range(6))
    assert many.choices[0].text == many.choices[1].text == many.choices[4].text == texts[json.dumps(ids)]
    two = http.post("/tokenize", json={"prompt": "One, two,"}).json()["count"]
    assert many.usage.prompt_tokens == 2 * len(ids) + two and many.usage.completion_tokens == 18
    events = sse(http, "/v1/completions", {"prompt": ["The sky is", "One, two,"], "n": 2, "max_tokens": 3,
                                           "temperature": 0, "stream_options": {"include_usage": True}})
    finishes = sorted(c["index"] for e in events for c in e["choices"] if c["finish_reason"])
    assert finishes == [0, 1, 2, 3] and events[-1]["usage"]["completion_tokens"] == 12
    assert stream_text(events, 2) == many.choices[2].text


def test_max_tokens_ignore_eos_and_finish_reasons(client, model):
    out = client.completions.create(model=model, prompt="Count: 1, 2, 3,", max_tokens=7,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 7
    default = client.completions.create(model=model, prompt="Once upon a time", extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16                  # OpenAI's default max_tokens
    short = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]
    chat = client.chat.completions.create(model=model, messages=short, temperature=0, max_tokens=20)
    assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens < 20


def test_greedy_equivalents_and_seeds_reproducible(client, model):
    def text(**kw):
        return client.completions.create(model=model, prompt="My favourite food is", max_tokens=4,
                                         **kw).choices[0].text
    greedy = text(temperature=0)
    assert text(temperature=0) == greedy
    assert text(temperature=1, top_p=1e-6) == greedy
    assert text(temperature=1, extra_body={"top_k": 1}) == greedy
    assert text(temperature=1, extra_body={"min_p": 1.0}) == greedy
    seeded = [text(temperature=1, seed=11) for _ in range(2)]
    assert seeded[0] == seeded[1]
    n_seeded = [client.completions.create(model=model, prompt="My favourite food is", max_tokens=4,
                                          temperature=1, seed=5, n=2) for _ in range(2)]
    assert [c.text for c in n_seeded[0].choices] == [c.text for c in n_seeded[1].choices]
    # choice i runs with seed + i: choice 1 of seed 5 is choice 0 of seed 6
    assert n_seeded[0].choices[1].text == text(temperature=1, seed=6)


def test_penalties_and_logit_bias_change_the_output(client, http, model):
    prompt = "a, b, a, b, a, b, a,"
    def text(**extra):
        return client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=8,
                                         extra_body=extra).choices[0].text
    base = text()
    assert set(base.replace(",", " ").split()) <= {"a", "b"}     # greedy repeats itself
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 2.0}):
        assert text(**extra) != base, extra
    (tok,) = http.post("/tokenize", json={"prompt": " banana"}).json()["tokens"]
    biased = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=3,
                                       logit_bias={str(tok): 100}).choices[0].text
    assert biased == " banana" * 3


def test_bad_words_are_never_generated(client, http, model):
    def chat(**extra):
        return client.chat.completions.create(model=model, messages=CAPITAL, temperature=0, max_tokens=12,
                                              extra_body=extra).choices[0].message.content
    assert "Paris" in chat()
    assert "Paris" not in chat(bad_words=["Paris"])
    story = {"prompt": "Once upon a time, in a small village,", "temperature": 0, "max_tokens": 12}
    text = http.post("/v1/completions", json=story).json()["choices"][0]["text"]
    phrase = " ".join(text.split()[:2])                  # a phrase of several tokens, banned whole
    banned = http.post("/v1/completions", json={**story, "bad_words": [phrase]}).json()["choices"][0]["text"]
    assert phrase not in banned and banned != text
    blank = http.post("/v1/completions", json={**story, "bad_words": ["  "]})
    assert blank.status_code == 400 and blank.json()["error"]["param"] == "bad_words"


def test_completion_logprobs_shape_and_echo(client, model):
    out = client.completions.create(model=model, prompt="The sky is", temperature=0, max_tokens=4, logprobs=2)
    lp = out.choices[0].logprobs
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, value, tops in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and token in tops and len(tops) == 2        # greedy: the token is a top one
        assert max(tops.values()) == pytest.approx(value, abs=1e-4)
    echo = client.completions.create(model=model, prompt="The sky is", temperature=0, max_tokens=4,
                                     logprobs=1, echo=True)
    c = echo.choices[0]
    assert c.text == "The sky is" + out.choices[0].text
    assert c.logprobs.tokens[:3] == ["The", " sky", " is"] and c.logprobs.token_logprobs[0] is None
    assert c.logprobs.top_logprobs[0] is None and all(v <= 0 for v in c.logprobs.token_logprobs[1:])
    assert len(c.logprobs.tokens) == 3 + 4 and c.logprobs.tokens[3:] == lp.tokens
    assert c.logprobs.text_offset[3] == len("The sky is")
    plain_echo = client.completions.create(model=model, prompt="The sky is", max_tokens=1, echo=True)
    assert plain_echo.choices[0].text.startswith("The sky is") and plain_echo.choices[0].logprobs is None


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client, http, model):
    """OpenAI's and vLLM's way to score a text: echo, max_tokens 0: the prompt with its log-probs."""
    scored = client.completions.create(model=model, prompt="The sky is", max_tokens=0, logprobs=1, echo=True)
    c = scored.choices[0]
    with_token = client.completions.create(model=model, prompt="The sky is", temperature=0, max_tokens=1,
                                           logprobs=1, echo=True).choices[0]
    assert c.text == "The sky is" and c.finish_reason == "length"
    assert c.logprobs.tokens == ["The", " sky", " is"] and c.logprobs.token_logprobs[0] is None
    assert c.logprobs.token_logprobs[1:] == pytest.approx(with_token.logprobs.token_logprobs[1:3], abs=1e-5)
    events = sse(http, "/v1/completions", {"prompt": "The sky is", "max_tokens": 0, "echo": True})
    assert stream_text(events) == "The sky is"
    r = http.post("/v1/completions", json={"prompt": "The sky is", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"     # without echo: nothing to answer


def test_streamed_echo_and_logprobs_match_plain(client, http, model):
    body = {"prompt": "The sky is", "temperature": 0, "max_tokens": 4, "logprobs": 1, "echo": True}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]
    events = sse(http, "/v1/completions", body)
    chunks = [c for e in events for c in e["choices"] if c["logprobs"]]
    assert stream_text(events) == plain["text"]
    assert sum((c["logprobs"]["tokens"] for c in chunks), []) == plain["logprobs"]["tokens"]
    assert sum((c["logprobs"]["text_offset"] for c in chunks), []) == plain["logprobs"]["text_offset"]


def test_skip_special_tokens_and_multibyte_text(client, http, model):
    eos = http.post("/tokenize", json={"prompt": "<|im_end|>"}).json()["tokens"]
    body = {"prompt": "Hello", "max_tokens": 2, "logit_bias": {str(eos[0]): 100}, "ignore_eos": True}
    assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == ""
    kept = http.post("/v1/completions", json={**body, "skip_special_tokens": False}).json()
    assert kept["choices"][0]["text"] == "<|im_end|>" * 2
    body = {"prompt": "日本 日本 日本 日本 日本 日本", "temperature": 0, "max_tokens": 8}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert "日本" in plain and "\ufffd" not in plain
    events = sse(http, "/v1/completions", body)
    pieces = [c["text"] for e in events for c in e["choices"] if c["text"]]
    assert "".join(pieces) == plain and not any("\ufffd" in p for p in pieces) and len(pieces) > 1


# -- stop conditions -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def greedy_story(client, model):
    """A greedy continuation and its tokens (to pick stop strings that span token boundaries)."""
    out = client.completions.create(model=model, prompt="Once upon a time, in a small village,",
                                    temperature=0, max_tokens=12, logprobs=0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text, out.choices[0].logprobs.tokens


def _spanning_stop(text: str, tokens: list[str]) -> tuple[str, int]:
    """A stop string made of the end of one token and the start of the next, found first at
    that boundary: (stop, where it starts in text)."""
    pos = 0
    for left, right in zip(tokens, tokens[1:]):
        pos += len(left)
        if pos > 4 and len(left) >= 2 and len(right) >= 2:
            stop = left[-2:] + right[:2]
            if text.find(stop) == pos - 2:
                return stop, pos - 2
    raise AssertionError(f"no usable token boundary in {tokens}")


def test_stop_strings_plain_and_streamed(client, http, model, greedy_story):
    text, tokens = greedy_story
    stop, at = _spanning_stop(text, tokens)
    body = {"prompt": "Once upon a time, in a small village,", "temperature": 0, "max_tokens": 12,
            "ignore_eos": True, "stop": [stop, "zzzz-never"]}
    plain = client.completions.create(model=model, **{k: v for k, v in body.items() if k != "ignore_eos"},
                                      extra_body={"ignore_eos": True}).choices[0]
    assert plain.text == text[:at] and plain.finish_reason == "stop" and plain.stop_reason == stop
    events = sse(http, "/v1/completions", body)
    pieces = [c["text"] for e in events for c in e["choices"]]
    assert "".join(pieces) == text[:at]          # released text is never withdrawn: nothing leaked
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["stop"]
    incl = http.post("/v1/completions", json={**body, "include_stop_str_in_output": True}).json()
    assert incl["choices"][0]["text"] == text[:at] + stop
    one = http.post("/v1/completions", json={**body, "stop": stop}).json()     # a single string
    assert one["choices"][0]["text"] == text[:at]
    chat = client.chat.completions.create(model=model, messages=CAPITAL, temperature=0, max_tokens=10,
                                          stop=["Paris"])
    assert "Paris" not in chat.choices[0].message.content and chat.choices[0].finish_reason == "stop"


def test_stop_token_ids_and_min_tokens(client, http, model, greedy_story):
    text, tokens = greedy_story
    base = {"prompt": "Once upon a time, in a small village,", "temperature": 0, "max_tokens": 12,
            "ignore_eos": True}
    # a generated token that is one id on its own and first appears at position k >= 2
    k, ids = next((k, ids) for k in range(2, len(tokens))
                  if tokens.index(tokens[k]) == k
                  and len(ids := http.post("/tokenize", json={"prompt": tokens[k]}).json()["tokens"]) == 1)
    out = http.post("/v1/completions", json={**base, "stop_token_ids": ids}).json()["choices"][0]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == ids[0]
    assert out["text"] == "".join(tokens[:k])              # vLLM's rule: the stop token's text is not shown
    assert out["logprobs"] is None and http.post("/v1/completions", json={**base, "stop_token_ids": ids}).json()[
        "usage"]["completion_tokens"] == k + 1               # though it is counted
    kept = http.post("/v1/completions", json={**base, "stop_token_ids": ids,
                                              "include_stop_str_in_output": True}).json()["choices"][0]
    assert kept["text"] == "".join(tokens[:k + 1])
    first_word = tokens[0]
    early = http.post("/v1/completions", json={**base, "stop": [first_word]}).json()
    assert early["choices"][0]["text"] == "" and early["usage"]["completion_tokens"] == 1
    held = http.post("/v1/completions", json={**base, "stop": [first_word], "min_tokens": 6}).json()
    assert held["usage"]["completion_tokens"] >= 6 and len(held["choices"][0]["text"]) > len(first_word)


# -- errors --------------------------------------------------------------------------------------
BAD_COMPLETIONS = [
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": 7}, "temperature"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -5}, "top_k"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"1": 500}}, "logit_bias"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),         # past --max-logprobs (20)
    ({"prompt": "x", "stop": ""}, "stop"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "x", "min_tokens": 99, "max_tokens": 3}, "min_tokens"),
    ({"prompt": "x", "seed": 2 ** 70}, "seed"),
    ({"prompt": "x", "priority": 1}, "priority"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "bogus_field": 1}, "bogus_field"),
    ({"prompt": [1.5]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [10 ** 8]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({}, "prompt"),
]
BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": 7, "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "text": None}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra"),
    ({"messages": CAPITAL, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": CAPITAL, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": CAPITAL, "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"messages": CAPITAL, "max_tokens": 0}, "max_tokens"),
]


def test_bad_input_gets_400_naming_the_field(http):
    for path, cases in (("/v1/completions", BAD_COMPLETIONS), ("/v1/chat/completions", BAD_CHATS)):
        for body, param in cases:
            r = http.post(path, json=body)
            err = r.json()["error"]
            assert r.status_code == 400, (body, r.text)
            assert set(err) == {"message", "type", "param", "code"} and err["message"], body
            assert err["type"] == "BadRequestError" and err["code"] == 400, (body, err)
            assert err["param"] == param, (body, err)
    for raw in (b"", b"{", b"[]", b"null", b'"text"', b"\xff\xfe"):
        r = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"], raw


def context_length_exceeded(body: dict, max_len: int, param: str) -> bool:
    """vLLM's shape for OpenAI's context_length_exceeded: a 400 whose message says it."""
    return (body["code"] == 400 and body["type"] == "BadRequestError" and body["param"] == param
            and f"maximum context length is {max_len} tokens" in body["message"])


def test_context_length_and_oversized_body(client, http, model):
    max_len = client.models.retrieve(model).model_extra["max_model_len"]
    prompt = "The capital of France is"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model, prompt=prompt, max_tokens=max_len - 2)
    assert context_length_exceeded(exc.value.body, max_len, "prompt"), exc.value.body
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=max_len - 2)
    assert context_length_exceeded(exc.value.body, max_len, "messages"), exc.value.body
    for too_many in (max_len, 2 ** 64, 10 ** 30):     # no prompt fits beside these: refused at once
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": too_many})
        assert r.status_code == 400 and context_length_exceeded(r.json()["error"], max_len, "prompt")
        r = http.post("/v1/chat/completions", json={"messages": CAPITAL, "max_completion_tokens": too_many})
        assert r.status_code == 400 and context_length_exceeded(r.json()["error"], max_len, "messages")
    long_prompt = list(range(100, 100 + max_len))
    r = http.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 1})
    assert r.status_code == 400 and context_length_exceeded(r.json()["error"], max_len, "prompt")
    r = http.post("/v1/completions", content=b'{"prompt": "' + b"a" * (9 << 20) + b'"}',
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413 and r.json()["error"]["message"]


# -- the edge holds: hostile values never reach the engine ---------------------------------------
HUGE = 2 ** 64
HOSTILE = [   # (path, body: a dict or raw JSON text, the param named)
    ("/v1/completions", {"prompt": "x", "top_k": 2 ** 63}, "top_k"),
    ("/v1/completions", {"prompt": "x", "top_k": HUGE}, "top_k"),
    ("/v1/completions", {"prompt": "x", "top_k": 10 ** 6}, "top_k"),
    ("/v1/chat/completions", {"messages": CAPITAL, "min_tokens": 2 ** 70}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "seed": HUGE}, "seed"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [HUGE]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [2 ** 63]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1_0": 1}}, "logit_bias"),
    ("/v1/completions", '{"prompt": "x", "temperature": 1e400}', "temperature"),
    ("/v1/completions", '{"prompt": "x", "logit_bias": {"5": -1e400}}', "logit_bias"),
    ("/v1/completions", '{"prompt": "x", "top_p": NaN}', None),
    ("/v1/completions", {"prompt": "x", "n": HUGE}, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": HUGE}, "logprobs"),
    ("/v1/chat/completions", {"messages": CAPITAL, "logprobs": True, "top_logprobs": HUGE}, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "priority": HUGE}, "priority"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [HUGE]}, "allowed_token_ids"),
    ("/v1/chat/completions", {"messages": CAPITAL, "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/chat/completions", {"messages": CAPITAL, "truncate_prompt_tokens": HUGE}, "truncate_prompt_tokens"),
]


def test_out_of_range_values_are_refused_and_never_fail_a_shared_step(http):
    """A top_k past int64 used to reach the sampler and fail the whole step (a 500 for it and
    for every request in the step); now each such value is a 400 while a neighbour runs on."""
    neighbour = {"prompt": "Once upon a time", "max_tokens": 32, "ignore_eos": True, "temperature": 0}
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(http.post, "/v1/completions", json=neighbour)
        while not running.done():
            for path, body, param in HOSTILE:
                raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                r = http.post(path, content=raw)
                assert r.status_code == 400, (body, r.text)
                err = r.json()["error"]
                assert (err["type"], err["code"], err["param"]) == ("BadRequestError", 400, param), (body, err)
        done = running.result()
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["completion_tokens"] == 32


def test_bodies_nested_too_deeply_are_400(http):
    deep = b"[" * 1000 + b"]" * 1000
    for path, body in (("/v1/completions", b'{"prompt": ' + deep + b"}"),
                       ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
                       ("/v1/chat/completions", b'{"messages": ' + deep + b"}"),
                       ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": ' + deep + b"}]}"),
                       ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
                                                b'"chat_template_kwargs": {"x": ' + deep + b"}}"),
                       ("/tokenize", b'{"prompt": ' + deep + b"}"),
                       ("/detokenize", b'{"tokens": ' + deep + b"}")):
        r = http.post(path, content=body)
        assert r.status_code == 400, (path, body[:60], r.text)
        assert r.json()["error"]["code"] == 400 and r.json()["error"]["type"] == "BadRequestError"


def test_a_message_without_content_is_400_naming_it(http):
    for i, message in ((0, {"role": "user"}), (0, {"role": "user", "content": None}),
                       (1, {"role": "system", "content": None}), (1, {"role": "assistant"})):
        messages = [message] if i == 0 else [{"role": "user", "content": "hi"}, message]
        r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        assert r.status_code == 400, (message, r.text)
        assert r.json()["error"]["param"] == f"messages[{i}].content", r.text
    r = http.post("/tokenize", json={"messages": [{"role": "user", "content": None}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"


def tool_history(arguments: str) -> list[dict]:
    return [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "content": "22 degrees and sunny", "tool_call_id": "call_1"}]


def test_tool_calls_and_tool_results_in_history_are_accepted(client, http, model):
    for arguments in ('{"city": "Paris"}', '{"city": "Par'):     # malformed: rendered as {}
        out = client.chat.completions.create(model=model, messages=tool_history(arguments),
                                             temperature=0, max_tokens=3)
        assert out.choices[0].message.role == "assistant" and out.usage.completion_tokens == 3
    with_result = http.post("/tokenize", json={"messages": tool_history("{}")}).json()["count"]
    without = http.post("/tokenize", json={"messages": tool_history("{}")[:2]}).json()["count"]
    assert with_result > without            # the default template renders the tool's answer
    r = http.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": "x", "tool_calls": tool_history("{}")[1]["tool_calls"]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].tool_calls"


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, http, model):
    """vLLM's field: the left side of the prompt goes, so even a prompt past the context runs."""
    max_len = client.models.retrieve(model).model_extra["max_model_len"]
    ids = [100 + i % 5000 for i in range(max_len + 50)]
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 3, "temperature": 0,
                                           "truncate_prompt_tokens": 7})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 7
    tail = http.post("/v1/completions", json={"prompt": ids[-7:], "max_tokens": 3, "temperature": 0})
    assert r.json()["choices"][0]["text"] == tail.json()["choices"][0]["text"]
    chat = http.post("/v1/chat/completions", json={"messages": CAPITAL, "max_tokens": 1, "truncate_prompt_tokens": 4})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 4, chat.text
    right = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 3, "temperature": 0, "truncate_prompt_tokens": 7,
                                               "truncation_side": "right", "return_token_ids": True})
    assert right.status_code == 200 and right.json()["choices"][0]["prompt_token_ids"] == ids[:7], right.text
    head = http.post("/v1/completions", json={"prompt": ids[:7], "max_tokens": 3, "temperature": 0})
    assert right.json()["choices"][0]["text"] == head.json()["choices"][0]["text"]
    bad = http.post("/v1/completions", json={"prompt": "x", "truncate_prompt_tokens": 1, "truncation_side": "middle"})
    assert bad.status_code == 400 and "truncation_side" in bad.text


def test_allowed_token_ids_are_the_only_tokens_generated(http):
    ids = [http.post("/tokenize", json={"prompt": word, "add_special_tokens": False}).json()["tokens"][0]
           for word in (" yes", " no")]
    for path, body in (("/v1/completions", {"prompt": "Is the sky green?"}),
                       ("/v1/chat/completions", {"messages": CAPITAL})):
        r = http.post(path, json={**body, "max_tokens": 6, "temperature": 1.0, "seed": 3, "ignore_eos": True,
                                  "allowed_token_ids": ids})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        assert text and text.replace(" yes", "").replace(" no", "") == "", text


def test_cache_salt_must_be_a_non_empty_string(http):
    for salt in ("", 5, ["a"]):
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "cache_salt": salt})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", (salt, r.text)


def test_request_timeout_field_aborts_a_request_past_it(http):
    t0 = time.monotonic()
    r = http.post("/v1/completions", json={"prompt": "Tell a long story:", "max_tokens": 4000,
                                           "ignore_eos": True, "request_timeout": 1.5})
    assert r.status_code == 504 and "timeout of 1.5 s" in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < 5.0
    bad = http.post("/v1/completions", json={"prompt": "x", "request_timeout": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_timeout"


def test_cache_salt_keeps_cached_prefixes_apart(http):
    """vLLM's cache_salt: requests share a cached prefix only when their salts are equal."""
    prompt = f"{uuid.uuid4()} " + "The quick brown fox jumps over the lazy dog. " * 20
    def cached(**salt) -> int:
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, **salt})
        assert r.status_code == 200, r.text
        return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-b") == 0           # another salt: no hit
    assert cached() == 0                                # no salt: no hit on a salted prefix
    assert cached(cache_salt="tenant-a") > 0            # the same salt: a hit


def test_prompt_logprobs_score_every_prompt_token_but_the_first(http):
    """vLLM's field: per prompt token its log-prob, rank and alternatives; the same values an
    echo with logprobs shows."""
    body = {"prompt": "The sky is blue and the grass", "max_tokens": 1, "temperature": 0}
    r = http.post("/v1/completions", json={**body, "prompt_logprobs": 2, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids, scored = choice["prompt_token_ids"], choice["prompt_logprobs"]
    assert len(scored) == len(ids) == r.json()["usage"]["prompt_tokens"] and scored[0] is None
    for token, entry in zip(ids[1:], scored[1:]):
        assert str(token) in entry and 1 <= len(entry) <= 3
        ranks = {v["rank"]: v["logprob"] for v in entry.values()}
        assert 1 in ranks and ranks[1] == max(ranks.values()) and all(v <= 0 for v in ranks.values())
        assert entry[str(token)]["decoded_token"] == http.post(
            "/detokenize", json={"tokens": [token]}).json()["prompt"]
    echo = http.post("/v1/completions", json={**body, "echo": True, "logprobs": 0}).json()["choices"][0]["logprobs"]
    assert echo["token_logprobs"][1:len(ids)] == pytest.approx(
        [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], scored[1:])], abs=1e-5)
    chat = http.post("/v1/chat/completions", json={"messages": CAPITAL, "max_tokens": 1, "prompt_logprobs": 0})
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["prompt_logprobs"]) == chat.json()["usage"]["prompt_tokens"]
    for bad, says in (({"prompt_logprobs": 1, "stream": True}, "stream=True"), ({"prompt_logprobs": -2}, "-1"),
                      ({"prompt_logprobs": -1}, "--max-logprobs")):
        r = http.post("/v1/completions", json={**body, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
        assert says in r.json()["error"]["message"]


def test_return_token_ids_plain_and_streamed(http):
    """vLLM's field: the prompt's token ids and each choice's, whole or chunk by chunk."""
    body = {"prompt": "Count: one, two,", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    plain = http.post("/v1/completions", json=body).json()
    choice = plain["choices"][0]
    assert choice["prompt_token_ids"] == http.post("/tokenize", json={"prompt": body["prompt"]}).json()["tokens"]
    assert len(choice["token_ids"]) == plain["usage"]["completion_tokens"]
    assert http.post("/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"] == choice["text"]
    events = sse(http, "/v1/completions", body)
    entries = [c for e in events for c in e["choices"]]
    assert entries[0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert sum((c["token_ids"] for c in entries), []) == choice["token_ids"]
    chat_body = {"messages": CAPITAL, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    chat = http.post("/v1/chat/completions", json=chat_body).json()
    assert len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    events = sse(http, "/v1/chat/completions", chat_body)
    assert events[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert sum((c.get("token_ids", []) for e in events for c in e["choices"]), []) == chat["choices"][0]["token_ids"]
    without = http.post("/v1/completions", json={**body, "return_token_ids": False}).json()["choices"][0]
    assert "token_ids" not in without and "prompt_token_ids" not in without


def test_return_tokens_as_token_ids_and_the_clients_request_id(http):
    body = {"prompt": "The sky is", "max_tokens": 3, "temperature": 0, "logprobs": 1,
            "return_tokens_as_token_ids": True, "return_token_ids": True, "request_id": "job-7"}
    r = http.post("/v1/completions", json=body).json()
    assert r["id"] == "cmpl-job-7"
    lp, ids = r["choices"][0]["logprobs"], r["choices"][0]["token_ids"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    assert all(f"token_id:{t}" in tops for t, tops in zip(ids, lp["top_logprobs"]))
    chat = http.post("/v1/chat/completions", json={
        "messages": CAPITAL, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 1,
        "return_tokens_as_token_ids": True, "return_token_ids": True, "request_id": "job-8"}).json()
    assert chat["id"] == "chatcmpl-job-8"
    assert [e["token"] for e in chat["choices"][0]["logprobs"]["content"]] == \
        [f"token_id:{t}" for t in chat["choices"][0]["token_ids"]]
    r = http.post("/v1/completions", json={**body, "request_id": "x" * 300})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"


def test_logprob_token_ids_score_a_fixed_label_set_at_each_position(client, http, model):
    """vLLM's logprob_token_ids: with logprobs set, each position's alternatives are exactly the
    listed tokens (a label set), with the log-probs the full distribution gives them."""
    labels = [http.post("/tokenize", json={"prompt": w, "add_special_tokens": False}).json()["tokens"][0]
              for w in (" Paris", " London", " Berlin")]
    ask = dict(model=model, prompt="The capital of France is", max_tokens=1, temperature=0)
    out = client.completions.create(logprobs=0, extra_body={"logprob_token_ids": labels,
                                                            "return_tokens_as_token_ids": True}, **ask)
    top = out.choices[0].logprobs.top_logprobs[0]
    assert {f"token_id:{t}" for t in labels} <= set(top) and len(top) <= len(labels) + 1
    full = client.completions.create(logprobs=20, extra_body={"return_tokens_as_token_ids": True}, **ask)
    paris = f"token_id:{labels[0]}"
    assert abs(top[paris] - full.choices[0].logprobs.top_logprobs[0][paris]) < 1e-4
    chat = client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=2, temperature=0,
                                          logprobs=True, top_logprobs=0, extra_body={"logprob_token_ids": labels})
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 3
    for bad in ({"logprob_token_ids": labels}, {"logprob_token_ids": [10 ** 9], "logprobs": 0}):
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(model=model, prompt="x", max_tokens=1, extra_body=bad)
        assert exc.value.body["param"] == "logprob_token_ids"


def test_best_of_returns_the_n_most_likely_of_its_samples(client, model):
    """OpenAI's best_of: best_of seeded samples per prompt (choice i with seed + i, as n gives),
    the n of the highest mean log-prob per token returned, best first; the usage counts all."""
    ask = dict(model=model, prompt=["The weather today is", "My favourite food is"], max_tokens=8,
               temperature=1.0, seed=11)
    out = client.completions.create(n=2, best_of=4, **ask)
    every = client.completions.create(n=4, logprobs=0, **ask)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for p in range(2):
        ranked = sorted(every.choices[4 * p:4 * p + 4], key=lambda c: -sum(c.logprobs.token_logprobs)
                        / len(c.logprobs.token_logprobs))
        assert [c.text for c in out.choices[2 * p:2 * p + 2]] == [c.text for c in ranked[:2]]
    assert all(c.logprobs is None for c in out.choices)
    assert out.usage.completion_tokens == every.usage.completion_tokens
    with_lp = client.completions.create(n=1, best_of=3, logprobs=1, **ask)
    assert len(with_lp.choices) == 2 and all(len(c.logprobs.top_logprobs[0]) >= 1 for c in with_lp.choices)
    for bad in (dict(n=3, best_of=2), dict(n=1, best_of=2, stream=True)):
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(model=model, prompt="x", max_tokens=2, **bad)
        assert exc.value.body["param"] == "best_of"


def test_repetition_detection_ends_a_looping_completion(client, model):
    """vLLM's repetition_detection: a greedy completion that loops ends with finish_reason
    "repetition" well before max_tokens; bad settings are a 400 naming the field."""
    prompt = "Repeat after me: yes yes yes yes yes yes yes"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0,
                                      extra_body={"ignore_eos": True})
    out = client.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0, extra_body={
        "ignore_eos": True, "repetition_detection": {"max_pattern_size": 4, "min_count": 4}})
    (choice,) = out.choices
    assert choice.finish_reason == "repetition" and choice.model_extra["stop_reason"] == "repetition_detected"
    assert out.usage.completion_tokens < 40 and plain.choices[0].text.startswith(choice.text)
    for bad in ({"max_pattern_size": 4, "min_count": 1}, {"max_pattern_size": 2, "min_pattern_size": 3},
                {"max_pattern_size": 4000, "min_count": 2}, {"max_pattern_size": 2, "size": 1}):
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(model=model, prompt="x", max_tokens=2,
                                      extra_body={"repetition_detection": bad})
        assert exc.value.body["param"].startswith("repetition_detection"), bad


def test_openai_platform_fields_are_accepted_and_change_nothing(client, model):
    """Fields of OpenAI's API about its platform (storage, billing tier, its caches, abuse ids, a
    predicted output) are accepted as vLLM accepts them, and the answer is the one without them;
    audio output is refused, naming the field."""
    plain = client.chat.completions.create(model=model, messages=CAPITAL, temperature=0, max_tokens=8)
    fields = dict(metadata={"team": "a"}, store=False, service_tier="auto", prompt_cache_key="k1",
                  safety_identifier="user-1", verbosity="low", modalities=["text"],
                  prediction={"type": "content", "content": "The capital of France is Paris."})
    out = client.chat.completions.create(model=model, messages=CAPITAL, temperature=0, max_tokens=8, **fields,
                                         extra_body={"spaces_between_special_tokens": True, "session_id": "s1",
                                                     "prompt_cache_retention": "in_memory"})
    assert out.choices[0].message.content == plain.choices[0].message.content
    for bad, param in (({"modalities": ["text", "audio"]}, "modalities"),
                       ({"audio": {"voice": "alloy", "format": "wav"}}, "audio")):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=1, extra_body=bad)
        assert exc.value.body["param"].startswith(param)
    r = client.responses.create(model=model, input="What is the capital of France?", max_output_tokens=4,
                                temperature=0, service_tier="auto", prompt_cache_key="k1", safety_identifier="u",
                                max_tool_calls=2, store=False, extra_body={"session_id": "s1"})
    assert r.status in ("completed", "incomplete") and r.output_text


def test_responses_api_answers_as_the_chat_endpoint_does_and_is_stored(client, http, model):
    """POST /v1/responses with the openai client: instructions, input and max_output_tokens are
    a chat completion's system message, messages and max_completion_tokens (greedy: the same
    text and usage); the response is stored, and previous_response_id continues it."""
    r = client.responses.create(model=model, instructions="Answer in one word.", input="What is the capital of France?",
                                max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(model=model, temperature=0, max_completion_tokens=6, messages=[
        {"role": "system", "content": "Answer in one word."}, *CAPITAL])
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert client.responses.retrieve(r.id).output_text == r.output_text
    follow = client.responses.create(model=model, input="And of Italy?", previous_response_id=r.id,
                                     max_output_tokens=4, temperature=0)
    again = client.chat.completions.create(model=model, temperature=0, max_completion_tokens=4, messages=[
        *CAPITAL, {"role": "assistant", "content": r.output_text}, {"role": "user", "content": "And of Italy?"}])
    assert follow.output_text == again.choices[0].message.content       # instructions are not carried over
    assert follow.usage.input_tokens == again.usage.prompt_tokens
    unstored = client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError):          # no response runs in the background here
        client.responses.cancel(r.id)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="More?", previous_response_id=r.id, max_output_tokens=2)


def test_responses_stream_events_in_order_with_the_same_text(client, model):
    body = dict(model=model, input="Name three colors.", max_output_tokens=8, temperature=0,
                include=["message.output_text.logprobs"], top_logprobs=1)
    whole = client.responses.create(**body)
    events = list(client.responses.create(**body, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if whole.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == whole.output_text == events[-1].response.output_text
    logprobs = whole.output[0].content[0].logprobs
    assert [lp.token for e in deltas for lp in e.logprobs] == [lp.token for lp in logprobs]
    assert all(len(lp.top_logprobs) == 1 for lp in logprobs)


def test_responses_json_schema_and_refusals(client, http, model):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"]}
    r = client.responses.create(model=model, input="A person as JSON.", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema}})
    assert isinstance(json.loads(r.output_text)["name"], str)
    for bad, param in ((dict(background=True), "background"), (dict(max_output_tokens=0), "max_output_tokens"),
                       (dict(include=["file_search_call.results"]), "include"), (dict(input=[]), "input"),
                       (dict(tools=[{"type": "web_search"}]), "tools[0].type"),
                       (dict(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]),
                        "input[0].content")):
        resp = http.post("/v1/responses", json={"model": model, "input": "x", **bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    image = http.post("/v1/responses", json={"model": model, "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]})
    assert image.status_code == 400 and "this model takes no images" in image.json()["error"]["message"]
    gone = http.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_none"})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "previous_response_id"
    assert http.get("/v1/responses/resp_none").status_code == 404


def test_chat_echo_starts_the_answer_with_the_assistants_last_message(client, http, model):
    """vLLM's chat echo: with continue_final_message, the answer is the whole assistant turn."""
    partial = CAPITAL + [{"role": "assistant", "content": "The capital of France is"}]
    body = {"messages": partial, "temperature": 0, "max_tokens": 4, "continue_final_message": True,
            "add_generation_prompt": False}
    plain = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    echoed = http.post("/v1/chat/completions", json={**body, "echo": True}).json()["choices"][0]["message"]["content"]
    assert echoed == "The capital of France is" + plain
    events = sse(http, "/v1/chat/completions", {**body, "echo": True})
    assert "".join(c["delta"].get("content", "") for e in events for c in e["choices"]) == echoed
    untrusted = http.post("/v1/chat/completions", json={"messages": CAPITAL, "chat_template": "{{ messages }}"})
    assert untrusted.status_code == 400 and "--trust-request-chat-template" in untrusted.text
    user_last = http.post("/v1/chat/completions", json={"messages": CAPITAL, "temperature": 0, "max_tokens": 3,
                                                        "echo": True}).json()
    same = http.post("/v1/chat/completions", json={"messages": CAPITAL, "temperature": 0, "max_tokens": 3}).json()
    assert user_last["choices"][0]["message"]["content"] == same["choices"][0]["message"]["content"]


def test_load_counts_the_requests_being_answered(http):
    """vLLM's GET /load: a stream in progress counts, and nothing once it ended."""
    assert http.get("/load").json() == {"server_load": 0}
    conn = http_client.HTTPConnection(http.netloc, timeout=120)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "Once upon a time", "max_tokens": 200,
                                                                  "ignore_eos": True, "stream": True}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        assert http.get("/load").json() == {"server_load": 1}
    finally:
        conn.close()
    deadline = time.monotonic() + 30
    while http.get("/load").json()["server_load"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert http.get("/load").json() == {"server_load": 0}


def test_invocations_routes_chat_and_completion_bodies_as_vllm_does(http):
    """vLLM's SageMaker route: the body's shape picks the endpoint that answers it."""
    chat = {"messages": CAPITAL, "max_tokens": 3, "temperature": 0}
    completion = {"prompt": "The sky is", "max_tokens": 3, "temperature": 0}
    for body, path in ((chat, "/v1/chat/completions"), (completion, "/v1/completions")):
        via, direct = http.post("/invocations", json=body).json(), http.post(path, json=body).json()
        assert via["object"] == direct["object"] and via["choices"] == direct["choices"]
    assert sse(http, "/invocations", completion)[0]["object"] == "text_completion"
    for bad in ({"input": "x"}, ["a"]):
        r = http.post("/invocations", json=bad)
        assert r.status_code == 400 and "Cannot find suitable handler" in r.json()["error"]["message"]
    assert http.post("/invocations", content=b"{not json").status_code == 400


def test_use_beam_search_answers_n_beams_best_first(http):
    """vLLM's use_beam_search: n beams per prompt as the choices; width 1 is greedy; no stream."""
    body = {"prompt": ["The capital of France is", "One, two,"], "max_tokens": 5, "temperature": 0}
    beams = http.post("/v1/completions", json={**body, "n": 3, "use_beam_search": True, "request_id": "b-1"}).json()
    assert beams["id"] == "cmpl-b-1" and [c["index"] for c in beams["choices"]] == list(range(6))
    for p in range(2):
        texts = [c["text"] for c in beams["choices"][3 * p:3 * p + 3]]
        assert len(set(texts)) == 3
    width1 = http.post("/v1/completions", json={**body, "use_beam_search": True}).json()["choices"]
    greedy = http.post("/v1/completions", json=body).json()["choices"]
    assert [c["text"] for c in width1] == [c["text"] for c in greedy]
    chat = http.post("/v1/chat/completions", json={"messages": CAPITAL, "max_tokens": 8, "n": 2, "temperature": 0,
                                                   "use_beam_search": True, "length_penalty": 0.5}).json()
    assert len(chat["choices"]) == 2 and all(c["message"]["content"] for c in chat["choices"])
    assert chat["usage"]["completion_tokens"] > 0
    for bad, param in (({"stream": True}, "stream"), ({"logprobs": 1}, "logprobs"),
                       ({"response_format": {"type": "json_object"}}, "use_beam_search"),
                       ({"prompt": [100] * 8190}, "prompt")):       # no room for max_tokens, as without beams
        r = http.post("/v1/completions", json={**body, "use_beam_search": True, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(http):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far, growing
    to the last one's (a chat's role chunk: no tokens yet)."""
    body = {"prompt": "One, two,", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = sse(http, "/v1/completions", body)
    *chunks, last = events
    counts = [e["usage"]["completion_tokens"] for e in chunks]
    assert counts == sorted(counts) and counts[-1] == last["usage"]["completion_tokens"] == 5
    assert all(e["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"] for e in chunks)
    plain = sse(http, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert all("usage" not in e for e in plain[:-1])
    chat = sse(http, "/v1/chat/completions", {"messages": CAPITAL, "max_tokens": 2, "stream_options": body["stream_options"]})
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant"          # the role chunk carries it too, as vLLM's
    assert chat[0]["usage"] == {"prompt_tokens": chat[-1]["usage"]["prompt_tokens"], "completion_tokens": 0,
                                "total_tokens": chat[-1]["usage"]["prompt_tokens"]}


def test_tokenize_renders_tools_as_the_chat_endpoint_does(http):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    plain = http.post("/tokenize", json={"messages": CAPITAL}).json()
    with_tools = http.post("/tokenize", json={"messages": CAPITAL, "tools": tools}).json()
    chat = http.post("/v1/chat/completions", json={"messages": CAPITAL, "tools": tools, "tool_choice": "none",
                                                   "max_tokens": 1}).json()
    assert with_tools["count"] == chat["usage"]["prompt_tokens"] >= plain["count"]
    r = http.post("/tokenize", json={"messages": CAPITAL, "chat_template": "{{ messages }}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def test_vllm_0_32_fields_are_served_taken_or_refused_by_name(client, http, model):
    """return_prompt_text shows the prompt as the template rendered it (its tokens are the
    prompt's); fields asking for what Troupe does are taken; those asking for what it does not
    (a thinking budget on a server without a reasoning parser, media_io_kwargs, suffix, prompt
    embeddings without --enable-prompt-embeds) are a 400 naming them; watermarking on a server
    without --watermark-config runs unwatermarked, as vLLM runs it (a warning in the log)."""
    out = http.post("/v1/chat/completions", json={"model": model, "messages": CAPITAL, "max_tokens": 2,
                                                  "return_prompt_text": True, "return_token_ids": True,
                                                  "include_reasoning": True, "return_mm_kwargs": False,
                                                  "routed_experts_prompt_start": 0})
    assert out.status_code == 200, out.text
    body = out.json()
    tokens = http.post("/tokenize", json={"prompt": body["prompt_text"], "add_special_tokens": False}).json()["tokens"]
    assert body["prompt_text"].startswith("<|im_start|>") and tokens == body["prompt_token_ids"]
    streamed = http.post("/v1/chat/completions", json={"model": model, "messages": CAPITAL, "max_tokens": 2,
                                                       "stream": True, "return_prompt_text": True})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert chunks[0]["prompt_text"] == body["prompt_text"] and all("prompt_text" not in c for c in chunks[1:])
    for path, field, value, words in (
            ("/v1/chat/completions", "thinking_token_budget", 64, "reasoning_config is not configured"),
            ("/v1/chat/completions", "media_io_kwargs", {"image": {"mode": "L"}}, "reads images as they are"),
            ("/v1/chat/completions", "media_io_kwargs", {"video": {"backend": "x"}}, "not supported"),
            ("/v1/completions", "suffix", "!", "suffix is not currently supported"),
            ("/v1/completions", "prompt_embeds", "AAAA", "--enable-prompt-embeds"),
            ("/v1/responses", "prompt", {"id": "pmpt_1"}, "stored"),
            ("/v1/responses", "enable_response_messages", True, "Harmony")):
        base = ({"messages": CAPITAL} if "chat" in path else {"input": "Hi"} if "responses" in path
                else {"prompt": "Hi"})
        resp = http.post(path, json={"model": model, **base, field: value})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == field, (field, resp.text)
        assert words in resp.json()["error"]["message"], resp.text
    ok = http.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 1,
                                            "spaces_between_special_tokens": False, "thinking_token_budget": None,
                                            "watermarking": True})
    assert ok.status_code == 200, ok.text


def test_chat_batch_answers_each_conversation_as_the_chat_endpoint_does(http, model):
    """vLLM's /v1/chat/completions/batch: choice i is conversation i's answer, the same text as
    the chat endpoint gives it alone; usage sums every conversation's; the fields it does not
    take are a 400 naming them, and a refused conversation leaves nothing running."""
    convs = [CAPITAL, [{"role": "user", "content": "What is 2 + 2?"}],
             [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}]]
    shared = {"model": model, "temperature": 0, "max_tokens": 8, "return_token_ids": True}
    batch = http.post("/v1/chat/completions/batch", json={**shared, "messages": convs})
    assert batch.status_code == 200, batch.text
    body = batch.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    alone = [http.post("/v1/chat/completions", json={**shared, "messages": conv}).json() for conv in convs]
    for choice, single in zip(body["choices"], alone):
        assert choice["message"] == single["choices"][0]["message"]
        assert choice["token_ids"] == single["choices"][0]["token_ids"]
    for key in ("prompt_tokens", "completion_tokens"):
        assert body["usage"][key] == sum(a["usage"][key] for a in alone)
    for field, value in (("n", 2), ("stream", True), ("use_beam_search", True), ("tool_choice", "auto"),
                         ("tools", [{"type": "function", "function": {"name": "f"}}]), ("prompt_logprobs", 1),
                         ("messages", CAPITAL)):
        resp = http.post("/v1/chat/completions/batch", json={"messages": convs, **{field: value}})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == field, (field, resp.text)
    too_long = [{"role": "user", "content": "word " * 9000}]      # past the context: refused once admitted
    bad_last = http.post("/v1/chat/completions/batch",
                         json={"messages": [CAPITAL, too_long], "max_tokens": 2000, "ignore_eos": True})
    assert bad_last.status_code == 400 and "context" in bad_last.text, bad_last.text

    def metric(*names: str) -> float:
        lines = [line for line in http.get("/metrics").text.splitlines() if line.startswith(names)]
        assert lines, names
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

    time.sleep(1.0)           # the first conversation, admitted before the second was refused, was ended
    generated = metric("vllm:generation_tokens_total")
    time.sleep(1.0)
    assert metric("vllm:generation_tokens_total") == generated
    assert metric("vllm:num_requests_running", "vllm:num_requests_waiting") == 0
    assert http.get("/load").json() == {"server_load": 0}


def test_generative_scoring_reads_the_next_tokens_probabilities_of_the_labels(http, model):
    """vLLM's /generative_scoring: each item's score is the first label's probability after
    query + item (item + query with item_first), over the labels alone or, with apply_softmax
    off, the model's own: exactly what a completion's logprob_token_ids read for that prompt."""
    labels = [http.post("/tokenize", json={"prompt": w, "add_special_tokens": False}).json()["tokens"][0]
              for w in (" Paris", " London")]
    query, items = "The capital of France is", ["", " the city of"]

    def label_logprobs(prompt: str) -> list[float]:
        out = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1, "logprobs": 0,
                                                 "logprob_token_ids": labels, "return_tokens_as_token_ids": True})
        top = out.json()["choices"][0]["logprobs"]["top_logprobs"][0]
        return [top[f"token_id:{t}"] for t in labels]

    expected = [label_logprobs(query + item) for item in items]
    for apply_softmax in (True, False):
        resp = http.post("/generative_scoring", json={"model": model, "query": query, "items": items,
                                                      "label_token_ids": labels, "apply_softmax": apply_softmax})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["object"] == "list" and body["id"].startswith("generative-scoring-")
        assert [d["index"] for d in body["data"]] == [0, 1] and {d["object"] for d in body["data"]} == {"score"}
        for d, (paris, london) in zip(body["data"], expected):
            want = 1 / (1 + math.exp(london - paris)) if apply_softmax else math.exp(paris)
            assert abs(d["score"] - want) < 1e-4, (d, want)
        assert body["usage"]["completion_tokens"] == 2
    assert body["data"][0]["score"] > 0.5         # " Paris" is the likelier capital of France
    ids = http.post("/tokenize", json={"prompt": query, "add_special_tokens": False}).json()["tokens"]
    flipped = http.post("/generative_scoring", json={"query": ids[2:], "items": [ids[:2]], "item_first": True,
                                                     "label_token_ids": labels, "apply_softmax": False}).json()
    assert abs(flipped["data"][0]["score"] - math.exp(expected[0][0])) < 1e-4
    for body, param in (({"query": "x", "items": [], "label_token_ids": labels}, "items"),
                        ({"query": "x", "items": ["a", [1]], "label_token_ids": labels}, "items"),
                        ({"query": "x", "items": ["a"], "label_token_ids": []}, "label_token_ids"),
                        ({"query": "x", "items": ["a"], "label_token_ids": [10 ** 9]}, "label_token_ids"),
                        ({"query": [10 ** 9], "items": ["a"], "label_token_ids": labels}, "query")):
        resp = http.post("/generative_scoring", json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (body, resp.text)


def test_every_answer_carries_the_servers_system_fingerprint_and_no_metrics_unless_asked(client, model, http):
    """vLLM's system_fingerprint (--fingerprint-mode full): troupe-VERSION-HASH8, the same on every
    answer; a stream's terminal chunk carries it (without include_usage). Per-request metrics
    are off by default."""
    a = client.completions.create(model=model, prompt="Hi", max_tokens=2)
    b = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert re.fullmatch(r"troupe-[0-9][^-]*-[0-9a-f]{8}", a.system_fingerprint), a.system_fingerprint
    assert b.system_fingerprint == a.system_fingerprint and "metrics" not in a.model_extra
    events = sse(http, "/v1/chat/completions", {"model": model, "max_tokens": 3, "stream": True,
                                                 "messages": [{"role": "user", "content": "Hi"}]})
    marked = [e for e in events if "system_fingerprint" in e]
    assert len(marked) == 1 and marked[0]["choices"][0]["finish_reason"] == "length"
    assert marked[0]["system_fingerprint"] == a.system_fingerprint
