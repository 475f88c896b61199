"""vLLM's KV events (--kv-events-config) from the real Scheduler and KV manager: blocks entering
the prefix cache, leaving it, and the cache cleared; and their wire format."""
from __future__ import annotations

import msgspec
import pytest
import zmq

from actors.kv_manager.block_hash import hash_block_tokens
from actors.kv_manager.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVEventsConfig,
                                         ZmqEventPublisher, external_hash, kv_events_config, offset_endpoint)
from sched_utils import Harness


def _recording(num_blocks: int = 64) -> Harness:
    h = Harness(num_blocks)
    h.s.record_kv_events()
    return h


def test_full_prompt_blocks_are_stored_with_their_tokens_and_chained_hashes():
    h = _recording()
    prompt = list(range(100, 110))                      # two full blocks of 4 and two tokens
    h.add("a", prompt)
    h.step()
    (ev,) = h.s.take_kv_events()
    first = hash_block_tokens(None, prompt[:4])
    second = hash_block_tokens(first, prompt[4:8])
    assert ev == BlockStored([external_hash(first), external_hash(second)], None, prompt[:8], 4, None, "GPU",
                             None, group_idx=0)
    assert h.s.take_kv_events() == []                   # taken once


def test_a_block_filled_while_decoding_is_stored_after_the_one_before_it():
    h = _recording()
    h.add("a", list(range(100, 107)))                   # one full block, three tokens
    h.step()
    (first,) = h.s.take_kv_events()
    h.step()                                            # the output token fills the second block
    h.step()
    (ev,) = h.s.take_kv_events()
    assert ev.parent_block_hash == first.block_hashes[0] and ev.token_ids == [104, 105, 106, 7]


def test_evicted_blocks_are_removed_and_a_reset_clears_all():
    h = _recording(num_blocks=6)                        # five usable blocks
    h.add("a", list(range(100, 116)), max_tokens=1)     # four full blocks, cached then freed
    while h.s.has_work():
        h.step()
    stored = [e for e in h.s.take_kv_events() if isinstance(e, BlockStored)]
    hashes = [x for e in stored for x in e.block_hashes]
    h.add("b", list(range(200, 216)), max_tokens=1)     # needs four blocks: a's are evicted
    h.step()
    removed = [x for e in h.s.take_kv_events() if isinstance(e, BlockRemoved) for x in e.block_hashes]
    assert set(removed) <= set(hashes) and len(removed) >= 3
    h.s.kv.reset_prefix_cache()
    assert h.s.take_kv_events()[-1] == AllBlocksCleared()


def test_nothing_is_noted_unless_kv_events_are_on():
    h = Harness()
    h.add("a", 12)
    h.step()
    assert h.s.kv.pool.events is None and h.s.take_kv_events() == []


def test_the_config_takes_vllms_keys_and_refuses_others():
    c = kv_events_config('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert c.active and c.publisher == "zmq" and c.endpoint == "tcp://*:5557"
    assert not kv_events_config({"enable_kv_cache_events": False}).active
    with pytest.raises(ValueError, match="unsupported kv_events_config field"):
        kv_events_config({"enable_kv_cache_event": True})
    with pytest.raises(ValueError, match="publisher must be one of"):
        kv_events_config({"enable_kv_cache_events": True, "publisher": "kafka"})
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559" and offset_endpoint("tcp://*:0", 2) == "tcp://*:0"


def test_batches_go_out_as_topic_sequence_and_vllms_msgpack_and_replay_from_a_sequence():
    ctx = zmq.Context.instance()
    # an endpoint without a wildcard is connected to (vLLM's rule): the subscriber binds it
    sub = ctx.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    with socket_port() as replay_port:
        pub = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}",
                                               replay_endpoint=f"tcp://127.0.0.1:{replay_port}", topic="kv"), 0)
    try:
        batches = [KVEventBatch(1.5, [BlockStored([7], None, [1, 2, 3, 4], 4, None, "GPU", None, group_idx=0)]),
                   KVEventBatch(2.5, [BlockRemoved([7], "GPU", group_idx=0), AllBlocksCleared()])]
        got = []
        for attempt in range(50):                         # PUB drops what it sends before SUB has joined
            pub.publish(batches[0])
            if sub.poll(100):
                got.append(sub.recv_multipart())
                break
        pub.publish(batches[1])
        assert sub.poll(5000)
        got.append(sub.recv_multipart())
        topic, seq, payload = got[-1]
        assert topic == b"kv" and int.from_bytes(seq, "big") == int.from_bytes(got[0][1], "big") + 1
        raw = msgspec.msgpack.decode(payload)             # vLLM's layout: [ts, events, dp rank]
        assert raw == [2.5, [{"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0},
                             {"type": "AllBlocksCleared"}], 0]
        assert msgspec.msgpack.decode(got[0][2], type=KVEventBatch).events == batches[0].events
        req = ctx.socket(zmq.DEALER)
        req.connect(pub.replay_endpoint)
        req.send_multipart((b"", got[-1][1]))             # replay from the last sequence
        assert req.poll(5000)
        assert req.recv_multipart()[1:] == [b"kv", got[-1][1], payload]
        assert req.poll(5000)
        assert int.from_bytes(req.recv_multipart()[2], "big", signed=True) == -1
        req.close(linger=0)
    finally:
        pub.shutdown()
        sub.close(linger=0)


class socket_port:
    """A free TCP port on 127.0.0.1 (closed before use)."""

    def __enter__(self) -> int:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc) -> None:
        pass
