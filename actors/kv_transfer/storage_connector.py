"""ExampleConnector (vLLM's name; SharedStorageConnector, its earlier name, too): prompts' KV
saved layer by layer to a directory during the forward that computes them, and loaded from it
by any instance that later meets a prompt starting with the same blocks: a prefix cache that
outlives the process and is shared by every instance that mounts the directory.

    --kv-transfer-config '{"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"shared_storage_path": "/var/cache/troupe"}}'

``kv_role``: ``kv_producer`` saves, ``kv_consumer`` loads, ``kv_both`` does both.

Saving. The step that computes a prompt's last token saves the prompt's full blocks: in every
attention layer, once the layer wrote its keys and values (``save_kv_layer``), the request's
blocks of that layer are copied out of the cache and handed to a writer thread, which writes
them while the later layers compute; the blocks are free to be reused as soon as the step ends.
When the last layer is written the entry is published atomically (written under a temporary
name, then renamed), so a reader never sees half an entry.

Loading. A waiting request looks its prompt's block hashes up (the prefix cache's chained
SHA-256 hashes, which cover the tokens before the block, the LoRA adapter and the cache salt, so
the same prefix has the same name in every process): the longest run of its blocks past its
local prefix-cache hits that an entry holds is loaded in the background while the request waits
(WAITING_FOR_REMOTE_KVS), then the rest of the prompt is computed. A load that fails (an entry
deleted or truncated meanwhile) is reported, and the prompt computed here (or the request
failed, by ``kv_load_failure_policy``).

On disk, under ``shared_storage_path``/troupe-kv/<layout hash>/ (the layout hash covers the model,
block size, cache dtype and cache shape, so instances of another configuration never read these):

    entries/<hash of the last block>/meta.json     the entry's block hashes, shape and dtype
    entries/<hash of the last block>/layer-<i>.kv  layer i's (2, blocks, block_size, kv heads, head size)
    blocks/<block hash>                            a link to the entry holding that block

With tensor or pipeline parallelism each rank saves and loads its own share (its KV heads of its
stage's layers) as entries and links of its own, named ``<hash>.r<rank>``; a prompt's blocks are
loaded once every rank holds them.

``max_storage_gb`` (0: no limit) bounds the entries' total size: past it, those used least
recently (loaded or written) are deleted. An instance counts the entries present when it started
and those it writes (not those other instances write meanwhile).
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

import msgspec

from actors.kv_transfer.base import KVConnectorBase, KVConnectorOutput, KVConnectorRole, extra_config, runs

if TYPE_CHECKING:
    from actors.engine.config import EngineConfig
    from actors.scheduler.request import Request

log = logging.getLogger("troupe.kv_transfer")

EXTRA_KEYS = {
    "shared_storage_path": "/tmp",   # vLLM's key and default
    "max_storage_gb": 0.0,           # the entries' total size this instance keeps (0: no limit)
}

WRITE_QUEUE = 64                     # layers' copies waiting for the writer (then the forward waits)

_encode = msgspec.msgpack.encode
_decode = msgspec.msgpack.decode


class _Load(msgspec.Struct, array_like=True):
    first: int                   # the prompt's first block to load (its local hits before it)
    hashes: list[str]            # the loaded blocks' hashes (each rank finds its entry by the last)
    block_ids: list[int]         # the local blocks they go into


class _Save(msgspec.Struct, array_like=True):
    hashes: list[str]            # the prompt's full blocks' hashes
    block_ids: list[int]         # and their local blocks


class _Meta(msgspec.Struct, omit_defaults=True):
    loads: dict[str, _Load] = {}
    saves: dict[str, _Save] = {}


def _extra(kv_config: Any) -> dict[str, Any]:
    return extra_config(kv_config, EXTRA_KEYS)


def storage_layout(config: EngineConfig) -> dict[str, Any]:
    """What every instance sharing entries must agree on, with its hash (the directory's name)."""
    arch = config.model.arch
    info = {"model": config.model.source.served_name, "num_layers": arch.num_layers,
            "block_size": config.cache.block_size, "num_kv_heads": arch.num_kv_heads,
            "head_size": arch.head_size, "kv_cache_dtype": config.cache.cache_dtype,
            "tensor_parallel_size": config.parallel.tensor_parallel_size,
            "pipeline_parallel_size": config.parallel.pipeline_parallel_size,
            "layout": "per rank, per layer of its stage (2, blocks, block_size, its kv heads, head_size)"}
    info["hash"] = hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:16]
    return info


def _name(block_hash: bytes) -> str:
    return block_hash.hex()[:32]


class StorageConnector(KVConnectorBase):
    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        self.extra = _extra(self.kv_config)
        # an engine's ranks (tensor-parallel ranks x pipeline stages) each save and load their
        # own share (their heads of their stage's layers) as entries and links of their own
        self.tp_size = config.parallel.tensor_parallel_size
        self.world = self.tp_size * config.parallel.pipeline_parallel_size
        if len(config.kv_cache_groups()) > 1:
            raise ValueError(f"{self.kv_config.kv_connector} needs a model with one KV cache group "
                             "(no sliding-window layers beside full-attention ones)")
        self.block_size = config.cache.block_size
        self.layout = storage_layout(config)
        self.root = os.path.join(os.path.abspath(os.path.expanduser(str(self.extra["shared_storage_path"]))),
                                 "troupe-kv", self.layout["hash"])
        self.entries = os.path.join(self.root, "entries")
        self.blocks = os.path.join(self.root, "blocks")
        try:
            os.makedirs(self.entries, exist_ok=True)
            os.makedirs(self.blocks, exist_ok=True)
            with open(os.path.join(self.root, "layout.json"), "w") as f:
                json.dump(self.layout, f, indent=1)
        except OSError as exc:
            raise ValueError(f"kv_connector_extra_config.shared_storage_path: cannot write {self.root}: {exc}") from None
        self._init_side()

    @classmethod
    def check_config(cls, kv_config: Any) -> None:
        extra = _extra(kv_config)
        if not isinstance(extra["shared_storage_path"], str) or not extra["shared_storage_path"]:
            raise ValueError("kv_connector_extra_config.shared_storage_path must be a directory path, "
                             f"got {extra['shared_storage_path']!r}")
        size = extra["max_storage_gb"]
        if not isinstance(size, (int, float)) or isinstance(size, bool) or size < 0:
            raise ValueError(f"kv_connector_extra_config.max_storage_gb must be a number of GB >= 0, got {size!r}")

    # ==== scheduler side =======================================================================
    def _ranked(self, name: str, rank: int) -> str:
        """Rank ``rank``'s name for an entry or a link (the name itself with one rank)."""
        return name if self.world == 1 else f"{name}.r{rank}"

    def _held(self, name: str, rank: int) -> bool:
        """Whether rank ``rank`` has a published entry holding the block of hash ``name``."""
        link = os.path.join(self.blocks, self._ranked(name, rank))
        entry = os.path.realpath(link)
        return entry != link and os.path.isfile(os.path.join(entry, "meta.json"))

    def _init_scheduler_side(self) -> None:
        self._found: dict[str, int] = {}                  # request -> how many of its first blocks are stored
        self._missed: dict[str, int] = {}                 # request -> local hits when nothing was found
        self._pending_loads: dict[str, _Load] = {}
        self._loading: set[str] = set()
        self._failed: set[str] = set()                    # its load failed: computed here
        self._saved: set[str] = set()

    def _lookup(self, request: Request, num_computed_tokens: int) -> int:
        """How many of the prompt's first blocks every rank's entries hold, past the request's
        local hits (0: none); the prompt's last token is always computed here, so its block is
        never loaded."""
        want = (request.num_prompt_tokens - 1) // self.block_size
        start = num_computed_tokens // self.block_size
        hashes = request.block_hashes
        for i in range(min(want, len(hashes)) - 1, start - 1, -1):
            if all(self._held(_name(hashes[i]), r) for r in range(self.world)):
                return i + 1
        return 0

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        if (not self.kv_config.is_consumer or rid in self._failed
                or request.sampling_params.prompt_logprobs is not None):     # every position's logits needed
            return 0, False
        if self._missed.get(rid) == num_computed_tokens:   # looked up already (it waits for room)
            return 0, False
        found = self._lookup(request, num_computed_tokens)
        if not found:
            self._missed[rid] = num_computed_tokens
            return 0, False
        self._found[rid] = found
        return found * self.block_size - num_computed_tokens, True

    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        rid = request.request_id
        n = self._found.pop(rid, None)
        if not num_external_tokens or n is None:
            return
        first = n - num_external_tokens // self.block_size
        self._pending_loads[rid] = _Load(first, [_name(h) for h in request.block_hashes[first:n]],
                                         list(block_ids[0][first:n]))

    def build_connector_meta(self, scheduled: list[Request],
                             block_ids: Callable[[str], tuple[list[int], ...]] | None = None) -> bytes:
        saves: dict[str, _Save] = {}
        if self.kv_config.is_producer and block_ids is not None:
            for req in scheduled:       # the step that computes the prompt's last token saves it
                rid = req.request_id
                n = min(req.num_prompt_tokens // self.block_size, len(req.block_hashes))
                if rid in self._saved or req.num_computed_tokens < req.num_prompt_tokens or not n:
                    continue
                self._saved.add(rid)
                last = _name(req.block_hashes[n - 1])
                if all(self._held(last, r) for r in range(self.world)):
                    continue            # entries hold these blocks already
                saves[rid] = _Save([_name(h) for h in req.block_hashes[:n]], list(block_ids(rid)[0][:n]))
        meta = _Meta(self._pending_loads, saves)
        self._loading.update(self._pending_loads)
        self._pending_loads = {}
        return _encode(meta)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_recving:
            self._loading.discard(rid)
        for rid in output.failed_recving:
            self._loading.discard(rid)
            self._failed.add(rid)

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None          # the saves copied the blocks out during the forward

    def request_dropped(self, request_id: str) -> None:
        self._forget(request_id)

    def _forget(self, rid: str) -> None:
        for d in (self._found, self._missed, self._pending_loads):
            d.pop(rid, None)
        self._failed.discard(rid)
        self._saved.discard(rid)

    def is_loading(self, request_id: str) -> bool:
        return request_id in self._loading or request_id in self._pending_loads

    def has_pending(self) -> bool:
        return bool(self._loading or self._pending_loads)

    def reset(self) -> None:
        self._loading.clear()
        self._pending_loads.clear()
        self._found.clear()

    # ==== worker side ==========================================================================
    def _init_worker_side(self) -> None:
        self.kv_caches: list[Any] = []
        self._lock = threading.Lock()
        # request -> (save, its temporary entry, its block ids as an index on the cache's device)
        self._step_saves: dict[str, tuple[_Save, str, Any]] = {}
        self._finished_recving: list[str] = []
        self._failed_recving: dict[str, str] = {}
        self._transfers: list[tuple[str, str, int, int, int]] = []
        self._stats: dict[str, float] = {}
        self._loads = ThreadPoolExecutor(1, thread_name_prefix="kv-storage-load")
        self._writes: queue.Queue = queue.Queue(WRITE_QUEUE)
        self._writer = threading.Thread(target=self._write_loop, name="kv-storage-write", daemon=True)
        self._writer.start()
        self._max_bytes = float(self.extra["max_storage_gb"]) * 2**30 / self.world     # each rank its share
        self._sizes: dict[str, int] = {}          # this rank's entries present at start and written since -> bytes
        self._closed = False
        atexit.register(self.shutdown)            # the saves handed to the writer are published first

    def _remove_stale(self, age_s: float = 3600.0) -> None:
        """Remove the entries a process left half written (killed while saving) that nobody
        finished since; count the size of this rank's others (for max_storage_gb)."""
        now = time.time()
        for name in os.listdir(self.entries):
            path = os.path.join(self.entries, name)
            try:
                if name.startswith(".tmp-"):
                    if now - os.stat(path).st_mtime > age_s:
                        shutil.rmtree(path, ignore_errors=True)
                    continue
                if self.world > 1 and not name.endswith(f".r{self.rank}"):
                    continue
                with open(os.path.join(path, "meta.json")) as f:
                    self._sizes[path] = int(json.load(f)["bytes"])
            except (OSError, ValueError, KeyError, TypeError):
                pass

    def _add(self, **kw: float) -> None:
        with self._lock:
            for k, v in kw.items():
                self._stats[k] = self._stats.get(k, 0.0) + v

    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        """This rank's caches (its stage's layers, its heads); ``rank`` is set by now."""
        self.kv_caches = list(kv_caches)
        t = self.kv_caches[0]
        layers = self.layout["num_layers"]
        if self.world > self.tp_size:                 # a pipeline stage's layers
            from models.pp_layout import pp_layers
            first, end = pp_layers(layers, self.world // self.tp_size, self.rank // self.tp_size)
            layers = end - first
        shape = (len(self.kv_caches), self.block_size, int(t.shape[4]))
        expect = (layers, self.block_size, self.layout["head_size"])
        if shape != expect:
            raise ValueError(f"the KV cache (layers, block size, head size) {shape} is not the storage layout's {expect}")
        self._remove_stale()

    def start_load_kv(self, metadata: bytes) -> None:
        if not metadata:
            return
        import torch
        meta = _decode(metadata, type=_Meta)
        for rid, load in meta.loads.items():
            self._loads.submit(self._load, rid, load)
        for rid, save in meta.saves.items():
            idx = torch.tensor(save.block_ids, dtype=torch.long, device=self.kv_caches[0].device)
            self._step_saves[rid] = (save, os.path.join(self.entries, f".tmp-{uuid.uuid4().hex}"), idx)

    def has_layer_work(self) -> bool:
        return bool(self._step_saves)

    def save_kv_layer(self, layer: int, kv_layer: Any, attn_metadata: Any) -> None:
        for rid, (save, tmp, idx) in self._step_saves.items():
            blocks = kv_layer.index_select(1, idx)         # (2, n, block_size, kv heads, head size), a copy
            self._writes.put(("layer", rid, tmp, layer, blocks.cpu() if blocks.device.type != "cpu" else blocks))

    def wait_for_save(self) -> None:
        """The layers' copies are taken: the blocks may be reused now; the writer publishes each
        entry once its last layer is on disk."""
        for rid, (save, tmp, _) in self._step_saves.items():
            self._writes.put(("publish", rid, tmp, save, time.monotonic_ns()))
        self._step_saves = {}

    def get_finished(self) -> KVConnectorOutput:
        with self._lock:
            out = KVConnectorOutput([], self._finished_recving, self._failed_recving, self._stats, self._transfers)
            self._finished_recving, self._failed_recving, self._stats, self._transfers = [], {}, {}, []
        return out

    def _write_loop(self) -> None:
        import torch
        started: dict[str, int] = {}
        while True:
            item = self._writes.get()
            if item is None:
                return
            kind, rid, tmp = item[:3]
            try:
                if kind == "layer":
                    layer, blocks = item[3:]
                    started.setdefault(tmp, time.monotonic_ns())
                    os.makedirs(tmp, exist_ok=True)
                    blocks.contiguous().view(torch.uint8).numpy().tofile(os.path.join(tmp, f"layer-{layer}.kv"))
                else:
                    self._publish(rid, tmp, item[3], started.pop(tmp, item[4]))
            except Exception as exc:     # a full disk or a removed directory: the entry is not saved
                log.warning("saving the KV of request %s to %s failed: %s", rid, self.root, exc)
                started.pop(tmp, None)
                shutil.rmtree(tmp, ignore_errors=True)
            finally:
                self._writes.task_done()

    def _publish(self, rid: str, tmp: str, save: _Save, t0: int) -> None:
        t = self.kv_caches[0]
        files = [os.path.join(tmp, f"layer-{i}.kv") for i in range(len(self.kv_caches))]
        nbytes = sum(os.path.getsize(f) for f in files)      # a missing layer raises: not published
        if nbytes != len(files) * 2 * len(save.block_ids) * t[0, 0].numel() * t.element_size():
            raise RuntimeError(f"{tmp} holds {nbytes} bytes, not the {len(save.block_ids)} blocks of every layer")
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({"hashes": save.hashes, "dtype": str(t.dtype), "shape": [2, len(save.block_ids), *t.shape[2:]],
                       "bytes": nbytes}, f)
        name = self._ranked(save.hashes[-1], self.rank)
        entry = os.path.join(self.entries, name)
        try:
            os.rename(tmp, entry)
        except OSError:             # another instance published the same blocks first
            shutil.rmtree(tmp, ignore_errors=True)
            return
        for h in save.hashes:       # each block names the entry (a link written whole, then moved in)
            link = os.path.join(self.blocks, self._ranked(h, self.rank))
            if not os.path.lexists(link):
                tmp_link = f"{link}.{uuid.uuid4().hex[:8]}.tmp"
                os.symlink(os.path.join("..", "entries", name), tmp_link)
                os.replace(tmp_link, link)
        self._add(sent_bytes=nbytes, sent_blocks=len(save.block_ids), sent_requests=1)
        with self._lock:
            self._transfers.append((rid, "KVSend", t0, time.monotonic_ns(), nbytes))
        self._sizes[entry] = nbytes
        self._evict()

    def _evict(self) -> None:
        """Past max_storage_gb, the entries used least recently (loaded or written) go."""
        if not self._max_bytes:
            return
        total = sum(self._sizes.values())
        if total <= self._max_bytes:
            return
        def used(entry: str) -> float:
            try:
                return os.stat(os.path.join(entry, "meta.json")).st_mtime
            except OSError:
                return 0.0
        for entry in sorted(self._sizes, key=used):
            if total <= self._max_bytes:
                break
            total -= self._sizes.pop(entry)
            self.remove_entry(entry)

    def remove_entry(self, entry: str) -> None:
        """Delete an entry and the links that name it (a reader then misses or fails its load)."""
        try:
            with open(os.path.join(entry, "meta.json")) as f:
                hashes = json.load(f)["hashes"]
        except (OSError, ValueError, KeyError):
            hashes = []
        for h in hashes:
            link = os.path.join(self.blocks, self._ranked(h, self.rank))
            if os.path.realpath(link) == os.path.realpath(entry):
                try:
                    os.unlink(link)
                except OSError:
                    pass
        shutil.rmtree(entry, ignore_errors=True)

    def _load(self, rid: str, load: _Load) -> None:
        t0, t0_ns = time.perf_counter(), time.monotonic_ns()
        link = os.path.join(self.blocks, self._ranked(load.hashes[-1], self.rank))
        entry = os.path.realpath(link)
        try:
            with open(os.path.join(entry, "meta.json")) as f:
                meta = json.load(f)
            first, n = load.first, len(load.block_ids)
            if meta["hashes"][first:first + n] != load.hashes:
                raise RuntimeError(f"{entry} holds other blocks than the prompt's")
            os.utime(os.path.join(entry, "meta.json"))        # used: evicted last
            total = 0
            blocks = len(meta["hashes"])
            for i, layer in enumerate(self.kv_caches):
                per_block = layer[0, 0].numel() * layer.element_size()
                fd = os.open(os.path.join(entry, f"layer-{i}.kv"), os.O_RDONLY)
                try:
                    size = os.fstat(fd).st_size
                    if size != 2 * blocks * per_block:
                        raise RuntimeError(f"layer {i} of {entry} holds {size} bytes, not {blocks} blocks")
                    total += self._read_blocks(fd, layer, blocks, first, load.block_ids, per_block)
                finally:
                    os.close(fd)
            self._add(recv_bytes=total, recv_blocks=n, recv_seconds=time.perf_counter() - t0, recv_requests=1)
            with self._lock:
                self._finished_recving.append(rid)
                self._transfers.append((rid, "KVLoad", t0_ns, time.monotonic_ns(), total))
        except Exception as exc:    # reported, so the request is computed here, never stuck
            log.warning("loading the KV of request %s from %s failed: %s", rid, entry, exc)
            self._add(recv_failures=1)
            with self._lock:
                self._failed_recving[rid] = f"{type(exc).__name__}: {exc}"
                self._transfers.append((rid, "KVLoadFailed", t0_ns, time.monotonic_ns(), 0))

    @staticmethod
    def _read_blocks(fd: int, layer: Any, blocks: int, first: int, block_ids: list[int], per_block: int) -> int:
        """Read blocks ``first`` on of a layer's file (K of every block, then V) into the cache's
        ``block_ids``: on the CPU straight from the file into the cache's memory, one read per run
        of consecutive blocks."""
        import numpy as np
        import torch
        n = len(block_ids)
        if layer.device.type == "cpu":
            total = 0
            for kv in (0, 1):
                dst = layer[kv].view(torch.uint8).numpy().reshape(-1)
                for j, m in runs(block_ids):
                    start = block_ids[j] * per_block
                    want = m * per_block
                    got = os.preadv(fd, [memoryview(dst[start:start + want])],
                                    (kv * blocks + first + j) * per_block)
                    if got != want:
                        raise RuntimeError(f"read {got} of {want} bytes")
                    total += got
            return total
        data = np.frombuffer(os.pread(fd, 2 * blocks * per_block, 0), dtype=np.uint8).reshape(2, blocks, per_block)
        data = data[:, first:first + n]
        src = torch.from_numpy(np.ascontiguousarray(data)).view(layer.dtype).view(2, n, *layer.shape[2:])
        layer.index_copy_(1, torch.tensor(block_ids, dtype=torch.long, device=layer.device), src.to(layer.device))
        return src.numel() * src.element_size()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait (up to ``timeout`` s) until every save handed to the writer is published."""
        deadline = time.monotonic() + timeout
        while self._writes.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def shutdown(self) -> None:
        if self.role is not KVConnectorRole.WORKER or self._closed:
            return
        self._closed = True
        if not self.flush():
            log.warning("KV saves still being written to %s at shutdown: left unpublished", self.root)
        self._writes.put(None)
        self._writer.join(timeout=2)
        self._loads.shutdown(wait=False, cancel_futures=True)
