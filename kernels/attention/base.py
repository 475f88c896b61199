"""The attention-backend interface: per-step metadata and the contract every backend keeps."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """What one forward pass needs to read and write the paged KV cache.

    Tokens of all scheduled requests are flattened into one batch of T tokens, request after
    request; request i owns tokens ``query_start_loc[i]:query_start_loc[i+1]``.
    """

    num_reqs: int
    num_tokens: int                 # T, padding included
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor   # (B + 1,) int32, cumulative query lengths, starts at 0
    seq_lens: torch.Tensor          # (B,) int32, tokens in the cache after this step (context + new)
    block_table: torch.Tensor       # (B, max_blocks) int32, physical block ids, padding points at block 0
    slot_mapping: torch.Tensor      # (T,) int64, block_id * block_size + offset; -1 = padding, not written
    block_size: int

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """Contract: ``forward`` first writes ``key``/``value`` into ``kv_cache`` through
    ``meta.slot_mapping`` (slots of -1 are skipped), then returns causal attention of each
    request's queries over that request's whole context, read through ``meta.block_table``.

    kv_cache: (2, num_blocks, block_size, num_kv_heads, head_size), [0] keys and [1] values.
    """

    name: str = "base"

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,     # (T, num_heads, head_size)
        key: torch.Tensor,       # (T, num_kv_heads, head_size)
        value: torch.Tensor,     # (T, num_kv_heads, head_size)
        kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_size)
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:           # (T, num_heads, head_size)
        ...
