"""--kv-events-config on the real server: a subscriber learns the blocks a prompt put in the
prefix cache (vLLM's BlockStored, with the prompt's token ids) and the cache's reset, in vLLM's
wire format; /kv_event_sources says where to subscribe. With --kv-cache-metrics (every block
sampled, a small cache) /metrics shows the blocks' residency once prompts evict others."""
from __future__ import annotations

import json
import time

import msgspec
import pytest
import requests
import zmq

from server import Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup():
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")      # no wildcard: the engine connects here
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}", "topic": "kv"}
    s = Server("--threads", "1", "--kv-events-config", json.dumps(config),
               "--kv-cache-metrics", "--kv-cache-metrics-sample", "1", "--num-gpu-blocks-override", "32")
    # a SUB socket takes in a peer that connected (and sends it its subscription) only when it is
    # used: until then the engine's batches go to nobody, as with any ZeroMQ subscriber
    sub.poll(1000)
    yield s, sub, port
    s.stop()
    sub.close(linger=0)


def _events(sub: zmq.Socket, until, timeout: float = 30.0) -> list[dict]:
    """Events received (decoded as vLLM's KVEventBatch layout) until ``until(events)``."""
    seen: list[dict] = []
    deadline = time.monotonic() + timeout
    while not until(seen):
        assert time.monotonic() < deadline, f"no such events in {timeout} s: {seen}"
        if sub.poll(200):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv" and len(seq) == 8
            ts, events, rank = msgspec.msgpack.decode(payload)
            assert rank == 0 and ts > 0
            seen += events
    return seen


def test_a_prompts_full_blocks_are_published_with_its_token_ids_then_the_reset(setup):
    server, sub, port = setup
    prompt = "The history of the printing press begins in the fifteenth century, when " * 3
    ids = requests.post(server.url + "/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"]
    out = requests.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=120)
    assert out.status_code == 200
    stored = [e for e in _events(sub, lambda ev: any(e["type"] == "BlockStored" for e in ev))
              if e["type"] == "BlockStored"]
    first = stored[0]
    size = first["block_size"]
    assert first["parent_block_hash"] is None and first["medium"] == "GPU"
    assert first["token_ids"] == ids[:size * len(first["block_hashes"])]
    assert all(isinstance(h, int) and 0 <= h < 2 ** 64 for h in first["block_hashes"])
    assert requests.post(server.url + "/reset_prefix_cache", timeout=30).status_code == 200
    requests.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 1}, timeout=120)
    _events(sub, lambda ev: any(e["type"] == "AllBlocksCleared" for e in ev))


def test_kv_event_sources_names_the_endpoint_and_topic(setup):
    server, _, port = setup
    body = requests.get(server.url + "/kv_event_sources", timeout=30).json()
    assert body["0"]["endpoint"] == f"tcp://127.0.0.1:{port}" and body["0"]["topic"] == "kv"
    assert body["0"]["enable_kv_cache_events"] and body["0"]["publisher"] == "zmq"


def test_an_endpoint_already_taken_fails_the_start_saying_so():
    ctx = zmq.Context.instance()
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}
    try:
        with pytest.raises(RuntimeError) as err:
            Server("--threads", "1", "--kv-events-config", json.dumps(config))
    finally:
        taken.close(linger=0)
    assert "failed to start: ValueError: --kv-events-config" in str(err.value)
    assert "Address already in use" in str(err.value)


def test_kv_cache_metrics_show_the_residency_of_evicted_blocks(setup):
    server = setup[0]
    story = "A lighthouse keeper counts the ships that pass his island, night after night. " * 12
    for prompt in [story] * 3 + [f"{i}: " + story.replace("ships", f"boats {i}") for i in range(3)]:
        out = requests.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=120)
        assert out.status_code == 200
    metrics = requests.get(server.url + "/metrics", timeout=30).text

    def value(name: str) -> float:
        (line,) = [x for x in metrics.splitlines() if x.startswith(name + "{")]
        return float(line.rsplit(" ", 1)[1])
    assert value("vllm:kv_block_lifetime_seconds_count") > 0
    assert value("vllm:kv_block_idle_before_evict_seconds_count") == value("vllm:kv_block_lifetime_seconds_count")
    assert value("vllm:kv_block_reuse_gap_seconds_count") > 0       # the story's blocks were reused twice
