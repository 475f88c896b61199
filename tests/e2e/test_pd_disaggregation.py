"""Prefill/decode disaggregation on this machine: a prefill server (kv_producer), a decode server
(kv_consumer) and the proxy (tools/pd_proxy.py), each a process of its own, on the default model.
Greedy answers through the proxy are the prefill server's own answers; the decode server loads
every prompt token's KV but the last instead of computing it (also for a prompt given as
embeddings); a decode server killed while it reads leaves the producer's cache idle once its lease
expires; with the prefill server killed, the decode server computes the prompt itself. With tensor
and data parallelism (a producer of two engine cores of two ranks, a consumer of two ranks) each
rank moves its own heads' share, and with two pipeline stages on each side each stage its own
layers, and the answers are the same. ExampleConnector with two tensor-parallel ranks: each stores
its share, a new server loads them."""
from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from server import Server, alive, free_ports

pytestmark = pytest.mark.slow

LEASE_S = 3.0
PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Spain is"
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


def kv_config(role: str, port: int, connector: str = "TroupeConnector") -> str:
    return json.dumps({"kv_connector": connector, "kv_role": role, "kv_port": port,
                       "kv_connector_extra_config": {"kv_lease_duration": LEASE_S, "transfer_timeout_s": 3.0}})


def own_cores() -> list[dict[str, str] | None]:
    """Environments giving two servers started side by side a core each, as a one-machine
    deployment would (VLLM_CPU_OMP_THREADS_BIND): two servers that each take every core for their
    threads run their parallel regions against each other's (a start takes ~3x as long)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return [None, None]
    half = len(cores) // 2
    return [{"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, part))} for part in (cores[:half], cores[half:])]


def start_trio(connector: str = "TroupeConnector"):
    """A prefill server, a decode server (both with ``connector``) and the proxy in front of them."""
    common = ("--kv-cache-gib", "0.25", "--max-num-seqs", "8", "--enable-prompt-embeds")
    port = free_ports(2)                 # the producer's side channel, then the consumer's
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(Server, *common, "--kv-transfer-config", kv_config(role, port + i, connector),
                               env=env)
                   for i, (role, env) in enumerate(zip(("kv_producer", "kv_consumer"), own_cores()))]
        servers = []
        try:
            servers = [f.result() for f in futures]
        finally:
            if len(servers) < 2:
                for f in futures:
                    if f.exception() is None:
                        f.result().stop()
    prefill, decode = servers
    proxy = None
    try:
        proxy = Server(command=["tools.pd_proxy", "--prefill", prefill.url, "--decode", decode.url,
                                "--port", "0"], ready_timeout=60)
        yield prefill, decode, proxy
    finally:
        for s in (proxy, decode, prefill):
            if s is not None:
                s.stop()


@pytest.fixture(scope="module")
def trio():
    yield from start_trio()


@pytest.fixture(scope="module")
def alone(trio) -> str:
    """The prefill server's own greedy answer to PROMPT, answering by itself."""
    return completion(trio[0].url)["choices"][0]["text"]


def post(url: str, path: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def metric(server: Server, name: str) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    assert m is not None, f"no {name} in /metrics"
    return float(m.group(1))


def completion(url: str, **extra) -> dict:
    return post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0} | extra)


def hops(server: Server, response_id: str) -> set[str]:
    with urllib.request.urlopen(f"{server.url}/debug/requests/{response_id}", timeout=30) as r:
        return {h["name"] for h in json.load(r)["hops"]}


def test_greedy_answers_through_the_proxy_are_a_single_servers_and_decode_loads_the_prompt(trio, alone):
    prefill, decode, proxy = trio
    hits0 = metric(decode, "vllm:external_prefix_cache_hits_total")
    sent0 = metric(prefill, "troupe:kv_transfer_sent_requests_total")
    cma0 = metric(decode, "troupe:kv_transfer_cma_reads_total")
    via = completion(proxy.url)
    assert via["choices"][0]["text"] == alone
    prompt_tokens = via["usage"]["prompt_tokens"]
    # every prompt token but the last was loaded from the prefill server, not computed
    assert metric(decode, "vllm:external_prefix_cache_hits_total") - hits0 == prompt_tokens - 1
    assert metric(prefill, "troupe:kv_transfer_sent_requests_total") - sent0 == 1
    assert metric(decode, "troupe:kv_transfer_recv_bytes_total") > 0
    # two processes of one machine: copied straight from the prefill server's cache
    assert metric(decode, "troupe:kv_transfer_cma_reads_total") - cma0 == 1
    assert "kv.load" in hops(decode, via["id"])            # the transfer is a hop of the request's waterfall


def test_a_prompt_given_as_embeddings_goes_through_the_proxy_and_its_kv_is_loaded(trio, alone):
    """vLLM's prompt_embeds (the token embeddings of PROMPT): the decode server loads every
    position but the last from the prefill server and computes the last from its row."""
    import base64
    import io

    import torch

    from models.registry import load_model
    from models.resolve import resolve_model
    prefill, decode, proxy = trio
    ids = post(prefill.url, "/tokenize", {"prompt": PROMPT})["tokens"]
    model, _ = load_model(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct"))
    with torch.inference_mode():
        rows = model.embed_input_ids(torch.tensor(ids)).clone()
    buf = io.BytesIO()
    torch.save(rows, buf)
    hits0 = metric(decode, "vllm:external_prefix_cache_hits_total")
    via = post(proxy.url, "/v1/completions", {"prompt_embeds": base64.b64encode(buf.getvalue()).decode(),
                                              "max_tokens": 8, "temperature": 0})
    assert via["choices"][0]["text"] == alone
    assert metric(decode, "vllm:external_prefix_cache_hits_total") - hits0 == len(ids) - 1


def test_with_nixl_connectors_the_decode_server_reads_the_prompt_through_nixl(alone):
    """vLLM's NixlConnector on both servers: the same greedy answer through the proxy, the
    prompt's blocks read out of the prefill server's cache by NIXL (UCX between the processes)."""
    gen = start_trio("NixlConnector")
    prefill, decode, proxy = next(gen)
    try:
        via = completion(proxy.url)
        assert via["choices"][0]["text"] == alone
        assert metric(decode, "troupe:kv_transfer_nixl_reads_total") == 1
        assert metric(decode, "troupe:kv_transfer_cma_reads_total") == 0
        assert metric(decode, "vllm:external_prefix_cache_hits_total") == via["usage"]["prompt_tokens"] - 1
        assert metric(prefill, "troupe:kv_transfer_sent_requests_total") == 1
    finally:
        gen.close()
    # stopped at once, nothing of the transfer left running in either
    for server in (prefill, decode):
        assert " ERROR " not in server.log() and "still running" not in server.log(), server.errors()


def test_chat_streams_through_the_proxy(trio):
    prefill, _, proxy = trio
    own = post(prefill.url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "temperature": 0})
    body = json.dumps({"messages": CHAT, "max_tokens": 8, "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(proxy.url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    text, events = "", 0
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events += 1
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
    assert events > 2 and text == own["choices"][0]["message"]["content"]


def test_a_decode_server_killed_mid_transfer_leaves_the_producer_idle_once_the_lease_expires(trio):
    prefill = trio[0]
    doomed = Server("--kv-cache-gib", "0.25", "--max-num-seqs", "8",
                    "--kv-transfer-config", kv_config("kv_consumer", free_ports(1)))
    pool = ThreadPoolExecutor(1)
    try:
        expired0 = metric(prefill, "troupe:kv_transfer_leases_expired_total")
        sent0 = metric(prefill, "troupe:kv_transfer_sent_requests_total")
        params = completion(prefill.url, max_tokens=1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
        assert metric(prefill, "vllm:kv_cache_usage_perc") > 0          # held for the reader
        # the decode server takes the request and renews the lease; its worker is frozen before
        # the read completes, so the transfer is in flight when the whole server is killed
        os.kill(doomed.worker_pid(), signal.SIGSTOP)
        pending = pool.submit(completion, doomed.url, kv_transfer_params=params)
        time.sleep(LEASE_S * 1.5)
        assert not pending.done()
        assert metric(prefill, "vllm:kv_cache_usage_perc") > 0          # renewed past the lease by the reader
        for pid in doomed.all_pids():
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(OSError):                                    # the client sees the server go
            pending.result(timeout=30)
        deadline = time.monotonic() + LEASE_S * 5 + 10
        while metric(prefill, "vllm:kv_cache_usage_perc") > 0:
            assert time.monotonic() < deadline, "the producer's blocks were never freed"
            time.sleep(0.2)
        assert metric(prefill, "troupe:kv_transfer_leases_expired_total") - expired0 == 1
        assert metric(prefill, "troupe:kv_transfer_sent_requests_total") == sent0   # nothing was read
    finally:
        pool.shutdown(wait=False)
        doomed.stop()


def test_with_the_prefill_server_killed_the_decode_server_computes_the_prompt(trio, alone):
    prefill, decode, proxy = trio
    params = completion(prefill.url, max_tokens=1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    for pid in prefill.all_pids():
        prefill_signal(pid)
    failures0 = metric(decode, "troupe:kv_transfer_recv_failures_total")
    got = completion(decode.url, kv_transfer_params=params)         # its blocks are gone with it
    assert got["choices"][0]["text"] == alone
    assert metric(decode, "troupe:kv_transfer_recv_failures_total") - failures0 == 1
    via = completion(proxy.url)                                     # no prefill server: decode does it all
    assert via["choices"][0]["text"] == alone


def prefill_signal(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_with_tensor_and_data_parallel_instances_answers_through_the_proxy_are_the_producers():
    common = ("--kv-cache-gib", "0.25", "--max-num-seqs", "8")
    kv_port = free_ports(6)              # two engine cores of two ranks: kv_port .. kv_port + 3; then the consumer's
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(Server, *common, "-tp", "2", "-dp", "2",
                               "--kv-transfer-config", kv_config("kv_producer", kv_port)),
                   pool.submit(Server, *common, "-tp", "2", "--kv-transfer-config", kv_config("kv_consumer", kv_port + 4))]
        started = [f.result() for f in futures if f.exception() is None]
    servers = list(started)
    try:
        assert len(started) == 2, [str(f.exception()) for f in futures]
        prefill, decode = started
        servers.append(Server(command=["tools.pd_proxy", "--prefill", prefill.url, "--decode", decode.url,
                                       "--port", "0"], ready_timeout=60))
        proxy = servers[-1]
        hits0 = metric(decode, "vllm:external_prefix_cache_hits_total")
        prompts = [PROMPT, "def fibonacci(n):", "Name three colours of the rainbow:"]
        loaded = 0
        for prompt in prompts:          # the producer's router spreads them over its two engine cores
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
            alone = post(prefill.url, "/v1/completions", body)["choices"][0]["text"]
            via = post(proxy.url, "/v1/completions", body)
            assert via["choices"][0]["text"] == alone
            loaded += via["usage"]["prompt_tokens"] - 1
        assert metric(decode, "vllm:external_prefix_cache_hits_total") - hits0 == loaded
        assert metric(prefill, "troupe:kv_transfer_sent_requests_total") == len(prompts)
        assert metric(decode, "troupe:kv_transfer_recv_requests_total") == len(prompts)
        # two prompts at once go to the two engine cores, whose ranks listen from kv_port + dp_rank * tp
        with ThreadPoolExecutor(2) as pool:
            held = list(pool.map(lambda prompt: completion(prefill.url, prompt=prompt, max_tokens=1,
                                                           kv_transfer_params={"do_remote_decode": True}),
                                 ["The first prompt of two", "The second prompt of two"]))
        assert sorted(h["kv_transfer_params"]["remote_port"] for h in held) == [kv_port, kv_port + 2]
    finally:
        for s in reversed(servers):
            s.stop()


def test_with_pipeline_parallel_instances_each_stage_moves_its_own_layers():
    common = ("--kv-cache-gib", "0.25", "--max-num-seqs", "8", "-pp", "2")
    port = free_ports(4)                 # a side channel per stage: the producer's two, then the consumer's
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(Server, *common, "--kv-transfer-config", kv_config(role, port + 2 * i))
                   for i, role in enumerate(("kv_producer", "kv_consumer"))]
        started = [f.result() for f in futures if f.exception() is None]
    servers = list(started)
    try:
        assert len(started) == 2, [str(f.exception()) for f in futures]
        prefill, decode = started
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        alone = post(prefill.url, "/v1/completions", body)["choices"][0]["text"]
        held = post(prefill.url, "/v1/completions", body | {"max_tokens": 1,
                                                             "kv_transfer_params": {"do_remote_decode": True}})
        params = held["kv_transfer_params"]
        assert params["pp_size"] == 2
        via = post(decode.url, "/v1/completions", body | {"kv_transfer_params": params})
        assert via["choices"][0]["text"] == alone
        # both stages' layers came from the producer: every prompt token but the last was loaded
        assert metric(decode, "vllm:external_prefix_cache_hits_total") == via["usage"]["prompt_tokens"] - 1
        assert metric(decode, "troupe:kv_transfer_recv_requests_total") == 1
        assert metric(decode, "troupe:kv_transfer_recv_failures_total") == 0
    finally:
        for s in reversed(servers):
            s.stop()


def test_with_tensor_parallel_servers_each_rank_stores_its_share_and_a_new_server_loads_it(tmp_path):
    """ExampleConnector with -tp 2: each rank saves its heads' share of the prompt as entries of its
    own; a new -tp 2 server on the same directory loads every rank's share instead of computing it."""
    kv = json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                     "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
    common = ("--kv-cache-gib", "0.25", "--max-num-seqs", "8", "-tp", "2", "--kv-transfer-config", kv)
    body = {"prompt": " ".join([PROMPT] * 3), "max_tokens": 8, "temperature": 0}
    first = Server(*common)
    try:
        computed = post(first.url, "/v1/completions", body)
        full_blocks = computed["usage"]["prompt_tokens"] // 16
        (layout,) = os.listdir(tmp_path / "troupe-kv")
        entries = tmp_path / "troupe-kv" / layout / "entries"
        deadline = time.monotonic() + 30        # published (renamed from a hidden name) once written
        while len(published := [p.parent.name for p in entries.glob("[!.]*/meta.json")]) < 2:
            assert time.monotonic() < deadline, list(entries.iterdir())
            time.sleep(0.05)
        assert sorted(name.rsplit(".", 1)[1] for name in published) == ["r0", "r1"]
    finally:
        first.stop()
    second = Server(*common)
    try:
        loaded = post(second.url, "/v1/completions", body)
        assert loaded["choices"][0]["text"] == computed["choices"][0]["text"]
        # each rank loaded its share of the full blocks before the prompt's last token
        prompt_tokens = loaded["usage"]["prompt_tokens"]
        assert metric(second, "vllm:external_prefix_cache_hits_total") == (prompt_tokens - 1) // 16 * 16
        assert metric(second, "troupe:kv_transfer_recv_requests_total") == 1
        assert full_blocks >= (prompt_tokens - 1) // 16 >= 2
    finally:
        second.stop()
