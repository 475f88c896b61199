"""KV cache events (vLLM's ``--kv-events-config``): the prefix cache's changes published over
ZeroMQ, so a KV-aware router (llm-d, Dynamo, vLLM's router) knows which prompt prefixes each
engine holds and sends requests where their prefix is cached.

    --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                         "endpoint": "tcp://*:5557", "topic": "kv"}'

Every event vLLM 0.32 publishes for its prefix cache, in its wire format (decoded by vLLM's own
``KVEventBatch`` decoder): ``BlockStored`` when full blocks enter the prefix cache (their chained
hashes, the hash of the block before them, their token ids, the block size, the LoRA adapter,
the extra hash keys per block), ``BlockRemoved`` when a cached block is evicted or dropped, and
``AllBlocksCleared`` when the cache is reset. Each batch goes out as the multipart message
``[topic, sequence (8 bytes, big-endian), msgpack(KVEventBatch)]``; with ``replay_endpoint`` a
ROUTER socket answers a subscriber that sends a sequence number with every batch kept since it
(``buffer_steps`` of them), then an end marker (sequence -1). Block hashes go out as vLLM's: the
low 64 bits of the SHA-256 block hash as an integer (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``:
the 32 bytes). With data parallelism each engine core publishes on the endpoint's port plus its
rank, and its batches carry that rank.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from collections import deque
from itertools import count
from typing import Any, Mapping

import msgspec
import zmq

from actors.engine.json_flags import struct_of

log = logging.getLogger("troupe.kv_events")

PUBLISHERS = ("null", "zmq")
MEDIUM_GPU = "GPU"             # vLLM's name for the engine's own KV cache (its CPU build reports it too)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """vLLM's KVEventsConfig, key for key."""
    enable_kv_cache_events: bool = False
    publisher: str | None = None          # "zmq" when enabled, else "null"
    endpoint: str = "tcp://*:5557"        # bound when it has a wildcard (or is ipc/inproc), else connected
    replay_endpoint: str | None = None    # a ROUTER socket subscribers ask to replay missed batches
    buffer_steps: int = 10_000            # batches kept for replay
    hwm: int = 100_000                    # the PUB socket's high-water mark
    max_queue_size: int = 100_000         # batches waiting for the publisher thread
    topic: str = ""

    def __post_init__(self) -> None:
        publisher = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        if publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher must be one of {', '.join(PUBLISHERS)}, got {publisher!r}")
        msgspec.structs.force_setattr(self, "publisher", publisher)
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv_events_config.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"kv_events_config.{name} must be a tcp://, ipc:// or inproc:// address, "
                                 f"got {value!r}")

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def kv_events_config(value: Mapping[str, Any] | str | KVEventsConfig | None) -> KVEventsConfig | None:
    """--kv-events-config's JSON text, or the offline API's dict, parsed and validated."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    return struct_of(KVEventsConfig, value, "--kv-events-config", "kv_events_config")


# -- the wire format (vLLM's structs: same names, fields and encoding options) ---------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_hash(block_hash: bytes) -> bytes | int:
    """vLLM's ExternalBlockHash: the hash's low 64 bits as an integer, or its bytes when
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES is 0."""
    if os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") in ("0", "false", "False"):
        return bytes(block_hash)
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """vLLM's: data-parallel rank r publishes on the endpoint's tcp port + r (inproc: a suffix)."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://") or endpoint.startswith("ipc://"):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"


class ZmqEventPublisher:
    """Publishes KVEventBatches from a thread of its own (PUB socket, optional ROUTER for
    replay); ``publish`` only queues. A full queue drops the batch (logged), as a full PUB
    socket does past its high-water mark: the engine never waits for a subscriber."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.rank = data_parallel_rank
        self.topic = config.topic.encode()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        # a context of its own: the process's shared one may be the event loop's (zmq.asyncio),
        # whose sockets cannot be used from this thread
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, self.rank)
        try:
            self.endpoint = self._open(self._pub, offset_endpoint(config.endpoint, self.rank))
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            self._ctx.term()
            raise ValueError(f"--kv-events-config: the KV events publisher cannot open its sockets: {exc}") from None
        self.dropped = 0
        self._seq = count()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _open(sock: zmq.Socket, endpoint: str) -> str:
        if "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            sock.bind(endpoint)
            return sock.getsockopt_string(zmq.LAST_ENDPOINT)
        sock.connect(endpoint)
        return endpoint

    def publish(self, batch: KVEventBatch) -> None:
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("KV events: %d batches dropped (the publisher's queue is full)", self.dropped)

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq = next(self._seq)
            payload = encode(batch)
            try:
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError as exc:
                log.warning("KV events: batch %d not sent: %s", seq, exc)
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def shutdown(self, timeout: float = 1.0) -> None:
        """Send what is queued (for at most ``timeout`` seconds), then close the sockets."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
