"""A vLLM deployment's server, unchanged but for the command: `troupe serve --config FILE.yaml`
with the file's HTTPS certificate, allowed browser origin, response role, forced usage, request
and output logs (streamed deltas, error stacks), tools left out for tool_choice "none",
a config.json key overridden and the generation config overridden, the command line's own flags winning over the file's; real clients
(the OpenAI SDK, a browser's CORS exchange) against it."""
from __future__ import annotations

import json
import re
import ssl
import urllib.error
import urllib.request

import openai
import pytest

from helpers import self_signed_cert
from server import Server

pytestmark = pytest.mark.slow

APP = "https://app.example"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return self_signed_cert(str(tmp_path_factory.mktemp("tls")))


@pytest.fixture(scope="module")
def server(tls, tmp_path_factory):
    cert, key = tls
    folder = tmp_path_factory.mktemp("config")
    logged = folder / "server.log"
    (folder / "logging.json").write_text(json.dumps({      # every record to stderr and to a file
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"pid": {"format": "%(levelname)s pid=%(process)d %(name)s: %(message)s"}},
        "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "pid"},
                     "file": {"class": "logging.FileHandler", "formatter": "pid", "filename": str(logged)}},
        "root": {"level": "INFO", "handlers": ["console", "file"]}}))
    config = folder / "vllm.yaml"
    config.write_text(f"""\
served-model-name: [from-file]
threads: 1                        # Troupe's own: one compute thread on a shared 2-core machine
ssl-certfile: {cert}
ssl-keyfile: {key}
allowed-origins: ["{APP}"]
response-role: narrator
enable-force-include-usage: true
enable-log-requests: true
enable-log-outputs: true
max-log-len: 12
log-error-stack: true
trust-request-chat-template: true
exclude-tools-when-tool-choice-none: true
override-generation-config:
  max_new_tokens: 5
hf-overrides:
  max_position_embeddings: 4096
log-config-file: {folder / "logging.json"}
""")
    s = Server(command=["tools.cli", "serve", "--config", str(config), "--port", "0",
                        "--served-model-name", "from-cli"])
    s.logged = logged
    yield s
    s.stop()


def _get(server, tls, path: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, dict, str]:
    req = urllib.request.Request(server.url + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    ctx = ssl.create_default_context(cafile=tls[0])
    try:
        with urllib.request.urlopen(req, timeout=120, context=ctx) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def test_the_server_serves_https_with_the_files_flags_and_the_command_lines_win(server, tls):
    assert server.url.startswith("https://127.0.0.1:")
    status, _, body = _get(server, tls, "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["from-cli"]
    assert json.loads(body)["data"][0]["max_model_len"] == 4096     # the file's hf-overrides (the model: 8192)
    with pytest.raises(urllib.error.URLError):          # the certificate is checked: unknown CA
        urllib.request.urlopen(server.url + "/health", timeout=30)


def test_the_openai_sdk_chats_over_https_with_the_response_role_and_the_overridden_default(server, tls):
    http = getattr(openai, "DefaultHttpx2Client", None) or openai.DefaultHttpxClient     # the SDK's own
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120,
                           http_client=http(verify=ssl.create_default_context(cafile=tls[0])))
    answer = client.chat.completions.create(model="from-cli", messages=CAPITAL, temperature=0)
    assert answer.choices[0].message.role == "narrator"
    # generation config's max_new_tokens 5 (from --override-generation-config) for a request without max_tokens
    assert answer.usage.completion_tokens == 5 and answer.choices[0].finish_reason == "length"
    continued = client.chat.completions.create(
        model="from-cli", temperature=0, max_tokens=3,
        messages=[*CAPITAL, {"role": "assistant", "content": "The capital"}],
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert continued.choices[0].message.role == "assistant"     # the last message's role
    client.close()


def test_every_stream_sends_its_usage_without_asking(server, tls):
    status, _, body = _get(server, tls, "/v1/chat/completions",
                           {"model": "from-cli", "messages": CAPITAL, "stream": True, "max_tokens": 3})
    chunks = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    assert status == 200 and chunks[0]["choices"][0]["delta"]["role"] == "narrator"
    assert all("usage" in c for c in chunks[1:])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_a_page_from_the_allowed_origin_may_read_answers_streamed_ones_included(server, tls):
    req = urllib.request.Request(server.url + "/v1/chat/completions", method="OPTIONS", headers={
        "Origin": APP, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    with urllib.request.urlopen(req, timeout=30, context=ssl.create_default_context(cafile=tls[0])) as resp:
        assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == APP
        assert resp.headers["Access-Control-Allow-Headers"] == "content-type"
    body = {"model": "from-cli", "messages": CAPITAL, "max_tokens": 2}
    status, headers, _ = _get(server, tls, "/v1/chat/completions", {**body, "stream": True}, {"Origin": APP})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == APP
    status, headers, _ = _get(server, tls, "/v1/chat/completions", body, {"Origin": "https://evil.example"})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers


def test_the_log_shows_each_requests_output_cut_to_max_log_len(server, tls):
    status, _, body = _get(server, tls, "/v1/completions",
                           {"model": "from-cli", "prompt": "Paris is the capital of", "max_tokens": 8,
                            "temperature": 0})
    text = json.loads(body)["choices"][0]["text"]
    rid = json.loads(body)["id"].removeprefix("cmpl-")
    log = server.log_when(lambda log: f"response {rid}: output:" in log)
    lines = [line for line in log.splitlines() if f"response {rid}: output:" in line]
    assert status == 200 and len(lines) == 1
    assert lines[0].endswith(f"output: {text[:12]!r}, finish_reason: length")
    logged = re.compile(rf"request {rid}: \d+ prompt tokens, params: max_tokens=8")
    assert logged.search(server.log_when(lambda log: logged.search(log) is not None))


def test_a_streamed_request_logs_each_delta_then_its_whole_output(server, tls):
    """--enable-log-deltas, on by default as in vLLM."""
    status, _, body = _get(server, tls, "/v1/completions",
                           {"model": "from-cli", "prompt": "Paris is the capital of", "max_tokens": 4,
                            "temperature": 0, "stream": True})
    chunks = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    rid = chunks[0]["id"].removeprefix("cmpl-")
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    complete = f"response {rid} (streaming complete): output:"   # logged as the stream ends: may follow its last bytes
    log = server.log_when(lambda log: complete in log).splitlines()
    deltas = [line for line in log if f"response {rid} (streaming delta): output:" in line]
    whole = [line for line in log if complete in line]
    assert status == 200 and 1 <= len(deltas) <= 4 and len(whole) == 1
    assert whole[0].endswith(f"output: {text[:12]!r}, finish_reason: length")


def test_tool_choice_none_renders_the_prompt_without_the_tools(server, tls):
    """--exclude-tools-when-tool-choice-none: the template sees no tools when they may not be
    called (a template of the request's own shows what it was given)."""
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    template = "{% if tools %}[{{ tools | length }} tools]{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"

    def prompt(tool_choice: str) -> str:
        status, _, body = _get(server, tls, "/v1/chat/completions", {
            "model": "from-cli", "messages": CAPITAL, "max_tokens": 1, "tools": tools, "tool_choice": tool_choice,
            "chat_template": template, "return_token_ids": True})
        assert status == 200, body
        _, _, shown = _get(server, tls, "/detokenize", {"tokens": json.loads(body)["prompt_token_ids"]})
        return json.loads(shown)["prompt"]
    assert prompt("none").endswith(CAPITAL[0]["content"]) and "tools]" not in prompt("none")
    assert "[1 tools]" in prompt("required")


def test_an_error_answer_logs_its_stack_trace(server, tls):
    """--log-error-stack: a 400 too, with the traceback of where it was raised."""
    status, _, body = _get(server, tls, "/v1/completions", {"model": "from-cli", "prompt": "x", "max_tokens": -1})
    assert status == 400 and "max_tokens" in body
    def traced(log: str) -> bool:
        at = log.rfind("POST /v1/completions answered 400")
        return at >= 0 and "Traceback (most recent call last)" in log[at:]
    assert traced(server.log_when(traced))


def test_every_process_logs_through_the_logging_configuration_file(server):
    """--log-config-file: the frontend's, the engine's and the worker's records in the file's
    format, in its file."""
    lines = server.logged.read_text().splitlines()
    pids = {name: {re.search(r"pid=(\d+)", line).group(1) for line in lines if f" {name}: " in line}
            for name in ("troupe.serve", "troupe.engine", "troupe.worker")}
    assert all(pids.values()) and len(set().union(*pids.values())) == 3, pids
    assert str(server.engine_pid()) in pids["troupe.engine"]
