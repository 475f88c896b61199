"""The state-space recurrences on the GPU (models/mamba.py, models/qwen3_next.py): Mamba's and
Mamba-2's selective scan and Gated DeltaNet's delta rule for every request of a step, prompt chunks
and decodes alike, each request's state read from its slot once, carried in registers through its
tokens and written back once. One program per (request, head, block of channels); the tokens of a
request run in order inside it. The same contracts as kernels/cpu/ssm.c's (the torch references are
the mixers' own), registered as torch custom ops::

    ssm_scan(state!, slots, fresh, qsl, x, dt, A, a_per_state, B, C, D, heads, head_dim, groups) -> y
    gdn_scan(state!, slots, fresh, qsl, q, k, v, g, beta) -> o

States are float32; the inputs are float32 (the mixers widen them first).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import next_power_of_2


@triton.jit
def _ssm_scan_kernel(state_ptr, slot_stride, slots_ptr, fresh_ptr, qsl_ptr,
                     x_ptr, x_stride, dt_ptr, dt_stride, a_ptr, b_ptr, b_stride, c_ptr, c_stride, d_ptr,
                     y_ptr, y_stride, H, P, N, heads_per_group,
                     A_PER_STATE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pm, nm = p < P, n < N
    mask = pm[:, None] & nm[None, :]
    g = h // heads_per_group
    slot = tl.load(slots_ptr + r).to(tl.int64)
    ptrs = state_ptr + slot * slot_stride + h * P * N + p[:, None] * N + n[None, :]
    s = tl.load(ptrs, mask=mask, other=0.0)
    s = tl.where(tl.load(fresh_ptr + r) != 0, 0.0, s)
    if A_PER_STATE:
        a = tl.load(a_ptr + h * N + n, mask=nm, other=0.0)
    else:
        a = tl.load(a_ptr + h)
    dh = tl.load(d_ptr + h)
    t0 = tl.load(qsl_ptr + r)
    t1 = tl.load(qsl_ptr + r + 1)
    for t in range(t0, t1):
        d = tl.load(dt_ptr + t * dt_stride + h)
        xv = tl.load(x_ptr + t * x_stride + h * P + p, mask=pm, other=0.0)
        bv = tl.load(b_ptr + t * b_stride + g * N + n, mask=nm, other=0.0)
        cv = tl.load(c_ptr + t * c_stride + g * N + n, mask=nm, other=0.0)
        if A_PER_STATE:
            decay = tl.exp(d * a)[None, :]
        else:
            decay = tl.exp(d * a)
        s = decay * s + (d * xv)[:, None] * bv[None, :]
        yv = tl.sum(s * cv[None, :], axis=1) + dh * xv
        tl.store(y_ptr + t * y_stride + h * P + p, yv, mask=pm)
    tl.store(ptrs, s, mask=mask)


@triton.jit
def _gdn_scan_kernel(state_ptr, slot_stride, slots_ptr, fresh_ptr, qsl_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
                     o_ptr, H, DK, DV, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    i = tl.arange(0, BLOCK_K)
    im, jm = i < DK, j < DV
    mask = im[:, None] & jm[None, :]
    slot = tl.load(slots_ptr + r).to(tl.int64)
    ptrs = state_ptr + slot * slot_stride + h * DK * DV + i[:, None] * DV + j[None, :]
    s = tl.load(ptrs, mask=mask, other=0.0)
    s = tl.where(tl.load(fresh_ptr + r) != 0, 0.0, s)
    t0 = tl.load(qsl_ptr + r)
    t1 = tl.load(qsl_ptr + r + 1)
    for t in range(t0, t1):
        base = t * H + h
        kv = tl.load(k_ptr + base * DK + i, mask=im, other=0.0)
        qv = tl.load(q_ptr + base * DK + i, mask=im, other=0.0)
        vv = tl.load(v_ptr + base * DV + j, mask=jm, other=0.0)
        s = s * tl.exp(tl.load(g_ptr + base))
        delta = (vv - tl.sum(s * kv[:, None], axis=0)) * tl.load(beta_ptr + base)
        s = s + kv[:, None] * delta[None, :]
        tl.store(o_ptr + base * DV + j, tl.sum(s * qv[:, None], axis=0), mask=jm)
    tl.store(ptrs, s, mask=mask)


@torch.library.custom_op("troupe::ssm_scan", mutates_args=("state",))
def ssm_scan(state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, qsl: torch.Tensor, x: torch.Tensor,
             dt: torch.Tensor, A: torch.Tensor, a_per_state: bool, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
             heads: int, head_dim: int, groups: int) -> torch.Tensor:
    N = state.shape[-1]
    R, T = slots.numel(), x.shape[0]
    y = torch.empty(T, heads * head_dim, dtype=torch.float32, device=x.device)
    if R == 0:
        return y
    block_p = min(next_power_of_2(head_dim), 64)
    grid = (R, heads, triton.cdiv(head_dim, block_p))
    _ssm_scan_kernel[grid](state, state[0].numel(), slots, fresh.to(torch.int8), qsl, x, x.stride(0), dt,
                           dt.stride(0), A.contiguous(), B, B.stride(0), C, C.stride(0), D.contiguous(), y,
                           y.stride(0), heads, head_dim, N, heads // groups, A_PER_STATE=a_per_state,
                           BLOCK_P=block_p, BLOCK_N=next_power_of_2(N))
    return y


@ssm_scan.register_fake
def _(state, slots, fresh, qsl, x, dt, A, a_per_state, B, C, D, heads, head_dim, groups):
    return x.new_empty(x.shape[0], heads * head_dim, dtype=torch.float32)


@torch.library.custom_op("troupe::gdn_scan", mutates_args=("state",))
def gdn_scan(state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, qsl: torch.Tensor, q: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    T, H, DK = q.shape
    DV = v.shape[-1]
    o = torch.empty(T, H, DV, dtype=torch.float32, device=v.device)
    R = slots.numel()
    if R == 0:
        return o
    block_v = min(next_power_of_2(DV), 32)
    grid = (R, H, triton.cdiv(DV, block_v))
    _gdn_scan_kernel[grid](state, state[0].numel(), slots, fresh.to(torch.int8), qsl, q.contiguous(), k.contiguous(),
                           v.contiguous(), g.contiguous(), beta.contiguous(), o, H, DK, DV,
                           BLOCK_K=next_power_of_2(DK), BLOCK_V=block_v)
    return o


@gdn_scan.register_fake
def _(state, slots, fresh, qsl, q, k, v, g, beta):
    return v.new_empty(v.shape, dtype=torch.float32)
