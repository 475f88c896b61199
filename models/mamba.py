"""State-space models: Mamba (``MambaForCausalLM``, Falcon-Mamba), Mamba-2 (``Mamba2ForCausalLM``),
and the mixer layers the hybrid models share with attention ones.

A Mamba layer keeps no KV cache: each request carries, per layer, the last ``d_conv - 1`` inputs
of the causal convolution and the state-space state (the engine's recurrent state slots, one per
request of the worker's batch: ``meta.state_slots``). A step reads them, runs the request's new
tokens through the recurrence and writes them back, so a prompt may come in chunks and a decode
continues where the prompt ended. A request whose step starts at position 0 starts from zero
state (a slot is reused as requests come and go; nothing of its previous owner is read).

Mamba, per channel c of d_inner and token t (x the convolved input, dt > 0 its time step):
    h_t[c] = exp(dt_t[c] A[c]) h_{t-1}[c] + dt_t[c] B_t x_t[c]        (h[c], A[c], B_t of d_state)
    y_t[c] = C_t . h_t[c] + D[c] x_t[c], then gated: y_t * silu(z_t)
Mamba-2: one scalar decay A per head and the heads of a group sharing B and C, so a prompt's
chunk is computed at once (the "state space duality": a decay-masked attention within the
chunk, plus the state carried in from before it), and a gated RMSNorm takes the place of the gate.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention.base import AttentionBackend, AttentionMetadata
from kernels.cpu import ssm
from models.base import CausalLM, TensorMap
from models.config import ArchConfig, MambaDims
from models.granite import GraniteForCausalLM, GraniteMoeSharedForCausalLM
from models.layers import Embedding, GatedMLP, Linear, RMSNorm
from models.llama import LlamaDecoderLayer, LlamaForCausalLM
from models.qwen3_moe import use_moe_layers

CHUNK = 64          # Mamba-2: the tokens of a prompt computed at once


class StateSteps(NamedTuple):
    """The step's requests as the state-space layers see them, taken once per forward from the
    attention metadata: request i computes tokens ``starts[i] .. starts[i] + lens[i]`` of the
    step's batch in state slot ``slots[i]``; ``fresh[i]``: it starts at position 0 (zero state)."""
    slots: list[int]
    starts: list[int]
    lens: list[int]
    fresh: list[bool]
    slot_index: torch.Tensor        # (B,) int64, the slots
    fresh_mask: torch.Tensor        # (B,) bool
    decode: bool                    # one token each
    qsl: torch.Tensor               # (B + 1,) int64, where each request's tokens start, then their end

    def gather(self, state: torch.Tensor) -> torch.Tensor:
        """A decode step's states, (B, ...) copies of the requests' slots, zero where fresh."""
        h = state[self.slot_index]
        if any(self.fresh):
            h[self.fresh_mask] = 0
        return h

    def each_request(self, state: torch.Tensor, out: torch.Tensor,
                     scan: Callable[[slice, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``out[tokens] = scan(tokens, h)`` for each request, h its slot of ``state`` (zeroed first
        where fresh), updated in place by ``scan``."""
        for slot, start, n, fresh in zip(self.slots, self.starts, self.lens, self.fresh):
            h = state[slot]
            if fresh:
                h.zero_()
            s = slice(start, start + n)
            out[s] = scan(s, h)
        return out

    @classmethod
    def of(cls, meta: AttentionMetadata) -> StateSteps:
        """The step's, taken once: every state-space layer of a step is given the same metadata
        object, so the last one's are kept and handed on (no host reads per layer). (A metadata
        object refilled in place, as a captured CUDA graph's is, would not do: these layers run
        eagerly.)"""
        if _LAST_STEPS[0] is meta:
            return _LAST_STEPS[1]
        steps = cls._read(meta)
        _LAST_STEPS[:] = [meta, steps]
        return steps

    @classmethod
    def _read(cls, meta: AttentionMetadata) -> StateSteps:
        if meta.state_slots is None:
            raise ValueError("a state-space layer needs the step's state slots (AttentionMetadata.state_slots)")
        qsl = meta.query_start_loc.tolist()
        lens = [b - a for a, b in zip(qsl[:meta.num_reqs], qsl[1:meta.num_reqs + 1])]
        seq = meta.seq_lens.tolist()[:meta.num_reqs]
        fresh = [s == n for s, n in zip(seq, lens)]
        slots = meta.state_slots[:meta.num_reqs].to("cpu", torch.int64)
        device = meta.query_start_loc.device
        return cls(slots.tolist(), qsl[:meta.num_reqs], lens, fresh, slots.to(device),
                   torch.tensor(fresh, device=device), all(n == 1 for n in lens),
                   meta.query_start_loc[:meta.num_reqs + 1].to(torch.int64))


_LAST_STEPS: list = [None, None]        # (the metadata, its StateSteps): the step being run


class CausalConv1d(nn.Module):
    """A depthwise causal convolution over each request's tokens, continued from the inputs its
    previous step left (``conv_state`` (slots, channels, width - 1)); SiLU applied where ``silu``."""

    def __init__(self, channels: int, width: int, bias: bool, dtype: torch.dtype, silu: bool = True) -> None:
        super().__init__()
        self.silu = silu
        self.weight = nn.Parameter(torch.empty(channels, 1, width, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, steps: StateSteps) -> torch.Tensor:
        # x (T, C) -> (T, C)
        if self.weight.shape[-1] <= ssm.MAX_CONV and ssm.supports(conv_state, x, self.weight):
            return ssm.causal_conv(x, conv_state, steps.slot_index, steps.fresh_mask, steps.qsl, self.weight,
                                   self.bias, self.silu)
        w = self.weight[:, 0, :]                                          # (C, K)
        if steps.decode:
            prev = steps.gather(conv_state)                               # (B, C, K-1)
            window = torch.cat([prev, x[:steps.slot_index.numel(), :, None].to(prev.dtype)], -1)   # (B, C, K)
            conv_state[steps.slot_index] = window[:, :, 1:]
            out = (window.to(w.dtype) * w).sum(-1)
            if self.bias is not None:
                out = out + self.bias
            return F.silu(out) if self.silu else out
        out = torch.empty_like(x)
        keep = conv_state.shape[-1]
        for slot, start, n, fresh in zip(steps.slots, steps.starts, steps.lens, steps.fresh):
            prev = x.new_zeros(x.shape[1], keep) if fresh else conv_state[slot].to(x.dtype)
            seq = torch.cat([prev, x[start:start + n].T], -1)             # (C, K-1+n)
            conv_state[slot] = seq[:, seq.shape[1] - keep:]
            out[start:start + n] = F.conv1d(seq[None], self.weight, self.bias, groups=seq.shape[0])[0].T
        return F.silu(out) if self.silu else out


def native_scan(state: torch.Tensor, steps: StateSteps, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                a_per_state: bool, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, heads: int, head_dim: int,
                groups: int) -> torch.Tensor | None:
    """The selective scan over the step's requests by a kernel (kernels/cpu/ssm.c on the CPU,
    kernels/triton/ssm.py on GPUs); None where neither takes these tensors (the caller runs its
    torch reference)."""
    from kernels.triton import fused as triton_fused
    args = (state, steps.slot_index, steps.fresh_mask, steps.qsl, x, dt, A, a_per_state, B, C, D, heads, head_dim,
            groups)
    if ssm.supports(state, x, dt, B, C):
        return ssm.ssm_scan(*args)
    if triton_fused.supports(state, x, dt, B, C):
        from kernels.triton.ssm import ssm_scan as triton_scan
        return triton_scan(*args)
    return None


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """A weightless RMSNorm in float32 (Falcon-Mamba's of B, C and dt)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Mamba's recurrence over one request's n tokens, float32: x, dt (n, d) channels; B, C (n, N);
    A (d, N); D (d,); ``h`` (d, N) the state before them, updated in place. Returns y (n, d)."""
    dA = torch.exp(dt[:, :, None] * A)                                    # (n, d, N)
    dBx = (dt * x)[:, :, None] * B[:, None, :]                            # (n, d, N)
    hs = torch.empty_like(dA)
    state = h
    for t in range(x.shape[0]):
        state = torch.addcmul(dBx[t], dA[t], state)
        hs[t] = state
    h.copy_(state)
    return torch.einsum("tdn,tn->td", hs, C) + D * x


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor, h: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """Mamba-2's recurrence over one request's n tokens, float32, a chunk at a time: x (n, H, P);
    dt (n, H); A, D (H,); B, C (n, H, N) (each head's group's); ``h`` (H, P, N) the state before
    them, updated in place. Within a chunk, y_t = sum_{s<=t} exp(a_s+1 + ... + a_t) (C_t . B_s)
    dt_s x_s + exp(a_1 + ... + a_t) C_t . h0 + D x_t, with a = dt A (<= 0: every exponent is a
    decay, computed as a difference of prefix sums within the chunk). Returns y (n, H, P)."""
    n = x.shape[0]
    out = torch.empty_like(x)
    for c0 in range(0, n, chunk):
        c1 = min(c0 + chunk, n)
        xc, dtc, Bc, Cc = x[c0:c1], dt[c0:c1], B[c0:c1], C[c0:c1]
        cum = torch.cumsum(dtc * A, 0)                                    # (L, H)
        L = c1 - c0
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        seg = (cum[:, None, :] - cum[None, :, :]).masked_fill(~causal[:, :, None], float("-inf"))   # (t, s, H)
        weights = torch.einsum("thn,shn->tsh", Cc, Bc) * torch.exp(seg) * dtc[None, :, :]
        y = torch.einsum("tsh,shp->thp", weights, xc)
        y = y + torch.einsum("thn,hpn->thp", Cc, h) * torch.exp(cum)[:, :, None]
        out[c0:c1] = y + D[:, None] * xc
        decay_to_end = torch.exp(cum[-1][None, :] - cum)                  # (L, H)
        h.mul_(torch.exp(cum[-1])[:, None, None]).add_(
            torch.einsum("sh,shp,shn->hpn", decay_to_end * dtc, xc, Bc))
    return out


class MambaMixer(nn.Module):
    """Mamba's (version 1) or Mamba-2's mixer: the layer's state-space half, in place of
    attention. ``state``: (conv_state, ssm_state), the engine's slots of this layer."""

    def __init__(self, hidden_size: int, dims: MambaDims, dtype: torch.dtype) -> None:
        super().__init__()
        d = self.dims = dims
        if d.version == 1:
            self.in_proj = Linear(hidden_size, 2 * d.d_inner, dtype, bias=d.proj_bias)
            self.x_proj = Linear(d.d_inner, d.dt_rank + 2 * d.d_state, dtype)
            self.dt_proj = Linear(d.dt_rank, d.d_inner, dtype, bias=True)
            self.A_log = nn.Parameter(torch.empty(d.d_inner, d.d_state, dtype=dtype), requires_grad=False)
            self.D = nn.Parameter(torch.empty(d.d_inner, dtype=dtype), requires_grad=False)
            if d.bcdt_norm_weights:
                self.dt_layernorm = RMSNorm(d.dt_rank, d.bcdt_rms_eps, dtype)
                self.b_layernorm = RMSNorm(d.d_state, d.bcdt_rms_eps, dtype)
                self.c_layernorm = RMSNorm(d.d_state, d.bcdt_rms_eps, dtype)
        else:
            self.in_proj = Linear(hidden_size, d.d_inner + d.conv_dim + d.num_heads, dtype, bias=d.proj_bias)
            self.dt_bias = nn.Parameter(torch.empty(d.num_heads, dtype=dtype), requires_grad=False)
            self.A_log = nn.Parameter(torch.empty(d.num_heads, dtype=dtype), requires_grad=False)
            self.D = nn.Parameter(torch.empty(d.num_heads, dtype=dtype), requires_grad=False)
            self.norm = RMSNorm(d.d_inner, d.norm_eps, dtype)
        self.conv1d = CausalConv1d(d.conv_dim, d.d_conv, d.conv_bias, dtype)
        self.out_proj = Linear(d.d_inner, hidden_size, dtype, bias=d.proj_bias)

    def forward(self, hidden: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], steps: StateSteps
                ) -> torch.Tensor:
        d = self.dims
        conv_state, ssm_state = state
        proj = self.in_proj(hidden)                                       # (T, ...)
        if d.version == 1:
            xs, gate = proj.split([d.d_inner, d.d_inner], -1)
            xs = self.conv1d(xs, conv_state, steps)                       # (T, d)
            ts, B, C = self.x_proj(xs).split([d.dt_rank, d.d_state, d.d_state], -1)
            if d.bcdt_norm_weights:
                ts, B, C = self.dt_layernorm(ts), self.b_layernorm(B), self.c_layernorm(C)
            elif d.bcdt_rms_eps is not None:
                ts, B, C = (_rms(t, d.bcdt_rms_eps) for t in (ts, B, C))
            dt = F.softplus(self.dt_proj(ts).float())                     # (T, d)
            A = -torch.exp(self.A_log.float())
            x, B, C, D = xs.float(), B.float(), C.float(), self.D.float()
            y = native_scan(ssm_state, steps, x, dt, A, True, B, C, D, d.d_inner, 1, 1)
            if y is None:
                y = self._scan1(x, dt, A, B, C, ssm_state, steps)
            y = y * F.silu(gate.float())
        else:
            gate, xBC, dt = proj.split([d.d_inner, d.conv_dim, d.num_heads], -1)
            xBC = self.conv1d(xBC, conv_state, steps)
            x, B, C = xBC.float().split([d.d_inner, d.n_groups * d.d_state, d.n_groups * d.d_state], -1)
            dt = F.softplus(dt.float() + self.dt_bias.float())
            lo, hi = d.time_step_limit
            if lo > 0.0 or hi != float("inf"):
                dt = dt.clamp(lo, hi)
            A = -torch.exp(self.A_log.float())
            y = native_scan(ssm_state, steps, x, dt, A, False, B, C, self.D.float(), d.num_heads, d.head_dim,
                            d.n_groups)
            if y is not None:
                return self.out_proj(self._gated_norm(y, gate).to(hidden.dtype))
            T, rep = x.shape[0], d.num_heads // d.n_groups
            Bh = B.view(T, d.n_groups, 1, d.d_state).expand(T, d.n_groups, rep, d.d_state).reshape(T, d.num_heads, -1)
            Ch = C.view(T, d.n_groups, 1, d.d_state).expand(T, d.n_groups, rep, d.d_state).reshape(T, d.num_heads, -1)
            y = self._scan2(x.view(T, d.num_heads, d.head_dim), dt, A, Bh, Ch, ssm_state, steps).reshape(T, -1)
            y = self._gated_norm(y, gate)
        return self.out_proj(y.to(hidden.dtype))

    def _gated_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Mamba-2's RMSNorm of y * silu(gate), over each group's channels, float32."""
        d = self.dims
        if ssm.supports(y, gate, self.norm.weight):
            return ssm.gated_norm(y, gate, self.norm.weight, d.n_groups, d.norm_eps)
        g = y * F.silu(gate.float())
        g = g.view(g.shape[0], d.n_groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + d.norm_eps)
        return self.norm.weight * g.view(y.shape).to(self.norm.weight.dtype)

    def _scan1(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               ssm_state: torch.Tensor, steps: StateSteps) -> torch.Tensor:
        """The torch reference of Mamba's recurrence over the step's requests (kernels/cpu/ssm.py
        runs it natively)."""
        D = self.D.float()
        if steps.decode:
            b = steps.slot_index.numel()
            h = steps.gather(ssm_state)                                   # (B, d, N)
            x, dt, B, C = x[:b], dt[:b], B[:b], C[:b]
            h = torch.addcmul((dt * x)[:, :, None] * B[:, None, :], torch.exp(dt[:, :, None] * A), h)
            ssm_state[steps.slot_index] = h
            return torch.einsum("bdn,bn->bd", h, C) + D * x
        return steps.each_request(ssm_state, torch.empty_like(x),
                                  lambda s, h: selective_scan(x[s], dt[s], A, B[s], C[s], D, h))

    def _scan2(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               ssm_state: torch.Tensor, steps: StateSteps) -> torch.Tensor:
        """The torch reference of Mamba-2's (B and C given per head)."""
        D = self.D.float()
        if steps.decode:
            b = steps.slot_index.numel()
            h = steps.gather(ssm_state)                                   # (B, H, P, N)
            x, dt, B, C = x[:b], dt[:b], B[:b], C[:b]
            decay = torch.exp(dt * A)[:, :, None, None]                   # (B, H, 1, 1)
            h = decay * h + (dt[:, :, None] * x)[:, :, :, None] * B[:, :, None, :]
            ssm_state[steps.slot_index] = h
            return torch.einsum("bhpn,bhn->bhp", h, C) + D[:, None] * x
        return steps.each_request(ssm_state, torch.empty_like(x),
                                  lambda s, h: ssd_chunk_scan(x[s], dt[s], A, B[s], C[s], D, h))


class MambaDecoderLayer(nn.Module):
    def __init__(self, config: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mixer = MambaMixer(config.hidden_size, config.mamba, dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, state: tuple[torch.Tensor, torch.Tensor],
                steps: StateSteps) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.norm(hidden)
        else:
            hidden, residual = self.norm(hidden, residual)
        return self.mixer(hidden, state, steps), residual


def _mamba_map(mixer: tuple[str, ...]) -> TensorMap:
    out: TensorMap = {
        "backbone.embeddings.weight": ("embed_tokens.weight", None),
        "backbone.embedding.weight": ("embed_tokens.weight", None),          # the first conversions' name
        "backbone.layers.{i}.norm.weight": ("layers.{i}.norm.weight", None),
        "backbone.norm_f.weight": ("norm_f.weight", None),
        "lm_head.weight": ("lm_head.weight", None),
    }
    for name in mixer:
        out[f"backbone.layers.{{i}}.mixer.{name}"] = (f"layers.{{i}}.mixer.{name}", None)
    return out


MAMBA_MIXER = ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "x_proj.weight", "dt_proj.weight",
               "dt_proj.bias", "A_log", "D", "out_proj.weight", "out_proj.bias")
MAMBA2_MIXER = ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D",
                "norm.weight", "out_proj.weight", "out_proj.bias")


class MambaForCausalLM(CausalLM):
    """state-spaces/mamba-*-hf: Mamba layers only, each a pre-norm residual block."""
    hf_tensor_map: ClassVar[TensorMap] = _mamba_map(MAMBA_MIXER)
    gguf_tensor_map: ClassVar[TensorMap] = {}
    hf_defaults: ClassVar[dict[str, Any]] = {"layer_norm_epsilon": 1e-5, "conv_kernel": 4, "expand": 2,
                                             "use_bias": False, "use_conv_bias": True, "tie_word_embeddings": True}
    mamba_version: ClassVar[int] = 1

    @classmethod
    def hf_raw(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """No attention: one nominal head, and vLLM's default context (2,048 tokens) where the
        config names none (a state-space model has no position table)."""
        inner = raw.get("intermediate_size") or int(raw.get("expand", 2) * raw["hidden_size"])
        return {"num_attention_heads": 1, "max_position_embeddings": 2048, **raw,
                "intermediate_size": inner, "rms_norm_eps": raw.get("layer_norm_epsilon", 1e-5)}

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        return {"mamba": cls.mamba_dims(raw, fields)}

    @classmethod
    def mamba_dims(cls, raw: dict[str, Any], fields: dict[str, Any]) -> MambaDims:
        inner = fields["intermediate_size"]
        rank = raw.get("time_step_rank", "auto")
        rank = -(-raw["hidden_size"] // 16) if rank == "auto" else int(rank)
        return MambaDims(1, inner, raw.get("state_size", 16), raw["conv_kernel"], dt_rank=rank,
                         conv_bias=bool(raw["use_conv_bias"]), proj_bias=bool(raw["use_bias"]))

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if config.mamba is None or config.mamba.version != self.mamba_version:
            raise ValueError(f"{type(self).__name__} needs Mamba {self.mamba_version} dimensions in its config")
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(MambaDecoderLayer(config, dtype) for _ in range(config.num_layers))
        self.start_layer, self.end_layer = 0, config.num_layers
        self.norm_f = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        tied = self.embed_tokens.weight if config.tie_word_embeddings else None
        self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype, weight=tied)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[Any],
                meta: AttentionMetadata, intermediate: Any = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        # kv_caches[l]: layer l's state slots, (conv_state, ssm_state)
        steps = StateSteps.of(meta)
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer, state in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, state, steps)
        return self.norm_f(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


class FalconMambaForCausalLM(MambaForCausalLM):
    """Falcon-Mamba: Mamba with weightless RMSNorms of B, C and the time step."""
    hf_defaults: ClassVar[dict[str, Any]] = {**MambaForCausalLM.hf_defaults, "mixer_rms_eps": 1e-6}

    @classmethod
    def mamba_dims(cls, raw: dict[str, Any], fields: dict[str, Any]) -> MambaDims:
        import dataclasses
        return dataclasses.replace(super().mamba_dims(raw, fields), bcdt_rms_eps=float(raw["mixer_rms_eps"]))


class Mamba2ForCausalLM(MambaForCausalLM):
    """Mamba-2 (mamba-codestral, mamba2-*-hf): Mamba-2 layers only."""
    hf_tensor_map: ClassVar[TensorMap] = _mamba_map(MAMBA2_MIXER)
    hf_defaults: ClassVar[dict[str, Any]] = {**MambaForCausalLM.hf_defaults, "tie_word_embeddings": False,
                                             "n_groups": 1, "time_step_limit": (0.0, float("inf"))}
    mamba_version: ClassVar[int] = 2

    @classmethod
    def hf_raw(cls, raw: dict[str, Any]) -> dict[str, Any]:
        out = super().hf_raw({**raw, "intermediate_size": int(raw.get("expand", 2) * raw["hidden_size"])})
        out["num_attention_heads"] = 1          # its num_heads are the mixer's, not attention's
        return out

    @classmethod
    def mamba_dims(cls, raw: dict[str, Any], fields: dict[str, Any]) -> MambaDims:
        return mamba2_dims(raw, fields["intermediate_size"], prefix="")


def _json_float(value: Any) -> float:
    """A float of config.json: a number, "Infinity", or transformers 5's {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def mamba2_dims(raw: dict[str, Any], d_inner: int, prefix: str = "mamba_") -> MambaDims:
    """Mamba-2 dimensions from a config.json (``prefix``: the hybrids' key names, e.g. Bamba's
    mamba_n_heads, mamba_d_state)."""
    def key(name: str, plain: str, default: Any = None) -> Any:
        for k in (prefix + name, plain):
            if k in raw and raw[k] is not None:
                return raw[k]
        if default is None:
            raise ValueError(f"config.json lacks {prefix + name!r}")
        return default
    heads = key("n_heads", "num_heads")
    limit = [_json_float(v) for v in raw.get("time_step_limit") or (0.0, float("inf"))]
    return MambaDims(2, d_inner, key("d_state", "state_size"), key("d_conv", "conv_kernel", 4),
                     num_heads=heads, head_dim=key("d_head", "head_dim", d_inner // heads if heads else 0),
                     n_groups=key("n_groups", "n_groups", 1), conv_bias=bool(key("conv_bias", "use_conv_bias", True)),
                     proj_bias=bool(key("proj_bias", "use_bias", False)),
                     norm_eps=float(raw.get("layer_norm_epsilon", raw.get("rms_norm_eps", 1e-5))),
                     time_step_limit=(float(limit[0]), float(limit[1])))


# -- hybrids: Llama-built models whose layers mix with attention or with a Mamba state ------------


MAMBA_LAYER_TYPES = ("mamba", "linear_attention")      # the hub's name of a Mamba layer, and transformers 5's


class HybridDecoderLayer(LlamaDecoderLayer):
    """A Llama layer (norms, residual adds, MLP) whose mixer is attention or, in the layers
    ``config.mamba_layers`` names, a Mamba mixer (``mamba``) over the request's recurrent state."""

    def __init__(self, config: ArchConfig, layer: int, backend: AttentionBackend, dtype: torch.dtype,
                 qk_norm: bool = False, qk_norm_whole: bool = False) -> None:
        super().__init__(config, layer, backend, dtype, qk_norm, qk_norm_whole)
        self.mamba = None
        if config.is_mamba_layer(layer):
            del self.self_attn
            self.mamba = self.make_mixer(config, dtype)

    def make_mixer(self, config: ArchConfig, dtype: torch.dtype) -> nn.Module:
        """A state-space layer's mixer: Mamba's or Mamba-2's here."""
        return MambaMixer(config.hidden_size, config.mamba, dtype)

    def mix(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: Any,
            meta: AttentionMetadata) -> torch.Tensor:
        if self.mamba is None:
            return self.self_attn(hidden, cos, sin, kv_cache, meta)
        return self.mamba(hidden, kv_cache, StateSteps.of(meta))


def hybrid_mamba_layers(raw: dict[str, Any]) -> tuple[int, ...]:
    """The Mamba layers of a hybrid's config.json: ``layer_types`` ("mamba" or transformers 5's
    "linear_attention"), else every layer but ``attn_layer_indices`` (Bamba's)."""
    types = raw.get("layer_types") or raw.get("layers_block_type")
    if types:
        return tuple(i for i, t in enumerate(types) if t in MAMBA_LAYER_TYPES)
    attention = set(raw.get("attn_layer_indices") or ())
    return tuple(i for i in range(raw["num_hidden_layers"]) if i not in attention)


def _hybrid_mamba_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The Mamba-2 layers of a hybrid; none (an attention-only model, as granite-4.0-micro is)
    when every layer attends."""
    layers = hybrid_mamba_layers(raw)
    if not layers:
        return {}
    d_inner = int(raw.get("mamba_expand", 2) * raw["hidden_size"])
    return {"mamba": mamba2_dims(raw, d_inner), "mamba_layers": layers}


def _mamba_submap(prefix: str) -> TensorMap:
    return {f"model.layers.{{i}}.{prefix}.{name}": (f"layers.{{i}}.mamba.{name}", None) for name in MAMBA2_MIXER}


class SharedMLPOnly(nn.Module):
    """Granite 4.0-H's dense layers: the shared MLP is the layer's only MLP."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.shared_mlp = mlp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_mlp(hidden)


class GraniteMoeHybridForCausalLM(GraniteMoeSharedForCausalLM):
    """Granite 4.0-H: Granite's multipliers over Mamba-2 layers and a few attention ones (without
    positions: ``position_embedding_type`` "nope"), each followed by a mixture of experts beside a
    shared MLP, or by the shared MLP alone (no experts: the dense models)."""
    decoder_layer: ClassVar[type[nn.Module]] = HybridDecoderLayer
    hf_tensor_map: ClassVar[TensorMap] = {**GraniteMoeSharedForCausalLM.hf_tensor_map, **_mamba_submap("mamba")}
    hf_defaults: ClassVar[dict[str, Any]] = {"max_position_embeddings": 2048, "num_local_experts": 0}

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        if raw.get("num_local_experts"):
            out = super().hf_fields(raw, fields)
        else:
            out = {**GraniteForCausalLM.hf_fields(raw, fields),
                   "shared_expert_intermediate_size": int(raw.get("shared_intermediate_size") or 0)}
        if raw.get("position_embedding_type") != "rope":
            out["rope_layers"] = (False,) * fields["num_layers"]
        return {**out, **_hybrid_mamba_fields(raw)}

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend, dtype: torch.dtype = torch.float32) -> None:
        if config.num_experts:
            super().__init__(config, attn_backend, dtype)
            return
        GraniteForCausalLM.__init__(self, config, attn_backend, dtype)
        if not config.shared_expert_intermediate_size:
            raise ValueError("GraniteMoeHybridForCausalLM without experts needs shared_intermediate_size")
        for layer in self.layers:
            layer.mlp = SharedMLPOnly(GatedMLP(config.hidden_size, config.shared_expert_intermediate_size,
                                               config.hidden_act, dtype))


class BambaForCausalLM(LlamaForCausalLM):
    """Bamba (IBM's): Llama layers, Mamba-2 mixers in all but ``attn_layer_indices``, a rotary
    over part of each attention head."""
    decoder_layer: ClassVar[type[nn.Module]] = HybridDecoderLayer
    gguf_architectures: ClassVar[tuple[str, ...]] = ()
    hf_tensor_map: ClassVar[TensorMap] = {
        **{k: v for k, v in LlamaForCausalLM.hf_tensor_map.items() if ".mlp." not in k and "post_attention" not in k},
        "model.layers.{i}.pre_ff_layernorm.weight": ("layers.{i}.post_attention_layernorm.weight", None),
        "model.layers.{i}.feed_forward.gate_proj.weight": ("layers.{i}.mlp.gate_up_proj.weight", "gate"),
        "model.layers.{i}.feed_forward.up_proj.weight": ("layers.{i}.mlp.gate_up_proj.weight", "up"),
        "model.layers.{i}.feed_forward.down_proj.weight": ("layers.{i}.mlp.down_proj.weight", None),
        "model.final_layernorm.weight": ("norm.weight", None),
        **_mamba_submap("mamba"),
    }

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        return _hybrid_mamba_fields(raw)


class JambaForCausalLM(LlamaForCausalLM):
    """Jamba (AI21's): Llama layers without positions, attention in every ``attn_layer_period``-th
    layer (from ``attn_layer_offset``) and Mamba mixers, with RMSNorms of their time step, B and C,
    in the others; every ``expert_layer_period``-th MLP a mixture of experts (the softmax's top-k,
    not renormalized)."""
    decoder_layer: ClassVar[type[nn.Module]] = HybridDecoderLayer
    gguf_architectures: ClassVar[tuple[str, ...]] = ()
    hf_defaults: ClassVar[dict[str, Any]] = {"attn_layer_period": 8, "attn_layer_offset": 4, "expert_layer_period": 2,
                                             "expert_layer_offset": 1, "num_experts": 16, "mamba_d_state": 16,
                                             "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": "auto",
                                             "mamba_conv_bias": True, "mamba_proj_bias": False}
    hf_tensor_map: ClassVar[TensorMap] = {
        **BambaForCausalLM.hf_tensor_map,
        **{f"model.layers.{{i}}.mamba.{name}": (f"layers.{{i}}.mamba.{name}", None)
           for name in MAMBA_MIXER + ("dt_layernorm.weight", "b_layernorm.weight", "c_layernorm.weight")},
        "model.layers.{i}.feed_forward.router.weight": ("layers.{i}.mlp.gate.weight", None),
        "model.layers.{i}.feed_forward.experts.{e}.gate_proj.weight": ("layers.{i}.mlp.w13_weight", "gate.{e}"),
        "model.layers.{i}.feed_forward.experts.{e}.up_proj.weight": ("layers.{i}.mlp.w13_weight", "up.{e}"),
        "model.layers.{i}.feed_forward.experts.{e}.down_proj.weight": ("layers.{i}.mlp.w2_weight", "down.{e}"),
        "model.layers.{i}.feed_forward.experts.gate_up_proj": ("layers.{i}.mlp.w13_weight", None),
        "model.layers.{i}.feed_forward.experts.down_proj": ("layers.{i}.mlp.w2_weight", None),
    }

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        L, hidden = fields["num_layers"], raw["hidden_size"]
        attention = {i for i in range(L) if i % raw["attn_layer_period"] == raw["attn_layer_offset"]}
        rank = raw["mamba_dt_rank"]
        rank = -(-hidden // 16) if rank == "auto" else int(rank)
        dims = MambaDims(1, int(raw["mamba_expand"] * hidden), raw["mamba_d_state"], raw["mamba_d_conv"], dt_rank=rank,
                         conv_bias=bool(raw["mamba_conv_bias"]), proj_bias=bool(raw["mamba_proj_bias"]),
                         bcdt_rms_eps=fields["rms_norm_eps"], bcdt_norm_weights=True)
        experts = int(raw["num_experts"] or 1)
        moe = tuple(i for i in range(L) if i % raw["expert_layer_period"] == raw["expert_layer_offset"])
        out: dict[str, Any] = {"mamba": dims, "mamba_layers": tuple(i for i in range(L) if i not in attention),
                               "rope_layers": (False,) * L}
        if experts > 1 and moe:
            out.update(num_experts=experts, num_experts_per_tok=raw["num_experts_per_tok"], moe_layers=moe,
                       moe_intermediate_size=fields["intermediate_size"], norm_topk_prob=False)
        return out

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, attn_backend, dtype)
        use_moe_layers(self, config, dtype)
