"""The tensor-parallel ranks' shared-memory collectives (kernels/cpu/shm_comm.py) between real
processes: an all-reduce gives every rank the same bits, the sum in rank order, for vectors of one
value, of a layer's output and of several rounds of the segment's slots; an all-gather gives
every rank each rank's tensor; a dtype the segment does not take goes through gloo; a group over
several machines all-reduces and all-gathers through each machine's segment and gloo between the
machines, every rank getting the same bits; and a rank that died fails its peers' collective instead of leaving
them waiting."""
from __future__ import annotations

import os
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from kernels.cpu import native, shm_comm

pytestmark = pytest.mark.skipif(not native.available()[0], reason="needs the native CPU kernels")

SIZES = [1, 576, shm_comm.CHUNK // 4 + 5, 5 * shm_comm.CHUNK // 8 + 3]     # the last two: several rounds


def _data(rank: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(100 * rank + n))


def _collectives(rank: int, world: int, init: str, out: str) -> None:
    try:
        torch.set_num_threads(1)
        torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        assert shm_comm.register(init, rank, world) is not None
        reduced = []
        for n in SIZES:
            x = _data(rank, n)
            shm_comm.all_reduce(x)
            reduced.append(x)
        parts = [torch.empty(3, 5) for _ in range(world)]
        shm_comm.all_gather(parts, torch.full((3, 5), float(rank)))
        ints = torch.tensor([rank + 1], dtype=torch.int64)
        shm_comm.all_reduce(ints)                                 # not float32: through gloo
        torch.save({"reduced": reduced, "gathered": parts, "ints": ints}, f"{out}.{rank}")
        torch.distributed.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        raise


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_same_sum_in_rank_order_and_each_ranks_gathered_tensor(tmp_path, world):
    out = str(tmp_path / "result")
    mp.start_processes(_collectives, args=(world, f"file://{tmp_path}/init", out), nprocs=world,
                       start_method="spawn", join=True)
    results = [torch.load(f"{out}.{r}") for r in range(world)]
    for i, n in enumerate(SIZES):
        want = _data(0, n)
        for r in range(1, world):
            want = want + _data(r, n)
        for res in results:
            assert torch.equal(res["reduced"][i], want), (n, res["reduced"][i][:4], want[:4])
    for res in results:
        assert [float(p[0, 0]) for p in res["gathered"]] == [float(r) for r in range(world)]
        assert int(res["ints"]) == sum(range(1, world + 1))


def _machines(rank: int, world: int, nodes: list[int], init: str, out: str) -> None:
    """Four ranks on the "machines" ``nodes``: the group of all four, and the group of ranks 1-3."""
    try:
        torch.set_num_threads(1)
        torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        comm = shm_comm.register_hierarchical(init, rank, list(range(world)), nodes)
        sub = torch.distributed.new_group([1, 2, 3])
        sub_comm = shm_comm.register_hierarchical(f"{init}/sub", rank, [1, 2, 3], nodes[1:], sub)
        reduced, sub_reduced = [], []
        for n in SIZES[:3]:
            x = _data(rank, n)
            shm_comm.all_reduce(x)
            reduced.append(x)
            if rank > 0:
                y = _data(rank, n)
                shm_comm.all_reduce(y, sub)
                sub_reduced.append(y)
        parts = [torch.empty(3, 700) for _ in range(world)]
        shm_comm.all_gather(parts, torch.full((3, 700), float(rank)))
        sub_parts = [torch.empty(5) for _ in range(3)]
        if rank > 0:
            shm_comm.all_gather(sub_parts, torch.arange(5.0) + 10 * rank, sub)
        kinds = [type(c).__name__ if c is not None else None for c in (comm, sub_comm)]
        torch.save({"reduced": reduced, "sub": sub_reduced, "gathered": parts, "sub_gathered": sub_parts,
                    "kinds": kinds}, f"{out}.{rank}")
        torch.distributed.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        raise


@pytest.mark.parametrize("nodes", [[0, 0, 1, 1], [0, 0, 0, 1]])
def test_a_group_over_machines_gives_every_rank_the_same_sum_through_each_machines_segment(tmp_path, nodes):
    out = str(tmp_path / "result")
    mp.start_processes(_machines, args=(4, nodes, f"file://{tmp_path}/init", out), nprocs=4,
                       start_method="spawn", join=True)
    results = [torch.load(f"{out}.{r}") for r in range(4)]
    for i, n in enumerate(SIZES[:3]):
        want = sum(_data(r, n) for r in range(4))
        torch.testing.assert_close(results[0]["reduced"][i], want, rtol=1e-5, atol=1e-5)
        assert all(torch.equal(res["reduced"][i], results[0]["reduced"][i]) for res in results)
        sub_want = sum(_data(r, n) for r in (1, 2, 3))
        torch.testing.assert_close(results[1]["sub"][i], sub_want, rtol=1e-5, atol=1e-5)
        assert all(torch.equal(res["sub"][i], results[1]["sub"][i]) for res in results[1:])
    for r, res in enumerate(results):
        assert all(torch.equal(p, torch.full((3, 700), float(i))) for i, p in enumerate(res["gathered"]))
        assert res["kinds"][0] == "HierarchicalCommunicator"
        if r > 0:
            assert [p.tolist() for p in res["sub_gathered"]] == [[10.0 * i + j for j in range(5)] for i in (1, 2, 3)]
    # ranks 1-3: hierarchical where a machine holds two of them ([0, 1, 1]; [0, 0, 1]); rank 0 is not in it
    assert [res["kinds"][1] for res in results] == [None] + ["HierarchicalCommunicator"] * 3


def test_a_group_whose_machines_hold_one_rank_each_stays_on_gloo():
    """No machine holds two of its ranks: nothing to gain, no subgroups made."""
    assert shm_comm.register_hierarchical("x", 0, [0, 1], [0, 1]) is None


def _one_dies(rank: int, init: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    shm_comm.register(init, rank, 2)
    if rank == 1:
        os._exit(0)                               # gone before the collective
    t0 = time.monotonic()
    try:
        shm_comm.all_reduce(torch.ones(8))
        result = "returned"
    except RuntimeError as exc:
        result = str(exc)
    with open(out, "w") as f:
        f.write(f"{result}|{time.monotonic() - t0:.1f}")


def test_a_rank_that_died_fails_its_peers_collective_instead_of_leaving_them_waiting(tmp_path):
    out = str(tmp_path / "result")
    mp.start_processes(_one_dies, args=(f"file://{tmp_path}/init", out), nprocs=2, start_method="spawn",
                       join=True)
    result, seconds = open(out).read().split("|")
    assert result == "a tensor-parallel rank died during an all-reduce" and float(seconds) < 30
