"""Weight transfer for RL loops (vLLM's weight transfer engine, ``--weight-transfer-config``).

A trainer process and the engine's workers form a torch.distributed process group of their own
(gloo, or NCCL between CUDA devices): the trainer is rank 0 and hosts the rendezvous
(``master_address``:``master_port``), the workers join at ``rank_offset`` + their global rank
(data-parallel engine, pipeline stage, tensor rank, in vLLM's order). A round is vLLM's:
``start_weight_update``, one or more ``update_weights`` (the parameters' checkpoint names, dtypes
and shapes; the tensors follow as broadcasts from the trainer, several packed into one buffer of
at most ``packed_buffer_size_bytes``), ``finish_weight_update``. At the end of a round each
worker builds the model from the tensors it received exactly as start-up builds it from a
checkpoint (split over the ranks, quantized, packed) and copies it into the served model's own
tensors, so the KV cache, the running requests and the CUDA graphs stay: all or nothing, a round
that misses a parameter changes no weight and says which are missing.

The trainer's side is here too (``TrainerWeightTransferEngine``, with ``HTTPWeightSyncClient``
for a server and ``LLMWeightSyncClient`` for an ``LLM`` in the trainer's own process)."""
from __future__ import annotations

import datetime
import hashlib
import json
import logging
import threading
import urllib.error
import urllib.request
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from actors.engine.weight_transfer import NOT_CONFIGURED, WeightTransferConfig

log = logging.getLogger("troupe.weight_transfer")

ALIGN = 64                                    # each tensor's bytes start at a multiple of this in a packed buffer
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30    # vLLM's defaults
DEFAULT_PACKED_NUM_BUFFERS = 2
PREFIX = "troupe-weight-transfer"
NOT_JOINED = ("weight transfer not initialized: the trainer's group is to be joined first "
              "(/init_weight_transfer_engine, LLM.init_weight_transfer_engine)")

Meta = tuple[str, torch.dtype, tuple[int, ...]]


# -- the wire: metadata, packing, the process group (both sides) ----------------------------------
def parse_update_info(info: Any) -> list[Meta]:
    """vLLM's update info ``{"names", "dtype_names", "shapes"}`` as (name, dtype, shape) triples;
    ValueError naming what is wrong."""
    if not isinstance(info, Mapping):
        raise ValueError(f"update_info must be a JSON object with names, dtype_names and shapes, "
                         f"got {type(info).__name__}")
    unknown = sorted(set(info) - {"names", "dtype_names", "shapes", "packed", "is_checkpoint_format"})
    if unknown:
        raise ValueError(f"unsupported update_info field(s) {', '.join(unknown)}; accepted: names, "
                         f"dtype_names, shapes")
    names, dtypes, shapes = info.get("names"), info.get("dtype_names"), info.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise ValueError("update_info needs the lists names, dtype_names and shapes")
    if len(dtypes) != len(names):
        raise ValueError(f"`dtype_names` should be of the same size as `names`: got {len(dtypes)} and {len(names)}")
    if len(shapes) != len(names):
        raise ValueError(f"`shapes` should be of the same size as `names`: got {len(shapes)} and {len(names)}")
    out = []
    for name, dtype_name, shape in zip(names, dtypes, shapes):
        if not isinstance(name, str):
            raise ValueError(f"a parameter's name must be a string, got {name!r}")
        dtype = getattr(torch, str(dtype_name), None) if isinstance(dtype_name, str) else None
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{name}: dtype {dtype_name!r} is not a torch dtype (float32, bfloat16, ...)")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                for d in shape)):
            raise ValueError(f"{name}: shape must be a list of non-negative integers, got {shape!r}")
        out.append((name, dtype, tuple(shape)))
    return out


def update_info_of(metas: list[Meta]) -> dict[str, list]:
    return {"names": [m[0] for m in metas], "dtype_names": [str(m[1]).removeprefix("torch.") for m in metas],
            "shapes": [list(m[2]) for m in metas]}


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def packed_chunks(metas: list[Meta], limit: int) -> list[tuple[int, list[tuple[int, int, int]]]]:
    """The packed broadcasts of a round: each (its bytes, [(parameter index, offset, bytes)]),
    parameters in order, a buffer closed when the next would pass ``limit`` (one larger than
    ``limit`` goes alone). Both sides compute it from the same metadata."""
    chunks: list[tuple[int, list[tuple[int, int, int]]]] = []
    items: list[tuple[int, int, int]] = []
    size = 0
    for i, (_, dtype, shape) in enumerate(metas):
        n = _nbytes(dtype, shape)
        if n == 0:
            continue
        start = -(-size // ALIGN) * ALIGN
        if items and start + n > limit:
            chunks.append((size, items))
            items, start = [], 0
        items.append((i, start, n))
        size = start + n
    if items:
        chunks.append((size, items))
    return chunks


def open_group(backend: str, address: str, port: int, rank: int, world_size: int, timeout_s: float,
               device: torch.device) -> dist.ProcessGroup:
    """The trainer's and workers' process group: rank 0 hosts the store at address:port."""
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("weight transfer backend nccl needs CUDA devices on both sides; use gloo")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, rank == 0, timeout, wait_for_workers=False)
    store = dist.PrefixStore(PREFIX, store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


# -- the worker's side ------------------------------------------------------------------------------
class WeightReceiver:
    """A worker's end of the transfer: its process group with the trainer, and the tensors of the
    round under way (None: no round)."""

    def __init__(self, config: WeightTransferConfig | None, device: torch.device, global_rank: int) -> None:
        self.config, self.device, self.global_rank = config, device, global_rank
        self.group: dist.ProcessGroup | None = None
        self.packed = False
        self.buffer_bytes = DEFAULT_PACKED_BUFFER_SIZE_BYTES
        self.received: dict[str, torch.Tensor] | None = None
        self.draft = False                       # the round updates speculative decoding's draft model

    def _configured(self) -> WeightTransferConfig:
        if self.config is None:
            raise ValueError(NOT_CONFIGURED)
        return self.config

    def init(self, init_info: Mapping[str, Any]) -> None:
        """Join the trainer's group (vLLM's worker init info: master_address, master_port,
        rank_offset, world_size, packed, packed_buffer_size_bytes, packed_num_buffers)."""
        config = self._configured()
        if not isinstance(init_info, Mapping):
            raise ValueError(f"init_info must be a JSON object, got {type(init_info).__name__}")
        accepted = {"master_address", "master_port", "rank_offset", "world_size", "packed",
                    "packed_buffer_size_bytes", "packed_num_buffers"}
        unknown = sorted(set(init_info) - accepted)
        if unknown:
            raise ValueError(f"unsupported init_info field(s) {', '.join(unknown)}; accepted: "
                             f"{', '.join(sorted(accepted))}")
        missing = sorted({"master_address", "master_port", "rank_offset", "world_size"} - set(init_info))
        if missing:
            raise ValueError(f"init_info needs {', '.join(missing)}")
        address, port = init_info["master_address"], init_info["master_port"]
        offset, world = init_info["rank_offset"], init_info["world_size"]
        if not isinstance(address, str) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                   for v in (port, offset, world)):
            raise ValueError("init_info: master_address is a host name, master_port, rank_offset and "
                             "world_size are integers")
        rank = offset + self.global_rank
        if not 0 < rank < world:
            raise ValueError(f"init_info: this worker's rank {rank} (rank_offset {offset} + worker {self.global_rank}) "
                             f"is not in 1..{world - 1} (world_size {world}, the trainer rank 0)")
        buffer_bytes = init_info.get("packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_SIZE_BYTES)
        if not (isinstance(buffer_bytes, int) and buffer_bytes > 0):
            raise ValueError(f"init_info: packed_buffer_size_bytes must be a positive integer, got {buffer_bytes!r}")
        self.shutdown()
        try:
            self.group = open_group(config.backend, address, port, rank, world, config.timeout_s, self.device)
        except (RuntimeError, OSError) as exc:
            raise ValueError(f"weight transfer: could not join the trainer's group at {address}:{port} as rank "
                             f"{rank} of {world} ({exc})") from None
        self.packed = bool(init_info.get("packed", False))
        self.buffer_bytes = buffer_bytes
        log.info("weight transfer (%s): joined the trainer's group at %s:%d as rank %d of %d", config.backend,
                 address, port, rank, world)

    def shutdown(self) -> None:
        if self.received is not None:
            raise ValueError("Cannot release a trainer connection during a weight update")
        self.group = None                        # the group's sockets close with it

    def start(self, draft: bool) -> None:
        self._configured()
        if self.group is None:
            raise ValueError(NOT_JOINED)
        if self.received is not None:
            log.warning("a weight update round was started again: the tensors received so far are dropped")
        self.received, self.draft = {}, draft

    def receive(self, update_info: Any) -> int:
        """One update_weights call: the broadcasts its metadata announces, kept for the round's end
        (a list of update infos: this worker's by its global rank, as in vLLM). The tensors are
        received even when the round is refused afterwards, so the trainer's broadcasts end."""
        self._configured()
        if isinstance(update_info, list):
            if self.global_rank >= len(update_info):
                raise ValueError(f"update_info lists {len(update_info)} workers' infos; this is worker {self.global_rank}")
            update_info = update_info[self.global_rank]
        metas = parse_update_info(update_info)
        if self.group is None:
            raise ValueError(NOT_JOINED)
        if self.received is None:
            raise ValueError("start_weight_update must be called before update_weights.")
        on = self.device if self.config.backend == "nccl" else torch.device("cpu")
        try:
            if self.packed:
                for size, items in packed_chunks(metas, self.buffer_bytes):
                    buf = torch.empty(size, dtype=torch.uint8, device=on)
                    broadcast(self.group, buf)
                    for i, offset, n in items:
                        name, dtype, shape = metas[i]
                        self.received[name] = buf[offset:offset + n].view(dtype).view(shape)
            else:
                for name, dtype, shape in metas:
                    t = torch.empty(shape, dtype=dtype, device=on)
                    if t.numel():
                        broadcast(self.group, _bytes_of(t))
                    self.received[name] = t
            for name, dtype, shape in metas:
                if _nbytes(dtype, shape) == 0:
                    self.received[name] = torch.empty(shape, dtype=dtype)
        except RuntimeError as exc:              # the trainer went away, or a broadcast timed out
            self.group, self.received = None, None
            raise ValueError(f"weight transfer: the trainer's broadcast failed ({exc}); the round is dropped "
                             f"and the group closed: init again") from None
        return len(metas)

    def take(self) -> tuple[dict[str, torch.Tensor], bool]:
        """The round's tensors (the round ends), and whether they are the draft model's."""
        self._configured()
        if self.received is None:
            raise ValueError("finish_weight_update called without a matching start_weight_update.")
        received, self.received = self.received, None
        return received, self.draft


def drain(received: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The received tensors as a checkpoint's (name, float tensor) stream, each let go once read."""
    while received:
        name = next(iter(received))
        t = received.pop(name)
        yield name, t.float() if t.is_floating_point() else t


def tensor_digests(model: torch.nn.Module, tensors: Callable[[torch.nn.Module], dict[str, torch.Tensor]],
                   prefix: str) -> dict[str, str]:
    """SHA-256 of every tensor the model holds (vLLM's weight checksums), by module and attribute."""
    out = {}
    for name, module in model.named_modules():
        for key, t in tensors(module).items():
            data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            out[f"{prefix}{name + '.' if name else ''}{key}"] = hashlib.sha256(data).hexdigest()
    return out


# -- the trainer's side -----------------------------------------------------------------------------
class HTTPWeightSyncClient:
    """A Troupe (or vLLM) server's weight transfer routes, as vLLM's HTTPVLLMWeightSyncClient calls
    them; an error answer raises RuntimeError with the server's message."""

    def __init__(self, base_url: str, timeout: float = 300, api_key: str | None = None) -> None:
        self.base_url, self.timeout, self.api_key = base_url.rstrip("/"), timeout, api_key

    def _post(self, path: str, body: dict[str, Any] | None = None) -> None:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(f"{self.base_url}/{path}", json.dumps(body or {}).encode(), headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"POST /{path}: {exc.code} {exc.read().decode(errors='replace')}") from None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("init_weight_transfer_engine", {"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self._post("start_weight_update")

    def start_draft_weight_update(self) -> None:
        self._post("start_draft_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("finish_weight_update", None if weight_version is None else {"weight_version": weight_version})


class LLMWeightSyncClient:
    """The same calls on an ``LLM`` (or its engine) in the trainer's own process."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def start_draft_weight_update(self) -> None:
        self.llm.start_draft_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


def _pairs(source: Any) -> list[tuple[str, torch.Tensor]]:
    """A weight source's (name, tensor) pairs: a module's parameters, a state dict, a callable
    returning pairs, or pairs."""
    if isinstance(source, torch.nn.Module):
        return list(source.named_parameters())
    if isinstance(source, Mapping):
        return list(source.items())
    if callable(source):
        return list(source())
    return list(source)


def _together(remote: Callable[[], None], local: Callable[[], None], what: str, timeout_s: float) -> None:
    """``remote`` (the engine's half, an HTTP call) and ``local`` (the trainer's half of the same
    collective) at once; the first failure raises at once (the other half gives up at its
    timeout), so a refusal never leaves the trainer waiting in a broadcast."""
    errors: list[BaseException] = []
    done = threading.Event()
    left = [2]
    lock = threading.Lock()

    def run(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:           # noqa: BLE001 -- handed to the caller
            errors.append(exc)
            done.set()
        finally:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

    for fn in (remote, local):
        threading.Thread(target=run, args=(fn,), daemon=True, name=f"troupe-{what}").start()
    if not done.wait(timeout_s + 30):
        raise TimeoutError(f"weight transfer: {what} did not finish in {timeout_s:g} s")
    if errors:
        raise errors[0]


class TrainerWeightTransferEngine:
    """The trainer's end (vLLM's NCCLTrainerWeightTransferEngine): ``trainer_init`` opens the
    group as rank 0 while the engine's workers join it, ``send_weights`` runs a whole round.

    ``init_info``: ``master_address``, ``master_port``, ``world_size`` (1 + the engine's workers),
    ``backend`` (gloo, or nccl between CUDA devices), ``packed`` (default true),
    ``packed_buffer_size_bytes``, ``timeout_s``. ``source``: a module (its named parameters, under
    the checkpoint's names: a Hugging Face model's), a state dict, or a callable returning
    (name, tensor) pairs, read afresh each round."""

    def __init__(self, client: Any, source: Any, group: dist.ProcessGroup, backend: str, packed: bool,
                 buffer_bytes: int, timeout_s: float, device: torch.device) -> None:
        self.client, self.source, self.group = client, source, group
        self.backend, self.packed, self.buffer_bytes = backend, packed, buffer_bytes
        self.timeout_s, self.device = timeout_s, device

    @classmethod
    def trainer_init(cls, init_info: Mapping[str, Any], *, client: Any, source: Any = None,
                     device: torch.device | str | None = None) -> TrainerWeightTransferEngine:
        info = dict(init_info)
        backend = info.pop("backend", "gloo")
        timeout_s = float(info.pop("timeout_s", 300.0))
        if info.pop("rank", 0) != 0:
            raise ValueError("this trainer helper is the sender, rank 0: other trainer ranks hand their "
                             "tensors to it (one process sends)")
        packed = bool(info.get("packed", True))
        buffer_bytes = int(info.get("packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_SIZE_BYTES))
        address, port, world = info["master_address"], int(info["master_port"]), int(info["world_size"])
        dev = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu"))
        worker_info = {"master_address": address, "master_port": port, "rank_offset": 1, "world_size": world,
                       "packed": packed, "packed_buffer_size_bytes": buffer_bytes,
                       "packed_num_buffers": int(info.get("packed_num_buffers", DEFAULT_PACKED_NUM_BUFFERS))}
        opened: list[dist.ProcessGroup] = []
        _together(lambda: client.init_weight_transfer_engine(worker_info),
                  lambda: opened.append(open_group(backend, address, port, 0, world, timeout_s, dev)),
                  "init", timeout_s)
        return cls(client, source, opened[0], backend, packed, buffer_bytes, timeout_s, dev)

    def send_weights(self, source: Any = None, weight_version: str | None = None, draft: bool = False) -> None:
        """One round: start, the parameters' metadata and broadcasts, finish (with
        ``weight_version``, the engine's new version). ``draft``: into speculative decoding's
        draft model."""
        pairs = _pairs(source if source is not None else self.source)
        metas: list[Meta] = [(name, t.dtype, tuple(t.shape)) for name, t in pairs]
        (self.client.start_draft_weight_update if draft else self.client.start_weight_update)()
        _together(lambda: self.client.update_weights(update_info_of(metas)),
                  lambda: self._broadcast(pairs, metas), "update_weights", self.timeout_s)
        self.client.finish_weight_update(weight_version)

    def _broadcast(self, pairs: list[tuple[str, torch.Tensor]], metas: list[Meta]) -> None:
        on = self.device
        if not self.packed:
            for _, t in pairs:
                if t.numel():
                    broadcast(self.group, _bytes_of(t.detach().to(on)))
            return
        for size, items in packed_chunks(metas, self.buffer_bytes):
            buf = torch.empty(size, dtype=torch.uint8, device=on)
            for i, offset, n in items:
                buf[offset:offset + n].copy_(_bytes_of(pairs[i][1].detach().to(on)))
            broadcast(self.group, buf)

    def shutdown(self) -> None:
        """Let the engine's workers leave the group (the engine serves on)."""
        self.client.shutdown_weight_transfer_engine()
        self.group = None
