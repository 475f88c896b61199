"""Random paged-attention cases for the kernel tests: requests given as (cached context length,
query length), pages shuffled so block tables are non-contiguous, page 0 left to padding.

Import after TRITON_INTERPRET is set (the test modules do that first)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from helpers import shuffled_paged_metadata
from kernels.attention import AttentionMetadata
from kernels.triton import interpreting

# Under the interpreter kernels run on CPU tensors; with a GPU and no interpreter, on CUDA.
DEVICE = "cpu" if interpreting() else "cuda"

# bfloat16 through the interpreter: fp32 -> bf16 casts truncate instead of rounding to
# nearest, so allow two bf16 ulps on top of the reference's own rounding.
TOLERANCES = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
              torch.float16: dict(atol=2e-3, rtol=2e-3)}


@dataclass
class PagedCase:
    meta: AttentionMetadata        # tensors on DEVICE
    query: torch.Tensor            # (T, H, D)
    key: torch.Tensor              # (T, KVH, D)
    value: torch.Tensor            # (T, KVH, D)
    kv_cache: torch.Tensor         # (2, num_blocks, block_size, KVH, D), the cached prefix


def make_case(reqs: list[tuple[int, int]], block_size: int, num_heads: int, num_kv_heads: int,
              head_size: int, dtype: torch.dtype = torch.float32, num_padding: int = 0,
              seed: int = 0) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    meta, num_blocks = shuffled_paged_metadata(reqs, block_size, gen, num_padding)
    meta = meta_on(meta, DEVICE)
    T = meta.num_tokens

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)

    return PagedCase(meta, randn(T, num_heads, head_size), randn(T, num_kv_heads, head_size),
                     randn(T, num_kv_heads, head_size),
                     randn(2, num_blocks, block_size, num_kv_heads, head_size))


def meta_on(meta: AttentionMetadata, device: str) -> AttentionMetadata:
    """A copy of ``meta`` with its tensors on ``device``."""
    return replace(meta, **{name: getattr(meta, name).to(device)
                            for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping")})


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **TOLERANCES[expected.dtype])
