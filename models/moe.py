"""The mixture-of-experts MLP of Qwen3-MoE, Mixtral, OLMoE, gpt-oss, Granite MoE, Qwen2-MoE,
DeepSeek, GLM-4.5 and ERNIE 4.5 MoE (vLLM's ``FusedMoE``): a router, top-k routing (``route``:
DeepSeek's scoring, groups, correction bias and scale where ``Routing`` says), the experts'
weights stacked into two tensors, run as one fused call, and a shared expert beside them where a
model has one (``SharedExpertMoE``).

  router logits = x Wg^T (+ b)  ->  softmax (float32)  ->  top-k experts per token (their
  weights renormalized to sum to 1 when ``renormalize``)  ->  the tokens grouped by expert  ->
  per expert: down(act(gate(x), up(x)))  ->  each token's outputs summed, weighted by its
  routing weights.

The activation is SiLU(gate) * up, or gpt-oss's "swigluoai" (vLLM's name): g = min(gate, limit),
u = clamp(up, -limit, limit), (u + 1) * g * sigmoid(alpha * g). gpt-oss's experts also carry
biases (``w13_bias`` (E, 2I), ``w2_bias`` (E, H)), and its router one; its softmax over the top-k
logits is the renormalized top-k of the full softmax.

The experts are stacked at load: ``w13_weight`` (E, 2I, H) holds each expert's gate rows then
its up rows, ``w2_weight`` (E, H, I) its down projection; the checkpoint's per-expert tensors
are copied in by ``load_shard`` (shards ``gate.{e}``, ``up.{e}``, ``down.{e}``).

``fused_experts`` runs the grouped expert matmuls: the native C kernel on float32 CPU tensors
(kernels/cpu/moe.py), the Triton kernel on CUDA tensors (kernels/triton/moe.py), otherwise
``fused_experts_ref``, a loop over the experts with torch matmuls (the reference the kernels are
tested against).

Parallelism (``shard``, called by models/tensor_parallel.py):
  - tensor parallelism: every rank keeps every expert, with its share of each expert's
    intermediate dimension (gate|up rows, down columns); an all-reduce sums the partial outputs;
  - expert parallelism (--enable-expert-parallel): every rank keeps E / ranks whole experts.
    The ranks hold the same tokens (attention stays tensor-parallel), so each routes its own
    share of them, sends each (token, expert) pair to the rank that owns the expert (all-to-all
    dispatch), runs its experts on what it received, sends the results back (all-to-all
    combine), weights and sums them per token, and an all-gather gives every rank every token.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import shm_comm
from models.config import Routing
from models.layers import Linear, _empty_param
from models.tp_layout import split


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) router logits -> (weights (T, k) float32, expert ids (T, k) int64): softmax in
    float32, the k largest probabilities, renormalized to sum to 1 when ``renormalize``."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


ACTIVATIONS = ("silu", "swigluoai")


class ExpertActivation(NamedTuple):
    """The experts' gated activation (module docstring); alpha and limit are swigluoai's."""
    name: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.name == "silu":
            return F.silu(gate) * up
        g = gate.clamp(max=self.limit)
        return (up.clamp(-self.limit, self.limit) + 1) * g * torch.sigmoid(g * self.alpha)


SILU = ExpertActivation()


PLAIN = Routing()


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, routing: Routing = PLAIN,
          correction: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) router logits -> (weights (T, k) float32, expert ids (T, k) int64) as ``routing``
    says (module docstring; plain routing is ``select_experts``)."""
    if routing == PLAIN:
        return select_experts(router_logits, top_k, renormalize)
    logits = router_logits.float()
    scores = torch.sigmoid(logits) if routing.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores if correction is None else scores + correction.float()
    if routing.n_group > 1:
        T, E = choice.shape
        groups = choice.view(T, routing.n_group, E // routing.n_group)
        group_scores = groups.max(-1).values if routing.group_by == "max" else groups.topk(2, -1).values.sum(-1)
        best = group_scores.topk(routing.topk_group, dim=-1).indices                      # (T, topk_group)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // routing.n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scale if routing.scale != 1.0 else weights, ids


def fused_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, expert_start: int = 0, w13_bias: torch.Tensor | None = None,
                      w2_bias: torch.Tensor | None = None, activation: ExpertActivation = SILU) -> torch.Tensor:
    """The reference: a loop over the experts held here (global ids ``expert_start`` ..
    ``expert_start + E``), each a gate|up matmul, the activation and a down matmul (with their
    biases when given) on the tokens routed to it; pairs routed to experts not held here add
    nothing. x (T, H), w13 (E, 2I, H), w2 (E, H, I), topk_weights (T, k), topk_ids (T, k),
    w13_bias (E, 2I), w2_bias (E, H) -> (T, H) in x's dtype."""
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    local = topk_ids - expert_start
    for e in range(w13.shape[0]):
        token, slot = torch.where(local == e)
        if token.numel() == 0:
            continue
        gate_up = F.linear(x[token], w13[e].to(x.dtype), None if w13_bias is None else w13_bias[e].to(x.dtype))
        h = activation(gate_up[:, :inter], gate_up[:, inter:])
        y = F.linear(h, w2[e].to(x.dtype), None if w2_bias is None else w2_bias[e].to(x.dtype))
        out[token] += y * topk_weights[token, slot, None].to(x.dtype)   # a token meets an expert once
    return out


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_start: int = 0, w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None, activation: ExpertActivation = SILU) -> torch.Tensor:
    """``fused_experts_ref``'s result through the fastest path these tensors take: the native
    CPU kernel (float32 CPU tensors), the Triton kernel (CUDA tensors), else the reference."""
    from kernels.cpu import moe as cpu_moe
    from kernels.triton import fused as triton_fused
    if cpu_moe.supports(x, w13, w2):
        return cpu_moe.fused_experts(x, w13, w2, topk_weights, topk_ids, expert_start, w13_bias, w2_bias,
                                     *activation)
    if triton_fused.supports(x, w13, w2):
        from kernels.triton.moe import fused_experts as triton_fused_experts
        return triton_fused_experts(x, w13, w2, topk_weights, topk_ids, expert_start, w13_bias, w2_bias,
                                    *activation)
    return fused_experts_ref(x, w13, w2, topk_weights, topk_ids, expert_start, w13_bias, w2_bias, activation)


class FusedMoE(nn.Module):
    """Router (``gate``) and E stacked gated experts; (T, H) -> (T, H). ``bias``: the experts'
    projections and the router have biases (gpt-oss's)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, dtype: torch.dtype, hidden_act: str = "silu", bias: bool = False,
                 swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, routing: Routing = PLAIN) -> None:
        super().__init__()
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"mixture-of-experts layers with activation {hidden_act!r} are not supported; "
                             f"supported: {', '.join(ACTIVATIONS)}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        if routing.n_group > 1 and (num_experts % routing.n_group or not 0 < routing.topk_group <= routing.n_group):
            raise ValueError(f"{num_experts} experts in n_group={routing.n_group} groups with "
                             f"topk_group={routing.topk_group}: the groups must divide the experts and "
                             "topk_group be in [1, n_group]")
        self.routing = routing
        self.activation = ExpertActivation(hidden_act, swiglu_alpha, swiglu_limit)
        self.intermediate_size = intermediate_size             # this rank's share under tensor parallelism
        self.gate = Linear(hidden_size, num_experts, dtype, bias=bias)   # the router (replicated on every rank)
        self.w13_weight = _empty_param(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype)
        self.w2_weight = _empty_param(num_experts, hidden_size, intermediate_size, dtype=dtype)
        # the experts' biases: gate rows then up rows, down
        self.w13_bias = _empty_param(num_experts, 2 * intermediate_size, dtype=dtype) if bias else None
        self.w2_bias = _empty_param(num_experts, hidden_size, dtype=dtype) if bias else None
        # DeepSeek V3's per-expert bias on the scores that choose (float32), when its routing has one
        self.e_score_correction_bias = (_empty_param(num_experts, dtype=torch.float32) if routing.correction_bias
                                        else None)
        self.expert_start = 0           # global id of this rank's first expert (expert parallelism)
        self.parallel = "none"          # "none" | "tensor" | "expert" (``shard``)
        self.world, self.rank, self.group = 1, 0, None
        self.expert_starts: list[int] = [0]      # each rank's first expert (expert parallelism)

    def extra_repr(self) -> str:
        return (f"experts={self.w13_weight.shape[0]} of {self.num_experts} from {self.expert_start}, "
                f"top_k={self.top_k}, intermediate={self.intermediate_size}, parallel={self.parallel}, "
                f"activation={self.activation.name}, bias={self.w13_bias is not None}")

    # -- loading ---------------------------------------------------------------------------------

    def param_shards(self, param: str) -> list[str | None]:
        """The shards a checkpoint fills ``param`` with (what the loader reports as unloaded)."""
        E = self.num_experts
        if param == "w13_weight":
            return [f"{part}.{e}" for e in range(E) for part in ("gate", "up")]
        if param == "w2_weight":
            return [f"down.{e}" for e in range(E)]
        return [None]

    def load_shard(self, shard: str, tensor: torch.Tensor, param: str = "weight") -> None:
        """Copy one expert's gate, up or down projection (shard ``gate.{e}`` / ``up.{e}`` of
        ``w13_weight``, ``down.{e}`` of ``w2_weight``) into its place."""
        part, _, index = shard.partition(".")
        if param not in ("w13_weight", "w2_weight") or f"{part}.{index}" not in self.param_shards(param):
            raise KeyError(f"no shard {shard!r} of {param}; a layer of {self.num_experts} experts has shards "
                           "gate.E and up.E of w13_weight, down.E of w2_weight")
        e, inter = int(index), self.intermediate_size
        target = getattr(self, param).data[e]
        if part == "gate":
            target = target[:inter]
        elif part == "up":
            target = target[inter:]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"expert {e}'s {part} projection has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(target.shape)}")
        target.copy_(tensor)

    # -- parallelism -----------------------------------------------------------------------------

    def shard(self, world: int, rank: int, group: Any, expert_parallel: bool) -> None:
        """Keep this rank's part: whole experts (``expert_parallel``) or every expert's share of
        the intermediate dimension."""
        if world == 1:
            return
        w13, w2, inter = self.w13_weight.data, self.w2_weight.data, self.intermediate_size
        b13 = None if self.w13_bias is None else self.w13_bias.data
        b2 = None if self.w2_bias is None else self.w2_bias.data
        if expert_parallel:
            if self.num_experts < world:
                raise ValueError(f"expert parallelism over {world} ranks needs at least as many experts, the model "
                                 f"has {self.num_experts}")
            start, count = split(self.num_experts, world, rank)
            w13, w2 = w13[start:start + count], w2[start:start + count]
            if b13 is not None:
                b13, b2 = b13[start:start + count], b2[start:start + count]
            self.expert_start = start
            self.expert_starts = [split(self.num_experts, world, r)[0] for r in range(world)]
            self.parallel = "expert"
        else:
            start, count = split(inter, world, rank)
            w13 = torch.cat([w13[:, start:start + count], w13[:, inter + start:inter + start + count]], dim=1)
            w2 = w2[:, :, start:start + count]
            if b13 is not None:      # the down bias once: the ranks' partial outputs are summed
                b13 = torch.cat([b13[:, start:start + count], b13[:, inter + start:inter + start + count]], dim=1)
                b2 = b2 if rank == 0 else torch.zeros_like(b2)
            self.intermediate_size = count
            self.parallel = "tensor"
        self.w13_weight = nn.Parameter(w13.contiguous(), requires_grad=False)
        self.w2_weight = nn.Parameter(w2.contiguous(), requires_grad=False)
        if b13 is not None:
            self.w13_bias = nn.Parameter(b13.contiguous(), requires_grad=False)
            self.w2_bias = nn.Parameter(b2.contiguous(), requires_grad=False)
        self.world, self.rank, self.group = world, rank, group

    # -- forward ---------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # (T, H) -> (T, H)
        weights, ids = route(self.gate(x), self.top_k, self.renormalize, self.routing, self.e_score_correction_bias)
        if self.parallel == "expert":
            return self._expert_parallel(x, weights, ids)
        out = fused_experts(x, self.w13_weight, self.w2_weight, weights, ids, 0, self.w13_bias, self.w2_bias,
                            self.activation)
        if self.parallel == "tensor":
            shm_comm.all_reduce(out, self.group)
        return out

    def _expert_parallel(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """All-to-all dispatch, local experts, all-to-all combine, all-gather (module docstring)."""
        dist = torch.distributed
        T, H = x.shape
        if T == 0:                     # every rank has the same tokens: none skips a collective alone
            return torch.zeros_like(x)
        world, k = self.world, self.top_k
        start, count = split(T, world, self.rank)
        pair_ids = ids[start:start + count].reshape(-1)                 # (count * k,) this rank's pairs
        pair_token = torch.arange(count, device=x.device).repeat_interleave(k)
        bounds = torch.tensor(self.expert_starts[1:], device=x.device, dtype=pair_ids.dtype)
        owner = torch.bucketize(pair_ids, bounds, right=True)           # the rank holding each expert
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        sends, recvs = send_counts.tolist(), recv_counts.tolist()
        # dispatch: each pair's hidden state and expert id to the expert's rank
        send_x = x[start + pair_token[order]]
        recv_x = x.new_empty(sum(recvs), H)
        dist.all_to_all_single(recv_x, send_x, recvs, sends, group=self.group)
        recv_ids = pair_ids.new_empty(sum(recvs))
        dist.all_to_all_single(recv_ids, pair_ids[order].contiguous(), recvs, sends, group=self.group)
        # this rank's experts, one row per received pair (weight 1: the sender weights)
        ones = torch.ones(recv_x.shape[0], 1, dtype=torch.float32, device=x.device)
        y = fused_experts(recv_x, self.w13_weight, self.w2_weight, ones, recv_ids[:, None], self.expert_start,
                          self.w13_bias, self.w2_bias, self.activation)
        # combine: the results back to the pairs' ranks, weighted and summed per token
        back = x.new_empty(len(order), H)
        dist.all_to_all_single(back, y.contiguous(), sends, recvs, group=self.group)
        w = weights[start:start + count].reshape(-1)[order].to(x.dtype)
        local = torch.zeros(count, H, dtype=x.dtype, device=x.device)
        local.index_add_(0, pair_token[order], back * w[:, None])
        # every rank gets every token's output (the next layer's attention is tensor-parallel)
        sizes = [split(T, world, r)[1] for r in range(world)]
        width = max(sizes)
        if count < width:
            local = F.pad(local, (0, 0, 0, width - count))
        parts = [torch.empty_like(local) for _ in range(world)]
        shm_comm.all_gather(parts, local.contiguous(), self.group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)])


class SharedExpertMoE(nn.Module):
    """Routed experts plus a shared expert every token goes through (a SiLU-gated MLP), summed;
    with ``shared_gate`` (hidden -> 1, Qwen2-MoE's) the shared expert's output scaled by its sigmoid."""

    def __init__(self, moe: FusedMoE, shared: nn.Module | None, shared_gate: nn.Module | None = None) -> None:
        super().__init__()
        self.moe, self.shared_mlp, self.shared_gate = moe, shared, shared_gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared_mlp is None:          # (a config with no shared expert)
            return self.moe(x)
        shared = self.shared_mlp(x)
        if self.shared_gate is not None:
            shared = torch.sigmoid(self.shared_gate(x)) * shared
        return self.moe(x) + shared
