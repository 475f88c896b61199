"""The experts of a mixture-of-experts layer on the GPU (vLLM's fused_moe): the (token, expert)
pairs sorted by expert into blocks of BLOCK_M pairs of one expert (``moe_align_block_size``),
then one grouped GEMM launch per projection, each program multiplying one block of pairs by a
tile of its expert's weight:

  1. cache1[p] = x[token(p)] w13[e]^T (+ b13[e])            (T k, 2I)
  2. cache2 = SiLU(gate) * up of cache1                      (T k, I)   (silu_mul.py; gpt-oss's
                                                                         swigluoai in torch)
  3. cache3[p] = weight(p) * (cache2[p] w2[e]^T (+ b2[e]))   (T k, H)
  4. out[t] = sum over k of cache3[t k + k]                  (T, H)

The alignment runs as torch ops sized by the worst case (T k + E (BLOCK_M - 1) slots), so no
step waits on the host; the programs past the padded count return at once. Pairs routed to
experts not held here (another rank's under expert parallelism) are left out of the blocks and
add nothing. The torch reference is models/moe.py's ``fused_experts_ref``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import FLOAT_DTYPES, check_tensor, dot_in_float32, dot_precision
from kernels.triton.silu_mul import silu_and_mul

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int, expert_start: int = 0
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs (flat index t k + k of ``topk_ids``) of the experts ``expert_start`` ..
    ``expert_start + num_experts`` grouped by expert, each expert's run padded to a multiple of
    ``block_m`` with the sentinel T k. Returns (sorted pair ids (T k + E (block_m - 1),), the
    expert of each block (-1 past the last), the padded count (1,) int32)."""
    TK, E = topk_ids.numel(), num_experts
    dev = topk_ids.device
    local = topk_ids.reshape(-1).to(torch.int64) - expert_start
    local = torch.where((local >= 0) & (local < E), local, E)           # E: not held here
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, local, torch.ones_like(local))
    # (not bincount: on CUDA it reads the largest id back to the host, which a CUDA graph cannot)
    padded = (counts[:E] + block_m - 1) // block_m * block_m
    padded_starts = torch.cumsum(padded, 0) - padded
    starts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(local, stable=True)
    expert_of = local[order]
    max_len = TK + E * (block_m - 1)
    rank_in_expert = torch.arange(TK, device=dev) - starts[expert_of]
    dest = torch.where(expert_of < E, padded_starts[expert_of.clamp(max=E - 1)] + rank_in_expert, max_len)
    sorted_ids = torch.full((max_len + 1,), TK, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    num_blocks = triton.cdiv(max_len, block_m)
    block_ends = torch.cumsum(padded // block_m, 0)
    block_expert = torch.bucketize(torch.arange(num_blocks, device=dev), block_ends, right=True)
    expert_ids = torch.where(block_expert < E, block_expert, -1).to(torch.int32)
    return sorted_ids[:max_len], expert_ids, padded.sum().reshape(1).to(torch.int32)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,              # (M, K): rows read as pair // TOP_K
    b_ptr,              # (E, N, K)
    c_ptr,              # (T k, N): row per pair
    w_ptr,              # (T k,) routing weights (read with MUL_WEIGHT)
    bias_ptr,           # (E, N), each expert's bias (read with HAS_BIAS, added in float32)
    sorted_ptr, expert_ptr, padded_ptr,
    N, K, num_pairs,
    stride_am, stride_be, stride_bn, stride_cm,
    TOP_K: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m).to(tl.int64)
    mask_m = pair < num_pairs
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    row = tl.where(mask_m, pair // TOP_K, 0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_ptr + row[:, None] * stride_am + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)                 # (BLOCK_M, BLOCK_K)
        b = tl.load(b_ptr + e * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)                 # (BLOCK_K, BLOCK_N)
        if DOT_F32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc = acc * tl.load(w_ptr + pair, mask=mask_m, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pair[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weights: torch.Tensor | None,
                  sorted_ids: torch.Tensor, expert_ids: torch.Tensor, padded: torch.Tensor, top_k: int,
                  bias: torch.Tensor | None = None) -> None:
    E, N, K = b.shape
    grid = (expert_ids.shape[0], triton.cdiv(N, BLOCK_N))
    _grouped_gemm_kernel[grid](
        a, b, c, weights if weights is not None else c, bias if bias is not None else c, sorted_ids, expert_ids,
        padded, N, K, c.shape[0], a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        TOP_K=top_k, MUL_WEIGHT=weights is not None, HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        DOT_F32=dot_in_float32(a.dtype), DOT_PRECISION=dot_precision(a.dtype))


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_start: int = 0, w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None, activation: str = "silu", alpha: float = 1.702,
                  limit: float = 7.0) -> torch.Tensor:
    """x (T, H), w13 (E, 2I, H), w2 (E, H, I) contiguous, topk_weights / topk_ids (T, k) global
    expert ids, the biases w13_bias (E, 2I) and w2_bias (E, H) or None -> (T, H) in x's
    dtype (pairs of experts not held here add nothing). ``activation``: "silu" or gpt-oss's
    "swigluoai" (min(g, limit) * sigmoid(alpha min(g, limit)) * (clamp(u, +-limit) + 1))."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("w13", w13, ndim=3, dtypes=(x.dtype,), device=x.device)
    check_tensor("w2", w2, ndim=3, dtypes=(x.dtype,), device=x.device)
    T, H = x.shape
    E, two_i, _ = w13.shape
    if w13.shape[2] != H or two_i % 2 or tuple(w2.shape) != (E, H, two_i // 2):
        raise ValueError(f"w13 must be (E, 2I, {H}) and w2 (E, {H}, I), got {tuple(w13.shape)} and {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_weights and topk_ids must both be ({T}, k), got {tuple(topk_weights.shape)} "
                         f"and {tuple(topk_ids.shape)}")
    for name, bias, shape in (("w13_bias", w13_bias, (E, two_i)), ("w2_bias", w2_bias, (E, H))):
        if bias is not None:
            check_tensor(name, bias, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
            if tuple(bias.shape) != shape:
                raise ValueError(f"{name} must be {shape}, got {tuple(bias.shape)}")
    if activation not in ("silu", "swigluoai"):
        raise ValueError(f"expert activation {activation!r} is not supported; supported: silu, swigluoai")
    k = topk_ids.shape[1]
    if T == 0:
        return torch.zeros_like(x)
    w13, w2 = w13.contiguous(), w2.contiguous()
    sorted_ids, expert_ids, padded = moe_align_block_size(topk_ids, BLOCK_M, E, expert_start)
    cache1 = torch.zeros(T * k, two_i, dtype=x.dtype, device=x.device)   # rows of pairs left out stay 0
    _grouped_gemm(x, w13, cache1, None, sorted_ids, expert_ids, padded, top_k=k,
                  bias=None if w13_bias is None else w13_bias.contiguous())
    if activation == "silu":
        cache2 = silu_and_mul(cache1)
    else:                      # rows of pairs left out stay 0: (0 + 1) * 0 * sigmoid(0) = 0
        g = cache1[:, :two_i // 2].float().clamp(max=limit)
        u = cache1[:, two_i // 2:].float().clamp(-limit, limit)
        cache2 = ((u + 1) * g * torch.sigmoid(g * alpha)).to(x.dtype)
    cache3 = torch.zeros(T * k, H, dtype=x.dtype, device=x.device)
    _grouped_gemm(cache2, w2, cache3, topk_weights.reshape(-1).to(torch.float32).contiguous(), sorted_ids,
                  expert_ids, padded, top_k=1, bias=None if w2_bias is None else w2_bias.contiguous())
    return cache3.view(T, k, H).sum(dim=1)
