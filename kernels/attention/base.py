"""The attention-backend interface: per-step metadata, what a layer needs from a backend, and
the contract every backend keeps. Backends declare what they support and say why they refuse."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """What one forward pass needs to read and write the paged KV cache.

    Tokens of all scheduled requests are flattened into one batch of T tokens, request after
    request; request i owns tokens ``query_start_loc[i]:query_start_loc[i+1]``.

    With several KV cache groups (the hybrid KV cache: sliding-window layers apart from full
    attention ones), each group has its own block table and slot mapping: ``groups[g]`` is the
    step's metadata for group g's layers (``for_group``), and the fields here are group 0's.
    Backends are always given one group's metadata.
    """

    num_reqs: int
    num_tokens: int                 # T, padding included
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor   # (B + 1,) int32, cumulative query lengths, starts at 0
    seq_lens: torch.Tensor          # (B,) int32, tokens in the cache after this step (context + new)
    block_table: torch.Tensor       # (B, max_blocks) int32, physical block ids, padding points at block 0
    slot_mapping: torch.Tensor      # (T,) int64, block_id * block_size + offset; -1 = padding, not written
    block_size: int
    common_prefix_len: int = 0      # P: tokens every request holds in the same first blocks (0 = none); a
                                    # multiple of block_size, every query at a position >= P (cascade.py)
    groups: tuple[AttentionMetadata, ...] = ()   # per KV cache group when there are several
    state_slots: torch.Tensor | None = None      # (B,) int64: each request's recurrent state slot (its row of
                                                 # the worker's batch), read by state-space layers (models/mamba.py)
    # a prefix LM's images in the step (kernels/attention/prefix_lm.py): (request, the step's row of
    # the first query, that query's position, the image's first and end positions), one per image
    # whose positions the step computes; () for any other step
    mm_prefix_spans: tuple[tuple[int, int, int, int, int], ...] = ()

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata of KV cache group ``group``'s layers."""
        if self.groups:
            return self.groups[group]
        if group:
            raise ValueError(f"KV cache group {group} asked of a step with one group")
        return self

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


@dataclass(frozen=True, slots=True)
class AttentionRequirements:
    """What one model's attention layers need from a backend."""
    dtype: torch.dtype               # query / key / value dtype
    kv_cache_dtype: torch.dtype
    head_size: int
    block_size: int
    sliding_window: int | None       # the largest window of any layer; None = full attention only
    device: str                      # "cpu" | "cuda"
    logits_soft_cap: bool = False    # some layer caps its scores (Gemma 2): cap * tanh(score / cap)
    sinks: bool = False              # the layers have attention sinks (gpt-oss): a learned logit per head
    alibi: bool = False              # ALiBi (BLOOM, MPT): each score biased by its head's slope times the distance


CudaGraphSupport = Literal["never", "uniform_decode", "always"]


class AttentionBackend(ABC):
    """Contract: ``forward`` first writes ``key``/``value`` into ``kv_cache`` through
    ``meta.slot_mapping`` (slots of -1 are skipped), then returns causal attention of each
    request's queries over that request's whole context, read through ``meta.block_table``.
    A query at absolute position p sees keys at positions k with k <= p, and, when
    ``sliding_window`` W is given, also p - k < W (the last W positions, itself included; the
    Hugging Face convention).

    kv_cache: (2, num_blocks, block_size, num_kv_heads, head_size), [0] keys and [1] values.
    An 8-bit float cache (float8_e4m3fn / float8_e5m2, ``--kv-cache-dtype fp8``) holds
    fp8(key / k_scale) and fp8(value / v_scale), rounded to nearest even and saturated, and every
    read is fp8 * scale (kernels/attention/fp8.py); ``k_scale`` / ``v_scale`` are the layer's
    float32 scalars on the cache's device (None: 1.0), unused by the other cache dtypes.

    ``meta.common_prefix_len`` P > 0 says that the requests' first P / block_size block-table
    entries are the same blocks and that every query lies at a position >= P: a backend that
    ``supports_cascade`` may attend over that prefix once for all queries (cascade attention,
    kernels/attention/cascade.py) when the layer has no sliding window; any backend may ignore it.

    ``logits_soft_cap`` C (Gemma 2's attn_logit_softcapping) replaces each scaled score s by
    C * tanh(s / C) before the softmax; only a backend that ``supports_logits_soft_cap`` takes it.

    ``sinks`` S (H,) (gpt-oss's attention sinks, in the model's dtype): head h's softmax has one more term,
    exp(S[h]), with no value behind it, so a query's weights sum to less than one: the output is
    scaled by sum(exp(s)) / (sum(exp(s)) + exp(S[h])); only a backend that ``supports_sinks``
    takes them.

    ``alibi_slopes`` A (H,) float32 (ALiBi: BLOOM's, MPT's positions): head h's score of a key
    at position k for a query at position p gains A[h] * (k - p), after the scale; only a backend
    that ``supports_alibi`` takes them.

    Subclasses declare their capabilities; ``refusal`` turns them into a reason string.
    """

    name: ClassVar[str] = "base"
    devices: ClassVar[tuple[str, ...]] = ()
    dtypes: ClassVar[tuple[torch.dtype, ...]] = ()
    kv_cache_dtypes: ClassVar[tuple[torch.dtype, ...]] = ()
    head_sizes: ClassVar[tuple[int, ...] | None] = None      # None: any
    block_sizes: ClassVar[tuple[int, ...] | None] = None     # None: any
    supports_sliding_window: ClassVar[bool] = False
    supports_logits_soft_cap: ClassVar[bool] = False   # takes forward's logits_soft_cap
    supports_sinks: ClassVar[bool] = False          # takes forward's sinks
    supports_alibi: ClassVar[bool] = False          # takes forward's alibi_slopes
    supports_cascade: ClassVar[bool] = False        # uses meta.common_prefix_len
    cascade_min_prefix: ClassVar[int] = 256         # the shortest shared prefix worth a cascade here
    cudagraph_support: ClassVar[CudaGraphSupport] = "never"

    @classmethod
    def refusal(cls, req: AttentionRequirements) -> str | None:
        """None when this backend can serve ``req``, else the reason it cannot."""
        if req.device not in cls.devices:
            return f"{cls.name}: runs on {', '.join(cls.devices)}, not {req.device}"
        if req.dtype not in cls.dtypes:
            return f"{cls.name}: dtype {req.dtype} not supported ({_names(cls.dtypes)})"
        if req.kv_cache_dtype not in cls.kv_cache_dtypes:
            return f"{cls.name}: KV cache dtype {req.kv_cache_dtype} not supported ({_names(cls.kv_cache_dtypes)})"
        if cls.head_sizes is not None and req.head_size not in cls.head_sizes:
            return f"{cls.name}: head size {req.head_size} not supported ({cls.head_sizes})"
        if cls.block_sizes is not None and req.block_size not in cls.block_sizes:
            return f"{cls.name}: block size {req.block_size} not supported ({cls.block_sizes})"
        if req.sliding_window is not None and not cls.supports_sliding_window:
            return f"{cls.name}: sliding-window attention not supported"
        if req.logits_soft_cap and not cls.supports_logits_soft_cap:
            return f"{cls.name}: attention logit softcapping not supported"
        if req.sinks and not cls.supports_sinks:
            return f"{cls.name}: attention sinks not supported"
        if req.alibi and not cls.supports_alibi:
            return f"{cls.name}: ALiBi not supported"
        return None

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,     # (T, num_heads, head_size)
        key: torch.Tensor,       # (T, num_kv_heads, head_size)
        value: torch.Tensor,     # (T, num_kv_heads, head_size)
        kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_size)
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        k_scale: torch.Tensor | None = None,   # () float32
        v_scale: torch.Tensor | None = None,
        logits_soft_cap: float | None = None,  # scores (after the scale) capped: cap * tanh(s / cap)
        sinks: torch.Tensor | None = None,     # (num_heads,), each head's sink logit
        alibi_slopes: torch.Tensor | None = None,   # (num_heads,) float32, ALiBi's slopes
    ) -> torch.Tensor:           # (T, num_heads, head_size)
        ...


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)
