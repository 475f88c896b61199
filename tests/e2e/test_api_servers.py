"""--api-server-count 3 (vLLM's): three API server processes accept on the server's one port and
share one engine core. Every answer is the one the engine gives whichever server took the
connection; /metrics, from any of them, adds up every server's requests; a LoRA adapter loaded
through one is served by all and unloaded from all; a stored response is found through any; a
sleep asked of one is woken through any; /abort_requests through one aborts every server's
requests; an API server that is killed is started again (its running requests aborted in the engine, the
others' answered); an engine core that dies is restarted and every API server serves again.
On a tiny random Llama with a LoRA adapter. Two API servers also serve a headless machine's engine
core (data parallelism across machines, both on 127.0.0.1): requests through either reach both
engine cores, and its death and return are every API server's news."""
from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.server import ROOT, HeadlessProcess, Server, alive, free_ports
from tests.helpers import save_tiny_llama, save_tiny_lora, save_tiny_tokenizer

pytestmark = pytest.mark.slow

VOCAB = 128
PROMPTS = [f"t{i} t{(7 * i) % 97} t{(3 * i) % 89} t5" for i in range(8)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("api-servers")
    base = save_tiny_llama(root / "base", VOCAB, 64, 96, 4, 2, 16, 256)
    save_tiny_tokenizer(base, VOCAB)
    save_tiny_lora(base, root / "adapter", 8, ["q_proj", "v_proj", "down_proj"], seed=3, scale=0.3)
    s = Server("--model", base, "--served-model-name", "tiny", "--api-server-count", "3", "--enable-lora",
               "--max-lora-rank", "8", "--chat-template", f"{ROOT}/tools/chat_templates/chatml_tools.jinja",
               env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_SERVER_DEV_MODE": "1"})
    yield s, root
    s.stop()


def _request(method: str, url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, str]:
    """One request on a connection of its own (urllib closes it), so the API servers take turns."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _complete(url: str, prompt: str, model: str = "tiny", tokens: int = 6) -> tuple[int, str]:
    status, text = _request("POST", url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": tokens,
                                                              "temperature": 0, "ignore_eos": True})
    return status, json.loads(text)["choices"][0]["text"] if status == 200 else text


def _metric(url: str, name: str) -> dict[str, float]:
    """Each sample of ``name`` on /metrics, by its labels."""
    _, text = _request("GET", url + "/metrics")
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", text, re.M)}


def _per_server(url: str) -> dict[int, float]:
    samples = _metric(url, "troupe:api_server_requests_total")
    return {int(re.search(r'api_server="(\d+)"', k).group(1)): v for k, v in samples.items()}


def _open(url: str) -> dict[int, float]:
    samples = _metric(url, "troupe:api_server_requests_open")
    return {int(re.search(r'api_server="(\d+)"', k).group(1)): v for k, v in samples.items()}


def _answers(url: str, prompts: list[str], model: str = "tiny") -> list[tuple[int, str]]:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda p: _complete(url, p, model), prompts))


def _served_by_several(url: str, model: str = "tiny", rounds: int = 20) -> dict[int, float]:
    """Concurrent requests until at least two API servers have answered some since now (each
    answer checked against the first one given for its prompt)."""
    before, expected = _per_server(url), {}
    for _ in range(rounds):
        for p, (status, text) in zip(PROMPTS, _answers(url, PROMPTS, model)):
            assert status == 200, text
            assert expected.setdefault(p, text) == text
        after = _per_server(url)
        grew = {i: n - before.get(i, 0) for i, n in after.items() if n > before.get(i, 0)}
        if len(grew) >= 2:
            return grew
    raise AssertionError(f"one API server took every connection: {before} -> {after}")


def test_the_api_servers_share_the_port_the_engine_and_the_metrics(setup):
    server, _ = setup
    one = [_complete(server.url, p) for p in PROMPTS]         # the engine's answers, one at a time
    assert all(status == 200 for status, _ in one)
    grew = _served_by_several(server.url)
    assert set(grew) <= {0, 1, 2}
    # /metrics from whichever server: every server's requests added up, the same total each time
    totals = set()
    for _ in range(6):
        finished = _metric(server.url, "vllm:request_success_total")
        per_server = _per_server(server.url)
        totals.add(sum(finished.values()))
        assert sum(finished.values()) == sum(per_server.values())
    assert len(totals) == 1
    assert [_complete(server.url, p) for p in PROMPTS] == one
    # the dashboard's data, from whichever server: every process's actors
    for _ in range(6):
        status, text = _request("GET", server.url + "/debug/actors")
        assert status == 200, text
        nodes = {a["node"] for a in json.loads(text)["actors"]}
        assert {"frontend", "api1", "api2", "engine", "worker0"} <= nodes, nodes


def test_an_adapter_loaded_through_one_server_is_served_and_unloaded_by_all(setup):
    server, root = setup
    status, text = _request("POST", server.url + "/v1/load_lora_adapter",
                            {"lora_name": "styled", "lora_path": str(root / "adapter")})
    assert status == 200 and text == "Success: LoRA adapter 'styled' added successfully."
    base = [_complete(server.url, p)[1] for p in PROMPTS[:2]]
    grew = _served_by_several(server.url, "styled")        # every server that answered knew it
    assert len(grew) >= 2
    styled = [_complete(server.url, p, "styled")[1] for p in PROMPTS[:2]]
    assert styled != base
    for _ in range(6):                                      # listed by each server a connection reaches
        status, text = _request("GET", server.url + "/v1/models")
        assert status == 200 and "styled" in {m["id"] for m in json.loads(text)["data"]}
    status, _ = _request("POST", server.url + "/v1/load_lora_adapter",
                         {"lora_name": "styled", "lora_path": str(root / "adapter")})
    assert status == 400                                    # already loaded, whichever server is asked
    status, text = _request("POST", server.url + "/v1/unload_lora_adapter", {"lora_name": "styled"})
    assert status == 200, text
    for status, text in _answers(server.url, PROMPTS, "styled") + _answers(server.url, PROMPTS, "styled"):
        assert status == 404 and "styled" in text


def test_a_stored_response_is_found_through_every_server(setup):
    server, _ = setup
    status, text = _request("POST", server.url + "/v1/responses",
                            {"model": "tiny", "input": PROMPTS[0], "max_output_tokens": 4, "temperature": 0})
    assert status == 200, text
    rid = json.loads(text)["id"]
    for _ in range(8):
        status, text = _request("GET", server.url + f"/v1/responses/{rid}")
        assert status == 200 and json.loads(text)["id"] == rid
    status, text = _request("POST", server.url + "/v1/responses",
                            {"model": "tiny", "input": PROMPTS[1], "max_output_tokens": 4, "previous_response_id": rid})
    assert status == 200, text
    status, _ = _request("DELETE", server.url + f"/v1/responses/{rid}")
    assert status == 200
    for _ in range(4):
        assert _request("GET", server.url + f"/v1/responses/{rid}")[0] == 404


def test_a_sleep_through_one_server_is_woken_through_any(setup):
    """The pause and sleep state is every API server's: whichever one /wake_up reaches resumes."""
    server, _ = setup
    for _ in range(4):
        assert _request("POST", server.url + "/sleep?level=0")[0] == 200
        for _ in range(3):
            status, text = _request("GET", server.url + "/is_sleeping")
            assert status == 200 and json.loads(text)["is_sleeping"] is True
        status, text = _request("POST", server.url + "/wake_up")
        assert status == 200 and json.loads(text)["status"] == "awake", text
        for _ in range(3):
            assert json.loads(_request("GET", server.url + "/is_sleeping")[1])["is_sleeping"] is False
    assert all(status == 200 for status, _ in _answers(server.url, PROMPTS))


def test_abort_requests_through_one_server_aborts_every_servers_requests(setup):
    """vLLM's POST /abort_requests (VLLM_SERVER_DEV_MODE): every API server's open requests end."""
    server, _ = setup
    assert _request("POST", server.url + "/pause?mode=keep")[0] == 200      # they wait in the engine
    try:
        with ThreadPoolExecutor(16) as pool:
            running = [pool.submit(_request, "POST", server.url + "/v1/completions",
                                   {"model": "tiny", "prompt": p, "max_tokens": 8}) for p in PROMPTS * 2]
            deadline = time.monotonic() + 60
            while sum(_open(server.url).values()) < len(running) and time.monotonic() < deadline:
                time.sleep(0.1)
            held = _open(server.url)
            assert sum(held.values()) == len(running) and len([n for n in held.values() if n]) >= 2, held
            status, text = _request("POST", server.url + "/abort_requests", {})
            assert status == 200 and json.loads(text)["aborted"] == len(running), text
            for f in running:
                status, text = f.result(timeout=60)
                assert status == 200 and json.loads(text)["choices"][0]["finish_reason"] == "abort", text
    finally:
        assert _request("POST", server.url + "/resume")[0] == 200
    assert all(status == 200 for status, _ in _answers(server.url, PROMPTS))


def _api_pid(server: Server, index: int, after: int = 0) -> int:
    log = server.log_when(lambda text: len(re.findall(rf"API server {index} serving \(pid (\d+)\)", text)) > after,
                          timeout=120)
    return int(re.findall(rf"API server {index} serving \(pid (\d+)\)", log)[after])


def test_a_killed_api_server_is_started_again_and_its_requests_aborted(setup):
    server, _ = setup
    pid = _api_pid(server, 1)
    assert _request("POST", server.url + "/pause?mode=keep")[0] == 200     # requests wait in the engine
    with ThreadPoolExecutor(16) as pool:
        running = []
        deadline = time.monotonic() + 60
        while not _open(server.url).get(1) and time.monotonic() < deadline:   # until API server 1 holds some
            running += [pool.submit(_complete, server.url, p) for p in PROMPTS[:2]]
            time.sleep(0.3)
        held = _open(server.url)
        assert held.get(1), held
        os.kill(pid, signal.SIGKILL)
        log = server.log_when(lambda text: "API server 1 is gone" in text, timeout=30)
        aborted = int(re.search(r"API server 1 is gone \(.*\): (\d+) of its requests aborted", log).group(1))
        assert aborted == held[1]                           # its requests left the engine, the others stay
        assert _request("POST", server.url + "/resume")[0] == 200
        answered = 0
        for f in running:                                   # the other servers' requests are answered
            try:
                status, _ = f.result(timeout=120)
                answered += status == 200
            except OSError:                                 # API server 1's: their connection was lost
                pass
        assert answered == len(running) - aborted
    new = _api_pid(server, 1, after=1)
    assert new != pid and alive(new) and not alive(pid)
    assert sum(_metric(server.url, "vllm:num_requests_running").values()) == 0
    before = _per_server(server.url).get(1, 0)              # the new API server 1 answers too
    for _ in range(40):
        assert all(status == 200 for status, _ in _answers(server.url, PROMPTS))
        if _per_server(server.url).get(1, 0) > before:
            break
    assert _per_server(server.url).get(1, 0) > before, _per_server(server.url)


def test_an_engine_core_that_dies_is_restarted_and_every_server_serves_again(setup):
    server, _ = setup
    engine = int(re.search(r"\(engine pid (\d+)\)", server.log()).group(1))
    os.kill(engine, signal.SIGKILL)
    server.log_when(lambda text: "engine core restarted" in text, timeout=120)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:                     # 503 until every server hears it is back
        if all(status == 200 for status, _ in _answers(server.url, PROMPTS)):
            break
        time.sleep(0.5)
    grew = _served_by_several(server.url)
    assert len(grew) >= 2


def test_two_api_servers_serve_a_headless_machines_engine_core_too(setup):
    _, root = setup
    tiny = ("--model", str(root / "base"), "--served-model-name", "tiny", "-dp", "2", "-dpl", "1")
    port = free_ports(1)
    headless = HeadlessProcess(*tiny, "--data-parallel-start-rank", "1", "--data-parallel-rpc-port", str(port))
    server = None
    try:
        server = Server(*tiny, "--data-parallel-rpc-port", str(port), "--api-server-count", "2")
        headless.wait_joined()
        grew = _served_by_several(server.url)
        assert set(grew) == {0, 1}
        queries = _metric(server.url, "vllm:prefix_cache_queries_total")
        assert len(queries) == 2 and all(n > 0 for n in queries.values()), queries   # both engine cores served
        pid = headless.engine_pid()
        os.kill(pid, signal.SIGKILL)
        log = server.log_when(lambda text: "engine core 1 is back" in text, timeout=120)
        assert "engine core 1 is back" in log
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(s == 200 for s, _ in _answers(server.url, PROMPTS)):
            time.sleep(0.5)
        before = _metric(server.url, "vllm:prefix_cache_queries_total")
        assert set(_served_by_several(server.url)) == {0, 1}
        deadline = time.monotonic() + 15          # an engine core's counters reach /metrics with its next stats
        after = _metric(server.url, "vllm:prefix_cache_queries_total")
        while time.monotonic() < deadline and not all(after[k] > before[k] for k in after):
            time.sleep(0.5)
            after = _metric(server.url, "vllm:prefix_cache_queries_total")
        assert all(after[k] > before[k] for k in after), (before, after)          # the new one serves again
    finally:
        if server is not None:
            server.stop()
        headless.stop()
