"""vLLM's external and hybrid load balancing of data parallelism, where each server serves only its
own ranks (Troupe's ranks share no collectives, so no rank waits for another): a server of rank 1
of 2 (--data-parallel-size 2 --data-parallel-rank 1) runs that one engine core and labels its
metrics engine "1"; a machine's server of ranks 2 and 3 of 4 (-dp 4 -dpl 2 -dpr 2
--data-parallel-hybrid-lb) runs those two, spreads requests over them, and with rank 3 killed
fails only that rank's requests while rank 2 serves on, until rank 3 is back."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from server import Server, alive
from test_data_parallel import _complete, _concurrently, _engine_pids, _metric

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference() -> str:
    from server import one_worker_texts
    return one_worker_texts(["The capital of France is"], [8])[0]


def test_a_server_of_one_rank_runs_and_serves_that_rank_under_its_number(reference):
    s = Server("--data-parallel-size", "2", "--data-parallel-rank", "1")
    try:
        pids = _engine_pids(s)
        assert list(pids) == [1] and alive(pids[1])
        status, body = _complete(s, "The capital of France is")
        assert status == 200 and body["choices"][0]["text"] == reference
        assert set(_metric(s, "prefix_cache_queries_total")) == {"1"}
    finally:
        s.stop()


def test_a_machines_server_balances_its_own_ranks_and_a_killed_one_fails_only_its_requests(reference):
    s = Server("-dp", "4", "-dpl", "2", "-dpr", "2", "--data-parallel-hybrid-lb", "--max-num-seqs", "8")
    try:
        pids = _engine_pids(s)
        assert sorted(pids) == [2, 3] and all(alive(p) for p in pids.values())
        results = _concurrently(_complete, [(s, "The capital of France is")] * 6)
        assert all(status == 200 and body["choices"][0]["text"] == reference for status, body in results)
        queries = _metric(s, "prefix_cache_queries_total")
        assert set(queries) == {"2", "3"} and all(v > 0 for v in queries.values())
        streams: list = [None] * 4

        def run(i):
            streams[i] = _complete(s, f"Story {i}: once upon a time", max_tokens=96)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while sum(_metric(s, "num_requests_running").values()) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _metric(s, "num_requests_running") == {"2": 2.0, "3": 2.0}
        os.kill(pids[3], signal.SIGKILL)
        for t in threads:
            t.join(180)
        failed = [body for status, body in streams if status != 200]
        assert len(failed) == 2 and all("engine core 3 died" in body["error"]["message"] for body in failed)
        status, _ = _complete(s, "The capital of France is")          # rank 2 serves meanwhile
        assert status == 200
        deadline = time.monotonic() + 120
        while not any("engine core 3 restarted" in line for line in s.lines) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert any("engine core 3 restarted" in line for line in s.lines)
        assert all(status == 200 for status, _ in _concurrently(_complete, [(s, "The capital of France is")] * 4))
    finally:
        s.stop()
