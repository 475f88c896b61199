"""Attention backends over the paged KV cache, plus helpers to allocate the cache and to build
per-step metadata from plain lists (for tests and simple callers)."""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from kernels.attention.base import AttentionBackend, AttentionMetadata
from kernels.attention.cpu import CpuAttentionBackend
from kernels.attention.reference import reference_paged_attention


class _KVShape(Protocol):  # the ArchConfig fields the cache needs
    num_layers: int
    num_kv_heads: int
    head_size: int


def allocate_kv_caches(config: _KVShape, num_blocks: int, block_size: int,
                       dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """One zeroed (2, num_blocks, block_size, num_kv_heads, head_size) tensor per layer."""
    shape = (2, num_blocks, block_size, config.num_kv_heads, config.head_size)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]


def build_attention_metadata(query_lens: Sequence[int], seq_lens: Sequence[int],
                             block_tables: Sequence[Sequence[int]], block_size: int,
                             num_tokens: int | None = None, state_slots: Sequence[int] | None = None
                             ) -> AttentionMetadata:
    """Metadata for requests whose new tokens are the last query_lens[i] of seq_lens[i], stored
    in the blocks block_tables[i]. Tokens past sum(query_lens) up to num_tokens are padding.
    ``state_slots``: each request's recurrent state slot (state-space layers); None: 0, 1, 2, ..."""
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per request")
    slots = []
    for q_len, s_len, blocks in zip(query_lens, seq_lens, block_tables):
        if not 0 < q_len <= s_len or len(blocks) * block_size < s_len:
            raise ValueError(f"bad request: query_len {q_len}, seq_len {s_len}, {len(blocks)} blocks of {block_size}")
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(s_len - q_len, s_len)]
    total = len(slots)
    num_tokens = total if num_tokens is None else num_tokens
    max_blocks = max((len(b) for b in block_tables), default=0)
    block_table = torch.zeros(len(block_tables), max(max_blocks, 1), dtype=torch.int32)
    for i, blocks in enumerate(block_tables):
        block_table[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    return AttentionMetadata(
        num_reqs=len(query_lens),
        num_tokens=num_tokens,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.tensor(slots + [-1] * (num_tokens - total), dtype=torch.int64),
        block_size=block_size,
        state_slots=torch.tensor(range(len(query_lens)) if state_slots is None else state_slots, dtype=torch.int64),
    )


__all__ = ["AttentionBackend", "AttentionMetadata", "CpuAttentionBackend", "reference_paged_attention", "allocate_kv_caches", "build_attention_metadata"]
