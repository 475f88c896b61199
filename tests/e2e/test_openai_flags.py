"""Server flags: probes answer 503 while the model loads; --api-key guards /v1/* only;
--lenient accepts unknown fields; --scheduling-policy priority orders the queue by priority."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import aiohttp
import jinja2
import openai
import pytest

from server import Server

pytestmark = pytest.mark.slow

# One compute thread: on a shared 2-core machine, two spinning torch threads per step make
# every step several times slower, and these tests are about the API, not throughput.
SERVER_ARGS = ("--threads", "1")

KEY = "sk-test-key"
FINGERPRINT = "fp-flags-test"


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0               # not listening yet


@pytest.fixture(scope="module")
def started():
    """The server (one request at a time, priority policy) and the /health codes seen while
    it started, polled on a port chosen up front."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    box: dict = {}

    def start() -> None:
        try:
            box["server"] = Server(*SERVER_ARGS, "--port", str(port), "--api-key", KEY,
                                   "--lenient", "--scheduling-policy", "priority",
                                   "--max-num-seqs", "1", "--trust-request-chat-template",
                                   "--return-tokens-as-token-ids", "--enable-tokenizer-info-endpoint",
                                   "--default-chat-template-kwargs", '{"greeting": "Hello"}', "--stream-interval", "2",
                                   "--sse-keep-alive-interval", "1", "--max-num-queued-reqs", "3",
                                   "--chat-template-content-format", "string",
                                   "--enable-per-request-metrics", "--enable-mfu-metrics", "--fingerprint-mode", "custom",
                                   "--fingerprint-value", FINGERPRINT)
        except BaseException as exc:   # reported by the fixture below
            box["error"] = exc
    t = threading.Thread(target=start)
    t.start()
    seen = []
    while t.is_alive():
        seen.append(_status(f"http://127.0.0.1:{port}/health"))
        time.sleep(0.05)
    t.join()
    if "error" in box:
        raise box["error"]
    yield box["server"], seen
    box["server"].stop()


@pytest.fixture(scope="module")
def server(started):
    return started[0]


def test_health_is_503_while_loading_then_200(started):
    server, seen = started
    assert 503 in seen, seen
    assert _status(server.url + "/health") == 200
    after_503 = seen[seen.index(503):]
    assert set(after_503) <= {503, 200}          # once listening, only "loading" or "ready"


def test_api_key_guards_v1_only(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.models.list()
    assert set(exc.value.body) == {"message", "type", "param", "code"}
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert good.models.list().data
    for path in ("/health", "/ping", "/metrics", "/version"):
        assert _status(server.url + path) == 200, path
    for path in ("/v1/completions", "/invocations", "/generative_scoring", "/v2/rerank", "/v2/embed"):   # every route
        req = urllib.request.Request(server.url + path, data=b'{"prompt": "x"}',
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as http_exc:
            urllib.request.urlopen(req, timeout=30)
        assert http_exc.value.code == 401, path


def test_lenient_accepts_and_drops_unknown_fields(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    out = client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=2,
        messages=[{"role": "user", "content": "Hi", "mood": "happy"}],
        extra_body={"no_such_option": {"deep": 1}, "another_one": 3})
    assert out.usage.completion_tokens == 2
    both = ("ignoring unknown field `messages[0].mood`", "ignoring unknown field `no_such_option`")
    log = server.log_when(lambda log: all(w in log for w in both))
    assert all(w in log for w in both)
    with pytest.raises(openai.BadRequestError):        # wrong types are still refused
        client.completions.create(model=out.model, prompt="x", max_tokens="two")


def test_priority_orders_the_waiting_queue(server):
    headers = {"Authorization": f"Bearer {KEY}"}

    async def run(session, body, done):
        async with session.post(server.url + "/v1/completions", json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
        done.append(body["prompt"])

    async def main():
        done: list[str] = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            first = session.post(server.url + "/v1/completions", headers=headers, json={
                "prompt": "first", "max_tokens": 40, "ignore_eos": True, "stream": True})
            async with first as resp:     # the only running request (--max-num-seqs 1)
                await resp.content.readline()
                late = asyncio.ensure_future(run(session, {"prompt": "low", "max_tokens": 2,
                                                           "priority": 5}, done))
                await asyncio.sleep(0.2)
                urgent = asyncio.ensure_future(run(session, {"prompt": "urgent", "max_tokens": 2,
                                                             "priority": -5}, done))
                await resp.read()
            await asyncio.gather(late, urgent)
        return done
    assert asyncio.run(main()) == ["urgent", "low"]


def test_trusted_request_chat_templates_and_documents_render_the_prompt(server):
    """--trust-request-chat-template: a chat request's own template renders its messages (and
    the documents it sends); without the flag such a request is refused (tests/e2e/test_openai_api.py)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    model = client.models.list().data[0].id
    template = ("{% for d in documents %}[{{ d.title }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    out = client.chat.completions.create(
        model=model, max_tokens=1, messages=[{"role": "user", "content": "Hi"}],
        extra_body={"chat_template": template, "documents": [{"title": "Doc", "text": "x"}], "return_token_ids": True})
    rendered = "[Doc]<user>Hi<assistant>"
    ids = out.model_extra["prompt_token_ids"]
    tok = urllib.request.Request(server.url + "/tokenize", data=json.dumps({"prompt": rendered, "add_special_tokens": False}).encode(),
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(tok, timeout=30) as resp:
        expected = json.loads(resp.read())["tokens"]
    assert ids in (expected, ids[:1] + expected)         # a BOS first where the model adds one
    bad = client.chat.completions.with_raw_response
    with pytest.raises(openai.BadRequestError) as exc:
        bad.create(model=model, max_tokens=1, messages=[{"role": "user", "content": "Hi"}],
                   extra_body={"chat_template": "{% for m in messages %}"})
    assert "chat template" in str(exc.value)


def test_the_content_format_flag_decides_how_content_reaches_a_template_that_takes_both(server):
    """--chat-template-content-format string: a template that loops over a message's content
    (which "auto" would give a list of text parts) gets each message's text as one string, the
    parts joined by newlines, as vLLM gives it."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    model = client.models.list().data[0].id
    template = ("{% for m in messages %}<{{ m.role }}>{% if m.content is string %}S:{{ m.content }}"
                "{% else %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %}{% endfor %}")
    out = client.chat.completions.create(
        model=model, max_tokens=1, extra_body={"chat_template": template, "return_token_ids": True},
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}])
    req = urllib.request.Request(server.url + "/detokenize", data=json.dumps(
        {"tokens": out.model_extra["prompt_token_ids"]}).encode(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert json.loads(resp.read())["prompt"].endswith("<user>S:Hi\nthere")


def test_return_tokens_as_token_ids_flag_is_the_default_a_request_overrides(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="The sky is", max_tokens=2, logprobs=0, temperature=0)
    assert all(t.startswith("token_id:") for t in out.choices[0].logprobs.tokens)
    own = client.completions.create(model=model, prompt="The sky is", max_tokens=2, logprobs=0, temperature=0,
                                    extra_body={"return_tokens_as_token_ids": False})
    assert "".join(own.choices[0].logprobs.tokens) == own.choices[0].text


def test_tokenizer_info_lets_a_client_tokenize_and_template_as_the_server_does(server):
    """--enable-tokenizer-info-endpoint: GET /tokenizer_info is tokenizer_config.json's
    equivalent, which an evaluation harness's remote tokenizer reads: its eos_token tokenized by
    /tokenize is the id generation stops at, and its chat template rendered by the client gives
    the tokens /tokenize gives for the same messages."""
    info = json.loads(urllib.request.urlopen(server.url + "/tokenizer_info", timeout=30).read())
    assert info["tokenizer_class"] and info["eos_token"] and "vocab_file" not in info
    assert all(isinstance(t, str) for t in info["added_tokens_decoder"].values())

    def post(path: str, body: dict) -> dict:
        req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=30).read())
    (eos,) = post("/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})["tokens"]
    assert info["added_tokens_decoder"][str(eos)] == info["eos_token"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = jinja2.Environment().from_string(info["chat_template"]).render(messages=messages,
                                                                         add_generation_prompt=True)
    assert (post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
            == post("/tokenize", {"messages": messages})["tokens"])


def test_reasoning_effort_and_default_kwargs_reach_the_chat_template(server):
    """vLLM's chat ``reasoning_effort``: a template variable, and ``enable_thinking`` (off for
    "none") unless chat_template_kwargs set it; an effort outside vLLM's values is a 400. The
    server's --default-chat-template-kwargs are variables too, under a request's own."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    model = client.models.list().data[0].id
    template = ("[{{ reasoning_effort }} {{ enable_thinking }}]{{ greeting }} "
                "{% for m in messages %}{{ m.content }}{% endfor %}")

    def rendered(effort: str | None, **kwargs) -> str:
        out = client.chat.completions.create(model=model, max_tokens=1, messages=[{"role": "user", "content": "Hi"}],
                                             extra_body={"chat_template": template, "return_token_ids": True,
                                                         "reasoning_effort": effort, **kwargs})
        req = urllib.request.Request(server.url + "/detokenize", data=json.dumps(
            {"tokens": out.model_extra["prompt_token_ids"]}).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())["prompt"]
    assert rendered("low") == "[low True]Hello Hi"
    assert rendered("none") == "[none False]Hello Hi"
    assert rendered("high", chat_template_kwargs={"enable_thinking": False}) == "[high False]Hello Hi"
    # --default-chat-template-kwargs: under every chat request's own
    assert rendered(None, chat_template_kwargs={"greeting": "Hey"}) == "[ ]Hey Hi"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, max_tokens=1, messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"reasoning_effort": "extreme"})
    assert exc.value.body["param"] == "reasoning_effort"


def test_stream_interval_sends_tokens_in_chunks_of_the_servers_or_the_requests_interval(server):
    """--stream-interval 2: after the first token, chunks of at least 2 new tokens (the last may
    be fewer; a chunk the client was too slow to take holds more, as vLLM merges outputs its
    reader has not taken); a request's stream_interval raises it, never lowers it; the text is
    the same."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    model = client.models.list().data[0].id

    def sizes(**extra) -> tuple[list[int], str]:
        chunks = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                                    **extra})
        got = [c.choices[0] for c in chunks if c.choices]
        return [len(c.model_extra["token_ids"]) for c in got if c.model_extra.get("token_ids")], \
            "".join(c.text for c in got)
    def chunked_by(got: list[int], interval: int) -> bool:
        return len(got) >= 2 and got[0] == 1 and sum(got) == 12 and all(n >= interval for n in got[1:-1])

    server_sizes, text = sizes()
    assert chunked_by(server_sizes, 2), server_sizes       # [1, 2, 2, 2, 2, 2, 1] on a quiet machine
    own, own_text = sizes(stream_interval=5)
    assert chunked_by(own, 5) and own_text == text, own    # [1, 5, 5, 1]
    assert chunked_by(sizes(stream_interval=1)[0], 2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", max_tokens=2, extra_body={"stream_interval": 0})


def test_a_stream_waiting_in_the_queue_sends_keep_alive_comments(server):
    """--sse-keep-alive-interval 1: a streamed request queued behind a running one (--max-num-seqs
    1) sends SSE comment lines while it waits, then its events; a client reads them as usual."""
    headers = {"Authorization": f"Bearer {KEY}"}

    async def main() -> list[bytes]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            first = session.post(server.url + "/v1/completions", headers=headers, json={
                "prompt": "first", "max_tokens": 200, "ignore_eos": True, "stream": True})
            async with first as running:
                await running.content.readline()
                async with session.post(server.url + "/v1/completions", headers=headers, json={
                        "prompt": "second", "max_tokens": 2, "stream": True}) as queued:
                    lines = [line async for line in queued.content]
                await running.read()
        return lines
    lines = [line for line in asyncio.run(main()) if line.strip()]
    assert lines[0] == b": keep-alive\n"
    data = [line for line in lines if line.startswith(b"data: ")]
    assert data[-1] == b"data: [DONE]\n" and len(data) >= 2
    assert all(line == b": keep-alive\n" or line.startswith(b"data: ") for line in lines)


def test_max_num_queued_reqs_refuses_past_the_requests_in_flight(server):
    """--max-num-queued-reqs 3 (vLLM's): with one request running and two waiting (--max-num-seqs
    1), a fourth is refused at once with 503 and Retry-After; once they finish, requests pass."""
    headers = {"Authorization": f"Bearer {KEY}"}

    async def main() -> tuple[int, str | None, int]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            body = {"prompt": "first", "max_tokens": 60, "ignore_eos": True, "stream": True}
            streams = [await session.post(server.url + "/v1/completions", headers=headers, json=body)]
            await streams[0].content.readline()
            for _ in range(2):
                streams.append(await session.post(server.url + "/v1/completions", headers=headers, json=body))
            async with session.post(server.url + "/v1/completions", headers=headers,
                                    json={"prompt": "fourth", "max_tokens": 2}) as refused:
                status, retry = refused.status, refused.headers.get("Retry-After")
            for resp in streams:
                await resp.read()
                resp.release()
            async with session.post(server.url + "/v1/completions", headers=headers,
                                    json={"prompt": "later", "max_tokens": 2}) as later:
                return status, retry, later.status
    status, retry, later = asyncio.run(main())
    assert status == 503 and retry is not None and later == 200


def test_generation_control_endpoints_need_vllm_server_dev_mode_and_the_key(server):
    for method, path in (("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"),
                         ("POST", "/abort_requests"), ("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                         ("POST", "/start_profile"), ("POST", "/stop_profile")):
        req = urllib.request.Request(server.url + path, method=method, data=b"{}" if method == "POST" else None)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 401, path               # the API key guards them first
        req.add_header("Authorization", f"Bearer {KEY}")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 404, path               # absent without VLLM_SERVER_DEV_MODE=1 (or --profiler-config)


def test_scale_out_endpoints_answer_403_without_enable_scale_out(server):
    for path in ("/v1/chat/completions/render", "/v1/completions/render", "/inference/v1/generate",
                 "/inference/v1/abort_requests", "/v1/chat/completions/derender", "/v1/completions/derender",
                 "/v1/responses/render"):
        req = urllib.request.Request(server.url + path, method="POST", data=b"{}",
                                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 403, path
        assert "--enable-scale-out" in json.loads(err.value.read())["error"]["message"]


def test_per_request_metrics_time_a_one_choice_answer_and_its_stream_and_the_fingerprint_is_the_custom_one(server):
    """vLLM's --enable-per-request-metrics: a one-choice answer holds its time in the queue, to the
    first token (from its first scheduling), generating, per token and its tokens per second,
    consistent with each other; a stream sends them in its usage chunk; n=2 answers have none.
    --fingerprint-mode custom: every answer's system_fingerprint is --fingerprint-value."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="Count: 1, 2, 3,", max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.system_fingerprint == FINGERPRINT
    m = out.model_extra["metrics"]
    assert set(m) == {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms",
                      "tokens_per_second", "speculative_decoding"} and m["speculative_decoding"] is None
    assert m["queue_time_ms"] >= 0 and m["time_to_first_token_ms"] > 0 and m["generation_time_ms"] > 0
    assert m["mean_itl_ms"] == pytest.approx(m["generation_time_ms"] / 5)
    assert m["tokens_per_second"] == pytest.approx(6 / ((m["time_to_first_token_ms"] + m["generation_time_ms"]) / 1e3))
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.usage.completion_tokens == 4 and last.system_fingerprint == FINGERPRINT
    assert last.model_extra["metrics"]["mean_itl_ms"] > 0
    assert all("metrics" not in (c.model_extra or {}) for c in chunks[:-1])
    two = client.completions.create(model=model, prompt="Hi", max_tokens=2, n=2)
    assert "metrics" not in two.model_extra and two.system_fingerprint == FINGERPRINT
    req = urllib.request.Request(server.url + "/v1/responses", data=json.dumps(
        {"model": model, "input": "Hi", "max_output_tokens": 3}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert json.loads(resp.read())["metrics"]["generation_time_ms"] > 0


def test_mfu_metrics_count_each_steps_estimated_flops_and_bytes(server):
    """--enable-mfu-metrics: the estimated FLOPs and bytes per device grow with each request, by
    at least the model's weights read and two FLOPs per weight and token."""
    import re

    def sample(name: str) -> float:
        req = urllib.request.Request(server.url + "/metrics")
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read().decode()
        return float(re.search(rf'^vllm:{name}{{[^}}]*}} (\S+)$', text, re.M).group(1))
    names = ("estimated_flops_per_gpu_total", "estimated_read_bytes_per_gpu_total", "estimated_write_bytes_per_gpu_total")
    before = [sample(n) for n in names]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    model = client.models.list().data[0].id
    client.completions.create(model=model, prompt="Count: 1, 2, 3,", max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True})
    after = [sample(n) for n in names]
    weights = 134_515_008                        # SmolLM2-135M's parameters
    assert after[0] - before[0] >= 2 * weights * 9     # 5 prompt tokens and 3 more, at 2 FLOPs per weight
    # the weights read on each of the 4 steps: exact mode runs the GGUF file's blocks (4.5 bits a
    # weight), not float32 copies (4 bytes)
    assert 0.5 * weights * 4 <= after[1] - before[1] < 4 * weights * 4
    assert after[2] > before[2]
