"""A vLLM user's command line, with `vllm` changed to `troupe`: the server answers to its
served names, bounds log-probs by --max-logprobs, writes vLLM's metric names, and a vLLM flag
Troupe lacks stops the command at once with one line naming it."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from actors.frontend.stats import METRICS, VLLM_METRIC_NAMES
from server import ROOT, Server, free_ports

pytestmark = pytest.mark.slow

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
VLLM_COMMAND_LINE = [MODEL, "--served-model-name", "my-model", "other-name", "--enable-prefix-caching",
                     "--max-logprobs", "5", "--seed", "0", "--generation-config", "vllm",
                     "--uvicorn-log-level", "warning", "--disable-log-requests", "--trust-remote-code"]
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    # --threads 1 is Troupe's own: on a shared 2-core machine two spinning threads per step
    # make every step several times slower
    s = Server(command=["tools.cli", "serve", *VLLM_COMMAND_LINE, "--port", str(free_ports(1)), "--threads", "1"],
               env={"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "1", "VLLM_LOGGING_LEVEL": "WARNING"})
    yield s
    s.stop()


def _request(url: str, path: str, body: dict | None = None) -> tuple[int, dict | str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            status, raw = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read().decode()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def _samples(text: str) -> dict[str, float]:
    """``name{labels}`` -> value, labels as written."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_v1_models_lists_every_served_name_and_only_those(server):
    status, body = _request(server.url, "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == ["my-model", "other-name"]
    assert all(m["root"] == MODEL for m in body["data"])
    assert _request(server.url, "/v1/models/other-name")[0] == 200
    assert _request(server.url, f"/v1/models/{MODEL}")[0] == 404


def test_a_request_for_any_served_name_is_answered_as_the_first(server):
    status, body = _request(server.url, "/v1/chat/completions", {
        "model": "other-name", "messages": CAPITAL, "temperature": 0, "max_tokens": 8})
    assert status == 200, body
    assert body["model"] == "my-model" and body["choices"][0]["message"]["content"]
    status, body = _request(server.url, "/v1/chat/completions", {
        "model": MODEL, "messages": CAPITAL, "max_tokens": 4})
    assert status == 404 and body["error"]["param"] == "model"


def test_more_log_probs_than_max_logprobs_is_a_400_naming_the_field(server):
    status, body = _request(server.url, "/v1/chat/completions", {
        "model": "my-model", "messages": CAPITAL, "max_tokens": 2, "logprobs": True, "top_logprobs": 6})
    assert status == 400 and body["error"]["param"] == "top_logprobs", body
    assert "--max-logprobs" in body["error"]["message"]
    status, body = _request(server.url, "/v1/completions", {"prompt": "The sky is", "max_tokens": 2, "logprobs": 6})
    assert status == 400 and body["error"]["param"] == "logprobs", body
    status, body = _request(server.url, "/v1/chat/completions", {
        "messages": CAPITAL, "max_tokens": 2, "temperature": 0, "logprobs": True, "top_logprobs": 5})
    assert status == 200, body
    assert all(len(t["top_logprobs"]) == 5 for t in body["choices"][0]["logprobs"]["content"])


def test_metrics_have_every_documented_vllm_name_and_count_requests_with_n(server):
    before = _samples(_request(server.url, "/metrics")[1])
    status, body = _request(server.url, "/v1/completions", {
        "model": "other-name", "prompt": "Once upon a time", "n": 2, "max_tokens": 3, "seed": 1,
        "ignore_eos": True})
    assert status == 200 and len(body["choices"]) == 2, body
    text = _request(server.url, "/metrics")[1]
    for name in VLLM_METRIC_NAMES + tuple(f"troupe:{m.name}" for m in METRICS):
        if name.endswith("watermark_requests_total"):
            continue            # vLLM's: only on a server with --watermark-config (test_watermarked_server.py)
        if "estimated_" in name:
            continue            # vLLM's: only with --enable-mfu-metrics (test_openai_flags.py)
        if "api_server_requests_" in name:
            continue            # only with --api-server-count above 1 (test_api_servers.py)
        if "rl_weight_update_" in name or "sleep_mode_operation" in name:
            continue            # once such a call was made (test_weight_transfer.py, test_pause.py)
        assert re.search(rf"^# TYPE {name} (counter|gauge|histogram)$", text, re.M), name
        if name.endswith("spec_decode_num_accepted_tokens_per_pos_total"):
            continue            # one sample per draft position: none on a server without drafts
        assert re.search(rf"^{name}(_bucket|_sum|_count)?{{", text, re.M), name
    after = _samples(text)
    labels = 'model_name="my-model",engine="0"'
    grew = lambda key: after[key] - before.get(key, 0.0)  # noqa: E731
    assert grew(f"vllm:request_params_n_count{{{labels}}}") == 1
    assert grew(f"vllm:request_params_n_sum{{{labels}}}") == 2
    assert grew(f'vllm:request_success_total{{{labels},finished_reason="length"}}') == 2
    assert grew(f"vllm:request_generation_tokens_sum{{{labels}}}") == 6
    assert grew(f"vllm:request_max_num_generation_tokens_sum{{{labels}}}") == 3
    assert grew(f"vllm:request_params_max_tokens_sum{{{labels}}}") == 6
    assert grew(f"vllm:request_decode_time_seconds_count{{{labels}}}") == 2
    assert after[f"vllm:generation_tokens_total{{{labels}}}"] == after[f"troupe:generation_tokens_total{{{labels}}}"]
    info = next(k for k in after if k.startswith("vllm:cache_config_info{"))
    assert 'enable_prefix_caching="True"' in info and 'block_size="16"' in info


def test_the_log_warns_once_about_trust_remote_code_and_logs_no_requests(server):
    log = server.log()
    assert log.count("--trust-remote-code is accepted and changes nothing") == 1
    assert not re.search(r"request req-\S+: \d+ prompt tokens", log)


def test_the_log_level_holds_in_every_process(server):
    """--uvicorn-log-level warning: no INFO line from the frontend, the engine or the worker."""
    assert " WARNING [frontend] " in server.log_when(lambda log: " WARNING [frontend] " in log)
    assert not re.search(r" INFO \[(frontend|engine|worker\d*)\] ", server.log())


def test_an_unimplemented_vllm_flag_stops_the_command_at_once_with_one_line():
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "tools.cli", "serve", MODEL, "--decode-context-parallel-size", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [r.stderr.rstrip("\n")]
    assert r.stderr.startswith("troupe: error: --decode-context-parallel-size is a vLLM flag Troupe does not implement")
    assert time.monotonic() - t0 < 60          # refused before any model loads


def test_vllm_environment_sets_the_keep_alive_and_the_log_level(server):
    """VLLM_HTTP_TIMEOUT_KEEP_ALIVE=1: an idle connection is closed after a second;
    VLLM_LOGGING_LEVEL=WARNING: no INFO line in any process's log."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n")
        assert conn.recv(4096).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        assert conn.recv(4096) == b""                      # the server closed it
        assert 0.5 < time.monotonic() - t0 < 5
    assert not [line for line in server.lines if " INFO " in line]
