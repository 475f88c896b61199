"""Fused elementwise kernels of the float32 CPU path (fused.c): RMSNorm with the residual add
folded in, rotary embedding in place on q and k, the activations alone or gating a second half
(SiLU(gate) * up). Each is a torch custom op (namespace ``troupe``, a CPU kernel and a fake one
giving the output's shape) so torch.compile traces it as one opaque node; the functions below call
the ops, the model and the tests alike::

    cpu_rms_norm(x, weight, eps) -> Tensor
    cpu_fused_add_rms_norm(x, residual!, weight, eps) -> Tensor     residual += x, norm of the sum
    cpu_rotary_(q!, k!, cos, sin) -> ()
    cpu_activation(x, act) -> Tensor                  act(x), act an ACTIVATIONS code
    cpu_gated_activation(x, act) -> Tensor            act(gate) * up for x = gate | up

The activations (``ACTIVATIONS``, fused.c's ACT_* codes): ``silu``, ``gelu`` (erf), ``gelu_tanh``
``relu`` and ``relu2`` (its square). The panel matmuls (kernels/cpu/panels.py) apply the same code to each tile they
write, with the same bits.

``supports`` is the one place that decides between them and the plain torch ops: float32 CPU
tensors, the native library available, and ``ENABLED`` (set ``TROUPE_FUSED_CPU=0``, or patch it,
to force the plain path). The kernels take the memory layouts noted on each function; callers
check those and fall back to torch otherwise.
"""
from __future__ import annotations

import ctypes
import os
from functools import lru_cache

import torch

from kernels.cpu import native

ENABLED = os.environ.get("TROUPE_FUSED_CPU", "1") != "0"

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


# fused.c's ACT_* codes
ACTIVATIONS: dict[str, int] = {"silu": 1, "gelu": 2, "gelu_tanh": 3, "relu": 4, "relu2": 5}

_NATIVE_OK: list[bool] = []      # filled once: whether the library builds and loads here


def _native_ok() -> bool:
    """Filled before torch.compile traces a layer (actors/worker/compilation.py), which then
    reads the list and never traces the library's build."""
    if not _NATIVE_OK:
        _NATIVE_OK.append(native.available()[0])
    return _NATIVE_OK[0]


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernels can take these tensors: float32 on the CPU, each with a
    contiguous last dimension (the shapes and other strides each kernel takes are on it)."""
    if not ENABLED:
        return False
    for t in tensors:   # a plain loop: this runs several times per layer, at decode too
        if t.dtype != torch.float32 or not t.is_cpu or t.stride(-1) != 1:
            return False
    return _native_ok()


@lru_cache(maxsize=None)
def _kernel(name: str) -> ctypes._CFuncPtr:
    argtypes = {
        "rms_norm_f32": [_P, _I64, _P, _P, _P, _I64, _I64, _F32],
        "rotary_f32": [_P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _I64, _I64, _I64],
        "act_f32": [ctypes.c_int, _P, _I64, _P, _I64, _I64],
        "gated_act_f32": [ctypes.c_int, _P, _I64, _P, _I64, _I64],
    }[name]
    return native.declare(name, argtypes)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, N) with any row stride, weight (N,) contiguous. Without ``residual``:
    x / sqrt(mean(x^2) + eps) * weight. With ``residual`` (T, N) contiguous: residual += x in
    place, and the norm of that sum is returned. -> (T, N) contiguous."""
    if residual is None:
        return torch.ops.troupe.cpu_rms_norm(x, weight, eps)
    return torch.ops.troupe.cpu_fused_add_rms_norm(x, residual, weight, eps)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Half-split (NeoX) rotary in place: q (T, H, D) and k (T, KVH, D) with packed heads
    (stride(1) == D) and any row stride (views into a fused qkv output need no copy); cos and
    sin (T, 1, RD) or (T, RD) with one row stride: the leading RD (<= D, even) dimensions of
    each head turn (a partial rotary when RD < D)."""
    torch.ops.troupe.cpu_rotary_(q, k, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2I) with any row stride = gate | up -> silu(gate) * up (T, I), silu(g) = g / (1 + exp(-g))."""
    return gated_activation(gate_up, "silu")


def activation(x: torch.Tensor, act: str) -> torch.Tensor:
    """x (T, N) with any row stride -> act(x) (T, N); ``act`` one of ACTIVATIONS."""
    return torch.ops.troupe.cpu_activation(x, ACTIVATIONS[act])


def gated_activation(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """gate_up (T, 2I) with any row stride = gate | up -> act(gate) * up (T, I)."""
    return torch.ops.troupe.cpu_gated_activation(gate_up, ACTIVATIONS[act])


# The kernels behind the ops (CPU dispatch key: a few microseconds per call, where a Python
# ``torch.library.custom_op`` costs tens; the layers call these at every decode step).

def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None) -> torch.Tensor:
    T, N = x.shape
    out = torch.empty(T, N, dtype=x.dtype)
    if T:
        r = residual.data_ptr() if residual is not None else None
        _kernel("rms_norm_f32")(x.data_ptr(), x.stride(0), r, weight.data_ptr(), out.data_ptr(), T, N, eps)
    return out


def _rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    T, H, D = q.shape
    RD = cos.shape[-1]
    if RD > D or RD % 2:
        raise ValueError(f"rotary over {RD} of a head's {D} dimensions: an even number, at most the head's")
    if T:
        _kernel("rotary_f32")(q.data_ptr(), q.stride(0), H, k.data_ptr(), k.stride(0), k.shape[1],
                              cos.data_ptr(), sin.data_ptr(), cos.stride(0), T, D, RD)


def _gated_activation(gate_up: torch.Tensor, act: int) -> torch.Tensor:
    T, I2 = gate_up.shape
    out = torch.empty(T, I2 // 2, dtype=gate_up.dtype)
    if T:
        _kernel("gated_act_f32")(act, gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), T, I2 // 2)
    return out


def _activation(x: torch.Tensor, act: int) -> torch.Tensor:
    T, N = x.shape
    out = torch.empty(T, N, dtype=x.dtype)
    if T:
        _kernel("act_f32")(act, x.data_ptr(), x.stride(0), out.data_ptr(), T, N)
    return out


_LIB = torch.library.Library("troupe", "FRAGMENT")
_LIB.define("cpu_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_LIB.define("cpu_fused_add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor")
_LIB.define("cpu_rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()")
_LIB.define("cpu_activation(Tensor x, int act) -> Tensor")
_LIB.define("cpu_gated_activation(Tensor x, int act) -> Tensor")
_LIB.impl("cpu_rms_norm", lambda x, weight, eps: _rms_norm(x, weight, eps, None), "CPU")
_LIB.impl("cpu_fused_add_rms_norm", lambda x, residual, weight, eps: _rms_norm(x, weight, eps, residual), "CPU")
_LIB.impl("cpu_rotary_", _rotary, "CPU")
_LIB.impl("cpu_activation", _activation, "CPU")
_LIB.impl("cpu_gated_activation", _gated_activation, "CPU")


def _fake_norm(x: torch.Tensor, *args) -> torch.Tensor:
    return x.new_empty(x.shape)


def _fake_gated(x: torch.Tensor, act: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], x.shape[1] // 2)


torch.library.register_fake("troupe::cpu_rms_norm", _fake_norm, lib=_LIB)
torch.library.register_fake("troupe::cpu_fused_add_rms_norm", _fake_norm, lib=_LIB)
torch.library.register_fake("troupe::cpu_rotary_", lambda q, k, cos, sin: None, lib=_LIB)
torch.library.register_fake("troupe::cpu_activation", lambda x, act: x.new_empty(x.shape), lib=_LIB)
torch.library.register_fake("troupe::cpu_gated_activation", _fake_gated, lib=_LIB)
