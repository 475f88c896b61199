"""Building blocks shared by the architectures: linear layers (plain and fused), embedding,
RMSNorm, rotary position embedding and the gated activation.

Parameters are allocated with ``torch.empty`` (no random init: weights come from a checkpoint)
and never require grad.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T without bias. ``weight`` may be an existing parameter (a tied LM head)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 weight: nn.Parameter | None = None) -> None:
        super().__init__()
        if weight is not None and tuple(weight.shape) != (out_features, in_features):
            raise ValueError(f"tied weight has shape {tuple(weight.shape)}, expected {(out_features, in_features)}")
        self.weight = weight if weight is not None else _empty_param(out_features, in_features, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out)
        return F.linear(x, self.weight)


class MergedLinear(Linear):
    """Several projections of the same input fused into one matmul, e.g. q|k|v or gate|up.

    The output is the concatenation of the shards in declaration order; a checkpoint's separate
    tensors are copied into their row ranges by ``load_shard``.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], dtype: torch.dtype) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), dtype)
        self.shard_sizes = dict(shard_sizes)
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = offset
            offset += size

    def load_shard(self, shard: str, tensor: torch.Tensor) -> None:
        if shard not in self.shard_sizes:
            raise KeyError(f"no shard {shard!r}; shards are {list(self.shard_sizes)}")
        start, size = self.shard_offsets[shard], self.shard_sizes[shard]
        expected = (size, self.weight.shape[1])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"shard {shard!r} has shape {tuple(tensor.shape)}, expected {expected}")
        self.weight.data[start:start + size].copy_(tensor)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _empty_param(num_embeddings, embedding_dim, dtype=dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, dim)
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, hidden)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight.float(), self.eps)
        y = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * y.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Hugging Face-style ("half-split", NeoX) rotary: dimension j pairs with j + head_size/2.

    cos/sin for every position up to max_positions are precomputed once in float32.
    """

    def __init__(self, head_size: int, max_positions: int, theta: float) -> None:
        super().__init__()
        # Same arithmetic as transformers' default rope init, so float32 results match bit for bit.
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)                                         # (P, D)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions (T,) -> cos, sin (T, 1, D): broadcast over heads
        cos = self.cos_cache[positions].to(dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x (T, heads, D), cos/sin (T, 1, D)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)  # rotate_half
    return x * cos + rotated * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up (T, 2I) = gate | up -> (T, I)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
