"""Sampling one token per row from float32 logits with per-row temperature, top-k and top-p,
without host synchronisation: Triton kernel, launcher and torch reference.

Semantics (those of ``models.sampler.Sampler``):
  * temperature <= 0: greedy, argmax of the raw logits (first index among ties);
  * otherwise s = logits / temperature; top-k (k > 0 and k < V) keeps s >= the k-th largest s;
    top-p (p < 1) then keeps the smallest set of largest-s tokens whose softmax mass, renormalised
    over the top-k set, reaches p (ties at either boundary are all kept);
  * the draw is an exponential race: argmax over kept tokens of softmax(s) / q, q ~ Exp(1) given
    as an input tensor, so a caller seeds it and a test replays it.

No sort: each cut-off is found by bisection on the 32-bit order-preserving integer key of s
(count of keys >= t for top-k, mass of keys >= t for top-p), one pass over the row per step,
~32 steps; rows without top-k/top-p skip them. The cut-off is exact: it is the key of a real
token, so the kept set equals the sorted reference's up to float rounding of the mass sums.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import check_shape, check_tensor, next_power_of_2

BLOCK_V = 1024


@triton.jit
def _order_key(s):
    # float32 -> int32 whose signed order is the float order (-0.0 sorts just below +0.0)
    bits = s.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _bisect_top_k(row_ptr, temp, V, k, lo, hi, BLOCK: tl.constexpr):
    # largest key t in [lo, hi] with count(key >= t) >= k (lo always qualifies)
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        count = 0
        for start in range(0, V, BLOCK):
            v = start + tl.arange(0, BLOCK)
            s = tl.load(row_ptr + v, mask=v < V, other=float("-inf")) / temp
            key = _order_key(s).to(tl.int64)
            count += tl.sum(((key >= mid) & (v < V)).to(tl.int32), 0)
        lo = tl.where(count >= k, mid, lo)
        hi = tl.where(count >= k, hi, mid - 1)
    return lo


@triton.jit
def _mass_above(row_ptr, temp, V, m, t, BLOCK: tl.constexpr):
    # sum of exp(s - m) over tokens whose key >= t
    mass = 0.0
    for start in range(0, V, BLOCK):
        v = start + tl.arange(0, BLOCK)
        s = tl.load(row_ptr + v, mask=v < V, other=float("-inf")) / temp
        keep = (_order_key(s).to(tl.int64) >= t) & (v < V)
        mass += tl.sum(tl.where(keep, tl.exp(s - m), 0.0), 0)
    return mass


@triton.jit
def _bisect_top_p(row_ptr, temp, V, m, target, lo, hi, BLOCK: tl.constexpr):
    # largest key t in [lo, hi] with mass(key >= t) >= target (lo always qualifies)
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        ok = _mass_above(row_ptr, temp, V, m, mid, BLOCK) >= target
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def _sample_kernel(
    logits_ptr,         # (B, V) float32
    temperature_ptr,    # (B,) float32
    top_k_ptr,          # (B,) int32 or int64, <= 0 or >= V = off
    top_p_ptr,          # (B,) float32, >= 1 = off
    noise_ptr,          # (B, V) float32, Exp(1) draws
    out_ptr,            # (B,) int64
    stride_lb, stride_nb, V,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + b * stride_lb
    temp_in = tl.load(temperature_ptr + b)
    greedy = temp_in <= 0
    temp = tl.where(greedy, 1.0, temp_in)      # s = logits / temp, exactly as the reference divides
    top_k = tl.load(top_k_ptr + b).to(tl.int64)
    top_p = tl.load(top_p_ptr + b)

    # 1) max and key range of s = logits / temperature
    m = float("-inf")
    key_lo = tl.full([], 2147483647, tl.int64)
    key_hi = tl.full([], -2147483648, tl.int64)
    for start in range(0, V, BLOCK):
        v = start + tl.arange(0, BLOCK)
        s = tl.load(row_ptr + v, mask=v < V, other=float("-inf")) / temp
        key = _order_key(s).to(tl.int64)
        m = tl.maximum(m, tl.max(s, 0))
        key_lo = tl.minimum(key_lo, tl.min(tl.where(v < V, key, 2147483647), 0))
        key_hi = tl.maximum(key_hi, tl.max(tl.where(v < V, key, -2147483648), 0))

    # 2) cut-off keys: top-k, then top-p within the top-k set (sampled rows only)
    cut = key_lo
    if (temp_in > 0) & (top_k > 0) & (top_k < V):
        cut = _bisect_top_k(row_ptr, temp, V, top_k, key_lo, key_hi, BLOCK)
    if (temp_in > 0) & (top_p < 1.0):
        target = top_p * _mass_above(row_ptr, temp, V, m, cut, BLOCK)
        cut = _bisect_top_p(row_ptr, temp, V, m, target, cut, key_hi, BLOCK)

    # 3) race: argmax of exp(s - m) / q over kept tokens; greedy rows take argmax of s
    best = float("-inf")
    best_idx = tl.full([], 0, tl.int64)
    for start in range(0, V, BLOCK):
        v = start + tl.arange(0, BLOCK)
        s = tl.load(row_ptr + v, mask=v < V, other=float("-inf")) / temp
        if greedy:
            score = s
        else:
            q = tl.load(noise_ptr + b * stride_nb + v, mask=v < V, other=1.0)
            score = tl.exp(s - m) / q
            score = tl.where(_order_key(s).to(tl.int64) >= cut, score, -1.0)
        score = tl.where(v < V, score, float("-inf"))
        chunk_best = tl.max(score, 0)
        chunk_idx = tl.argmax(score, 0).to(tl.int64) + start
        better = chunk_best > best
        best_idx = tl.where(better, chunk_idx, best_idx)
        best = tl.where(better, chunk_best, best)
    tl.store(out_ptr + b, best_idx)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           exp_noise: torch.Tensor) -> torch.Tensor:
    """logits (B, V) float32; temperature (B,) float32 (<= 0: greedy); top_k (B,) int32/int64
    (<= 0 or >= V: off); top_p (B,) float32 (>= 1: off); exp_noise (B, V) float32, i.i.d. Exp(1)
    (e.g. ``torch.empty_like(logits).exponential_(generator=g)``). Returns token ids (B,) int64."""
    check_tensor("logits", logits, ndim=2, dtypes=(torch.float32,))
    B, V = logits.shape
    dev = logits.device
    check_tensor("temperature", temperature, ndim=1, dtypes=(torch.float32,), device=dev)
    check_shape("temperature", temperature, (B,))
    check_tensor("top_k", top_k, ndim=1, dtypes=(torch.int32, torch.int64), device=dev)
    check_shape("top_k", top_k, (B,))
    check_tensor("top_p", top_p, ndim=1, dtypes=(torch.float32,), device=dev)
    check_shape("top_p", top_p, (B,))
    check_tensor("exp_noise", exp_noise, ndim=2, dtypes=(torch.float32,), device=dev)
    check_shape("exp_noise", exp_noise, (B, V))
    if V == 0:
        raise ValueError("logits must have at least one column")
    out = torch.empty(B, dtype=torch.int64, device=dev)
    if B > 0:
        _sample_kernel[(B,)](logits, temperature, top_k, top_p, exp_noise, out,
                             logits.stride(0), exp_noise.stride(0), V,
                             BLOCK=min(BLOCK_V, next_power_of_2(V)))
    return out


def sample_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               exp_noise: torch.Tensor) -> torch.Tensor:
    """The same draw with a sort: mask outside top-k and the nucleus, softmax, divide by the
    noise, argmax; greedy rows take the argmax of the raw logits."""
    B, V = logits.shape
    greedy = temperature <= 0
    s = logits / torch.where(greedy, 1.0, temperature)[:, None]                     # (B, V)
    desc = s.sort(dim=-1, descending=True).values                                   # (B, V)
    k = torch.where((top_k > 0) & (top_k < V), top_k, V).long()
    kth = desc.gather(1, (k - 1)[:, None])                                          # (B, 1)
    s = s.masked_fill(s < kth, float("-inf"))
    desc = desc.masked_fill(desc < kth, float("-inf"))
    cum = desc.softmax(-1).cumsum(-1)                                               # (B, V)
    # the nucleus ends at the first sorted token whose cumulative mass reaches p
    last = (cum < top_p[:, None]).sum(-1).clamp(max=V - 1)                          # (B,)
    pth = desc.gather(1, last[:, None])
    s = torch.where((top_p < 1.0)[:, None] & (s < pth), float("-inf"), s)
    sampled = (s.softmax(-1) / exp_noise).argmax(-1)
    return torch.where(greedy, logits.argmax(-1), sampled)
