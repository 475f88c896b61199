"""The GPU path's fused elementwise ops and token draw, as the model layers and the sampler call
them: RMSNorm with the residual add folded in, rotary on q and k in place, SiLU(gate) * up, the
structured-output bitmask, and the temperature / top-k / top-p draw without a sort or a host
synchronisation.

``supports`` is the one place that decides between these Triton kernels and the plain torch
ops (the twin of ``kernels.cpu.fused.supports`` for the CPU): every tensor on CUDA, and
``ENABLED`` (set ``TROUPE_TRITON_OPS=0`` to force the plain ops). ``ON_CPU`` (tests only, with
``TRITON_INTERPRET=1``) also routes CPU tensors here, so that the whole GPU model path runs under
Triton's interpreter. The launchers are imported on first use: a CPU-only process never loads
Triton. Each function calls its kernel's registered custom op (kernels/triton/ops.py,
``torch.ops.troupe.*``): the model and the tests run the same op, and torch.compile traces it.
"""
from __future__ import annotations

import os

import torch

from kernels.triton import interpreting

ENABLED = os.environ.get("TROUPE_TRITON_OPS", "1") != "0"
ON_CPU = False


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the Triton ops take these tensors: all on CUDA (or on the CPU with ``ON_CPU`` and
    the interpreter on), each with a contiguous last dimension."""
    if not ENABLED:
        return False
    for t in tensors:   # a plain loop: this runs several times per layer
        if not (t.is_cuda or (ON_CPU and t.is_cpu and interpreting())) or (t.dim() and t.stride(-1) != 1):
            return False
    return True


def _ops():
    """torch.ops.troupe, with the Triton ops registered (imported on first use)."""
    import kernels.triton.ops  # noqa: F401
    return torch.ops.troupe


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, N) -> (norm(x + residual), x + residual); without a residual, (norm(x), x)."""
    ops = _ops()
    if residual is None:
        return ops.rms_norm(x, weight, eps), x
    out, residual = ops.fused_add_rms_norm(x, residual, weight, eps)
    return out, residual


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q (T, H, D) and k (T, KVH, D) in place by the layers' (T, 1, D) cos and sin."""
    _ops().rotary_embedding_rows_(q, k, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2I) = gate | up -> SiLU(gate) * up, (T, I)."""
    return _ops().silu_and_mul(gate_up)


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf on every logit of (B, V) whose bit in the (B, ceil(V / 32)) int32 bitmask is clear."""
    from kernels.triton.bitmask import apply_bitmask_ as launch
    launch(logits, bitmask)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           exp_noise: torch.Tensor) -> torch.Tensor:
    """One token per row of float32 logits (B, V): temperature <= 0 greedy, else the exponential
    race over the top-k / top-p set, with the caller's Exp(1) noise (B, V). -> (B,) int64."""
    return _ops().sample(logits, temperature, top_k, top_p, exp_noise)
