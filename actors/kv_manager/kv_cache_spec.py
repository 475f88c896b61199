"""KV cache specifications: what one attention layer needs per block, the KV cache groups (layers
that share one block table), and the cache tensor layout with its per-layer views.

Groups (vLLM's hybrid KV cache manager). Layers of one kind (full attention, or one sliding
window) share a block table; a model mixing kinds has one group per kind, or several per kind,
every group holding the same number of layers, ``group_size``, so that a block id stands for
the same bytes in every group. Gemma 3 270m, 15 sliding layers (S) and 3 global ones (F):

    group 0  F5  F11 F17          full attention: every block of the sequence
    group 1  S0  S1  S2           sliding window: the blocks of the last window only
    ...                           (older entries of its block table point at the null block)
    group 5  S12 S13 S14 S15 S16  (15 sliding layers in 5 groups of 3)

Layout: one flat buffer of ``group_size`` tensors, tensor-outermost:
    [tensor 0: K blocks | V blocks][tensor 1: K blocks | V blocks] ...
tensor j is the cache of layer j of every group: block b of tensor j holds layer j of whichever
group block b is allocated to (the block pool hands a block to one group at a time). Each
tensor is (2, num_blocks, block_size, num_kv_heads, head_size), so a block's keys for one layer
are contiguous (page_size_bytes / 2 bytes). With one group of all layers (a model without
sliding windows, or --disable-hybrid-kv-cache-manager) every layer has a tensor of its own and
holds every block.

State-space layers (Mamba, Gated DeltaNet: MambaSpec) hold no KV blocks: each request's recurrent
state sits in the worker's state slots (``create_state_views``); they, and layers without a token
mixer (MixerlessSpec), join no group. A model of such layers only has one group of no layers.

A draft model (speculative decoding, ``with_draft_layers``) keeps its KV cache in the same blocks:
its layers are numbered after the target's and join the target's groups, so one block id stands
for the target's page and the draft's, and the KV manager allocates, caches and frees both at
once. A draft of the target's own architecture (self_draft) pairs draft layer i with target layer
i (every group doubles: Gemma 3's draft sliding layers hold a window too); another draft model
joins a target of one group.
"""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of this layer takes: keys and values."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(KVCacheSpec):
    pass


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(KVCacheSpec):
    sliding_window: int = 0


# The spec kinds a KV cache group can serve. A subclass of a known kind is served like it.
SUPPORTED_SPECS = (FullAttentionSpec, SlidingWindowSpec)


@dataclass(frozen=True, slots=True)
class MambaSpec:
    """A state-space layer (models/mamba.py): no KV blocks, but a recurrent state of
    ``state_bytes`` per request, kept in the worker's state slots (one per request it runs). Such
    layers join no KV cache group; the attention layers beside them (a hybrid model) group as
    always, and a model of state-space layers only has one group of no layers, whose blocks
    count tokens and take no memory."""
    block_size: int
    state_bytes: int


@dataclass(frozen=True, slots=True)
class MixerlessSpec:
    """A layer without a token mixer (Nemotron-H's MLP blocks): neither KV blocks nor state."""
    block_size: int


NO_KV_SPECS = (MambaSpec, MixerlessSpec)       # layers that join no KV cache group


def attention_specs(specs: list[Any]) -> list[tuple[int, KVCacheSpec]]:
    """(layer, spec) of the layers that hold KV cache (state-space and mixerless layers left out)."""
    return [(i, s) for i, s in enumerate(specs) if not isinstance(s, NO_KV_SPECS)]


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """Layers sharing one block table, and the kind of attention that decides which blocks
    that table holds (a SlidingWindowSpec: only the last window's)."""
    layer_ids: tuple[int, ...]
    kv_cache_spec: KVCacheSpec

    @property
    def sliding_window(self) -> int | None:
        return self.kv_cache_spec.sliding_window if isinstance(self.kv_cache_spec, SlidingWindowSpec) else None


def kv_cache_groups(specs: list[KVCacheSpec], hybrid: bool = True) -> tuple[KVCacheGroupSpec, ...]:
    """The KV cache groups of a model's layers (``specs``, one per layer). ``hybrid`` False
    (--disable-hybrid-kv-cache-manager), or a model with one kind of attention layer: one group
    of every layer; with a single kind that is a sliding window and ``hybrid``, that group keeps
    only the window's blocks. Otherwise one or more groups per kind, each of ``group_size``
    layers as vLLM sizes them (the fewest layers of any kind, or the most when the counts are
    within 25%); full attention groups first. State-space and mixerless layers join no group; a
    model of those only has one group of no layers."""
    check_kv_cache_specs(specs)
    attending = attention_specs(specs)
    if not attending:
        return (KVCacheGroupSpec((), FullAttentionSpec(specs[0].block_size, 0, 0, 0)),)
    s = attending[0][1]
    shape = (s.block_size, s.num_kv_heads, s.head_size, s.dtype_bytes)
    kinds: dict[KVCacheSpec, list[int]] = {}
    for layer, spec in attending:
        window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        kind = SlidingWindowSpec(*shape, sliding_window=window) if window else FullAttentionSpec(*shape)
        kinds.setdefault(kind, []).append(layer)
    if not hybrid:
        return (KVCacheGroupSpec(tuple(i for i, _ in attending), FullAttentionSpec(*shape)),)
    if len(kinds) == 1:
        (kind, layers), = kinds.items()
        return (KVCacheGroupSpec(tuple(layers), kind),)
    counts = [len(layers) for layers in kinds.values()]
    group_size = max(counts) if max(counts) < 1.25 * min(counts) else min(counts)
    ordered = sorted(kinds.items(), key=lambda kv: (isinstance(kv[0], SlidingWindowSpec), kv[1][0]))
    return tuple(KVCacheGroupSpec(tuple(layers[i:i + group_size]), kind)
                 for kind, layers in ordered for i in range(0, len(layers), group_size))


def with_draft_layers(groups: tuple[KVCacheGroupSpec, ...], target_specs: list[KVCacheSpec],
                      draft_specs: list[KVCacheSpec]) -> tuple[KVCacheGroupSpec, ...]:
    """``groups`` (the target's) with the draft model's layers (``draft_specs``, numbered after
    the target's ``target_specs``) added: draft layer i in the group of target layer i when the
    two models' layers are alike, else all in the target's one group. ValueError when the
    draft's KV cache page differs from the target's, or the target has several groups and the
    draft another architecture."""
    check_kv_cache_specs(draft_specs)
    t, d = target_specs[0], draft_specs[0]
    shape = lambda s: (s.block_size, s.num_kv_heads, s.head_size, s.dtype_bytes)   # noqa: E731
    if shape(t) != shape(d):
        raise ValueError(f"the draft model's KV cache page ({d.num_kv_heads} KV heads of {d.head_size}) must match "
                         f"the target's ({t.num_kv_heads} KV heads of {t.head_size}): its layers share the "
                         "target's blocks")
    L = len(target_specs)
    if list(draft_specs) == list(target_specs):
        return tuple(KVCacheGroupSpec(g.layer_ids + tuple(L + i for i in g.layer_ids), g.kv_cache_spec)
                     for g in groups)
    if len(groups) > 1:
        raise ValueError("a draft model of another architecture than the target's cannot share the blocks of a "
                         f"target with {len(groups)} KV cache groups; use --disable-hybrid-kv-cache-manager")
    g = groups[0]
    window = g.sliding_window
    if window is not None and any(getattr(s, "sliding_window", None) != window for s in draft_specs):
        raise ValueError(f"the target keeps only a sliding window of {window} tokens: the draft model's layers "
                         "must have that window too")
    return (KVCacheGroupSpec(g.layer_ids + tuple(range(L, L + len(draft_specs))), g.kv_cache_spec),)


def describe_groups(groups: tuple[KVCacheGroupSpec, ...]) -> str:
    """The groups for the startup log: "1 group: full attention (18 layers)", or "6 groups of 3
    layers: 1 full attention, 5 sliding window 512"."""
    if len(groups) == 1:
        g = groups[0]
        kind = f"sliding window {g.sliding_window}" if g.sliding_window else "full attention"
        return f"1 KV cache group: {kind} ({len(g.layer_ids)} layers)"
    kinds: dict[str, int] = {}
    for g in groups:
        kind = f"sliding window {g.sliding_window}" if g.sliding_window else "full attention"
        kinds[kind] = kinds.get(kind, 0) + 1
    return (f"{len(groups)} KV cache groups of {group_size(groups)} layers: "
            + ", ".join(f"{n} {kind}" for kind, n in kinds.items()))


def layer_groups(groups: tuple[KVCacheGroupSpec, ...], num_layers: int, without_kv: frozenset[int] = frozenset()
                 ) -> list[int]:
    """The KV cache group of each layer; -1 for the layers ``without_kv`` (state-space and mixerless ones)."""
    out = [-1] * num_layers
    for g, group in enumerate(groups):
        for layer in group.layer_ids:
            out[layer] = g
    missing = [i for i, g in enumerate(out) if g < 0 and i not in without_kv]
    if missing:
        raise ValueError(f"layer {missing[0]} belongs to no KV cache group")
    return out


def layers_without_kv(specs: list[Any]) -> frozenset[int]:
    """The layers without KV cache: state-space layers (their states are the worker's) and mixerless ones."""
    return frozenset(i for i, s in enumerate(specs) if isinstance(s, NO_KV_SPECS))


def group_size(groups: tuple[KVCacheGroupSpec, ...]) -> int:
    """Layers per group: the number of cache tensors, each serving one layer of every group."""
    return max(len(g.layer_ids) for g in groups)


def bytes_per_block(groups: tuple[KVCacheGroupSpec, ...]) -> int:
    """Bytes one block id stands for: its page in every cache tensor."""
    return group_size(groups) * groups[0].kv_cache_spec.page_size_bytes


def max_blocks_per_request(group: KVCacheGroupSpec, num_tokens: int, max_num_batched_tokens: int) -> int:
    """The most blocks ``group`` holds at once for a request of ``num_tokens`` tokens computed in
    chunks of at most ``max_num_batched_tokens``: every block for full attention; for a sliding
    window W, the blocks a step's chunk of n tokens and the W - 1 keys before it span, at most
    cdiv(W - 1 + n, block_size) + 1."""
    bs = group.kv_cache_spec.block_size
    every = -(-num_tokens // bs)
    window = group.sliding_window
    if window is None:
        return every
    return min(every, -(-min(window - 1 + max_num_batched_tokens, num_tokens) // bs) + 1)


def blocks_per_request(groups: tuple[KVCacheGroupSpec, ...], num_tokens: int, max_num_batched_tokens: int) -> int:
    """Blocks of all groups a request of ``num_tokens`` tokens holds at most."""
    return sum(max_blocks_per_request(g, num_tokens, max_num_batched_tokens) for g in groups)


def max_tokens_per_request(groups: tuple[KVCacheGroupSpec, ...], num_blocks: int, max_num_batched_tokens: int,
                           limit: int) -> int:
    """The longest request, up to ``limit`` tokens, that fits alone in ``num_blocks`` blocks
    (block 0 is the null block); 0 when not even one token does."""
    usable = num_blocks - 1
    if blocks_per_request(groups, limit, max_num_batched_tokens) <= usable:
        return limit
    lo, hi = 0, limit                  # fits(lo), not fits(hi); blocks grow with the length
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if blocks_per_request(groups, mid, max_num_batched_tokens) <= usable:
            lo = mid
        else:
            hi = mid
    return lo


def model_kv_cache_specs(config: Any, block_size: int, dtype_bytes: int) -> list[Any]:
    """One spec per layer of a model (``models.config.ArchConfig``): its attention's, a MambaSpec
    for a state-space layer, a MixerlessSpec for a layer without a token mixer."""
    specs: list[Any] = []
    for layer in range(config.num_layers):
        if config.is_mamba_layer(layer):
            specs.append(MambaSpec(block_size, config.mamba.state_bytes(dtype_bytes)))
            continue
        if layer in config.mixerless_layers:
            specs.append(MixerlessSpec(block_size))
            continue
        window = config.layer_sliding_window(layer)
        shape = (block_size, config.num_kv_heads, config.head_size, dtype_bytes)
        specs.append(SlidingWindowSpec(*shape, sliding_window=window) if window
                     else FullAttentionSpec(*shape))
    return specs


def check_kv_cache_specs(specs: list[KVCacheSpec]) -> None:
    """Validate every layer's spec at start-up (raises ValueError, never an assert): known
    kinds only, and one page shape for all layers."""
    if not specs:
        raise ValueError("the model declares no KV cache layers")
    specs = [s for _, s in attention_specs(specs)]
    if not specs:
        return                    # state-space layers only
    unknown = sorted({type(s).__name__ for s in specs if not isinstance(s, SUPPORTED_SPECS)})
    if unknown:
        raise ValueError(f"no KV cache manager serves {', '.join(unknown)}; supported: "
                         f"{', '.join(c.__name__ for c in SUPPORTED_SPECS)}")
    shapes = {(s.block_size, s.num_kv_heads, s.head_size, s.dtype_bytes) for s in specs}
    if len(shapes) != 1:
        raise ValueError(f"all layers must share one KV cache page shape for now; got {sorted(shapes)}")


def num_blocks_for(specs: list[KVCacheSpec], memory_bytes: int,
                   groups: tuple[KVCacheGroupSpec, ...] | None = None) -> int:
    """How many blocks fit in ``memory_bytes``: each block id takes a page in every cache
    tensor (``groups``; None: one group of every layer, each layer holding each block)."""
    groups = groups or kv_cache_groups(specs, hybrid=False)
    per_block = bytes_per_block(groups)
    if not per_block:
        raise ValueError("a model without attention layers has no KV blocks to size by memory")
    return memory_bytes // per_block


def stage_groups(groups: tuple[KVCacheGroupSpec, ...], start: int, end: int) -> tuple[KVCacheGroupSpec, ...]:
    """``groups`` with only the layers ``start`` .. ``end`` - 1 (a pipeline stage's): the same
    groups and block ids, fewer layers each (a group may keep none), so fewer cache tensors."""
    return tuple(KVCacheGroupSpec(tuple(i for i in g.layer_ids if start <= i < end), g.kv_cache_spec)
                 for g in groups)


def zeroed(numel: int, dtype: torch.dtype, device: Any = "cpu") -> torch.Tensor:
    """A zero-filled 1-D buffer. On the CPU, private anonymous memory: its pages are zero when
    first read and taken from the system when first written, so a KV cache costs nothing at
    start-up (torch.zeros writes every page: about a second for the default model's 1 GiB here)
    and only the blocks in use take memory. Small pages: huge ones (MADV_HUGEPAGE) made the
    first write of each block cost a 2 MiB clear and, with fragmented memory, a compaction in the
    middle of a step (the offline small workload ran 4% slower), and attention read them no
    faster."""
    import torch
    if torch.device(device).type != "cpu" or numel == 0:
        return torch.zeros(numel, dtype=dtype, device=device)
    size = torch.tensor([], dtype=dtype).element_size()
    anon = mmap.mmap(-1, numel * size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):        # small pages even where huge ones are the default
        anon.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(anon, dtype=torch.uint8).view(dtype)


def create_kv_cache_views(specs: list[KVCacheSpec], num_blocks: int, dtype: torch.dtype,
                          device: Any = "cpu", groups: tuple[KVCacheGroupSpec, ...] | None = None,
                          layers: range | None = None) -> list[torch.Tensor]:
    """One flat buffer of ``group_size`` tensors of (2, num_blocks, block_size, num_kv_heads,
    head_size), and per layer the tensor it reads: layer j of every group shares tensor j
    (``groups``; None: one group of every layer, a tensor each). ``layers``: the layers whose
    views are returned (a pipeline stage's, with ``groups`` cut to them: ``stage_groups``);
    None: every layer."""
    import torch
    groups = groups or kv_cache_groups(specs, hybrid=False)
    without_kv = layers_without_kv(specs)
    attending = attention_specs(specs)          # the layers' own shape (a tensor-parallel rank's KV heads)
    s = attending[0][1] if attending else groups[0].kv_cache_spec
    if s.dtype_bytes and torch.tensor([], dtype=dtype).element_size() != s.dtype_bytes:
        raise ValueError(f"dtype {dtype} does not match the spec's {s.dtype_bytes}-byte elements")
    per_tensor = 2 * num_blocks * s.block_size * s.num_kv_heads * s.head_size
    n = group_size(groups)
    buf = zeroed(per_tensor * n, dtype, device)
    shape = (2, num_blocks, s.block_size, s.num_kv_heads, s.head_size)
    tensors = [buf[j * per_tensor:(j + 1) * per_tensor].view(shape) for j in range(n)]
    views: list[torch.Tensor | None] = [None] * len(specs)
    for g in groups:
        for j, layer in enumerate(g.layer_ids):
            views[layer] = tensors[j]
    layers = range(len(specs)) if layers is None else layers
    missing = [i for i in layers if views[i] is None and i not in without_kv]
    if missing:
        raise ValueError(f"layers {missing} belong to no KV cache group")
    return [views[i] for i in layers]


def create_state_views(config: Any, num_slots: int, dtype: torch.dtype, device: Any = "cpu"
                       ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per state-space layer of ``config`` (an ArchConfig with ``mamba``): its requests' recurrent
    states, (conv_state (num_slots, conv_dim, d_conv - 1) in ``dtype``, ssm_state (num_slots,
    *ssm_state_shape) in float32), slot i the state of the request in row i of the worker's
    batch. Lazily zeroed: a slot's pages are taken when a request first writes them."""
    import torch
    d = config.mamba
    out = {}
    for layer in range(config.num_layers):
        if config.is_mamba_layer(layer):
            conv = zeroed(num_slots * math.prod(d.conv_state_shape), dtype, device)
            ssm = zeroed(num_slots * math.prod(d.ssm_state_shape), torch.float32, device)
            out[layer] = (conv.view(num_slots, *d.conv_state_shape), ssm.view(num_slots, *d.ssm_state_shape))
    return out
