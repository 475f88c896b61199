"""The KV connector interface (vLLM's KVConnectorBase_V1): how an engine loads a prompt's KV
blocks from another instance instead of computing them, and keeps its own blocks for another
instance to read.

One connector class, two instances: the scheduler's (``role`` SCHEDULER, in the engine-core
process) and the worker's (``role`` WORKER, beside the KV cache tensors). Each step the
scheduler's side writes a metadata blob (``build_connector_meta``) that travels with the step
to the worker's side, and the worker's side answers in the step's output
(``KVConnectorOutput``: the transfers that ended since the last step).

Scheduler side, in the order a request meets it:
  get_num_new_matched_tokens(req, n)  tokens past the n computed locally that a remote
                                      instance holds, and whether they load asynchronously
  update_state_after_alloc(req, ...)  the local blocks the remote tokens go into
  build_connector_meta(...)           this step's loads and saves, for the worker
  update_connector_output(out)        transfers the worker finished (or failed)
  request_finished(req, block_ids)    hold the blocks for a remote reader? and the
                                      kv_transfer_params the response carries

Worker side, each step:
  start_load_kv(meta)                 start the loads the metadata asks for (in the background)
  has_layer_work()                    whether this step's forward calls the two per-layer hooks:
    wait_for_layer_load(layer)          before layer ``layer``'s attention reads the cache
    save_kv_layer(layer, kv, meta)      after it wrote its keys and values (saving layer by
                                        layer while the later layers compute)
  wait_for_save()                     after the forward: the KV the step wrote is complete,
                                      the requests saved in it may be read
  get_finished()                      sends and receives that ended (KVConnectorOutput)

A step with layer work runs through the model's layers one by one (never a captured graph nor
the native one-call decode stack, which would skip the hooks).

Blocks are never freed while a transfer may still touch them (the book's read-after-write
hazard): a request whose blocks a remote reader holds is freed only when the worker reports
the send finished (read and released, or its lease expired); a request aborted while its KV
loads keeps its blocks until the load is reported finished.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable

import msgspec

if TYPE_CHECKING:
    from actors.engine.config import EngineConfig
    from actors.scheduler.request import Request


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorOutput(msgspec.Struct, omit_defaults=True):
    """What the worker's side reports with a step's output."""
    finished_sending: list[str] = []          # producer: blocks no longer read (released or expired)
    finished_recving: list[str] = []          # consumer: KV loaded into the request's blocks
    failed_recving: dict[str, str] = {}       # consumer: loads that failed, with why
    stats: dict[str, float] = {}              # counters since the last report (TRANSFER_STATS)
    # for the request waterfall: (request id, "KVLoad" | "KVLoadFailed" | "KVSend", start, end
    # (monotonic ns), bytes) of each transfer that ended
    transfers: list[tuple[str, str, int, int, int]] = []


# the counters a connector may report in KVConnectorOutput.stats (summed by the scheduler)
TRANSFER_STATS = ("recv_bytes", "recv_blocks", "recv_seconds", "recv_requests", "recv_failures",
                  "sent_bytes", "sent_blocks", "sent_requests", "leases_expired", "shm_reads",
                  "cma_reads", "nixl_reads")


class KVOutputAggregator:
    """The ranks' reports as one (vLLM's KVOutputAggregator): with tensor parallelism each rank
    moves its own heads' share of a request's blocks, in steps of its own, so a send or a load is
    finished once every rank reported it; a load that failed on any rank fails once all reported
    (no rank writes into the blocks any more when the request is computed instead). Counters:
    the bytes of every rank, the rest (requests, blocks, seconds) as rank 0 counts them, since
    every rank moves every request's blocks."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._sending: dict[str, int] = {}
        self._recving: dict[str, int] = {}
        self._failed: dict[str, str] = {}

    def aggregate(self, outputs: list[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        if all(o is None for o in outputs):
            return None
        out = KVConnectorOutput(stats={}, transfers=[])
        for rank, o in enumerate(outputs):
            if o is None:
                continue
            for rid in o.finished_sending:
                if self._count(self._sending, rid):
                    out.finished_sending.append(rid)
            for rid in (*o.finished_recving, *o.failed_recving):
                if rid in o.failed_recving:
                    self._failed.setdefault(rid, o.failed_recving[rid])
                if self._count(self._recving, rid):
                    if rid in self._failed:
                        out.failed_recving[rid] = self._failed.pop(rid)
                    else:
                        out.finished_recving.append(rid)
            for key, value in o.stats.items():     # bytes add up; requests, blocks, time: rank 0's
                if rank == 0 or key.endswith("_bytes"):
                    out.stats[key] = out.stats.get(key, 0.0) + value
            out.transfers.extend(o.transfers)
        return out

    def _count(self, counts: dict[str, int], rid: str) -> bool:
        """Count one rank's report of ``rid``; whether every rank has reported it now."""
        n = counts.get(rid, 0) + 1
        if n < self.world_size:
            counts[rid] = n
            return False
        counts.pop(rid, None)
        return True


def extra_config(kv_config: Any, defaults: dict[str, Any]) -> dict[str, Any]:
    """A connector's ``kv_connector_extra_config`` over its ``defaults``; ValueError naming keys
    it does not take."""
    unknown = sorted(set(kv_config.kv_connector_extra_config) - set(defaults))
    if unknown:
        raise ValueError(f"unknown kv_connector_extra_config key(s) for {kv_config.kv_connector}: "
                         f"{', '.join(unknown)}; accepted: {', '.join(defaults)}")
    return {**defaults, **kv_config.kv_connector_extra_config}


def runs(ids: list[int]) -> list[tuple[int, int]]:
    """(index into ids, length) of each run of consecutive block ids."""
    out: list[tuple[int, int]] = []
    i = 0
    while i < len(ids):
        j = i + 1
        while j < len(ids) and ids[j] == ids[j - 1] + 1:
            j += 1
        out.append((i, j - i))
        i = j
    return out


class KVConnectorBase(ABC):
    """Subclasses implement both sides; ``role`` says which one this instance is. A worker side
    serves one rank of its engine core, ``rank`` = pipeline stage x tensor-parallel size +
    tensor-parallel rank (vLLM's order; set by KVConnectorFactory.create_connector before
    ``register_kv_caches``): it moves that rank's share of the KV heads of its stage's layers."""
    rank: int = 0

    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        self.config = config
        self.kv_config = config.kv_transfer
        self.role = role

    def _init_side(self) -> None:
        """The subclass's ``_init_scheduler_side()`` or ``_init_worker_side()``, by ``role``."""
        if self.role is KVConnectorRole.SCHEDULER:
            self._init_scheduler_side()
        else:
            self._init_worker_side()

    @classmethod
    def check_config(cls, kv_config: Any) -> None:
        """ValueError naming what the connector cannot take in ``kv_config`` (its extra config)."""

    @classmethod
    def check_engine_config(cls, config: EngineConfig) -> None:
        """ValueError naming what the connector cannot run with in the rest of the engine's
        config (parallelism, say), before any process starts."""

    # -- scheduler side ----------------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """How many of the request's tokens past ``num_computed_tokens`` (local prefix hits) a
        remote instance holds, and whether they are loaded asynchronously (the request waits in
        WAITING_FOR_REMOTE_KVS meanwhile)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        """The request got its blocks (per KV cache group, local hits first) for the remote
        tokens too."""

    @abstractmethod
    def build_connector_meta(self, scheduled: list[Request],
                             block_ids: Callable[[str], tuple[list[int], ...]] | None = None) -> bytes:
        """This step's metadata for the worker's side: ``scheduled``, the step's requests (their
        ``num_computed_tokens`` already counting the step's tokens); ``block_ids(request id)``,
        a request's blocks per KV cache group."""

    @abstractmethod
    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The worker's report of transfers that ended (before the scheduler acts on it: a
        connector may take out of ``finished_sending`` sends that are not over for it yet)."""

    @abstractmethod
    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """The request finished: whether its blocks are freed later (a remote reader holds them
        until the worker reports the send finished), and the kv_transfer_params its response
        carries (None: none)."""

    def request_added(self, request: Request) -> None:
        """A request entered the scheduler (a consumer may start keeping its remote lease)."""

    def request_dropped(self, request_id: str) -> None:
        """A request the connector may know left without finishing normally (aborted, failed)."""

    def reset(self) -> None:
        """The workers restarted (their KV caches and side channels are new): forget transfers
        under way and blocks held."""

    def set_rank_hosts(self, hosts: list[str]) -> None:
        """Where each rank's worker runs (its machine's address, in rank order) when the ranks
        are placed on a cluster's machines (``--distributed-executor-backend ray``); called
        again after the workers restart."""

    def has_pending(self) -> bool:
        """Whether transfers are under way or blocks are held, so the worker's side must be polled
        even when no tokens are scheduled."""
        return False

    def is_loading(self, request_id: str) -> bool:
        """Whether the request's KV is being loaded (its blocks are written to until reported)."""
        return False

    def shutdown(self) -> None:
        pass

    # -- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        """The worker's KV cache tensors, one per layer."""

    def start_load_kv(self, metadata: bytes) -> None:
        """Start the loads (and take in the saves) this step's metadata names."""

    def has_layer_work(self) -> bool:
        """Whether the step whose metadata ``start_load_kv`` just took calls the per-layer hooks."""
        return False

    def wait_for_layer_load(self, layer: int) -> None:
        """Layer ``layer`` (an index into the registered caches) is about to read the cache: its
        share of this step's loads must be in place."""

    def save_kv_layer(self, layer: int, kv_layer: Any, attn_metadata: Any) -> None:
        """Layer ``layer`` wrote this step's keys and values into ``kv_layer`` (its cache tensor;
        ``attn_metadata``: the step's AttentionMetadata): save this layer's share of the requests
        the step saves."""

    def wait_for_save(self) -> None:
        """The step's forward is done: the KV of the requests it saved is complete."""

    def get_finished(self) -> KVConnectorOutput:
        return KVConnectorOutput()
