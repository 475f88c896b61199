"""TroupeConnector: KV blocks moved between instances over ZeroMQ (one machine or several), with
a shared-memory path between processes of one machine.

A producer's worker listens on ``kv_ip:kv_port`` (a ROUTER socket served by a thread beside the
KV cache; with tensor and pipeline parallelism rank r = stage x tp + tensor-parallel rank on
``kv_port + r``, and with data parallelism engine d's ranks from ``kv_port + d * tp * pp``, as
vLLM's side channels; each rank moves its own heads' share of its stage's layers and reads from
the producer's rank of the same number, so both sides run the same ``-tp`` and ``-pp``). Its
requests marked ``{"do_remote_decode": true}`` keep their blocks when they finish; the
response's ``kv_transfer_params`` name the engine, the host and port, the request and its block
ids. A consumer's request carrying those params (``do_remote_prefill``) gets local blocks
for the prompt, waits in WAITING_FOR_REMOTE_KVS while its worker reads the producer's blocks,
then computes only its last prompt token and decodes.

The side channel's exchanges (msgpack header, then raw frames):
  handshake  both sides' model, block size, dtype, cache layout and a hash of them; a mismatch
             is refused with a message naming the field (``block_size 16 vs 32``)
  read       the blocks of a held request: per run of consecutive block ids, per layer, K then V,
             each frame the cache tensor's own memory (zero-copy on the CPU); or, between
             processes of one machine (``"shm": true`` in kv_connector_extra_config, the
             default), the addresses of those runs in the producer's cache, which the consumer
             copies straight into its own (cross-memory attach, ``"cma": true``, the default:
             one copy), or where the system forbids that, the blocks copied once into a
             shared-memory segment the consumer maps; or, where both sides run NIXL
             (``"nixl": true``, what the name ``NixlConnector`` sets), the addresses of those runs
             in the producer's registered cache, which the consumer reads with NIXL's one-sided
             READs (UCX: any two machines, GPU memory included)
  heartbeat  the consumer renews the leases of the requests it will read (every
             ``kv_lease_duration`` / 4; each renewal extends the lease to 2/3 of it from now, never shortens it)
  release    the consumer read them: the producer frees the blocks

A lease (``kv_lease_duration``, vLLM's key, 30 s by default) not renewed in time expires: the producer frees the blocks, so a consumer that
died never leaks the producer's cache; a read after that is refused. A load that fails (the
producer gone, refused, expired, a timeout) is reported as finished with its reason, and the
consumer computes the prompt itself (``kv_load_failure_policy`` "recompute", the default) or
fails the request ("fail"): nothing waits forever.

kv_connector_extra_config keys: EXTRA_KEYS.
"""
from __future__ import annotations

import array
import atexit
import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import msgspec
import zmq

from actors.kv_transfer import cma as cross_memory
from actors.kv_transfer import nixl
from actors.kv_transfer.base import KVConnectorBase, KVConnectorOutput, KVConnectorRole, extra_config, runs
from actors.kv_manager.block_pool import NULL_BLOCK
from actors.runtime.ray_nodes import NODE_IP_ENV

if TYPE_CHECKING:
    from actors.engine.config import EngineConfig
    from actors.scheduler.request import Request

log = logging.getLogger("troupe.kv_transfer")

EXTRA_KEYS = {
    "kv_lease_duration": 30.0,     # vLLM's: a producer's held blocks are freed this long after saving, unless renewed
    "heartbeat_s": 0.0,            # a consumer renews its leases this often (0: kv_lease_duration / 4)
    "transfer_timeout_s": 10.0,    # a handshake or read unanswered this long fails (the prompt is recomputed)
    "shm": True,                   # between processes of one machine, read through shared memory
    "cma": True,                   # and there, first straight from the producer's cache (process_vm_readv)
    "nixl": False,                 # read through NIXL (UCX) where both sides run it, before the paths above
}

_encode = msgspec.msgpack.encode
_decode = msgspec.msgpack.decode


class HandshakeError(RuntimeError):
    pass


class _Load(msgspec.Struct, array_like=True):
    """A consumer's load: the producer's blocks into its own blocks, per KV cache group, in
    pairs (neither a null block); rank r reads from ``hosts[r]:port + r``."""
    hosts: list[str]
    port: int
    remote_request_id: str
    remote_block_ids: list[list[int]]
    local_block_ids: list[list[int]]


class _Meta(msgspec.Struct, omit_defaults=True):
    loads: dict[str, _Load] = {}
    saves: dict[str, list[list[int]]] = {}    # producer: readable once this step's forward is done (per group)
    drops: list[str] = []                     # producer: saved, then not held (aborted): unreadable


LOOPBACK = ("127.0.0.1", "localhost")


def listen_ip(kv_ip: str) -> str:
    """Where a side channel listens: ``kv_ip``, unless that is the loopback default and the
    process runs on a Ray cluster's machine (``TROUPE_NODE_IP``): there, the machine's cluster
    address, so the cluster's other machines reach it too."""
    node_ip = os.environ.get(NODE_IP_ENV)
    return node_ip if node_ip and kv_ip in LOOPBACK else kv_ip


def machine_id() -> str:
    """Processes that print the same id share /dev/shm (same machine, same boot)."""
    parts = [socket.gethostname()]
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
        except OSError:
            pass
    return hashlib.sha256("/".join(parts).encode()).hexdigest()[:16]


def layout_info(config: EngineConfig, kv_caches: list[Any], first_layer: int = 0) -> dict[str, Any]:
    """What both sides of a transfer must agree on, with a hash of it: ``kv_caches`` are the
    layers from ``first_layer`` on (a pipeline stage's)."""
    t = kv_caches[0]
    info = {
        "model": config.model.source.served_name,
        "num_layers": len(kv_caches),
        "block_size": config.cache.block_size,
        "num_kv_heads": int(t.shape[3]),
        "head_size": int(t.shape[4]),
        "kv_cache_dtype": config.cache.cache_dtype,
        "layout": "per layer (2, num_blocks, block_size, num_kv_heads, head_size)",
        "tensor_parallel_size": config.parallel.tensor_parallel_size,
        "pipeline_parallel_size": config.parallel.pipeline_parallel_size,
        "first_layer": first_layer,
        "kv_cache_groups": group_layers(config, len(kv_caches), first_layer),
    }
    info["compat_hash"] = hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:16]
    return info


def check_compatible(mine: dict[str, Any], theirs: dict[str, Any], me: str = "consumer",
                     them: str = "producer") -> None:
    """HandshakeError naming the first field the two sides disagree on, each side's value."""
    for key in ("model", "block_size", "kv_cache_dtype", "tensor_parallel_size", "pipeline_parallel_size",
                "first_layer", "num_layers", "kv_cache_groups", "num_kv_heads", "head_size", "layout", "compat_hash"):
        if mine.get(key) != theirs.get(key):
            raise HandshakeError(f"KV transfer refused: {key} {mine.get(key)} ({me}) vs {theirs.get(key)} ({them})")


def group_layers(config: EngineConfig, num_layers: int, first_layer: int = 0) -> list[list[int]]:
    """Per KV cache group, the indices (into a rank's ``num_layers`` caches, its stage's layers
    from ``first_layer`` on) of the layers whose blocks that group's block ids name. One group of
    every layer without a resolved model or with a single group."""
    groups = config.kv_cache_groups() if config.model.arch is not None else ()
    if len(groups) <= 1:
        return [list(range(num_layers))]
    return [[i - first_layer for i in g.layer_ids if first_layer <= i < first_layer + num_layers] for g in groups]


def per_group(block_ids: Any) -> list[list[int]]:
    """``remote_block_ids`` as lists per KV cache group: vLLM's flat list (one group) or a list
    per group (its hybrid-allocator form). ValueError for anything else."""
    if not isinstance(block_ids, list) or not block_ids:
        raise ValueError("remote_block_ids must be a non-empty list")
    if all(isinstance(b, int) for b in block_ids):
        return [list(block_ids)]
    if all(isinstance(g, list) and all(isinstance(b, int) for b in g) for g in block_ids):
        return [list(g) for g in block_ids]
    raise ValueError("remote_block_ids must be a list of block ids, or one such list per KV cache group")


def prompt_hash(request: Request) -> str:
    """A digest of the prompt's token ids (and of its embeddings when it came as those: its ids
    are then placeholders; and of its images' identifiers, whose placeholders are alike): a
    consumer loads KV computed for the same prompt only."""
    h = hashlib.blake2b(array.array("q", request.prompt_token_ids).tobytes(), digest_size=8)
    if request.prompt_embeds is not None:
        h.update(request.prompt_embeds.tobytes())
    for feature in request.mm_features or ():
        h.update(f"{feature.identifier}@{feature.offset}".encode())
    return h.hexdigest()


@dataclass(slots=True)
class _Held:
    block_ids: list[list[int]]            # per KV cache group
    deadline: float
    shm_paths: list[str] = field(default_factory=list)    # segments written for its readers

    def unlink(self) -> None:
        for path in self.shm_paths:
            try:
                os.unlink(path)
            except OSError:
                pass


@dataclass(slots=True)
class _Stats:
    values: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **kw: float) -> None:
        with self.lock:
            for k, v in kw.items():
                self.values[k] = self.values.get(k, 0.0) + v

    def take(self) -> dict[str, float]:
        with self.lock:
            out, self.values = self.values, {}
        return out


class TroupeConnector(KVConnectorBase):
    EXTRA_DEFAULTS = EXTRA_KEYS          # kv_connector_extra_config's keys and their defaults

    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        kv = self.kv_config
        self.extra = extra_config(kv, self.EXTRA_DEFAULTS)
        self.lease_s = float(self.extra["kv_lease_duration"])
        self.lease_extension = self.lease_s * 2 / 3       # what a heartbeat extends a lease to (vLLM's 2/3)
        self.heartbeat_s = float(self.extra["heartbeat_s"]) or self.lease_s / 4
        self.timeout_s = float(self.extra["transfer_timeout_s"])
        self.listen_ip = listen_ip(kv.kv_ip)
        self.host = self.listen_ip if self.listen_ip not in ("0.0.0.0", "::", "*") else socket.gethostname()
        self.rank_hosts: list[str] = []       # where each rank listens, when they run on a cluster's machines
        # vLLM's side-channel ports: an engine's ranks listen on kv_port + dp_rank * tp * pp + rank
        self.tp_size = config.parallel.tensor_parallel_size
        self.pp_size = config.parallel.pipeline_parallel_size
        self.port = kv.kv_port + config.parallel.data_parallel_rank * self.tp_size * self.pp_size
        self.engine_id = kv.engine_id or f"{self.host}:{self.port}"
        self.block_size = config.cache.block_size
        self.ctx = zmq.Context.instance()
        self.stats = _Stats()
        self._closed = threading.Event()
        atexit.register(self.shutdown)       # open side-channel sockets would hold the process's exit
        self._init_side()

    @classmethod
    def check_config(cls, kv_config: Any) -> None:
        extra = extra_config(kv_config, cls.EXTRA_DEFAULTS)
        for key in ("kv_lease_duration", "heartbeat_s", "transfer_timeout_s"):
            if not isinstance(extra[key], (int, float)) or extra[key] < 0 or (key != "heartbeat_s" and not extra[key]):
                raise ValueError(f"kv_connector_extra_config.{key} must be a positive number of seconds, "
                                 f"got {extra[key]!r}")
        if extra["nixl"]:
            why = nixl.reason()
            if why is not None:
                raise ValueError(f"{kv_config.kv_connector} reads through NIXL, which cannot run here: {why}")

    # ==== scheduler side =======================================================================
    def _init_scheduler_side(self) -> None:
        self.num_groups = len(self.config.kv_cache_groups()) if self.config.model.arch is not None else 1
        self._pending_loads: dict[str, _Load] = {}     # for the next step's metadata
        self._loading: set[str] = set()                # loads sent to the worker, not reported yet
        self._saved: set[str] = set()                  # producer: prompt KV saved for a reader
        self._pending_drops: list[str] = []
        self._held: set[str] = set()                   # producer: blocks kept for a remote reader
        self._remote: dict[str, tuple[list[str], int, str]] = {}   # consumer: (rank hosts, port, remote id) to keep alive
        self._gone: set[str] = set()                   # consumer: the producer no longer holds them
        self._lock = threading.Lock()
        self._heartbeats: threading.Thread | None = None

    @staticmethod
    def _params(request: Request) -> dict[str, Any]:
        return request.kv_transfer_params or {}

    def _remote_load(self, request: Request) -> bool:
        """Whether the request's prompt KV is to be loaded: asked for, and not a request that needs
        every prompt position's logits (prompt log-probs), which only computing the prompt gives."""
        p = self._params(request)
        return bool(self.kv_config.is_consumer and p.get("do_remote_prefill") and p.get("remote_block_ids")
                    and request.sampling_params.prompt_logprobs is None)

    def request_added(self, request: Request) -> None:
        if not self._remote_load(request):
            return
        p = self._params(request)
        try:
            ranks = max(1, int(p.get("tp_size", 1))) * max(1, int(p.get("pp_size", 1)))
            hosts = [str(h) for h in p.get("remote_hosts") or [p["remote_host"]] * ranks]
            if len(hosts) != ranks:
                raise ValueError(f"{len(hosts)} remote_hosts for {ranks} ranks")
            target = (hosts, int(p["remote_port"]), str(p.get("remote_request_id", "")))
        except (KeyError, TypeError, ValueError):
            with self._lock:
                self._gone.add(request.request_id)   # malformed: computed here
            log.warning("request %s: kv_transfer_params without remote_host / remote_port: computed here",
                        request.request_id)
            return
        with self._lock:
            self._remote[request.request_id] = target
        if self._heartbeats is None:
            self._heartbeats = threading.Thread(target=self._heartbeat_loop, name="kv-heartbeats", daemon=True)
            self._heartbeats.start()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if not self._remote_load(request):
            return 0, False
        with self._lock:
            if request.request_id in self._gone or request.request_id not in self._remote:
                return 0, False
        p = self._params(request)
        try:
            remote = per_group(p["remote_block_ids"])
        except ValueError as exc:
            log.warning("request %s: %s: computed here", request.request_id, exc)
            return 0, False
        if len(remote) != self.num_groups or len({len(g) for g in remote}) != 1:
            log.warning("request %s: remote_block_ids name %d KV cache group(s) of %s blocks, this model has %d "
                        "groups: computed here", request.request_id, len(remote),
                        "/".join(str(len(g)) for g in remote), self.num_groups)
            return 0, False
        covered = min(request.num_prompt_tokens, len(remote[0]) * self.block_size)
        if covered < request.num_prompt_tokens:          # a partial remote prompt: computed here
            return 0, False
        if (p.get("remote_num_tokens", request.num_prompt_tokens) != request.num_prompt_tokens
                or p.get("remote_prompt_hash", prompt_hash(request)) != prompt_hash(request)):
            log.warning("request %s: kv_transfer_params are another prompt's: computed here", request.request_id)
            return 0, False
        return max(0, request.num_prompt_tokens - num_computed_tokens), True

    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        p = self._params(request)
        hosts, port, remote_id = self._remote[request.request_id]
        first = (request.num_prompt_tokens - num_external_tokens) // self.block_size
        n = -(-request.num_prompt_tokens // self.block_size)
        remote, local = [], []
        for theirs, ours in zip(per_group(p["remote_block_ids"]), block_ids):
            # a sliding window's group holds null blocks (0) before the window, on either side:
            # those positions are read by no query any more, so they are not moved
            pairs = [(a, b) for a, b in zip(theirs[first:n], ours[first:n]) if a != NULL_BLOCK and b != NULL_BLOCK]
            remote.append([a for a, _ in pairs])
            local.append([b for _, b in pairs])
        self._pending_loads[request.request_id] = _Load(hosts, port, remote_id, remote, local)

    def build_connector_meta(self, scheduled: list[Request],
                             block_ids: Callable[[str], tuple[list[int], ...]] | None = None) -> bytes:
        saves: dict[str, list[int]] = {}
        if self.kv_config.is_producer and block_ids is not None:
            for req in scheduled:
                if (req.request_id not in self._saved and self._params(req).get("do_remote_decode")
                        and req.num_computed_tokens >= req.num_prompt_tokens):
                    n = -(-req.num_prompt_tokens // self.block_size)
                    saves[req.request_id] = [list(g[:n]) for g in block_ids(req.request_id)]
                    self._saved.add(req.request_id)
        meta = _Meta(self._pending_loads, saves, self._pending_drops)
        self._loading.update(self._pending_loads)
        self._pending_loads, self._pending_drops = {}, []
        return _encode(meta)

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._forget_remote(rid)
        if rid not in self._saved:
            return False, None
        self._saved.discard(rid)
        if request.status.finish_reason not in ("stop", "length", "repetition"):
            self._pending_drops.append(rid)                  # aborted or failed: no reader will come
            return False, None
        self._held.add(rid)
        n = -(-request.num_prompt_tokens // self.block_size)
        groups = [list(g[:n]) for g in block_ids]
        hosts = self.rank_hosts or [self.host]
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_engine_id": self.engine_id, "remote_host": hosts[0],
                      **({"remote_hosts": hosts} if len(set(hosts)) > 1 else {}),
                      "remote_port": self.port, "remote_request_id": rid,
                      "remote_block_ids": groups[0] if len(groups) == 1 else groups,
                      "remote_num_tokens": request.num_prompt_tokens,
                      "remote_prompt_hash": prompt_hash(request),
                      "tp_size": self.tp_size, "pp_size": self.pp_size}

    def request_dropped(self, request_id: str) -> None:
        self._forget_remote(request_id)
        self._pending_loads.pop(request_id, None)
        if request_id in self._saved:
            self._saved.discard(request_id)
            self._pending_drops.append(request_id)

    def _forget_remote(self, request_id: str) -> None:
        with self._lock:
            self._remote.pop(request_id, None)
            self._gone.discard(request_id)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_sending:
            self._held.discard(rid)
        for rid in (*output.finished_recving, *output.failed_recving):
            self._loading.discard(rid)
            self._forget_remote(rid)

    def is_loading(self, request_id: str) -> bool:
        return request_id in self._loading or request_id in self._pending_loads

    def has_pending(self) -> bool:
        return bool(self._held or self._loading or self._pending_loads or self._pending_drops)

    def set_rank_hosts(self, hosts: list[str]) -> None:
        # the ranks listen on their machines' addresses unless kv_ip names one (then every rank's)
        self.rank_hosts = list(hosts) if self.kv_config.kv_ip in LOOPBACK else []

    def reset(self) -> None:
        """The worker (and its side channel) restarted: nothing is held or loading any more."""
        self._held.clear()
        self._loading.clear()
        self._pending_loads.clear()
        self._pending_drops.clear()
        self._saved.clear()

    def _heartbeat_loop(self) -> None:
        """Renew the producers' leases of the requests this consumer will read; those a producer
        no longer holds are computed here instead."""
        socks: dict[tuple[str, int], zmq.Socket] = {}
        try:
            while not self._closed.wait(self.heartbeat_s):
                with self._lock:
                    targets: dict[tuple[str, int], dict[str, str]] = {}
                    for rid, (hosts, port, remote_id) in self._remote.items():
                        for rank, host in enumerate(hosts):   # each producer rank holds its share
                            targets.setdefault((host, port + rank), {})[remote_id] = rid
                for addr, ids in targets.items():
                    sock = socks.get(addr)
                    if sock is None:
                        sock = socks[addr] = self.ctx.socket(zmq.DEALER)
                        sock.setsockopt(zmq.LINGER, 0)
                        sock.connect(f"tcp://{addr[0]}:{addr[1]}")
                    sock.send(_encode({"op": "heartbeat", "req_ids": list(ids)}))
                    if not sock.poll(int(self.timeout_s * 1000)):
                        sock.close()
                        del socks[addr]
                        continue                # the producer does not answer: its reads will fail
                    reply = _decode(sock.recv())
                    unknown = [ids[r] for r in reply.get("unknown", ()) if r in ids]
                    if unknown:
                        with self._lock:
                            self._gone.update(r for r in unknown if r in self._remote)
        finally:
            for s in socks.values():
                s.close()

    def shutdown(self) -> None:
        self._closed.set()
        pool = getattr(self, "_pool", None)     # worker side: its idle load threads end now
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        for name in ("_server", "_heartbeats"):
            thread = getattr(self, name, None)
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=2)
        agent, self._nixl = getattr(self, "_nixl", None), None
        if agent is not None:
            agent.close()

    # ==== worker side ==========================================================================
    def _init_worker_side(self) -> None:
        self.kv_caches: list[Any] = []
        self.group_layers: list[list[int]] = []      # per KV cache group, its layers' indices in kv_caches
        self.info: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._readable: dict[str, _Held] = {}
        self._to_save: dict[str, list[int]] = {}
        self._finished_sending: list[str] = []
        self._finished_recving: list[str] = []
        self._failed_recving: dict[str, str] = {}
        self._transfers: list[tuple[str, str, int, int, int]] = []
        self._handshaken: dict[tuple[str, int], dict[str, Any]] = {}
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kv-load")
        self._server: threading.Thread | None = None
        self._shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self._cma_ok = cross_memory.available()      # until the system refuses it once
        self._nixl: nixl.NixlAgent | None = None     # with "nixl": this worker's agent, its cache registered
        self._nixl_reads: dict[str, float] = {}      # producer: NIXL reads under way, until when they may last
        self.machine = machine_id()

    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        self.kv_caches = list(kv_caches)
        first_layer = 0
        if self.pp_size > 1:             # this rank's stage runs (and caches) a run of the layers
            from models.pp_layout import pp_layers
            first_layer = pp_layers(self.config.model.arch.num_layers, self.pp_size, self.rank // self.tp_size)[0]
        self.info = layout_info(self.config, self.kv_caches, first_layer)
        self.group_layers = group_layers(self.config, len(self.kv_caches), first_layer)
        if self.extra["nixl"] and self.kv_caches:
            self._nixl = nixl.NixlAgent(f"{self.kv_config.kv_role}-{self.rank}", self.kv_caches)
        if self.kv_config.is_producer:
            sock = self.ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            addr = f"tcp://{self.listen_ip}:{self.port + self.rank}"
            try:
                sock.bind(addr)
            except zmq.ZMQError as exc:
                sock.close()
                raise RuntimeError(f"the KV transfer side channel cannot listen on {addr}: {exc}") from None
            self._server = threading.Thread(target=self._serve, args=(sock,), name="kv-server", daemon=True)
            self._server.start()
            log.info("KV transfer side channel listening on %s (engine %s, lease %.1f s)", addr,
                     self.engine_id, self.lease_s)

    def start_load_kv(self, metadata: bytes) -> None:
        if not metadata:
            return
        meta = _decode(metadata, type=_Meta)
        if meta.drops:
            with self._lock:
                for rid in meta.drops:
                    h = self._readable.pop(rid, None)
                    if h is not None:
                        h.unlink()
        self._to_save.update(meta.saves)
        for rid, load in meta.loads.items():
            self._pool.submit(self._load, rid, load)

    def wait_for_save(self) -> None:
        """On the CPU the forward's writes are done when it returns; on CUDA wait for them."""
        if not self._to_save:
            return
        t = self.kv_caches[0]
        if t.device.type == "cuda":
            import torch
            torch.cuda.synchronize(t.device)
        deadline = time.monotonic() + self.lease_s
        with self._lock:
            for rid, ids in self._to_save.items():
                self._readable[rid] = _Held(ids, deadline)
        self._to_save = {}

    def get_finished(self) -> KVConnectorOutput:
        self._expire()
        with self._lock:
            out = KVConnectorOutput(self._finished_sending, self._finished_recving, self._failed_recving,
                                    self.stats.take(), self._transfers)
            self._finished_sending, self._finished_recving, self._failed_recving = [], [], {}
            self._transfers = []
        return out

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [rid for rid, h in self._readable.items() if h.deadline < now]
            for rid in expired:
                self._readable.pop(rid).unlink()
                self._finished_sending.append(rid)
        if expired:
            self.stats.add(leases_expired=len(expired))
            log.warning("KV lease expired for %d request(s) (no consumer heartbeat in %.1f s): blocks freed",
                        len(expired), self.lease_s)

    # -- the producer's side channel ---------------------------------------------------------
    def _serve(self, sock: zmq.Socket) -> None:
        try:
            while not self._closed.is_set():
                reading = self._nixl is not None and self._nixl_reads and self._nixl_progress()
                if not sock.poll(0 if reading else 100):
                    if not reading:
                        self._expire()
                    continue
                ident, raw = sock.recv_multipart(copy=True)[:2]
                try:
                    req = _decode(raw)
                    frames = self._handle(req)
                except Exception as exc:   # a bad message answers an error; the channel goes on
                    frames = [_encode({"ok": False, "error": f"{type(exc).__name__}: {exc}"})]
                sock.send_multipart([ident, *frames], copy=False)
        finally:
            sock.close()

    def _nixl_progress(self) -> bool:
        """Progress the agent while consumers read through it; whether any read is still under
        way (one unreleased past the transfer timeout is given up)."""
        now = time.monotonic()
        for rid in [r for r, until in self._nixl_reads.items() if until < now]:
            self._nixl_reads.pop(rid, None)
        if not self._nixl_reads:
            return False
        self._nixl.progress()
        return True

    def _handle(self, req: dict[str, Any]) -> list[Any]:
        op = req.get("op")
        if op == "handshake":
            try:
                check_compatible(self.info, req.get("info", {}), "producer", "consumer")
            except HandshakeError as exc:
                return [_encode({"ok": False, "error": str(exc), "info": self.info})]
            reply = {"ok": True, "info": self.info, "machine": self.machine}
            if self._nixl is not None:
                reply["nixl"] = self._nixl.metadata
            return [_encode(reply)]
        if op == "heartbeat":
            deadline = time.monotonic() + self.lease_extension
            unknown = []
            with self._lock:
                for rid in req.get("req_ids", ()):
                    h = self._readable.get(rid)
                    if h is None:
                        unknown.append(rid)
                    else:
                        h.deadline = max(h.deadline, deadline)     # a heartbeat only extends a lease
            return [_encode({"ok": True, "unknown": unknown})]
        if op == "release":
            released = 0
            with self._lock:
                for rid in req.get("req_ids", ()):
                    self._nixl_reads.pop(rid, None)
                    h = self._readable.pop(rid, None)
                    if h is not None:
                        h.unlink()
                        self._finished_sending.append(rid)
                        released += 1
            return [_encode({"ok": True, "released": released})]
        if op == "read":
            return self._read(req["req_id"], per_group(req["block_ids"]), req.get("shm", False),
                              req.get("cma", False), req.get("nixl", False))
        raise ValueError(f"unknown side-channel operation {op!r}")

    def _read(self, rid: str, block_ids: list[list[int]], shm: bool, cma: bool = False,
              via_nixl: bool = False) -> list[Any]:
        """The request's blocks as frames (views of the cache, sent without a copy), one
        shared-memory segment, or (``cma``, ``via_nixl``) their addresses in this process for the
        consumer to copy from or to read through NIXL. The read renews the lease, which keeps the
        blocks as they are while their bytes are copied or sent, outside the lock (the steps go on
        meanwhile)."""
        t0 = time.monotonic_ns()
        with self._lock:
            h = self._readable.get(rid)
            if h is None:
                return [_encode({"ok": False, "error": f"request {rid}'s blocks are not held here "
                                                        "(never saved, released, or their lease expired)"})]
            if len(block_ids) != len(h.block_ids) or any(not set(ask) <= set(held) - {NULL_BLOCK}
                                                        for ask, held in zip(block_ids, h.block_ids)):
                return [_encode({"ok": False, "error": f"blocks {block_ids} are not request {rid}'s"})]
            h.deadline = max(h.deadline, time.monotonic() + self.lease_extension)
        head = {"ok": True, "runs": [runs(ids) for ids in block_ids], "compat_hash": self.info["compat_hash"]}
        via_nixl = via_nixl and self._nixl is not None
        if via_nixl or (cma and self.kv_caches[0].device.type == "cpu"):
            regions = [(p.data_ptr(), p.nbytes) for p in self._block_parts(block_ids)]
            nbytes = sum(n for _, n in regions)
            self.stats.add(sent_bytes=nbytes, sent_blocks=sum(map(len, block_ids)), sent_requests=1)
            with self._lock:
                self._transfers.append((rid, "KVSend", t0, time.monotonic_ns(), nbytes))
            if via_nixl:          # the consumer reads now: this side's agent progresses until it releases
                self._nixl_reads[rid] = time.monotonic() + self.timeout_s
                return [_encode({**head, "nixl": {"regions": regions, "mem": self._nixl.mem, "dev": self._nixl.dev}})]
            return [_encode({**head, "cma": {"pid": os.getpid(), "regions": regions}})]
        chunks = self._block_chunks(block_ids)
        nbytes = sum(c.nbytes for c in chunks)
        self.stats.add(sent_bytes=nbytes, sent_blocks=sum(map(len, block_ids)), sent_requests=1)
        reply: list[Any] = [_encode(head), *chunks]
        if shm and self._shm_dir is not None and nbytes <= self.kv_config.kv_buffer_size:
            import numpy as np
            path = os.path.join(self._shm_dir, f"troupe-kv-{uuid.uuid4().hex}")
            mm = np.memmap(path, dtype=np.uint8, mode="w+", shape=(max(nbytes, 1),))
            off = 0
            for c in chunks:
                mm[off:off + c.nbytes] = c
                off += c.nbytes
            mm.flush()
            del mm
            h.shm_paths.append(path)          # unlinked when released or expired
            reply = [_encode({**head, "shm": path})]
        with self._lock:
            self._transfers.append((rid, "KVSend", t0, time.monotonic_ns(), nbytes))
        return reply

    def _block_parts(self, block_ids: list[list[int]]) -> Any:
        """Per KV cache group, per run of consecutive blocks, per layer of the group, K then V:
        the cache's view of those blocks (contiguous)."""
        for ids, layers in zip(block_ids, self.group_layers):
            for start, n in runs(ids):
                b0 = ids[start]
                for t in (self.kv_caches[i] for i in layers):
                    for kv in (0, 1):
                        yield t[kv, b0:b0 + n]

    def _block_chunks(self, block_ids: list[list[int]]) -> list[Any]:
        """The parts' bytes (views, no copy, on the CPU) as uint8 numpy arrays."""
        import torch
        return [(p if p.device.type == "cpu" else p.cpu()).contiguous().view(torch.uint8).numpy().reshape(-1)
                for p in self._block_parts(block_ids)]

    # -- the consumer's loads ----------------------------------------------------------------
    def _connect(self, host: str, port: int) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{host}:{port}")
        return sock

    def _ask(self, sock: zmq.Socket, msg: dict[str, Any], what: str) -> list[Any]:
        sock.send(_encode(msg))
        if not sock.poll(int(self.timeout_s * 1000)):
            raise TimeoutError(f"{what}: no answer from the producer in {self.timeout_s:g} s")
        frames = sock.recv_multipart(copy=False)
        return frames

    def handshake(self, host: str, port: int, sock: zmq.Socket | None = None) -> dict[str, Any]:
        """Agree with the producer at host:port on model, block size, dtype and layout (once per
        producer); HandshakeError naming the field when they differ."""
        key = (host, port)
        if key in self._handshaken:
            return self._handshaken[key]
        own = sock is None
        sock = sock or self._connect(host, port)
        try:
            reply = _decode(self._ask(sock, {"op": "handshake", "info": self.info}, "handshake")[0].bytes)
        finally:
            if own:
                sock.close()
        if not reply.get("ok"):
            raise HandshakeError(reply.get("error", "refused"))
        check_compatible(self.info, reply["info"])
        if self._nixl is not None and "nixl" in reply:      # both sides run NIXL: load its agent once
            reply["nixl_peer"] = self._nixl.add_peer(reply["nixl"])
        self._handshaken[key] = reply
        return reply

    def _load(self, rid: str, load: _Load) -> None:
        """Read this rank's share of the request's blocks from the producer's rank of the same
        number (the handshake has both sides agree on the ranks, their heads and their layers)."""
        t0, t0_ns = time.perf_counter(), time.monotonic_ns()
        host, port = load.hosts[self.rank], load.port + self.rank
        sock = self._connect(host, port)
        try:
            peer = self.handshake(host, port, sock)
            shm = bool(self.extra["shm"]) and peer.get("machine") == self.machine
            via_nixl = "nixl_peer" in peer
            ask = {"op": "read", "req_id": load.remote_request_id, "block_ids": load.remote_block_ids, "shm": shm,
                   "cma": shm and self.extra["cma"] and self._cma_ok and self.kv_caches[0].device.type == "cpu",
                   "nixl": via_nixl}
            head, frames = self._read_reply(sock, ask, host, port)
            nbytes = 0
            if "nixl" in head:
                region = head["nixl"]
                nbytes = self._nixl.read(peer["nixl_peer"], self._copies(head["runs"], region["regions"], load),
                                         region["mem"], int(region["dev"]), self.timeout_s)
            if "cma" in head:
                try:
                    nbytes = self._copy_cma(head, load)
                except PermissionError as exc:     # the system forbids it: shared memory from now on
                    self._cma_ok = False
                    log.warning("reading the producer's KV cache directly is not permitted here (%s): "
                                "through shared memory instead", exc)
                    head, frames = self._read_reply(sock, {**ask, "cma": False}, host, port)
            if "cma" not in head and "nixl" not in head:
                nbytes = self._write_blocks(head, frames[1:], load)
            sock.send(_encode({"op": "release", "req_ids": [load.remote_request_id]}))
            sock.poll(int(self.timeout_s * 1000))          # the release is best effort: the lease ends it anyway
            self.stats.add(recv_bytes=nbytes, recv_blocks=sum(map(len, load.local_block_ids)),
                           recv_seconds=time.perf_counter() - t0, recv_requests=1,
                           shm_reads=1 if "shm" in head else 0, cma_reads=1 if "cma" in head else 0,
                           nixl_reads=1 if "nixl" in head else 0)
            with self._lock:
                self._finished_recving.append(rid)
                self._transfers.append((rid, "KVLoad", t0_ns, time.monotonic_ns(), nbytes))
        except Exception as exc:   # whatever failed, the request is reported (and recomputed), never stuck
            log.warning("KV load of request %s from %s:%d failed: %s", rid, host, port, exc)
            self.stats.add(recv_failures=1)
            with self._lock:
                self._failed_recving[rid] = f"{type(exc).__name__}: {exc}"
                self._transfers.append((rid, "KVLoadFailed", t0_ns, time.monotonic_ns(), 0))
        finally:
            sock.close()

    def _read_reply(self, sock: zmq.Socket, ask: dict[str, Any], host: str, port: int) -> tuple[dict[str, Any], list[Any]]:
        """The producer's answer to a read: its head (checked) and frames."""
        frames = self._ask(sock, ask, "read")
        head = _decode(frames[0].bytes)
        if not head.get("ok"):
            raise RuntimeError(head.get("error", "read refused"))
        if head.get("compat_hash") != self.info["compat_hash"]:     # restarted with another config
            self._handshaken.pop((host, port), None)
            raise HandshakeError(f"KV transfer refused: compat_hash {self.info['compat_hash']} (consumer) vs "
                                 f"{head.get('compat_hash')} (producer)")
        return head, frames

    def _copy_cma(self, head: dict[str, Any], load: _Load) -> int:
        """Copy the blocks straight from the producer's cache into this cache's blocks."""
        copies = self._copies(head["runs"], head["cma"]["regions"], load)
        return cross_memory.read_regions(int(head["cma"]["pid"]), copies)

    def _copies(self, group_runs: list[Any], regions: list[Any], load: _Load) -> list[tuple[int, int, int]]:
        """(local address, producer address, bytes) of every run of blocks to copy: the
        producer's regions (in ``_block_parts``'s order) onto this cache's blocks of the load."""
        t = self.kv_caches[0]
        per_block = t[0, 0].numel() * t.element_size()
        if len(group_runs) != len(self.group_layers):
            raise RuntimeError(f"the producer sent {len(group_runs)} KV cache groups, expected {len(self.group_layers)}")
        copies: list[tuple[int, int, int]] = []
        i = 0
        for runs_g, layers, local_g in zip(group_runs, self.group_layers, load.local_block_ids):
            for start, n in runs_g:
                local = local_g[start:start + n]
                sub = runs(local)
                for layer in (self.kv_caches[j] for j in layers):
                    for kv in (0, 1):
                        if i >= len(regions) or regions[i][1] != n * per_block:
                            raise RuntimeError(f"the producer's region {i} does not hold {n} blocks of {per_block} bytes")
                        src = regions[i][0]
                        i += 1
                        base = layer[kv].data_ptr()             # (num_blocks, ...) contiguous
                        for j, m in sub:
                            copies.append((base + local[j] * per_block, src + j * per_block, m * per_block))
        if i != len(regions):
            raise RuntimeError(f"the producer named {len(regions)} regions, expected {i}")
        return copies

    def _write_blocks(self, head: dict[str, Any], frames: list[Any], load: _Load) -> int:
        import numpy as np
        import torch
        t = self.kv_caches[0]
        per_block = t[0, 0].numel() * t.element_size()
        group_runs = head["runs"]
        if len(group_runs) != len(self.group_layers):
            raise RuntimeError(f"the producer sent {len(group_runs)} KV cache groups, expected {len(self.group_layers)}")
        sizes = [n * per_block for runs_g, layers in zip(group_runs, self.group_layers)
                 for _, n in runs_g for _ in range(2 * len(layers))]
        path = head.get("shm")
        if path is not None:
            data = np.memmap(path, dtype=np.uint8, mode="r")
            offsets = np.cumsum([0, *sizes])
            views = [data[offsets[i]:offsets[i + 1]] for i in range(len(sizes))]
        else:
            views = [np.frombuffer(f.buffer, dtype=np.uint8) for f in frames]
        if len(views) != len(sizes):
            raise RuntimeError(f"the producer sent {len(views)} block frames, expected {len(sizes)}")
        i = total = 0
        shape = tuple(t.shape[2:])
        cpu = t.device.type == "cpu"
        for runs_g, layers, local_g in zip(group_runs, self.group_layers, load.local_block_ids):
            for start, n in runs_g:
                local = local_g[start:start + n]
                idx = None if cpu else torch.tensor(local, dtype=torch.long, device=t.device)
                for layer in (self.kv_caches[j] for j in layers):
                    for kv in (0, 1):
                        buf = views[i]
                        i += 1
                        if buf.nbytes != n * per_block:
                            raise RuntimeError(f"a frame of {buf.nbytes} bytes for {n} blocks of {per_block}")
                        if cpu:       # numpy slice copies: one thread, memcpy (torch's threads contend with the step's)
                            dst = layer[kv].view(torch.uint8).numpy().reshape(layer.shape[1], per_block)
                            src = np.asarray(buf).reshape(n, per_block)
                            for j, m in runs(local):
                                dst[local[j]:local[j] + m] = src[j:j + m]
                        else:
                            with warnings.catch_warnings():      # read-only buffers: copied from, never written
                                warnings.simplefilter("ignore")
                                src = torch.frombuffer(buf, dtype=torch.uint8).view(layer.dtype).view(n, *shape)
                            layer[kv].index_copy_(0, idx, src.to(layer.device))
                        total += buf.nbytes
        return total


class NixlConnector(TroupeConnector):
    """vLLM's ``NixlConnector``: TroupeConnector with its loads read through NIXL (``"nixl"``
    true unless kv_connector_extra_config says otherwise); the side channel, leases and
    fallbacks are TroupeConnector's."""
    EXTRA_DEFAULTS = {**EXTRA_KEYS, "nixl": True}
