"""A structured-output bitmask applied to logits in place: Triton kernel, launcher and torch
reference. Row b of ``bitmask`` (B, ceil(V / 32)) int32 allows token v when bit v % 32 of word
v // 32 is set; every other logit of row b becomes -inf (tokens past 32 W too)."""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.triton import FLOAT_DTYPES, check_shape, check_tensor

BLOCK_V = 1024


@triton.jit
def _apply_bitmask_kernel(
    logits_ptr,         # (B, V), written in place
    bitmask_ptr,        # (B, W) int32
    stride_lb, stride_mb,
    vocab, words,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = v < vocab
    word = tl.load(bitmask_ptr + b * stride_mb + v // 32, mask=in_vocab & (v // 32 < words), other=0)
    allowed = ((word >> (v % 32)) & 1) != 0
    tl.store(logits_ptr + b * stride_lb + v, float("-inf"), mask=in_vocab & ~allowed)


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits (B, V) float, in place; bitmask (B, W) int32 on the same device."""
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    B, V = logits.shape
    check_tensor("bitmask", bitmask, ndim=2, dtypes=(torch.int32,), device=logits.device)
    check_shape("bitmask", bitmask, (B, None))
    if B and V:
        _apply_bitmask_kernel[(B, triton.cdiv(V, BLOCK_V))](
            logits, bitmask, logits.stride(0), bitmask.stride(0), V, bitmask.shape[1], BLOCK=BLOCK_V)


def apply_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The same through numpy's little-endian bit unpacking (int32 words are little-endian)."""
    B, V = logits.shape
    bits = np.unpackbits(bitmask.cpu().numpy().view(np.uint8), axis=1, bitorder="little")   # (B, 32 W)
    allowed = np.zeros((B, V), dtype=bool)
    n = min(V, bits.shape[1])
    allowed[:, :n] = bits[:, :n].astype(bool)
    logits[torch.from_numpy(~allowed).to(logits.device)] = float("-inf")
