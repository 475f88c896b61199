"""Tensor parallelism across machines without Ray (vLLM's --nnodes with the mp backend): a server
of node rank 0 (--tensor-parallel-size 2 --nnodes 2 --node-rank 0) running worker rank 0, and a
headless machine of node rank 1 (--headless --nnodes 2 --node-rank 1) running worker rank 1 for it,
joined over TCP at --master-addr:--master-port, here both on 127.0.0.1 as two machines would be.
The headless one starts first (each waits for the other). Greedy answers equal one worker's; the
other machine's rank killed mid-request brings both ranks back and the request is recomputed; the
other machine lost outright holds the requests until a machine of its node rank joins again; the
engine core restarted has the other machine join it again; one started with other engine flags is
refused, naming both configurations; and the server's shutdown stops the other machine with it.
Four ranks on two machines of two each all-reduce through each machine's shared memory."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from server import HeadlessProcess, Server, alive, children, free_ports, one_worker_texts, streamed_text_in_thread
from test_parallel_servers import _texts

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time,", "Write a poem about the sea."]
TOKENS = [12, 12, 48]


def RanksHost(port: int, *args: str) -> HeadlessProcess:
    """Node rank 1's worker ranks for the engine core listening at ``port``."""
    return HeadlessProcess("--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
                           "--master-addr", "127.0.0.1", "--master-port", str(port), *args)


@pytest.fixture(scope="module")
def one_worker() -> list[str]:
    return one_worker_texts(PROMPTS, TOKENS)


@pytest.fixture(scope="module")
def cluster():
    port = free_ports(1)
    machines = [RanksHost(port)]          # the one serving node rank 1 now (replaced when lost)
    server = None
    try:
        server = Server("--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "0",
                        "--master-addr", "127.0.0.1", "--master-port", str(port))
        machines[0].wait_joined()
        yield server, machines, port
    finally:
        if server is not None:
            server.stop()
        for m in machines:
            m.stop()


def _wait_for(lines: list[str], text: str, after: int = 0, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(text in line for line in lines[after:]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any(text in line for line in lines[after:]), "".join(lines[-30:])


def _in_thread(server: Server, result: dict) -> threading.Thread:
    thread = threading.Thread(target=lambda: result.update(text=_texts(server, PROMPTS[2:], TOKENS[2:])[0]))
    thread.start()
    return thread


def test_two_ranks_on_two_machines_answer_as_one_worker_does(cluster, one_worker):
    server, machines, port = cluster
    (engine,) = children(server.pid)
    assert len(children(engine)) == 1                         # rank 0 here, rank 1 on the other machine
    machines[0].engine_pid()                                  # which runs it
    assert any(f"joining at tcp://127.0.0.1:{port}" in line for line in server.lines)
    assert any("node rank 1 (worker ranks 1) joined" in line for line in machines[0].lines)
    assert _texts(server, PROMPTS[:2], TOKENS[:2]) == one_worker[:2]


def test_the_other_machines_rank_killed_mid_request_brings_both_back_and_the_request_is_recomputed(
        cluster, one_worker):
    server, machines, _ = cluster
    (engine,) = children(server.pid)
    before = [*children(engine), machines[0].engine_pid()]
    mark = len(server.lines)
    result: dict = {}
    thread, streaming = streamed_text_in_thread(server.url, PROMPTS[2], TOKENS[2], result)
    assert streaming.wait(120), "no token streamed"
    os.kill(before[1], signal.SIGKILL)                        # mid-request: its first token is out
    thread.join(240)
    assert result.get("text") == one_worker[2]
    _wait_for(server.lines, "was killed by SIGKILL", mark)
    assert any("workers restarted" in line for line in server.lines[mark:])
    after = [*children(engine), machines[0].engine_pid()]
    assert not set(after) & set(before) and not any(alive(p) for p in before)


def test_a_lost_machine_holds_requests_until_a_machine_of_its_node_rank_joins_again(cluster, one_worker):
    server, machines, port = cluster
    lost = machines[0]
    rank = lost.engine_pid()
    mark = len(server.lines)
    lost.proc.kill()                                          # the machine gone: its rank dies with it
    result: dict = {}
    thread = _in_thread(server, result)
    _wait_for(server.lines, "sent no heartbeat", mark, timeout=60)
    assert thread.is_alive() and not alive(rank)              # the request waits for the ranks
    machines[0] = RanksHost(port)
    machines[0].wait_joined()
    thread.join(240)
    assert result.get("text") == one_worker[2]
    lost.stop()


def test_a_restarted_engine_core_has_the_other_machine_join_it_again(cluster, one_worker):
    server, machines, _ = cluster
    (engine,) = children(server.pid)
    mark, other_mark = len(server.lines), len(machines[0].lines)
    os.kill(engine, signal.SIGKILL)
    _wait_for(server.lines, "engine core restarted", mark)
    assert any("joining again" in line for line in machines[0].lines[other_mark:])
    assert _texts(server, PROMPTS[:1], TOKENS[:1]) == one_worker[:1]


def test_a_machine_started_with_other_engine_flags_is_refused_naming_both_digests(cluster):
    _, _, port = cluster
    other = RanksHost(port, "--max-model-len", "1024")
    try:
        assert other.proc.wait(120) == 1
        out = "".join(other.lines)
        assert "was started with another configuration than this server (config digest" in out, out[-2000:]
        assert not other.joined.is_set()
    finally:
        other.stop()


def test_the_servers_shutdown_stops_the_other_machine(cluster):
    server, machines, _ = cluster
    machine = machines[0]
    rank = machine.engine_pid()
    server.stop()
    assert machine.proc.wait(60) == 0
    assert not alive(rank)


def test_four_ranks_on_two_machines_all_reduce_through_each_machines_shared_memory(tmp_path):
    """-tp 4 over two machines of two ranks each: each machine's ranks sum through their shared
    memory, the machines' first ranks over gloo; the greedy tokens are one worker's (a tiny random
    model with 4 KV heads, one a rank)."""
    from actors.api import LLM, SamplingParams
    from helpers import save_tiny_llama, save_tiny_tokenizer
    model = save_tiny_tokenizer(save_tiny_llama(tmp_path, 256, 64, 128, 4, 4, 16, 512), 256)
    prompts, tokens = ["t5 t17 t42 t9 t100", "t1 t2 t3"], [16, 16]
    with LLM(model, multiprocess=False) as llm:
        want = [r.text for r in llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                                       for n in tokens], use_tqdm=False)]
    port = free_ports(1)
    flags = ("--tensor-parallel-size", "4", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port))
    other = HeadlessProcess(model, *flags, "--node-rank", "1")
    server = None
    try:
        server = Server(model, *flags, "--node-rank", "0")
        other.wait_joined()
        assert _texts(server, prompts, tokens) == want
        hierarchical = "each machine's shared memory and gloo between machines"
        assert sum(hierarchical in line for line in server.lines + other.lines) == 4, "".join(other.lines[-20:])
    finally:
        if server is not None:
            server.stop()
        other.stop()
