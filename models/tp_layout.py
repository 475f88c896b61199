"""How tensor parallelism splits a model's heads and columns over ranks (no torch: the engine
core sizes its KV cache blocks with it). ``models/tensor_parallel.py`` applies it."""
from __future__ import annotations


def split(n: int, world: int, rank: int) -> tuple[int, int]:
    """(start, count) of ``rank``'s share of ``n`` items in contiguous runs as even as they go."""
    base, extra = divmod(n, world)
    return rank * base + min(rank, extra), base + (rank < extra)


def head_split(num_heads: int, num_kv_heads: int, world: int, rank: int) -> tuple[int, int, int, int]:
    """(first query head, query heads, first KV head, KV heads) of ``rank``. ValueError when the
    heads cannot be split: fewer KV heads than ranks needs ranks a multiple of them."""
    group = num_heads // num_kv_heads                  # query heads per KV head
    if num_kv_heads >= world:
        kv_start, kv_count = split(num_kv_heads, world, rank)
        return kv_start * group, kv_count * group, kv_start, kv_count
    if world % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be shared by {world} ranks: with fewer KV heads than "
                         "ranks, the ranks must be a multiple of them")
    per_kv = world // num_kv_heads                     # ranks sharing one KV head
    kv = rank // per_kv
    if group < per_kv:
        raise ValueError(f"{num_heads} query heads cannot be split over {world} ranks")
    q_start, q_count = split(group, per_kv, rank % per_kv)
    return kv * group + q_start, q_count, kv, 1


def max_local_kv_heads(num_heads: int, num_kv_heads: int, world: int) -> int:
    """The most KV heads one rank holds: what each rank's KV cache block is sized for."""
    return max(head_split(num_heads, num_kv_heads, world, r)[3] for r in range(world))
