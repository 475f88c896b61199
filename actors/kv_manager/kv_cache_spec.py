"""KV cache specifications: what one attention layer needs per block, the check that a model's
layers can share one block table, and the cache tensor layout with its per-layer views.

Layout: one flat buffer, layer-outermost:
    [layer 0: K blocks | V blocks][layer 1: K blocks | V blocks] ...
each layer's view is (2, num_blocks, block_size, num_kv_heads, head_size), so a block's keys
for one layer are contiguous (page_size_bytes / 2 bytes).
"""
from __future__ import annotations

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


# The spec kinds one block table can serve. Sliding-window layers keep every block, like full
# attention (vLLM does the same with its hybrid allocator off); only the attention kernel applies
# the window. A subclass of a known kind is served like it.
SUPPORTED_SPECS = (FullAttentionSpec, SlidingWindowSpec)


def model_kv_cache_specs(config: Any, block_size: int, dtype_bytes: int) -> list[KVCacheSpec]:
    """One spec per attention layer of a model (``models.config.ArchConfig``)."""
    specs: list[KVCacheSpec] = []
    for layer in range(config.num_layers):
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
    unknown = sorted({type(s).__name__ for s in specs if not isinstance(s, SUPPORTED_SPECS)})
    if unknown:
        raise ValueError(f"no KV cache manager serves {', '.join(unknown)}; supported: "
                         f"{', '.join(c.__name__ for c in SUPPORTED_SPECS)}")
    shapes = {(s.block_size, s.num_kv_heads, s.head_size, s.dtype_bytes) for s in specs}
    if len(shapes) != 1:
        raise ValueError(f"all layers must share one KV cache page shape for now; got {sorted(shapes)}")


def num_blocks_for(specs: list[KVCacheSpec], memory_bytes: int) -> int:
    """How many blocks fit in ``memory_bytes`` when every layer holds each block."""
    per_block = sum(s.page_size_bytes for s in specs)
    return memory_bytes // per_block


def create_kv_cache_views(specs: list[KVCacheSpec], num_blocks: int, dtype: torch.dtype,
                          device: Any = "cpu") -> list[torch.Tensor]:
    """One flat buffer, and per layer a (2, num_blocks, block_size, num_kv_heads, head_size)
    view into it."""
    import torch
    check_kv_cache_specs(specs)
    s = specs[0]
    if torch.tensor([], dtype=dtype).element_size() != s.dtype_bytes:
        raise ValueError(f"dtype {dtype} does not match the spec's {s.dtype_bytes}-byte elements")
    per_layer = 2 * num_blocks * s.block_size * s.num_kv_heads * s.head_size
    buf = torch.zeros(per_layer * len(specs), dtype=dtype, device=device)
    shape = (2, num_blocks, s.block_size, s.num_kv_heads, s.head_size)
    return [buf[i * per_layer:(i + 1) * per_layer].view(shape) for i in range(len(specs))]
