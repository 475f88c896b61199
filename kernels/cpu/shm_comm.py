"""Shared-memory collectives for the tensor-parallel ranks of one machine (``shm_allreduce.c``):
the all-reduce after each row-parallel layer and the all-gather of the LM head's logits go
through a segment the ranks map, instead of gloo's sockets (a round trip of about a millisecond
on a loaded machine, two per decoder layer). The ranks still form their torch.distributed group
(gloo) for everything else: the segment's set-up, the MoE all-to-all, pipeline sends.

``register`` makes a group's communicator; ``all_reduce`` and ``all_gather`` take the group as
torch.distributed does and use its communicator when it has one (float32 tensors on the CPU),
torch.distributed otherwise. ``TROUPE_TP_SHARED_MEMORY=0`` keeps gloo.

A group over several machines (``--nnodes``) whose machines each hold several of its ranks
all-reduces and all-gathers in three legs (``register_hierarchical``): the ranks of each machine
through their segment, the machines' first ranks (one per machine) over gloo, and the result
back to the other ranks of each machine through the segment again (those add zeros), so every
rank gets the same bits and only one rank per machine crosses the network."""
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


class HierarchicalCommunicator:
    """A group spread over machines: ``local``, this machine's ranks of it (None: this rank is
    its machine's only one); ``leaders``, the group of each machine's first rank, when this rank
    is its machine's first (None otherwise); ``machines``, each machine's ranks as places in the
    group (rank order within a machine, machines in the order of their first rank)."""

    def __init__(self, local: ShmCommunicator | None, leaders: Any, machines: list[list[int]]) -> None:
        self.local, self.leaders, self.machines = local, leaders, machines

    def all_reduce(self, t: torch.Tensor) -> None:
        if self.local is not None:
            self.local.all_reduce(t)               # this machine's sum, on each of its ranks
        if self.leaders is not None:
            torch.distributed.all_reduce(t, group=self.leaders)
        else:
            t.zero_()
        if self.local is not None:
            self.local.all_reduce(t)               # the first rank's total, to the others

    def all_gather(self, parts: list[torch.Tensor], t: torch.Tensor) -> None:
        """In three legs too: this machine's parts through its segment, every machine's (padded
        to the most ranks a machine holds) between the first ranks, and those back through the
        segment; ``parts`` in group rank order."""
        most = max(len(m) for m in self.machines)
        mine = [t.unsqueeze(0)]
        if self.local is not None:
            gathered = [torch.empty_like(t) for _ in range(self.local.world)]
            self.local.all_gather(gathered, t)
            mine = [p.unsqueeze(0) for p in gathered]
        block = torch.zeros((most, *t.shape), dtype=t.dtype)
        block[:len(mine)] = torch.cat(mine)
        every = torch.zeros((len(self.machines), most, *t.shape), dtype=t.dtype)
        if self.leaders is not None:
            torch.distributed.all_gather(list(every.unbind(0)), block, group=self.leaders)
        if self.local is not None:
            self.local.all_reduce(every)                # the first rank's, to the others (they add zeros)
        for m, places in enumerate(self.machines):
            for i, place in enumerate(places):
                parts[place].copy_(every[m, i])


def register_hierarchical(key: str, rank: int, ranks: list[int], nodes: list[int], group: Any = None
                          ) -> HierarchicalCommunicator | None:
    """The three-legged communicator of ``group``, whose ranks (``ranks``, world ranks) run on the
    machines ``nodes`` (one entry per rank); ``rank``: this process's world rank. Every process of
    the default group calls it for every such group, in the same order (it makes subgroups). None
    (gloo serves the group) when turned off or no machine holds two of its ranks."""
    by_node: dict[int, list[int]] = {}
    for r, n in zip(ranks, nodes):
        by_node.setdefault(n, []).append(r)
    if not enabled() or len(by_node) < 2 or all(len(rs) == 1 for rs in by_node.values()):
        return None
    local_groups = {n: torch.distributed.new_group(rs) for n, rs in by_node.items() if len(rs) > 1}
    leaders = torch.distributed.new_group([rs[0] for rs in by_node.values()])
    if rank not in ranks:
        return None
    node = nodes[ranks.index(rank)]
    mine = by_node[node]
    local = None
    if len(mine) > 1:
        local = register(f"{key}/node{node}", mine.index(rank), len(mine), local_groups[node])
        if local is None:
            return None
    machines = [[ranks.index(r) for r in rs] for rs in by_node.values()]
    comm = HierarchicalCommunicator(local, leaders if rank == mine[0] else None, machines)
    _COMMUNICATORS[group] = comm
    return comm


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
    """``group``'s shared-memory communicator, if it has one (its ranks all on this machine)."""
    comm = _COMMUNICATORS.get(group)
    return comm if isinstance(comm, ShmCommunicator) else None


def _usable(group: Any, t: torch.Tensor) -> ShmCommunicator | HierarchicalCommunicator | None:
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
