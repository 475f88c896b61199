"""Tensor parallelism: a loaded model split in place over ``world`` ranks (chapter 8 of the book,
Megatron's layout), one rank per worker process, collectives through ``torch.distributed`` (the
all-reduces and the logits' all-gather through shared memory between the ranks of one CPU machine:
kernels/cpu/shm_comm.py).

Per decoder layer:
  - attention: each rank keeps a contiguous run of KV heads and the query heads that read them
    (q|k|v rows of the fused projection: column-parallel), attends over its own heads with its
    own KV cache, and multiplies by its columns of the output projection (row-parallel); an
    all-reduce sums the ranks' partial outputs. KV heads are split as evenly as they go (9 query
    heads over 3 KV heads on 2 ranks: 6 + 3 query heads, 2 + 1 KV heads); with fewer KV heads
    than ranks, each is replicated on world / KV ranks and its query heads split among them;
  - MLP: gate|up rows (column-parallel) and down columns (row-parallel) over an even split of
    the intermediate size, then an all-reduce;
  - mixture-of-experts MLP (models/moe.py): each expert's intermediate size split the same way,
    or, with ``expert_parallel`` (--enable-expert-parallel), whole experts per rank with an
    all-to-all dispatch and combine of the tokens; the router stays whole.
The embedding and the LM head are split by vocabulary: each rank holds a run of the token rows;
an embedding lookup takes the rows it holds (zeros for the others) and an all-reduce completes
it; the LM head computes its rows' logits and an all-gather puts the vocabulary together (a tied
head keeps sharing the embedding's rows). The norms stay whole; every rank gets the same logits
and samples the same tokens, and rank 0's output is the step's. A bias of a row-parallel layer
is added once, on rank 0.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import shm_comm
from models.layers import Embedding, GatedMLP, Linear, MergedLinear, SelfAttention
from models.moe import FusedMoE
from models.tp_layout import head_split, split


class TPShard(NamedTuple):
    """What a split projection holds of the unsplit one: per output slice, (first row, rows) of
    a column-parallel layer (its slice's rows within the slice), or a list of such runs, put
    together in order (ModernBERT's one-tensor q|k|v); or (first column, columns) of a
    row-parallel one's input."""
    rows: dict[str, tuple[int, int] | list[tuple[int, int]]] | None = None
    cols: tuple[int, int] | None = None


def take_rows(t: torch.Tensor, rows: tuple[int, int] | list[tuple[int, int]]) -> torch.Tensor:
    """The rows of ``t`` a TPShard's ``rows`` entry names (one run, or runs put together)."""
    if isinstance(rows, tuple):
        return t[rows[0]:rows[0] + rows[1]]
    return torch.cat([t[r0:r0 + n] for r0, n in rows])


class RowParallel(nn.Module):
    """A row-parallel linear: this rank's columns of the weight times its share of the input,
    summed over the ranks by an all-reduce."""

    def __init__(self, linear: nn.Module, group: Any) -> None:
        super().__init__()
        self.linear = linear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        shm_comm.all_reduce(y, self.group)
        return y


class VocabParallelEmbedding(nn.Module):
    """This rank's rows ``start .. start + n`` of the embedding; the lookup of the others comes
    from their ranks through an all-reduce."""

    def __init__(self, weight: torch.Tensor, start: int, group: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.group = start, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0.0)
        shm_comm.all_reduce(out, self.group)
        return out


class VocabParallelLMHead(nn.Module):
    """This rank's vocabulary rows of the LM head (``linear``); the logits of every rank's rows
    gathered into the whole vocabulary (``sizes``: each rank's row count, in rank order)."""

    def __init__(self, linear: nn.Module, sizes: list[int], group: Any) -> None:
        super().__init__()
        self.linear = linear
        self.sizes, self.group = sizes, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)                                     # (N, this rank's rows)
        width = max(self.sizes)
        if y.shape[1] < width:                                 # all_gather wants equal shapes
            y = F.pad(y, (0, width - y.shape[1]))
        parts = [torch.empty_like(y) for _ in self.sizes]
        shm_comm.all_gather(parts, y.contiguous(), self.group)
        return torch.cat([p[:, :n] for p, n in zip(parts, self.sizes)], dim=1)


def shard_vocab(model: nn.Module, world: int, rank: int, group: Any) -> None:
    """The embedding and LM head split by vocabulary rows (a tied head shares the split rows);
    a pipeline stage holding only one of them splits that one."""
    emb, head = model.embed_tokens, getattr(model, "lm_head", None)       # an encoder has no LM head
    has_emb, has_head = isinstance(emb, Embedding), isinstance(head, Linear)
    vocab = (emb if has_emb else head).weight.shape[0]
    start, count = split(vocab, world, rank)
    tied = has_emb and has_head and head.weight is emb.weight
    if has_emb:
        model.embed_tokens = VocabParallelEmbedding(emb.weight.data[start:start + count].clone(), start, group)
    if not has_head:
        return
    weight = model.embed_tokens.weight if tied else nn.Parameter(head.weight.data[start:start + count].clone(),
                                                                 requires_grad=False)
    bias = head.bias.data[start:start + count].clone() if head.bias is not None else None
    lin = Linear(weight.shape[1], count, weight.dtype, weight=weight, bias=bias is not None)
    if bias is not None:
        lin.bias.data = bias
    _quantized(lin, head, rows={None: (start, count)})
    model.lm_head = VocabParallelLMHead(lin, [split(vocab, world, r)[1] for r in range(world)], group)


def _quantized(part: Linear, whole: Linear, rows: dict | None = None, cols: tuple[int, int] | None = None) -> Linear:
    """``part`` of layer ``whole`` with its share of ``whole``'s quantization method and loaded
    checkpoint tensors, if it has them (split before the weights are processed:
    models/quantization)."""
    if whole.quant_method is not None:
        whole.quant_method.shard(whole, part, rows, cols)
    return part


def _weight(lin: Linear) -> torch.Tensor:
    """The layer's float weight; a layer whose weights are quantized checkpoint tensors has none
    until they are processed: a stand-in of its shape without storage, for its parts' shapes."""
    if lin.weight is not None:
        return lin.weight.data
    return torch.empty(lin.out_features, lin.in_features, device="meta")


def _set_weight(lin: Linear, weight: torch.Tensor) -> None:
    if weight.is_meta:                   # a quantized layer's stand-in: its tensors come with its method
        lin.weight = nn.Parameter(weight, requires_grad=False)
    else:
        lin.weight.data = weight.contiguous()


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    lin = Linear(weight.shape[1], weight.shape[0], weight.dtype, bias=bias is not None)
    _set_weight(lin, weight)
    if bias is not None:
        lin.bias.data = bias.contiguous()
    return lin


def _merged(shards: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> MergedLinear:
    first = next(iter(shards.values()))[0]
    with_bias = any(b is not None for _, b in shards.values())
    lin = MergedLinear(first.shape[1], {name: w.shape[0] for name, (w, _) in shards.items()}, first.dtype,
                       bias=with_bias)
    _set_weight(lin, torch.cat([w for w, _ in shards.values()]))
    if with_bias:
        lin.bias.data = torch.cat([b for _, b in shards.values()]).contiguous()
    return lin


def _rows(lin: MergedLinear, shard: str, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    off = lin.shard_offsets[shard]
    w = _weight(lin)[off + start:off + start + count]
    b = lin.bias.data[off + start:off + start + count] if lin.bias is not None else None
    return w, b


def column_parallel(lin: Linear, rows: dict[str, tuple[int, int]] | list[tuple[int, int]]) -> Linear:
    """This rank's output rows of ``lin``: per slice of a MergedLinear (slice -> (first row, rows)
    within it), or runs of a plain Linear's rows put together in order."""
    if isinstance(rows, dict):
        return _quantized(_merged({s: _rows(lin, s, *r) for s, r in rows.items()}), lin, rows=rows)
    if lin.quant_method is not None and len(rows) > 1:
        raise ValueError("a quantized checkpoint's one-tensor q|k|v is not split over tensor-parallel ranks yet")
    bias = take_rows(lin.bias.data, rows) if lin.bias is not None else None
    return _quantized(_linear(take_rows(_weight(lin), rows), bias), lin, rows={None: rows[0]})


def row_parallel(lin: Linear, cols: tuple[int, int], rank: int, group: Any) -> RowParallel:
    """This rank's input columns of ``lin``, its product summed over the ranks (the bias added
    once, on rank 0)."""
    bias = lin.bias.data if lin.bias is not None and rank == 0 else None
    start, count = cols
    return RowParallel(_quantized(_linear(_weight(lin)[:, start:start + count], bias), lin, cols=cols), group)


class ShardedRMSNorm(nn.Module):
    """An RMSNorm over features split between the ranks (OLMo 2's q/k norms, over all heads at
    once): this rank's features and their share of the weight, the mean of squares over all of
    them by an all-reduce of the ranks' sums (each feature held by ``copies`` ranks: replicated KV
    heads)."""

    def __init__(self, norm: nn.Module, start: int, count: int, copies: int, group: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(norm.weight.data[start:start + count].clone(), requires_grad=False)
        self.eps, self.size, self.copies, self.group = norm.eps, norm.weight.shape[0], copies, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sums = xf.pow(2).sum(-1, keepdim=True)
        shm_comm.all_reduce(sums, self.group)
        y = xf * torch.rsqrt(sums / (self.size * self.copies) + self.eps)
        return (self.weight.float() * y).to(x.dtype)


def shard_attention(m: SelfAttention, world: int, rank: int, group: Any) -> None:
    D = m.head_size
    q0, qn, k0, kn = head_split(m.num_heads, m.num_kv_heads, world, rank)
    if m.qk_norm_whole:          # each rank's features of q and k, normalized over all ranks' together
        m.q_norm = ShardedRMSNorm(m.q_norm, q0 * D, qn * D, 1, group)
        m.k_norm = ShardedRMSNorm(m.k_norm, k0 * D, kn * D, max(1, world // m.num_kv_heads), group)
    rows = {"q": (q0 * D, qn * D), "k": (k0 * D, kn * D), "v": (k0 * D, kn * D)}
    m.qkv_proj = column_parallel(m.qkv_proj, rows)
    m.o_proj = row_parallel(m.o_proj, (q0 * D, qn * D), rank, group)
    if m.sinks is not None:      # each rank's heads' sinks
        m.sinks = nn.Parameter(m.sinks.data[q0:q0 + qn].clone(), requires_grad=False)
    if m.alibi_slopes is not None:
        m.alibi_slopes = m.alibi_slopes[q0:q0 + qn].clone()
    m.num_heads, m.num_kv_heads = qn, kn
    m.q_size, m.kv_size = qn * D, kn * D
    # what of each projection's unsplit rows or columns this rank holds (a LoRA adapter's share)
    m.tp_shards = {"qkv_proj": TPShard(rows=rows), "o_proj": TPShard(cols=(q0 * D, qn * D))}


def shard_mlp(m: GatedMLP, world: int, rank: int, group: Any) -> None:
    start, count = split(m.gate_up_proj.shard_sizes["gate"], world, rank)
    rows = {"gate": (start, count), "up": (start, count)}
    m.gate_up_proj = column_parallel(m.gate_up_proj, rows)
    m.down_proj = row_parallel(m.down_proj, (start, count), rank, group)
    m.tp_shards = {"gate_up_proj": TPShard(rows=rows), "down_proj": TPShard(cols=(start, count))}


def shard_model(model: nn.Module, world: int, rank: int, group: Any = None,
                expert_parallel: bool = False) -> nn.Module:
    """Split ``model`` (weights loaded, not yet packed or quantized) in place for ``rank`` of
    ``world``; returns it. ``expert_parallel``: MoE layers keep whole experts per rank instead
    of a share of every expert. ValueError for a model whose layers are not the ones split here."""
    if world == 1:
        return model
    own = [m for m in model.modules() if callable(getattr(m, "shard_tensor_parallel", None))]
    for m in own:                        # layers that split themselves (the encoders')
        m.shard_tensor_parallel(world, rank, group)
    attention = [m for m in model.modules() if isinstance(m, SelfAttention) and not any(m is o for o in own)]
    mlps = [m for m in model.modules() if isinstance(m, GatedMLP)]
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    if not own and (not attention or len(mlps) + len(moes) < len(attention)):      # (a shared expert: both)
        raise ValueError(f"{type(model).__name__}: tensor parallelism splits models made of attention and gated "
                         "MLP or mixture-of-experts layers")
    for m in attention:
        shard_attention(m, world, rank, group)
    for m in mlps:
        shard_mlp(m, world, rank, group)
    for m in moes:
        m.shard(world, rank, group, expert_parallel)
    if isinstance(getattr(model, "embed_tokens", None), Embedding) or isinstance(getattr(model, "lm_head", None), Linear):
        shard_vocab(model, world, rank, group)
    return model
