"""The Ray backends on a local Ray cluster this module starts (`ray start --head --block` in a
session of its own, stopped by its process group). --distributed-executor-backend ray: the
default model served with --tensor-parallel-size 2 over two Ray actors gives one worker's greedy
tokens, a killed rank's actor brings both ranks back with the request recomputed, and no actor
or placement group of an engine is left in the cluster once the engine is killed outright or the
server stops; a rank whose event loop hangs (alive, no CPU used) is killed by its heartbeats, as a
process is. --data-parallel-backend ray: two engine cores in Ray actors (each with its worker
process) give the same tokens through both of two API servers (--api-server-count 2), a killed
one is restarted in a new actor and serves both again, and nothing is left once the server stops. Both at once as a KV producer: a decode server loads the prompt from the ranks'
side channels on the cluster address and answers the same."""
from __future__ import annotations

import asyncio
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import aiohttp
import pytest

from server import ROOT, Server, alive, children, free_ports, one_worker_texts, streamed_text_in_thread

pytestmark = pytest.mark.slow
pytest.importorskip("ray", reason="the Ray backend's test needs Ray (pip install ray; `make test` installs it)")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a poem about the sea."]
TOKENS = [12, 12, 48]

# what the cluster holds, seen by a driver of its own (in a process of its own, so the test
# process never joins the cluster), printed as a line each time a line is sent to it
STATE = """
import json, sys, ray
from ray._private.state import actors
from ray.util.placement_group import placement_group_table
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
for _ in sys.stdin:
    named = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    alive = {a["Name"]: a["Pid"] for a in actors().values() if a["State"] == "ALIVE" and a["Name"] in named}
    groups = {g["name"]: g["state"] for g in placement_group_table().values()}
    print(json.dumps({"actors": alive, "groups": groups}), flush=True)
"""
_views: dict[str, subprocess.Popen] = {}


def cluster_state(address: str, timeout: float = 120.0) -> dict:
    """What the cluster at ``address`` holds now: its named actors alive (name -> pid) and its
    placement groups (name -> state), asked of the one driver process kept for the cluster."""
    view = _views.get(address)
    if view is None:
        view = _views[address] = subprocess.Popen(
            [sys.executable, "-c", STATE, address], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=tempfile.TemporaryFile(), text=True, cwd=ROOT)
    view.stdin.write("\n")
    view.stdin.flush()
    ready, _, _ = select.select([view.stdout], [], [], timeout)
    line = view.stdout.readline() if ready else ""
    if not line:
        view.kill()
        view.wait(10)
        del _views[address]
        view.stderr.seek(0)
        raise AssertionError("the cluster's state was not read:\n" + view.stderr.read().decode()[-3000:])
    return json.loads(line)


def close_view(address: str) -> None:
    view = _views.pop(address, None)
    if view is not None:
        view.stdin.close()           # its loop ends; it leaves the cluster
        try:
            view.wait(10)
        except subprocess.TimeoutExpired:
            view.kill()
            view.wait(10)


@pytest.fixture(scope="module")
def cluster():
    """A one-machine Ray cluster of 4 (logical) CPUs; its workers import this checkout."""
    tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")          # Ray's socket paths must stay short
    log_path = os.path.join(tmp, "head.log")
    port = free_ports(1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    env.pop("RAY_ADDRESS", None)
    with open(log_path, "w") as log:
        head = subprocess.Popen(
            [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", f"--port={port}",
             "--num-cpus=4", "--num-gpus=0", "--include-dashboard=false", "--disable-usage-stats",
             f"--temp-dir={tmp}", "--block"],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    address = ""
    try:
        deadline, text = time.monotonic() + 120, ""
        while "Ray runtime started" not in text:
            assert head.poll() is None and time.monotonic() < deadline, "ray start failed:\n" + text
            time.sleep(0.5)
            text = open(log_path).read()
        ip = re.search(r"Local node IP: (\S+)", text).group(1)
        address = f"{ip}:{port}"
        yield address
    finally:
        close_view(address)
        try:                # the head and every process it started (it takes seconds to heed SIGTERM)
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        head.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def one_worker() -> list[str]:
    return one_worker_texts(PROMPTS, TOKENS)


@pytest.fixture(scope="module")
def server(cluster):
    s = Server("--tensor-parallel-size", "2", "--distributed-executor-backend", "ray",
               env={"RAY_ADDRESS": cluster}, ready_timeout=240)
    try:
        yield s
    finally:
        s.stop()


def ours(state: dict, engine_pid: int) -> dict[str, int]:
    """The engine's rank actors alive in the cluster: name -> pid."""
    return {name: pid for name, pid in state["actors"].items() if name.startswith(f"troupe-engine-{engine_pid}-")}


def gone(pids, timeout: float = 15.0) -> bool:
    """Every pid has exited (Ray ends a killed actor's process shortly after the kill)."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(p) for p in pids)


def _both_api_servers_answer(server: Server) -> None:
    """Requests on connections of their own until each of the two API servers has answered one
    more (the kernel spreads the connections over them)."""
    def answered() -> dict[str, float]:
        with urllib.request.urlopen(server.url + "/metrics", timeout=60) as r:
            text = r.read().decode()
        return dict(re.findall(r'^troupe:api_server_requests_total\{.*api_server="(\d)"\} (\S+)$', text, re.M))
    before = answered()
    for _ in range(40):
        body = json.dumps({"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}).encode()
        req = urllib.request.Request(server.url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200
        now = answered()
        if all(float(now[i]) > float(before.get(i, 0)) for i in ("0", "1")):
            return
    raise AssertionError(f"one API server took every connection: {before} -> {now}")


def _texts(server: Server, prompts: list[str], tokens: list[int]) -> list[str]:
    async def one(session, prompt, n):
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        async with session.post(server.url + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=240)) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["choices"][0]["text"]

    async def main():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, p, n) for p, n in zip(prompts, tokens)))
    return asyncio.run(main())


def test_two_ranks_in_ray_actors_answer_as_one_worker_does(cluster, server, one_worker):
    engine = server.engine_pid()
    assert children(engine) == []                  # no worker process of its own: Ray hosts the ranks
    ranks = ours(cluster_state(cluster), engine)
    assert sorted(ranks) == [f"troupe-engine-{engine}-worker{r}-g0" for r in range(2)]
    assert _texts(server, PROMPTS[:2], TOKENS[:2]) == one_worker[:2]
    assert any("Ray placement group of 2 bundles (1 CPU each) for the ranks ready" in line for line in server.lines)


def test_a_killed_rank_actor_brings_both_back_and_the_request_is_recomputed(cluster, server, one_worker):
    engine = server.engine_pid()
    before = ours(cluster_state(cluster), engine)
    result: dict = {}
    thread, streaming = streamed_text_in_thread(server.url, PROMPTS[2], TOKENS[2], result)
    assert streaming.wait(120), "no token streamed"
    os.kill(before[f"troupe-engine-{engine}-worker1-g0"], signal.SIGKILL)     # mid-request
    thread.join(240)
    assert result.get("text") == one_worker[2]
    after = ours(cluster_state(cluster), engine)
    assert sorted(after) == [f"troupe-engine-{engine}-worker{r}-g1" for r in range(2)]
    assert gone(before.values())
    assert any("died" in line and "worker1" in line for line in server.lines)
    assert any("workers restarted" in line for line in server.lines)


def test_nothing_of_an_engine_is_left_in_the_cluster_when_it_is_killed_or_the_server_stops(cluster, server):
    """An engine core killed outright: Ray ends its rank actors and placement group (they are
    owned by it); the engine restarted in its place removes its own when the server stops."""
    killed = server.engine_pid()
    pids = ours(cluster_state(cluster), killed).values()
    assert len(pids) == 2
    os.kill(killed, signal.SIGKILL)
    deadline = time.monotonic() + 240
    while not any(re.search(r"engine core restarted \(pid \d+\)", line) for line in server.lines):
        assert time.monotonic() < deadline and server.proc.poll() is None, server.log()
        time.sleep(0.2)
    engine = server.engine_pid()
    state = cluster_state(cluster)
    assert ours(state, killed) == {} and gone(pids)
    assert state["groups"][f"troupe-engine-{killed}"] == "REMOVED"
    pids = ours(state, engine).values()
    assert len(pids) == 2
    server.stop()
    assert server.proc.returncode == 0
    state = cluster_state(cluster)
    assert ours(state, engine) == {} and gone(pids)
    assert state["groups"][f"troupe-engine-{engine}"] == "REMOVED"


def test_engine_cores_in_ray_actors_serve_two_api_servers_restart_and_leave_nothing(cluster, one_worker):
    s = Server("--data-parallel-size", "2", "--data-parallel-backend", "ray", "--api-server-count", "2",
               env={"RAY_ADDRESS": cluster}, ready_timeout=240)
    try:
        prefix = f"troupe-frontend-{s.pid}-"
        engines = {n: p for n, p in cluster_state(cluster)["actors"].items() if n.startswith(prefix)}
        assert sorted(engines) == [prefix + "engine-g0", prefix + "engine1-g0"]
        assert not any(p in engines.values() for p in children(s.pid))      # not processes of the server's
        workers = {n: children(p) for n, p in engines.items()}
        assert all(len(w) == 1 for w in workers.values())                   # each engine core's own worker
        assert any("Ray placement group of 2 bundles (1 CPU each) for the engine cores ready" in line
                   for line in s.lines)
        assert _texts(s, PROMPTS, TOKENS) == one_worker
        _both_api_servers_answer(s)

        os.kill(engines[prefix + "engine1-g0"], signal.SIGKILL)
        deadline = time.monotonic() + 240
        while not any("engine core 1 restarted" in line for line in s.lines):
            assert time.monotonic() < deadline and s.proc.poll() is None, s.log()
            time.sleep(0.2)
        assert gone([engines[prefix + "engine1-g0"], *workers[prefix + "engine1-g0"]])
        now = {n: p for n, p in cluster_state(cluster)["actors"].items() if n.startswith(prefix)}
        assert sorted(now) == [prefix + "engine-g0", prefix + "engine1-g1"]
        assert _texts(s, PROMPTS, TOKENS) == one_worker
        _both_api_servers_answer(s)

        pids = [*now.values(), *(c for p in now.values() for c in children(p))]
        s.stop()
        assert s.proc.returncode == 0
        state = cluster_state(cluster)
        assert not any(n.startswith(prefix) for n in state["actors"]) and gone(pids)
        assert state["groups"][f"troupe-frontend-{s.pid}"] == "REMOVED"
    finally:
        s.stop()


def test_engine_cores_and_their_workers_all_on_the_cluster_answer_hand_a_decode_server_their_kv_and_leave_nothing(
        cluster, one_worker):
    """Both Ray backends at once, as a prefill server (KV producer): each rank's side channel listens
    on its machine's cluster address, and a decode server (processes of its own) loads the prompt
    from there and gives the same greedy answer."""
    from concurrent.futures import ThreadPoolExecutor

    def kv(role: str) -> str:           # the producer's two engine cores listen on kv_port and kv_port + 1
        return json.dumps({"kv_connector": "TroupeConnector", "kv_role": role, "kv_port": free_ports(2)})
    with ThreadPoolExecutor(2) as pool:
        producer = pool.submit(Server, "-dp", "2", "-dpb", "ray", "--distributed-executor-backend", "ray",
                               "--kv-transfer-config", kv("kv_producer"), env={"RAY_ADDRESS": cluster},
                               ready_timeout=240)
        consumer = pool.submit(Server, "--kv-cache-gib", "0.25", "--threads", "1",    # the producer's ranks have a core each
                               "--kv-transfer-config", kv("kv_consumer"))
        started = [f.result() for f in (producer, consumer) if f.exception() is None]
    s, decode = (producer.result(), consumer.result()) if len(started) == 2 else (None, None)
    try:
        assert len(started) == 2, [str(f.exception()) for f in (producer, consumer)]
        state = cluster_state(cluster)
        engines = {n: p for n, p in state["actors"].items() if n.startswith(f"troupe-frontend-{s.pid}-")}
        assert len(engines) == 2 and all(children(p) == [] for p in engines.values())   # workers are actors too
        workers = {n: p for n, p in state["actors"].items()
                   if any(n.startswith(f"troupe-{e}-{pid}-") for e in ("engine", "engine1") for pid in engines.values())}
        assert len(workers) == 2
        assert _texts(s, PROMPTS[:2], TOKENS[:2]) == one_worker[:2]
        body = {"prompt": PROMPTS[0], "max_tokens": TOKENS[0], "temperature": 0, "ignore_eos": True}
        held = post_json(s.url + "/v1/completions", body | {"max_tokens": 1,
                                                             "kv_transfer_params": {"do_remote_decode": True}})
        params = held["kv_transfer_params"]
        assert params["remote_host"] == cluster.split(":")[0]       # the rank's machine, not 127.0.0.1
        via = post_json(decode.url + "/v1/completions", body | {"kv_transfer_params": params})
        assert via["choices"][0]["text"] == one_worker[0]
        assert via["usage"]["prompt_tokens"] > 1
        loaded = re.search(r"^troupe:kv_transfer_recv_requests_total\{[^}]*\} (\S+)$", _metrics(decode), re.M)
        assert loaded is not None and float(loaded.group(1)) == 1.0       # loaded, not computed
        s.stop()
        assert s.proc.returncode == 0
        state = cluster_state(cluster)
        assert not set(engines) & set(state["actors"]) and not set(workers) & set(state["actors"])
        assert gone([*engines.values(), *workers.values()])
    finally:
        for server in started:
            server.stop()


def post_json(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=240) as r:
        return json.load(r)


def _metrics(server: Server) -> str:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        return r.read().decode()


# a parent node (this script) with one child node in a Ray actor, beating every 0.2 s, hung after 2 s
HANG = """
import asyncio, json, os, sys, tempfile, time
from actors.runtime import Node
from actors.runtime.errors import ActorDied
from actors.runtime.faults import InjectFault
from actors.runtime.process import NodeSpec, system_actor
from actors.runtime.ray_nodes import RayPlacement, start_ray_child
from transport.zmq_channel import ZmqTransport, endpoint

async def main():
    node = Node("parent", ZmqTransport(endpoint(tempfile.mkdtemp(), "parent")))
    system_actor(node)
    placement = RayPlacement(1, "cpu", f"hang-{os.getpid()}")
    await placement.start()
    spec = NodeSpec("child", "tests.unit.runtime_fixtures:echo_entry", b"cfg", "", "parent",
                    {"parent": placement.engine_address(node)}, heartbeat_s=0.2, hung_after_s=2.0)
    child, _ = await start_ray_child(node, spec, placement.new_host(0, "child", 0), ready_timeout=120)
    system = node.ref("_system", "child")
    await system.ask(InjectFault("stall", seconds=4.0, busy=True), timeout=30)     # a long step: no hang
    survived = child.returncode is None
    t0, error = time.monotonic(), ""
    try:
        await system.ask(InjectFault("stall", seconds=60.0, busy=False), timeout=90)
    except ActorDied as exc:
        error = str(exc)
    await asyncio.wait_for(child.exited, 30)
    print(json.dumps({"survived": survived, "killed_after": time.monotonic() - t0, "error": error,
                      "exit": child.describe_exit()}))
    placement.close()
    await node.stop()

asyncio.run(main())
"""


def test_a_hung_child_in_a_ray_actor_is_found_by_its_heartbeats_and_killed(cluster):
    out = subprocess.run([sys.executable, "-c", HANG], capture_output=True, text=True, timeout=240, cwd=ROOT,
                         env={**os.environ, "RAY_ADDRESS": cluster, "TROUPE_FAULT_INJECTION": "1",
                              "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["survived"]                           # four busy seconds are a long step, not a hang
    assert 2.0 <= result["killed_after"] < 8.0, result  # an idle stall is killed once 2 s pass
    assert "process 'child' is hung" in out.stderr and "killing its Ray actor" in out.stderr
    assert "died" in result["exit"] and result["error"]
