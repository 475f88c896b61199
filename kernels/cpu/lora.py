"""LoRA's shrink and expand over a step's tokens, every adapter at once: the native kernel
(lora.c) for float32 CPU tensors, and the pure-torch version beside it (any device; the
reference the kernel is tested against). Both add, for each token t of slot s = token_slots[t]
(-1: no adapter), ``(x[t] @ a[s])[slice j] @ b[s][:, slice j's columns]`` to y[t].

Layouts (see lora.c): a (S, in, num_slices * R), b (S, R, out), offsets (num_slices + 1,) the
output columns of each slice, slot_ranks (S,) the rank of the adapter in each slot.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch

from kernels.cpu import native

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class TokenSegments(NamedTuple):
    """A step's LoRA tokens grouped by slot, for the torch path: ``order`` (N,) int64 the
    indices of the tokens with an adapter sorted by slot; ``segments`` (slot, start, end) over it."""
    order: torch.Tensor
    segments: tuple[tuple[int, int, int], ...]


def token_segments(token_slots: np.ndarray, device: torch.device | str = "cpu") -> TokenSegments:
    """Group the tokens of ``token_slots`` (T,) (-1: none) by slot, in one stable sort."""
    idx = np.flatnonzero(token_slots >= 0)
    order = idx[np.argsort(token_slots[idx], kind="stable")]
    slots, starts, counts = np.unique(token_slots[order], return_index=True, return_counts=True)
    segments = tuple((int(s), int(a), int(a + n)) for s, a, n in zip(slots, starts, counts))
    return TokenSegments(torch.from_numpy(order).to(device), segments)


@lru_cache(maxsize=1)
def _kernel():
    return native.declare("lora_shrink_expand", [_I64, _P, _I64, _P, _I64, _P, _P, _P, _P, _I64, _I64, _I64,
                                                 _I64, _P], _I64)


def native_supports(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor) -> bool:
    return (native.available()[0] and x.device.type == "cpu" and y.dtype == x.dtype == a.dtype == torch.float32
            and x.dim() == 2 and y.dim() == 2 and x.stride(1) == 1 and y.stride(1) == 1)


def lora_shrink_expand(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       token_slots: torch.Tensor, slot_ranks: torch.Tensor, offsets: torch.Tensor) -> None:
    """y (T, out) += the LoRA delta of x (T, in), in place, with the native kernel. token_slots
    (T,) int64, slot_ranks (S,) int64, offsets (num_slices + 1,) int64, all contiguous on the CPU."""
    T, inp = x.shape
    S, R, out = b.shape
    num_slices = offsets.shape[0] - 1
    if a.shape != (S, inp, num_slices * R) or y.shape != (T, out) or token_slots.shape != (T,):
        raise ValueError(f"LoRA shapes do not agree: x {tuple(x.shape)}, y {tuple(y.shape)}, a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)}, token_slots {tuple(token_slots.shape)}")
    for t in (a, b, token_slots, slot_ranks, offsets):
        if not t.is_contiguous():
            raise ValueError("the LoRA kernel needs contiguous weights and index tensors")
    status = _kernel()(T, x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), a.data_ptr(), b.data_ptr(),
                       token_slots.data_ptr(), slot_ranks.data_ptr(), inp, out, R, num_slices, offsets.data_ptr())
    if status:
        raise ValueError(f"the LoRA kernel takes at most 4096 columns of h, got {num_slices * R}")


def lora_shrink_expand_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                           seg: TokenSegments, slot_ranks: list[int], offsets: list[int]) -> None:
    """The same in torch, on any device: the tokens gathered once in slot order, two matmuls
    per (slot, slice), the delta added back with one index_add (a loop over the step's
    adapters, never over its requests)."""
    if not seg.segments:
        return
    R = b.shape[1]
    xs = x.index_select(0, seg.order).to(a.dtype)                    # (N, in)
    delta = torch.zeros(xs.shape[0], b.shape[2], dtype=a.dtype, device=x.device)   # (N, out)
    for s, start, end in seg.segments:
        r = slot_ranks[s]
        h = xs[start:end] @ a[s]                                     # (n, num_slices * R)
        for j in range(len(offsets) - 1):
            o0, o1 = offsets[j], offsets[j + 1]
            delta[start:end, o0:o1] = h[:, j * R:j * R + r] @ b[s, :r, o0:o1]
    y.index_add_(0, seg.order, delta.to(y.dtype))
