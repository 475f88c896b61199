"""Choosing an attention backend: the first registered backend that accepts the model's
requirements; when none does, the error names every refusal."""
from __future__ import annotations

import importlib

from kernels.attention.base import AttentionBackend, AttentionRequirements

# name -> "module:Class", imported only when considered (Triton is not needed on the CPU)
BACKENDS: dict[str, str] = {
    "triton": "kernels.attention.triton_backend:TritonAttentionBackend",
    "cpu": "kernels.attention.cpu:CpuAttentionBackend",
}


def backend_class(name: str) -> type[AttentionBackend]:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(BACKENDS)}")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def select_backend(req: AttentionRequirements, candidates: list[str] | None = None) -> AttentionBackend:
    refusals = []
    for name in candidates or list(BACKENDS):
        try:
            cls = backend_class(name)
        except ImportError as exc:
            refusals.append(f"{name}: unavailable ({exc})")
            continue
        reason = cls.refusal(req)
        if reason is None:
            return cls()
        refusals.append(reason)
    raise ValueError("no attention backend supports this model: " + "; ".join(refusals))
