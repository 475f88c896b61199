"""CUDA graphs for decode steps: persistent padded input buffers, the dispatch of a step to a
captured batch size, capture (largest size first, one memory pool) and replay.

A step is captured only when it is a uniform decode (every request schedules one token) of at
most the largest capture size; it is padded up to the next capture size. Everything else runs
eagerly. The dispatch, the padding and the buffer filling are device-independent: on the CPU
(tests) ``run`` executes the model eagerly over the same padded buffers a graph would read.

Buffers, for a padded batch of N rows of which the first n are real:

    rows            0 .......... n-1 | n ........ N-1
    input_ids       the step's       | 0
    positions       the step's       | 0
    slot_mapping    the step's       | -1            (the KV store skips them)
    seq_lens        the step's       | 1             (one key: slot 0 of the null block)
    block_table     the step's       | 0 (null block)
    lora_slots      the step's       | -1            (no adapter; LoRA graphs only read it)
    query_start_loc 0, 1, 2, ..., N  (fixed)

slot_mapping and block_table have one such buffer per KV cache group, (G, rows) and (G, rows,
max_blocks): each group's layers read their own rows through the captured metadata's
``groups``, views of the same buffers at every replay.

Invariant: block-table columns past a row's seq_len may hold stale block ids from earlier
steps; no attention backend reads past a row's seq_len, so they are never used. Padded rows
compute harmless values that are sliced off.
"""
from __future__ import annotations

import bisect
import dataclasses
import time
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from kernels.attention.base import AttentionMetadata

if TYPE_CHECKING:
    from actors.engine.compilation import CompilationConfig
    from actors.worker.model_runner import StepInputs


class BatchDescriptor(NamedTuple):
    """The key of a captured graph (vLLM's name): the padded batch shape, and whether the step
    has LoRA tokens (its graph adds every layer's LoRA delta through the slot buffer)."""
    num_tokens: int
    num_reqs: int
    uniform_decode: bool
    has_lora: bool = False


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 256 and of 16 beyond, below max_num_seqs; then
    max_num_seqs itself, so that every decode batch the scheduler can form has a graph."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    s = 8
    while s < max_num_seqs:
        sizes.append(s)
        s += 8 if s < 256 else 16
    return sizes + [max_num_seqs]


def graph_sizes(compilation: CompilationConfig, max_num_seqs: int) -> list[int]:
    """The decode batch sizes to capture: the config's own (``cudagraph_capture_sizes``), else
    ``capture_sizes`` up to ``max_cudagraph_capture_size`` (else ``max_num_seqs``); none above
    ``max_num_seqs``."""
    largest = min(compilation.max_cudagraph_capture_size or max_num_seqs, max_num_seqs)
    sizes = compilation.cudagraph_capture_sizes or capture_sizes(largest)
    return [s for s in sizes if s <= min(largest, max_num_seqs)]


def is_uniform_decode(meta: AttentionMetadata) -> bool:
    """One query per request, no padding, and no cascade: a cascade step runs eagerly (a graph
    captures plain attention), as vLLM does."""
    return meta.max_query_len == 1 and meta.num_tokens == meta.num_reqs and not meta.common_prefix_len


class DecodeBuffers:
    """The persistent inputs of padded decode batches of up to ``max_reqs`` rows: device tensors
    (what graphs read) and host staging (pinned on CUDA) they are copied from each step."""

    INT64 = ("input_ids", "positions", "slot_mapping", "lora_slots")
    PAD = {"input_ids": 0, "positions": 0, "slot_mapping": -1, "seq_lens": 1, "lora_slots": -1}
    PER_GROUP = ("slot_mapping", "block_table")      # (G, rows, ...): one per KV cache group

    def __init__(self, max_reqs: int, max_blocks: int, device: torch.device, num_groups: int = 1) -> None:
        self.max_reqs = max_reqs
        self.num_groups = G = num_groups
        pin = device.type == "cuda"
        shapes = {"input_ids": (max_reqs,), "positions": (max_reqs,), "seq_lens": (max_reqs,),
                  "slot_mapping": (G, max_reqs), "block_table": (G, max_reqs, max_blocks),
                  "lora_slots": (max_reqs,)}     # each row's LoRA slot (-1: none), read by LoRA graphs
        self.host: dict[str, torch.Tensor] = {}
        self.dev: dict[str, torch.Tensor] = {}
        for name, shape in shapes.items():
            dtype = torch.int64 if name in self.INT64 else torch.int32
            self.host[name] = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            self.dev[name] = torch.zeros(shape, dtype=dtype, device=device)
        self.query_start_loc = torch.arange(max_reqs + 1, dtype=torch.int32, device=device)
        self._np = {name: t.numpy() for name, t in self.host.items()}   # views of the staging
        self._copied: torch.cuda.Event | None = None    # the last step's copies out of the staging

    def fill(self, inp: StepInputs, num_padded: int, lora_slots: np.ndarray | None = None) -> None:
        """Stage the step's n rows plus padding up to ``num_padded`` (``lora_slots``: each row's
        LoRA slot; none: -1 for every row), then copy rows
        [0, num_padded) to the device (asynchronously on CUDA: the staging is written again
        only once the previous step's copies are done)."""
        n, N = inp.meta.num_reqs, num_padded
        if self._copied is not None:
            self._copied.synchronize()
        h = self._np
        rows = {"input_ids": inp.input_ids.numpy(), "positions": inp.positions.numpy(),
                "seq_lens": inp.meta.seq_lens.numpy(), "lora_slots": lora_slots if lora_slots is not None else -1}
        for name, src in rows.items():
            h[name][:n] = src
            h[name][n:N] = self.PAD[name]
        metas = inp.meta.groups or (inp.meta,)
        if len(metas) != self.num_groups:
            raise ValueError(f"a step of {len(metas)} KV cache groups for buffers of {self.num_groups}")
        for g, m in enumerate(metas):
            h["slot_mapping"][g, :n] = m.slot_mapping.numpy()
            h["slot_mapping"][g, n:N] = -1
            bt = m.block_table.numpy()                                    # (n, w)
            w = bt.shape[1]
            h["block_table"][g, :n, :w] = bt
            h["block_table"][g, n:N, :w] = 0                              # column 0: null block
        for name, dev in self.dev.items():
            if name in self.PER_GROUP:      # group by group: each copy contiguous
                for g in range(self.num_groups):
                    dev[g, :N].copy_(self.host[name][g, :N], non_blocking=True)
            else:
                dev[:N].copy_(self.host[name][:N], non_blocking=True)
        if dev.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def metadata(self, num_padded: int, max_seq_len: int, block_size: int) -> AttentionMetadata:
        """Metadata over views of the device buffers: the same tensors at every replay.
        ``max_seq_len`` is an upper bound (the model's length): the decode kernel sizes its
        split-K grid from it, and that grid must serve any context a replay meets."""
        N = num_padded
        metas = [AttentionMetadata(
            num_reqs=N, num_tokens=N, max_query_len=1, max_seq_len=max_seq_len,
            query_start_loc=self.query_start_loc[:N + 1], seq_lens=self.dev["seq_lens"][:N],
            block_table=self.dev["block_table"][g, :N], slot_mapping=self.dev["slot_mapping"][g, :N],
            block_size=block_size) for g in range(self.num_groups)]
        return metas[0] if len(metas) == 1 else dataclasses.replace(metas[0], groups=tuple(metas))


class CudaGraphRunner:
    """Runs uniform decode steps through padded persistent buffers: replays the graph captured
    for the padded size when there is one (CUDA, after ``capture``), else runs the model
    eagerly over the same buffers."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], sizes: list[int],
                 max_model_len: int, block_size: int, device: torch.device, num_kv_cache_groups: int = 1) -> None:
        if not sizes:
            raise ValueError("CudaGraphRunner needs at least one capture size")
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(set(sizes))
        self.device = device
        self.buffers = DecodeBuffers(self.sizes[-1], -(-max_model_len // block_size), device, num_kv_cache_groups)
        self.metas = {N: self.buffers.metadata(N, max_model_len, block_size) for N in self.sizes}
        self.graphs: dict[BatchDescriptor, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.lora = getattr(model, "lora_manager", None)     # with LoRA: a second graph per size

    def dispatch(self, meta: AttentionMetadata, has_lora: bool = False) -> BatchDescriptor | None:
        """The padded descriptor this step runs as, or None: run it eagerly, unpadded."""
        if not is_uniform_decode(meta) or meta.num_reqs > self.sizes[-1] or (has_lora and self.lora is None):
            return None
        N = self.sizes[bisect.bisect_left(self.sizes, meta.num_reqs)]
        return BatchDescriptor(N, N, True, has_lora)

    def run(self, desc: BatchDescriptor, inp: StepInputs) -> torch.Tensor:
        """Hidden states (n, hidden) of the step's n real rows (a view: valid until the next
        step). A LoRA step's row slots are the LoRA manager's mapping of this step."""
        N = desc.num_reqs
        self.buffers.fill(inp, N, self.lora.mapping.token_slots_np if desc.has_lora else None)
        entry = self.graphs.get(desc)
        if entry is not None:
            graph, out = entry
            graph.replay()
        else:
            out = self._forward(N, desc.has_lora)
        return out[:inp.meta.num_reqs]

    def _forward(self, N: int, has_lora: bool = False) -> torch.Tensor:
        dev = self.buffers.dev
        if not has_lora:
            return self.model(dev["input_ids"][:N], dev["positions"][:N], self.kv_caches, self.metas[N])
        with self.lora.mapping.use_static(dev["lora_slots"][:N]):
            return self.model(dev["input_ids"][:N], dev["positions"][:N], self.kv_caches, self.metas[N])

    @torch.inference_mode()
    def capture(self, warmup: int = 2) -> float:
        """Capture one graph per size, largest first, all in one memory pool (a smaller graph
        reuses the larger ones' blocks; they never run at the same time). Returns seconds."""
        if self.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, the model is on {self.device}")
        t0 = time.perf_counter()
        self._pad_all()
        pool = torch.cuda.graph_pool_handle()
        for N in reversed(self.sizes):
            for has_lora in (False, True) if self.lora is not None else (False,):
                for _ in range(warmup):       # compiles this size's Triton kernels outside capture
                    self._forward(N, has_lora)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(N, has_lora)
                self.graphs[BatchDescriptor(N, N, True, has_lora)] = (graph, out)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _pad_all(self) -> None:
        """Every row padding: warm-up and capture runs then write nothing to the KV cache."""
        for name, value in DecodeBuffers.PAD.items():
            self.buffers.dev[name].fill_(value)
        self.buffers.dev["block_table"].zero_()
