"""The state-space layers' kernels on the float32 CPU path (ssm.c): the recurrence of Mamba and
Mamba-2 and the causal convolution before it, for every request of a step, prompt chunks and
decodes alike, each request's state updated in place in its slot; Mamba-2's gated RMSNorm.
Torch custom ops (a CPU kernel and a fake one) like the other native kernels::

    cpu_ssm_scan(state!, slots, fresh, qsl, x, dt, A, a_per_state, B, C, D, heads, head_dim, groups) -> y
    cpu_ssm_conv(x, conv_state!, slots, fresh, qsl, weight, bias, silu) -> (silu of) the causal conv of x
    cpu_ssm_gated_norm(y, gate, weight, groups, eps) -> Tensor
    cpu_gdn_scan(state!, slots, fresh, qsl, q, k, v, g, beta) -> o       Gated DeltaNet's delta rule

``state`` (slots, H, P, N) or (slots, H, N) float32 contiguous; ``slots`` (R,) int64 each
request's slot, ``fresh`` (R,) bool (zero its state first), ``qsl`` (R + 1,) int64 where each
request's tokens start in the step; ``x`` (T, H * P), ``dt`` (T, H), ``B`` and ``C`` (T, G * N),
rows of any stride, columns contiguous; ``A`` (H, N) (``a_per_state``: Mamba) or (H,) (Mamba-2);
``D`` (H,). Returns y (T, H * P). models/mamba.py's torch scans are the reference.

``supports`` decides between it and that reference, as kernels/cpu/fused.py does."""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from kernels.cpu import fused, native

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
MAX_STATE = 1024          # ssm.c's SSM_MAX_N
MAX_CONV = 8              # and CONV_MAX_K
MAX_VALUE_DIM = 1024      # and GDN_MAX_DV


def supports(state: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """float32 CPU tensors with contiguous columns, the state contiguous and at most MAX_STATE
    wide, the native library built here."""
    return (state.is_contiguous() and state.shape[-1] <= MAX_STATE and all(t.stride(-1) == 1 for t in tensors)
            and fused.supports(state, *tensors))


@lru_cache(maxsize=None)
def _kernel() -> ctypes._CFuncPtr:
    return native.declare("ssm_scan_f32", [_P, _I64, _P, _P, _P, _I64, _P, _I64, _P, _I64, _P, ctypes.c_int,
                                           _P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64])


@lru_cache(maxsize=None)
def _conv_kernel() -> ctypes._CFuncPtr:
    return native.declare("ssm_conv_f32", [_P, _I64, _P, _P, _P, _P, _I64, _P, _P, _P, _I64, _I64, ctypes.c_int])


@lru_cache(maxsize=None)
def _norm_kernel() -> ctypes._CFuncPtr:
    return native.declare("ssm_gated_norm_f32", [_P, _P, _I64, _P, _P, _I64, _I64, _I64, ctypes.c_float])


def _conv(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, qsl: torch.Tensor,
          weight: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    T, C = x.shape
    K = weight.shape[-1]
    if (weight.numel() != C * K or conv_state.shape[1:] != (C, K - 1) or not 2 <= K <= MAX_CONV
            or (bias is not None and bias.shape != (C,))):
        raise ValueError(f"ssm conv: x {tuple(x.shape)}, state {tuple(conv_state.shape)}, weight {tuple(weight.shape)}")
    out = torch.empty(T, C, dtype=torch.float32)
    slots, qsl = slots.to(torch.int64).contiguous(), qsl.to(torch.int64).contiguous()
    fresh = fresh.to(torch.uint8).contiguous()
    weight = weight.contiguous()
    _conv_kernel()(x.data_ptr(), x.stride(0), conv_state.data_ptr(), slots.data_ptr(), fresh.data_ptr(),
                   qsl.data_ptr(), slots.numel(), weight.data_ptr(), None if bias is None else bias.contiguous().data_ptr(),
                   out.data_ptr(), C, K, int(silu))
    return out


def _gated_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    T, D = y.shape
    if gate.shape != (T, D) or weight.shape != (D,) or D % groups:
        raise ValueError(f"ssm gated norm: y {tuple(y.shape)}, gate {tuple(gate.shape)}, weight {tuple(weight.shape)}")
    out = torch.empty(T, D, dtype=torch.float32)
    y, weight = y.contiguous(), weight.contiguous()
    _norm_kernel()(y.data_ptr(), gate.data_ptr(), gate.stride(0), weight.data_ptr(), out.data_ptr(), T, D, groups, eps)
    return out


@lru_cache(maxsize=None)
def _gdn_kernel() -> ctypes._CFuncPtr:
    return native.declare("gdn_scan_f32", [_P, _I64, _P, _P, _P, _I64, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64])


def _gdn(state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, qsl: torch.Tensor, q: torch.Tensor,
         k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    T, H, DK = q.shape
    DV = v.shape[-1]
    if (k.shape != q.shape or v.shape[:2] != (T, H) or g.shape != (T, H) or beta.shape != (T, H)
            or state.shape[1:] != (H, DK, DV) or DV > MAX_VALUE_DIM):
        raise ValueError(f"gdn scan: state {tuple(state.shape)}, q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}")
    o = torch.empty(T, H, DV, dtype=torch.float32)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    slots, qsl = slots.to(torch.int64).contiguous(), qsl.to(torch.int64).contiguous()
    fresh = fresh.to(torch.uint8).contiguous()
    _gdn_kernel()(state.data_ptr(), state[0].numel(), slots.data_ptr(), fresh.data_ptr(), qsl.data_ptr(),
                  slots.numel(), q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                  o.data_ptr(), H, DK, DV)
    return o


def gdn_scan(state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, qsl: torch.Tensor, q: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    return torch.ops.troupe.cpu_gdn_scan(state, slots, fresh, qsl, q, k, v, g, beta)


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor,
                qsl: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool = True) -> torch.Tensor:
    return torch.ops.troupe.cpu_ssm_conv(x, conv_state, slots, fresh, qsl, weight, bias, silu)


def gated_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    return torch.ops.troupe.cpu_ssm_gated_norm(y, gate, weight, groups, eps)


def _scan(state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, qsl: torch.Tensor, x: torch.Tensor,
          dt: torch.Tensor, A: torch.Tensor, a_per_state: bool, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
          heads: int, head_dim: int, groups: int) -> torch.Tensor:
    N = state.shape[-1]
    T, R = x.shape[0], slots.numel()
    if (x.shape[1] != heads * head_dim or dt.shape != (T, heads) or B.shape != (T, groups * N)
            or C.shape != (T, groups * N) or state[0].numel() != heads * head_dim * N or heads % groups
            or qsl.numel() != R + 1 or fresh.numel() != R
            or tuple(A.shape) != ((heads, N) if a_per_state else (heads,)) or tuple(D.shape) != (heads,)):
        raise ValueError(f"ssm scan: state {tuple(state.shape)}, x {tuple(x.shape)}, dt {tuple(dt.shape)}, "
                         f"B {tuple(B.shape)}, C {tuple(C.shape)}, A {tuple(A.shape)}, D {tuple(D.shape)} do not "
                         f"make {heads} heads of {head_dim} in {groups} groups")
    y = torch.empty(T, heads * head_dim, dtype=torch.float32)
    slots, qsl = slots.to(torch.int64).contiguous(), qsl.to(torch.int64).contiguous()
    fresh = fresh.to(torch.uint8).contiguous()
    A, D = A.contiguous(), D.contiguous()
    _kernel()(state.data_ptr(), state[0].numel(), slots.data_ptr(), fresh.data_ptr(), qsl.data_ptr(), R,
              x.data_ptr(), x.stride(0), dt.data_ptr(), dt.stride(0), A.data_ptr(), int(a_per_state),
              B.data_ptr(), B.stride(0), C.data_ptr(), C.stride(0), D.data_ptr(), y.data_ptr(), y.stride(0),
              heads, head_dim, groups, N)
    return y


def ssm_scan(state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, qsl: torch.Tensor, x: torch.Tensor,
             dt: torch.Tensor, A: torch.Tensor, a_per_state: bool, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor, heads: int, head_dim: int, groups: int) -> torch.Tensor:
    return torch.ops.troupe.cpu_ssm_scan(state, slots, fresh, qsl, x, dt, A, a_per_state, B, C, D,
                                         heads, head_dim, groups)


_LIB = torch.library.Library("troupe", "FRAGMENT")
_LIB.define("cpu_ssm_scan(Tensor(a!) state, Tensor slots, Tensor fresh, Tensor qsl, Tensor x, Tensor dt, Tensor A, "
            "bool a_per_state, Tensor B, Tensor C, Tensor D, int heads, int head_dim, int groups) -> Tensor")
_LIB.impl("cpu_ssm_scan", _scan, "CPU")
torch.library.register_fake("troupe::cpu_ssm_scan", lambda state, slots, fresh, qsl, x, *rest: x.new_empty(x.shape),
                            lib=_LIB)
_LIB.define("cpu_ssm_conv(Tensor x, Tensor(a!) conv_state, Tensor slots, Tensor fresh, Tensor qsl, Tensor weight, "
            "Tensor? bias, bool silu) -> Tensor")
_LIB.impl("cpu_ssm_conv", _conv, "CPU")
torch.library.register_fake("troupe::cpu_ssm_conv", lambda x, *rest: x.new_empty(x.shape), lib=_LIB)
_LIB.define("cpu_ssm_gated_norm(Tensor y, Tensor gate, Tensor weight, int groups, float eps) -> Tensor")
_LIB.impl("cpu_ssm_gated_norm", _gated_norm, "CPU")
torch.library.register_fake("troupe::cpu_ssm_gated_norm", lambda y, *rest: y.new_empty(y.shape), lib=_LIB)
_LIB.define("cpu_gdn_scan(Tensor(a!) state, Tensor slots, Tensor fresh, Tensor qsl, Tensor q, Tensor k, Tensor v, "
            "Tensor g, Tensor beta) -> Tensor")
_LIB.impl("cpu_gdn_scan", _gdn, "CPU")
torch.library.register_fake("troupe::cpu_gdn_scan", lambda state, slots, fresh, qsl, q, k, v, *rest: v.new_empty(v.shape),
                            lib=_LIB)
