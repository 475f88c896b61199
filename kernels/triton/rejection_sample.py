"""Rejection sampling of speculative decoding's draft tokens, one program per request: Triton
kernel, launcher and a per-request torch reference.

Inputs are what ``models.rejection_sampler`` prepares: the target's processed probabilities and
argmax at every verified position, and the random numbers already drawn (acceptance uniforms,
one Exp(1) row per request), so a test replays the same draws through the kernel and the
reference. Layout, for B requests with k_i drafts each (N = sum k_i, T = N + B):

    draft_token_ids     (N,)      request 0's drafts, then request 1's, ...
    cu_num_draft_tokens (B,)      inclusive cumulative sum of k_i
    target rows         (T, ...)  request i's k_i draft positions, then its bonus position
    output              (B, K+1)  accepted drafts, the recovered or bonus token, then -1

Per request, positions j = 0 .. k_i - 1 until the first rejection:
  * greedy: accept x_j iff x_j == argmax_j; then emit the argmax at the stopping position;
  * random: accept x_j iff u_j < p_j(x_j) / q_j(x_j) (q_j(x_j) = 0 rejects); at a rejection emit
    argmax(max(0, p_j - q_j) / e) (the target's own p_j / e when that residual is all zero,
    which only rounding can cause); when all are accepted, argmax(p_k / e), e the request's
    Exp(1) row. Without draft probabilities (n-gram) q_j is a point mass on x_j.
Ties go to the lowest token id, as torch.argmax breaks them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import check_shape, check_tensor, next_power_of_2

PLACEHOLDER_TOKEN_ID = -1
BLOCK_V = 1024


@triton.jit
def _rejection_sample_kernel(
    out_ptr,              # (B, K+1) int64
    draft_ids_ptr,        # (N,) int64
    cu_ptr,               # (B,) int64 or int32, inclusive cumulative draft counts
    draft_probs_ptr,      # (N, V) float32; not read without HAS_DRAFT_PROBS
    target_probs_ptr,     # (T, V) float32
    target_argmax_ptr,    # (T,) int64
    is_greedy_ptr,        # (B,) bool
    uniforms_ptr,         # (N,) float32, U[0, 1)
    noise_ptr,            # (B, V) float32, Exp(1)
    stride_out, stride_dp, stride_tp, stride_noise, V, K,
    HAS_DRAFT_PROBS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    end = tl.load(cu_ptr + b).to(tl.int64)
    start = tl.load(cu_ptr + b - 1, mask=b > 0, other=0).to(tl.int64)
    k = end - start
    row0 = start + b                                   # target row of draft position 0
    greedy = tl.load(is_greedy_ptr + b).to(tl.int1)

    # 1) the leading run of accepted drafts
    n_acc = tl.full([], 0, tl.int64)
    for j in range(0, k):
        x = tl.load(draft_ids_ptr + start + j)
        if greedy:
            ok = x == tl.load(target_argmax_ptr + row0 + j)
        else:
            p = tl.load(target_probs_ptr + (row0 + j) * stride_tp + x)
            if HAS_DRAFT_PROBS:
                q = tl.load(draft_probs_ptr + (start + j) * stride_dp + x)
            else:
                q = tl.full([], 1.0, tl.float32)
            u = tl.load(uniforms_ptr + start + j)
            ok = (q > 0) & (u < p / tl.where(q > 0, q, 1.0))
        n_acc += ((n_acc == j) & ok).to(tl.int64)
    rejected = n_acc < k

    # 2) the emitted token at position n_acc: the recovered draw or the bonus draw
    t_row = row0 + n_acc
    if greedy:
        token = tl.load(target_argmax_ptr + t_row)
    else:
        x_rej = tl.load(draft_ids_ptr + start + n_acc, mask=rejected, other=-1)
        best_p = -1.0
        idx_p = tl.full([], 0, tl.int64)
        best_r = -1.0
        idx_r = tl.full([], 0, tl.int64)
        max_r = 0.0
        for v0 in range(0, V, BLOCK):
            v = v0 + tl.arange(0, BLOCK)
            in_v = v < V
            p = tl.load(target_probs_ptr + t_row * stride_tp + v, mask=in_v, other=0.0)
            e = tl.load(noise_ptr + b * stride_noise + v, mask=in_v, other=1.0)
            if HAS_DRAFT_PROBS:
                # `rejected` spread over the block: the interpreter cannot mask with vector & scalar
                rejected_v = (v * 0 + n_acc) < k
                q = tl.load(draft_probs_ptr + (start + n_acc) * stride_dp + v, mask=in_v & rejected_v, other=0.0)
            else:
                q = tl.where(v == x_rej, 1.0, 0.0)
            r = tl.maximum(p - q, 0.0)
            max_r = tl.maximum(max_r, tl.max(tl.where(in_v, r, 0.0), 0))
            score_p = tl.where(in_v, p / e, -1.0)
            score_r = tl.where(in_v, r / e, -1.0)
            chunk_p = tl.max(score_p, 0)
            chunk_r = tl.max(score_r, 0)
            chunk_idx_p = tl.argmax(score_p, 0).to(tl.int64) + v0
            chunk_idx_r = tl.argmax(score_r, 0).to(tl.int64) + v0
            idx_p = tl.where(chunk_p > best_p, chunk_idx_p, idx_p)
            best_p = tl.maximum(best_p, chunk_p)
            idx_r = tl.where(chunk_r > best_r, chunk_idx_r, idx_r)
            best_r = tl.maximum(best_r, chunk_r)
        token = tl.where(rejected & (max_r > 0), idx_r, idx_p)

    # 3) the row: accepted drafts, the emitted token, placeholders
    offs = tl.arange(0, BLOCK_K)
    drafts = tl.load(draft_ids_ptr + start + offs, mask=offs < n_acc, other=-1)
    row = tl.where(offs < n_acc, drafts, tl.where(offs == n_acc, token, -1))
    tl.store(out_ptr + b * stride_out + offs, row, mask=offs <= K)


def _check(draft_token_ids, cu_num_draft_tokens, max_spec_len, draft_probs, target_probs,
           target_argmax, is_greedy, uniforms, exp_noise) -> tuple[int, int, int]:
    check_tensor("target_probs", target_probs, ndim=2, dtypes=(torch.float32,))
    T, V = target_probs.shape
    dev = target_probs.device
    check_tensor("draft_token_ids", draft_token_ids, ndim=1, dtypes=(torch.int64,), device=dev)
    N = draft_token_ids.shape[0]
    B = T - N
    check_tensor("cu_num_draft_tokens", cu_num_draft_tokens, ndim=1, dtypes=(torch.int32, torch.int64), device=dev)
    check_shape("cu_num_draft_tokens", cu_num_draft_tokens, (B,))
    if draft_probs is not None:
        check_tensor("draft_probs", draft_probs, ndim=2, dtypes=(torch.float32,), device=dev)
        check_shape("draft_probs", draft_probs, (N, V))
    check_tensor("target_argmax", target_argmax, ndim=1, dtypes=(torch.int64,), device=dev)
    check_shape("target_argmax", target_argmax, (T,))
    check_tensor("is_greedy", is_greedy, ndim=1, dtypes=(torch.bool,), device=dev)
    check_shape("is_greedy", is_greedy, (B,))
    check_tensor("uniforms", uniforms, ndim=1, dtypes=(torch.float32,), device=dev)
    check_shape("uniforms", uniforms, (N,))
    check_tensor("exp_noise", exp_noise, ndim=2, dtypes=(torch.float32,), device=dev)
    check_shape("exp_noise", exp_noise, (B, V))
    if max_spec_len < 0:
        raise ValueError(f"max_spec_len must be >= 0, got {max_spec_len}")
    if V == 0:
        raise ValueError("target_probs must have at least one column")
    return B, V, max_spec_len


def rejection_sample(draft_token_ids: torch.Tensor, cu_num_draft_tokens: torch.Tensor, max_spec_len: int,
                     draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     target_argmax: torch.Tensor, is_greedy: torch.Tensor, uniforms: torch.Tensor,
                     exp_noise: torch.Tensor) -> torch.Tensor:
    """draft_token_ids (N,) int64; cu_num_draft_tokens (B,) int32/int64; max_spec_len K >= every
    k_i; draft_probs (N, V) float32 or None (point masses); target_probs (N + B, V) float32;
    target_argmax (N + B,) int64; is_greedy (B,) bool; uniforms (N,) float32; exp_noise (B, V)
    float32. Returns (B, K + 1) int64: accepted drafts, the emitted token, then -1. A greedy row
    reads no probabilities, uniforms or noise; a random row no argmax."""
    B, V, K = _check(draft_token_ids, cu_num_draft_tokens, max_spec_len, draft_probs, target_probs,
                     target_argmax, is_greedy, uniforms, exp_noise)
    out = torch.empty(B, K + 1, dtype=torch.int64, device=target_probs.device)
    if B > 0:
        dp = target_probs if draft_probs is None else draft_probs
        if draft_token_ids.numel() == 0:   # nothing is read from them: any valid pointers do
            draft_token_ids, uniforms = target_argmax, exp_noise
        _rejection_sample_kernel[(B,)](
            out, draft_token_ids, cu_num_draft_tokens, dp, target_probs, target_argmax, is_greedy,
            uniforms, exp_noise, out.stride(0), dp.stride(0), target_probs.stride(0), exp_noise.stride(0),
            V, K, HAS_DRAFT_PROBS=draft_probs is not None, BLOCK_K=next_power_of_2(K + 1),
            BLOCK=min(BLOCK_V, next_power_of_2(V)))
    return out


def rejection_sample_ref(draft_token_ids: torch.Tensor, cu_num_draft_tokens: torch.Tensor, max_spec_len: int,
                         draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                         target_argmax: torch.Tensor, is_greedy: torch.Tensor, uniforms: torch.Tensor,
                         exp_noise: torch.Tensor) -> torch.Tensor:
    """The same, one request and one position at a time."""
    B, V = cu_num_draft_tokens.shape[0], target_probs.shape[1]
    out = torch.full((B, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
    cu = [0] + cu_num_draft_tokens.tolist()
    for b in range(B):
        start, end = cu[b], cu[b + 1]
        row = start + b                                   # the target row at the current position
        for j in range(start, end):
            x = int(draft_token_ids[j])
            if is_greedy[b]:
                ok = x == int(target_argmax[row])
            else:
                q = draft_probs[j, x] if draft_probs is not None else torch.tensor(1.0)
                ok = bool(q > 0) and bool(uniforms[j] < target_probs[row, x] / q)
            if not ok:
                break
            out[b, j - start] = x
            row += 1
        n_acc = row - start - b
        if is_greedy[b]:
            token = int(target_argmax[row])
        else:
            p = target_probs[row]
            dist = p
            if n_acc < end - start:
                q = (draft_probs[start + n_acc] if draft_probs is not None else
                     torch.nn.functional.one_hot(draft_token_ids[start + n_acc], V).to(p.dtype))
                residual = torch.clamp_min(p - q, 0.0)
                dist = residual if bool((residual > 0).any()) else p
            token = int((dist / exp_noise[b]).argmax())
        out[b, n_acc] = token
    return out.to(target_probs.device)
