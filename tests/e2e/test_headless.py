"""Data parallelism across machines without Ray (vLLM's --headless): a server running engine core 0
(--data-parallel-size 2 --data-parallel-size-local 1) and a headless server running engine core 1
(--headless --data-parallel-start-rank 1) that joins it over TCP at --data-parallel-rpc-port, here
both on 127.0.0.1 as two machines would be. The headless one starts first (the server waits for
it, and it for the server). Requests are spread over both engine cores and answered alike; the
headless engine core killed fails only its own requests and joins again once its server restarted
it; the headless server killed outright leaves engine core 0 serving until another headless server
runs rank 1; one started with other engine flags is refused, naming both configurations; the
server's shutdown stops the headless server with it; and a server with --data-parallel-size-local
0 serves through a headless machine's engine cores alone."""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from server import HeadlessProcess, Server, alive, children, free_ports
from test_data_parallel import _complete, _concurrently, _kill_amid_four_streams, _metric

pytestmark = pytest.mark.slow


def Headless(port: int, *args: str) -> HeadlessProcess:
    """This machine's engine core 1 of the server listening at ``port``."""
    return HeadlessProcess("--data-parallel-size", "2", "--data-parallel-size-local", "1",
                           "--data-parallel-start-rank", "1", "--data-parallel-rpc-port", str(port), *args)


@pytest.fixture(scope="module")
def cluster():
    port = free_ports(1)
    headless = Headless(port)
    server = None
    try:
        server = Server("--data-parallel-size", "2", "--data-parallel-size-local", "1",
                        "--data-parallel-rpc-port", str(port), "--max-num-seqs", "8")
        headless.wait_joined()
        yield server, headless, port
    finally:
        if server is not None:
            server.stop()
        headless.stop()


def _wait_for(lines: list[str], text: str, after: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(text in line for line in lines[after:]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any(text in line for line in lines[after:]), "".join(lines[-30:])


def _spread(server: Server, max_tokens: int) -> tuple[dict[str, float], list]:
    """Four concurrent greedy requests: the most each engine core ran at once, and the answers."""
    results: list = [None] * 4
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _complete(
        server, "The capital of France is", max_tokens))) for i in range(4)]
    for t in threads:
        t.start()
    most: dict[str, float] = {}
    while any(t.is_alive() for t in threads):
        for engine, n in _metric(server, "num_requests_running").items():
            most[engine] = max(most.get(engine, 0.0), n)
        time.sleep(0.05)
    return most, results


def test_requests_are_spread_over_the_servers_and_the_headless_engine_core_and_answered_alike(cluster):
    server, headless, _ = cluster
    assert re.search(r"engine pids 0: \d+, 1: \d+", server.log())
    most, results = _spread(server, 32)
    assert all(status == 200 for status, _ in results)
    assert len({body["choices"][0]["text"] for _, body in results}) == 1
    assert most == {"0": 2.0, "1": 2.0}                                 # both engine cores took requests


def test_a_killed_headless_engine_core_fails_only_its_requests_and_joins_again(cluster):
    server, headless, _ = cluster
    pid = headless.engine_pid()
    mark = len(server.lines)
    results = _kill_amid_four_streams(server, lambda: os.kill(pid, signal.SIGKILL), 40)
    failed = [body for status, body in results if status != 200]
    assert len(failed) == 2 and all("engine core 1 is down" in body["error"]["message"] for body in failed)
    assert sorted(body["usage"]["completion_tokens"] for status, body in results if status == 200) == [40, 40]
    _wait_for(server.lines, "engine core 1 is back", mark)
    assert headless.engine_pid() != pid
    most, results = _spread(server, 32)
    assert all(status == 200 for status, _ in results) and most == {"0": 2.0, "1": 2.0}


def test_a_headless_server_with_other_engine_flags_is_refused_naming_both_configurations(cluster):
    server, _, port = cluster
    other = Headless(port, "--max-model-len", "1024")
    try:
        assert other.proc.wait(180) == 1
    finally:
        other.stop()
    log = "".join(other.lines)
    assert "refused engine core 1" in log and "another configuration" in log, log[-2000:]
    status, _ = _complete(server, "The capital of France is")
    assert status == 200


def test_a_killed_headless_server_leaves_rank_0_serving_until_another_joins_and_shutdown_stops_it(cluster):
    server, headless, port = cluster
    mark = len(server.lines)
    pids = [headless.proc.pid, *children(headless.proc.pid)]
    headless.proc.kill()
    headless.proc.wait(30)
    _wait_for(server.lines, "engine core 1 is down", mark, timeout=30)
    deadline = time.monotonic() + 15
    while any(alive(p) for p in pids) and time.monotonic() < deadline:   # its engine core ends with it
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)
    results = _concurrently(_complete, [(server, "The capital of France is")] * 2)
    assert all(status == 200 for status, _ in results)                  # engine core 0 serves alone
    replacement = Headless(port)
    try:
        replacement.wait_joined()
        _wait_for(server.lines, "engine core 1 is back", mark)
        status, _ = _complete(server, "The capital of France is")
        assert status == 200
        new_pids = [replacement.proc.pid, *children(replacement.proc.pid)]
        server.stop()                                                    # the headless server stops with it
        assert replacement.proc.wait(30) == 0
        deadline = time.monotonic() + 15
        while any(alive(p) for p in new_pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in new_pids)
    finally:
        replacement.stop()


def test_a_server_without_engine_cores_serves_through_the_headless_machines():
    """vLLM's --data-parallel-size-local 0: this machine runs the server only, every engine core
    runs on a headless machine (here ranks 0 and 1, started from rank 0)."""
    port = free_ports(1)
    headless = HeadlessProcess("--data-parallel-size", "2", "--data-parallel-size-local", "2",
                               "--data-parallel-rpc-port", str(port))
    server = None
    try:
        server = Server("--data-parallel-size", "2", "--data-parallel-size-local", "0",
                        "--data-parallel-rpc-port", str(port))
        headless.wait_joined()
        assert children(server.pid) == []                                # no engine core of its own
        results = _concurrently(_complete, [(server, "The capital of France is")] * 4)
        assert all(status == 200 for status, _ in results)
        assert len({body["choices"][0]["text"] for _, body in results}) == 1
        assert set(_metric(server, "num_requests_running")) == {"0", "1"}
    finally:
        if server is not None:
            server.stop()
        headless.stop()
