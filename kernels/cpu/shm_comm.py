"""Shared-memory collectives for the tensor-parallel ranks of one machine (``shm_allreduce.c``):
the all-reduce after each row-parallel layer and the all-gather of the LM head's logits go
through a segment the ranks map, instead of gloo's sockets (a round trip of about a millisecond
on a loaded machine, two per decoder layer). The ranks still form their torch.distributed group
(gloo) for everything else: the segment's set-up, the MoE all-to-all, pipeline sends.

``register`` makes a group's communicator; ``all_reduce`` and ``all_gather`` take the group as
torch.distributed does and use its communicator when it has one (float32 tensors on the CPU),
torch.distributed otherwise. ``TROUPE_TP_SHARED_MEMORY=0`` keeps gloo."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import mmap
import os
from typing import Any

import torch

from kernels.cpu.native import library

log = logging.getLogger("troupe.tp")

ENV = "TROUPE_TP_SHARED_MEMORY"
CHUNK = 1 << 20                    # bytes a rank puts in its slot per round
_COMMUNICATORS: dict[Any, ShmCommunicator] = {}
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _lib() -> ctypes.CDLL:
    lib = library()
    if not getattr(lib, "_shm_declared", False):
        lib.shm_segment_bytes.restype, lib.shm_segment_bytes.argtypes = _I64, [_I64, _I64]
        lib.shm_register.restype, lib.shm_register.argtypes = None, [_PTR, _I64]
        lib.shm_all_reduce_f32.restype = _I64
        lib.shm_all_reduce_f32.argtypes = [_PTR, _I64, _I64, _I64, ctypes.POINTER(_I64), _PTR, _I64]
        lib.shm_all_gather.restype = _I64
        lib.shm_all_gather.argtypes = [_PTR, _I64, _I64, _I64, ctypes.POINTER(_I64), _PTR, _PTR, _I64]
        lib._shm_declared = True
    return lib


class ShmCommunicator:
    """The segment of one group of ``world`` ranks on this machine, named after ``key`` (the same
    on every rank, unique to the group and its generation); this process is ``rank``. Every rank
    constructs it at once (it takes two barriers of the group)."""

    def __init__(self, key: str, rank: int, world: int, group: Any = None) -> None:
        lib = _lib()
        self.rank, self.world = rank, world
        size = lib.shm_segment_bytes(world, CHUNK)
        path = f"/dev/shm/troupe-tp-{hashlib.sha256(key.encode()).hexdigest()[:20]}"
        if rank == 0:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)
            os.close(fd)
        torch.distributed.barrier(group=group)
        fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        lib.shm_register(self.base, rank)
        torch.distributed.barrier(group=group)
        if rank == 0:                      # mapped by every rank: nothing is left if they die
            os.unlink(path)
        self.seq = _I64(0)
        self.lib = lib

    def all_reduce(self, t: torch.Tensor) -> None:
        if self.lib.shm_all_reduce_f32(self.base, self.world, self.rank, CHUNK, ctypes.byref(self.seq),
                                       t.data_ptr(), t.numel()) != 0:
            raise RuntimeError("a tensor-parallel rank died during an all-reduce")

    def all_gather(self, parts: list[torch.Tensor], t: torch.Tensor) -> None:
        out = torch.empty((self.world, *t.shape), dtype=t.dtype)
        if self.lib.shm_all_gather(self.base, self.world, self.rank, CHUNK, ctypes.byref(self.seq), t.data_ptr(),
                                   out.data_ptr(), t.numel() * t.element_size()) != 0:
            raise RuntimeError("a tensor-parallel rank died during an all-gather")
        for p, o in zip(parts, out):
            p.copy_(o)


def register(key: str, rank: int, world: int, group: Any = None) -> ShmCommunicator | None:
    """The shared-memory communicator of ``group`` (None: the default group), made by every rank
    of it at once; None (torch.distributed serves the group) when turned off or unavailable here."""
    if not enabled() or world < 2:
        return None
    try:
        comm = ShmCommunicator(key, rank, world, group)
    except (OSError, RuntimeError) as exc:     # no /dev/shm, no native kernels: gloo serves the group
        log.warning("tensor-parallel collectives over gloo: no shared memory segment (%s)", exc)
        return None
    _COMMUNICATORS[group] = comm
    return comm


def communicator(group: Any = None) -> ShmCommunicator | None:
    """``group``'s shared-memory communicator, if it has one."""
    return _COMMUNICATORS.get(group)


def _usable(group: Any, t: torch.Tensor) -> ShmCommunicator | None:
    comm = _COMMUNICATORS.get(group)
    if comm is None or t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        return None
    return comm


def all_reduce(t: torch.Tensor, group: Any = None) -> None:
    """``t`` summed over ``group``'s ranks, in place."""
    comm = _usable(group, t)
    if comm is None:
        torch.distributed.all_reduce(t, group=group)
    else:
        comm.all_reduce(t)


def all_gather(parts: list[torch.Tensor], t: torch.Tensor, group: Any = None) -> None:
    """``parts[r]`` = rank r's ``t`` (the same shape on every rank)."""
    comm = _usable(group, t)
    if comm is None:
        torch.distributed.all_gather(parts, t, group=group)
    else:
        comm.all_gather(parts, t)
