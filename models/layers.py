"""Building blocks shared by the architectures: linear layers (plain and fused), embedding,
RMSNorm (plain and Gemma's 1 + weight), rotary position embedding, gated activations and the
paged self-attention block.

RMSNorm (with the residual add folded in), rotary and SiLU-and-multiply run as fused native
kernels on float32 CPU tensors (kernels/cpu/fused.py decides), as Triton kernels on CUDA
tensors (kernels/triton/fused.py decides), as plain torch ops otherwise.

Parameters are allocated with ``torch.empty`` (no random init: weights come from a checkpoint)
and never require grad.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention.base import AttentionBackend, AttentionMetadata
from kernels.attention.fp8 import K_SCALE_CONSTANT, V_SCALE_CONSTANT, calibrated_scale, is_fp8
from kernels.cpu import fused
from kernels.triton import fused as triton_fused
from models.rope import DEFAULT as PLAIN_ROPE
from models.rope import RopeScaling, rope_tables


def _empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b). ``weight`` may be an existing parameter (a tied LM head).
    ``quant_method`` (models/quantization) holds a quantized layer's weights and multiplies."""
    quant_method = None

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 weight: nn.Parameter | None = None, bias: bool = False) -> None:
        super().__init__()
        if weight is not None and tuple(weight.shape) != (out_features, in_features):
            raise ValueError(f"tied weight has shape {tuple(weight.shape)}, expected {(out_features, in_features)}")
        self.in_features, self.out_features = in_features, out_features
        self.weight = weight if weight is not None else _empty_param(out_features, in_features, dtype=dtype)
        self.bias = _empty_param(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out)
        if self.quant_method is not None:
            return self.quant_method.apply(self, x)
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input fused into one matmul, e.g. q|k|v or gate|up.

    The output is the concatenation of the shards in declaration order; a checkpoint's separate
    tensors (weights and, with ``bias``, biases) are copied into their row ranges by ``load_shard``.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], dtype: torch.dtype,
                 bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), dtype, bias=bias)
        self.shard_sizes = dict(shard_sizes)
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = offset
            offset += size

    def load_shard(self, shard: str, tensor: torch.Tensor, param: str = "weight") -> None:
        if shard not in self.shard_sizes:
            raise KeyError(f"no shard {shard!r}; shards are {list(self.shard_sizes)}")
        target = getattr(self, param)
        if target is None:
            raise ValueError(f"shard {shard!r} of a {param} given, but this layer has no {param}")
        start, size = self.shard_offsets[shard], self.shard_sizes[shard]
        expected = (size, *target.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{param} shard {shard!r} has shape {tuple(tensor.shape)}, expected {expected}")
        target.data[start:start + size].copy_(tensor)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _empty_param(num_embeddings, embedding_dim, dtype=dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, dim)
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension, normalized in float32.

    Called with a ``residual`` it first adds x to it, vLLM's fused add + norm:
    ``norm(x, residual) -> (norm(residual + x), residual + x)``, the sum being the next
    residual; the fused kernel updates ``residual`` in place. ``custom_ops`` False (set by
    ``set_custom_ops``) keeps it to plain torch ops.
    """
    custom_ops = True

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # (..., hidden) -> (..., hidden)
        if not self.custom_ops:
            return self._plain(x, residual)
        if residual is None:
            if x.dim() == 2 and fused.supports(x, self.weight):
                return fused.rms_norm(x, self.weight, self.eps)
            if x.dim() == 2 and triton_fused.supports(x, self.weight):
                return triton_fused.rms_norm(x, self.weight, self.eps)[0]
            return self._norm(x)
        if x.dim() == 2 and fused.supports(x, self.weight, residual) and residual.is_contiguous():
            return fused.rms_norm(x, self.weight, self.eps, residual), residual
        if x.dim() == 2 and triton_fused.supports(x, self.weight, residual) and residual.dtype == x.dtype:
            return triton_fused.rms_norm(x, self.weight, self.eps, residual)
        return self._plain(x, residual)

    def _plain(self, x: torch.Tensor, residual: torch.Tensor | None
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight.float(), self.eps)
        y = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * y.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's variant: x / sqrt(mean(x^2) + eps) * (1 + weight), all in float32, then cast.
    The checkpoint stores ``weight`` (zero = identity); llama.cpp's GGUF stores 1 + weight."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__(hidden_size, eps, dtype)
        self.weight.data.zero_()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # (..., hidden) -> (..., hidden)
        """With a ``residual``: (norm(residual + x), residual + x), as RMSNorm's."""
        if residual is not None:
            residual = residual + x
            return self.forward(residual), residual
        y = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Hugging Face-style ("half-split", NeoX) rotary: dimension j pairs with j + head_size/2.

    cos/sin for every position up to max_positions are precomputed once in float32, with the
    rope scaling of ``scaling`` (models/rope.py: linear, dynamic, yarn, llama3, longrope) for an
    engine serving contexts of ``serving_len`` (0: ``max_positions``).
    """

    def __init__(self, head_size: int, max_positions: int, theta: float, scaling: RopeScaling = PLAIN_ROPE,
                 serving_len: int = 0, mrope_section: tuple[int, ...] = (), mrope_interleaved: bool = False) -> None:
        super().__init__()
        # Same arithmetic as transformers' rope init functions, so float32 results match bit for bit.
        cos, sin = rope_tables(head_size, max_positions, theta, scaling, serving_len)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        # M-RoPE (Qwen2-VL's): which of a position's three rows turns each dimension (the
        # sections over the frequencies, the same for both halves); interleaved (Qwen3-VL's):
        # frequency i turns by row i % 3 within that row's share, by row 0 past it
        rows = torch.repeat_interleave(torch.arange(len(mrope_section)), torch.tensor(mrope_section, dtype=torch.long))
        if mrope_interleaved:
            i = torch.arange(sum(mrope_section))
            rows = torch.where(i < 3 * torch.tensor(mrope_section)[i % 3], i % 3, 0)
        self.register_buffer("mrope_rows", torch.cat((rows, rows)), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions (T,) -> cos, sin (T, 1, D): broadcast over heads; M-RoPE's (3, T): dimension j
        # of a token's cos and sin at the position of row mrope_rows[j]
        if positions.dim() == 2:
            if not len(self.mrope_rows):
                raise ValueError("three-row (M-RoPE) positions for a rotary without mrope_section")
            at = positions[self.mrope_rows].T                          # (T, D)
            dims = torch.arange(at.shape[1], device=at.device)
            return (self.cos_cache[at, dims].to(dtype).unsqueeze(1), self.sin_cache[at, dims].to(dtype).unsqueeze(1))
        cos = self.cos_cache[positions].to(dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x (T, heads, D), cos/sin (T, 1, D)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)  # rotate_half
    return x * cos + rotated * sin


def apply_rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    custom_ops: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary on q (T, H, D) and k (T, KVH, D) by cos/sin (T, 1, RD): the leading RD dims of each
    head turn (all of them unless a partial rotary); the fused kernel rotates them in place (they
    may be views into the qkv output), the plain path returns new tensors. Same results either way."""
    D = q.shape[-1]
    if cos.shape[-1] != D:
        if custom_ops and not torch.compiler.is_compiling() and fused.supports(q, k, cos, sin) \
                and q.stride(1) == D and k.stride(1) == D and cos.stride(0) == sin.stride(0):
            fused.rotary_(q, k, cos, sin)
            return q, k
        return _partial_rotary(q, cos, sin), _partial_rotary(k, cos, sin)
    if not custom_ops or torch.compiler.is_compiling():    # in place on views of qkv: not traced
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    if (fused.supports(q, k, cos, sin) and q.stride(1) == D and k.stride(1) == D
            and cos.stride(0) == sin.stride(0)):
        fused.rotary_(q, k, cos, sin)
        return q, k
    if triton_fused.supports(q, k, cos, sin) and cos.dtype == sin.dtype:
        triton_fused.rotary_(q, k, cos, sin)
        return q, k
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def _partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rd = cos.shape[-1]
    return torch.cat((apply_rotary(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)


# Hugging Face's activation names (config.json's hidden_act / hidden_activation) -> the
# activations of kernels/cpu/fused.py (ACTIVATIONS) and their torch forms
HF_ACTIVATIONS: dict[str, str] = {"silu": "silu", "swish": "silu", "gelu": "gelu", "relu": "relu", "relu2": "relu2",
                                  "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}
TORCH_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu,
    "relu2": lambda x: F.relu(x).square()}


def hf_activation(name: str, model: str) -> str:
    """The activation a checkpoint's ``name`` means (a key of TORCH_ACTIVATIONS); ValueError naming
    the supported ones otherwise."""
    if name not in HF_ACTIVATIONS:
        raise ValueError(f"{model}: activation {name!r} is not supported; supported: {sorted(HF_ACTIVATIONS)}")
    return HF_ACTIVATIONS[name]


def activation(x: torch.Tensor, act: str, custom_ops: bool = True) -> torch.Tensor:
    """act(x), ``act`` a key of TORCH_ACTIVATIONS: the native kernel on the CPU (what the packed
    linear layers apply to their tiles, so fused and unfused paths agree bit for bit), torch's op
    elsewhere or with ``custom_ops`` False."""
    if custom_ops and x.dim() == 2 and fused.supports(x):
        return fused.activation(x, act)
    return TORCH_ACTIVATIONS[act](x)


def gated_activation(gate_up: torch.Tensor, act: str, custom_ops: bool = True) -> torch.Tensor:
    """gate_up (T, 2I) = gate | up -> act(gate) * up (T, I)."""
    if custom_ops and gate_up.dim() == 2:
        if fused.supports(gate_up):
            return fused.gated_activation(gate_up, act)
        if act == "silu" and triton_fused.supports(gate_up):
            return triton_fused.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return TORCH_ACTIVATIONS[act](gate) * up


def silu_and_mul(gate_up: torch.Tensor, custom_ops: bool = True) -> torch.Tensor:
    # gate_up (T, 2I) = gate | up -> (T, I)
    return gated_activation(gate_up, "silu", custom_ops)


def linear_act(layer: nn.Module, x: torch.Tensor, act: str, custom_ops: bool = True,
               bfloat16_out: bool = False) -> torch.Tensor:
    """act(layer(x)): in one native pass where the layer has one (a packed linear layer applies
    the activation to each tile as it writes it), else the layer then ``activation``.
    ``bfloat16_out``: the result is only a linear layer's input, which bfloat16 weights may then
    write in bfloat16 (rounded as the next layer would round it: the CPU's --dtype bfloat16)."""
    fused_act = getattr(layer, "act_forward", None) if custom_ops else None
    y = fused_act(x, act, bfloat16_out) if fused_act is not None else None
    return y if y is not None else activation(layer(x), act, custom_ops)


def linear_residual(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + layer(x): in one native pass where the layer has one (a packed linear layer adds
    the residual to each tile as it writes it), with the same bits."""
    fused_add = getattr(layer, "residual_forward", None)
    y = fused_add(x, residual) if fused_add is not None and residual.shape[:-1] == x.shape[:-1] else None
    return y if y is not None else residual + layer(x)


def gated_linear_act(layer: nn.Module, x: torch.Tensor, act: str, custom_ops: bool = True,
                     bfloat16_out: bool = False) -> torch.Tensor:
    """``gated_activation(layer(x), act)`` for a gate|up projection, in one native pass where the
    layer has one (``bfloat16_out``: as ``linear_act``'s)."""
    fused_act = getattr(layer, "gated_act_forward", None) if custom_ops else None
    y = fused_act(x, act, bfloat16_out) if fused_act is not None else None
    return y if y is not None else gated_activation(layer(x), act, custom_ops)


# the gated MLPs' activations (config.hidden_act)
GATED_ACTIVATIONS: dict[str, str] = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate|up fused."""
    custom_ops = True

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, dtype: torch.dtype) -> None:
        super().__init__()
        if hidden_act not in GATED_ACTIVATIONS:
            raise ValueError(f"activation {hidden_act!r} is not supported; supported: {sorted(GATED_ACTIVATIONS)}")
        self.act = GATED_ACTIVATIONS[hidden_act]
        self.gate_up_proj = MergedLinear(hidden_size, {"gate": intermediate_size, "up": intermediate_size}, dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, hidden)
        # a packed projection fuses the activation in
        return self.down_proj(gated_linear_act(self.gate_up_proj, x, self.act, self.custom_ops, bfloat16_out=True))


class MLP(nn.Module):
    """down(act(up(x))): the ungated MLP (StarCoder2's, Phi's), with biases where the model has
    them; on the CPU the activation runs inside the up projection's matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, dtype: torch.dtype, bias: bool) -> None:
        super().__init__()
        self.act = act                   # a key of TORCH_ACTIVATIONS (hf_activation)
        self.up_proj = Linear(hidden_size, intermediate_size, dtype, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, dtype, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(linear_act(self.up_proj, x, self.act, bfloat16_out=True))


class KVLayerHooks(Protocol):
    """A KV connector's per-layer hooks (actors/kv_transfer/base.py): the layer's share of the
    step's loads before its attention reads the cache, its share of the saves after it wrote."""

    def wait_for_layer_load(self, layer: int) -> None: ...

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, attn_metadata: Any) -> None: ...


_kv_layer_hooks: KVLayerHooks | None = None


@contextmanager
def kv_layer_hooks(hooks: KVLayerHooks | None) -> Iterator[None]:
    """Every attention layer of the forwards run inside calls ``hooks`` (None: none)."""
    global _kv_layer_hooks
    previous, _kv_layer_hooks = _kv_layer_hooks, hooks
    try:
        yield
    finally:
        _kv_layer_hooks = previous


def kv_layer_hooks_active() -> bool:
    """Whether the forward must go layer by layer (a path that skips the attention layers, such
    as the native decode stack, would skip the hooks)."""
    return _kv_layer_hooks is not None


def attention(backend: AttentionBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, sliding_window: int | None,
              k_scale: torch.Tensor, v_scale: torch.Tensor, layer: int = 0,
              group_meta: AttentionMetadata | None = None, logits_soft_cap: float | None = None,
              sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """The attention call (KV store and paged attention through the backend, between a KV
    connector's per-layer hooks when a step has them): torch.compile's splitting op
    (``split_at_attention`` makes it untraced), so compiled layers run as the pieces between
    attention calls. ``layer``: the layer's index in the runner's KV caches; ``group_meta``:
    the step's whole metadata (``meta`` is this layer's KV cache group's)."""
    hooks = _kv_layer_hooks
    if hooks is not None:
        hooks.wait_for_layer_load(layer)
    # (backends that take neither need not know the words)
    sunk = {k: v for k, v in (("sinks", sinks), ("alibi_slopes", alibi_slopes)) if v is not None}
    out = backend.forward(q, k, v, kv_cache, meta, scale, sliding_window=sliding_window,
                          k_scale=k_scale, v_scale=v_scale, logits_soft_cap=logits_soft_cap, **sunk)
    if hooks is not None:
        hooks.save_kv_layer(layer, kv_cache, group_meta if group_meta is not None else meta)
    return out


def whole_prompts(meta: AttentionMetadata, model: str) -> list[int]:
    """The step's query_start_loc as a list, once checked that every request's queries are its
    whole prompt (an encoder's step: no cached context, no chunk); ValueError otherwise."""
    starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    if any(end - start != n for start, end, n in zip(starts, starts[1:], lens)):
        raise ValueError(f"{model} attends over whole prompts: a step gave it part of one (this model is "
                         "served without chunked prefill or prefix caching)")
    return starts


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: list[int],
                      scale: float, window: int | None = None, bfloat16: bool = False) -> torch.Tensor:
    """Bidirectional attention of each prompt's tokens over the same prompt's (an encoder's):
    q (T, H, D), k and v (T, KVH, D), prompt i's rows ``query_start_loc[i]:query_start_loc[i + 1]``;
    with ``window`` W, a query sees the keys fewer than W positions from it on either side
    (transformers' bidirectional sliding window). -> (T, H, D). On the CPU the native kernel takes
    every prompt of a step in one call (``bfloat16``: its products in bfloat16 where the CPU has
    AVX512-BF16, the CPU's ``--dtype bfloat16``); elsewhere torch's SDPA one prompt at a time (a
    prompt longer than the window with the band as a mask)."""
    T, H, D = q.shape
    G = H // k.shape[1]
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    spans = [(a, b) for a, b in zip(query_start_loc[:-1], query_start_loc[1:]) if b > a]
    if spans and q.device.type == "cpu" and q.dtype == torch.float32 and fused.ENABLED:
        from kernels.attention.cpu import causal_prefill
        bounds = torch.tensor(spans, dtype=torch.int64)
        if causal_prefill(q, k, v, out, bounds[:, 0], bounds[:, 1] - bounds[:, 0], scale, bidirectional=True,
                          window=window, bfloat16=bfloat16):
            return out
    for a, b in spans:
        # (1, H, n, D): four dimensions, which torch's CPU flash attention takes
        qs = q[a:b].transpose(0, 1).unsqueeze(0)
        ks, vs = (t[a:b].repeat_interleave(G, 1).transpose(0, 1).unsqueeze(0) for t in (k, v))
        mask = None
        if window is not None and b - a > window:
            pos = torch.arange(b - a, device=q.device)
            mask = (pos[:, None] - pos[None, :]).abs() < window
        out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)[0].transpose(0, 1)
    return out


def set_attention_bfloat16(model: nn.Module, enabled: bool) -> None:
    """Whether the model's encoder attention (bidirectional layers) multiplies in bfloat16 on the
    CPU: the CPU's ``--dtype bfloat16``, whose linear layers multiply bfloat16 weights."""
    for m in model.modules():
        if hasattr(m, "attention_bfloat16"):
            m.attention_bfloat16 = enabled


def alibi_slopes(num_heads: int, bias_max: float = 8.0) -> torch.Tensor:
    """ALiBi's per-head slopes (Press et al.; BLOOM's, and MPT's with its alibi_bias_max): for the
    largest power of two n <= H, 2^(-bias_max * i / n) for i = 1..n; the heads past it take the
    odd ones of 2n's."""
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-bias_max * i / n) for i in range(1, n + 1)]
    slopes += [2.0 ** (-bias_max * i / (2 * n)) for i in range(1, 2 * (num_heads - n), 2)]
    return torch.tensor(slopes, dtype=torch.float32)


class AttentionLayer(nn.Module):
    """A layer that writes and reads a KV cache through the attention backend: what the runner
    binds to its cache (``bind_kv_cache_groups``), what ``--calculate-kv-scales`` calibrates and
    what torch.compile splits at. ``attend`` is the paged attention of projected, rotated q, k, v.

    ``k_scale`` / ``v_scale`` (float32 scalars, vLLM's names) scale this layer's keys and values
    in an fp8 KV cache: stored fp8(k / k_scale), read fp8 * k_scale. They are 1.0 unless
    ``calculate_kv_scales`` is set, in which case the next forward that writes an fp8 cache sets
    them from its keys' and values' largest magnitudes (as vLLM: key amax / 200, value amax / 100,
    K_SCALE_CONSTANT and V_SCALE_CONSTANT) and clears the flag. They are updated in place only:
    kernels may hold their addresses."""

    def __init__(self, backend: AttentionBackend) -> None:
        super().__init__()
        self.backend = backend
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32), persistent=False)
        self.calculate_kv_scales = False
        self.kv_cache_group = 0     # whose block table this layer reads (bind_kv_cache_groups)
        self.kv_index = 0           # its cache's index in the runner's KV caches (bind_kv_cache_groups)
        self.attention = attention  # torch.compiler.disable(attention) once compiled (split_at_attention)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, sliding_window: int | None,
               logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
               alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
        """q (T, H, D), k and v (T, KVH, D) stored in ``kv_cache`` and attended over it (``meta``:
        the step's, this layer's group's block table taken from it) -> (T, H, D)."""
        step_meta, meta = meta, meta.for_group(self.kv_cache_group)
        if self.calculate_kv_scales:
            self._calculate_kv_scales(k, v, kv_cache.dtype, meta)
        out = self.attention(self.backend, q, k, v, kv_cache, meta, scale, sliding_window, self.k_scale,
                             self.v_scale, self.kv_index, step_meta, logits_soft_cap, sinks, alibi_slopes)
        if step_meta.mm_prefix_spans:        # a prefix LM's image positions: each image seen both ways
            from kernels.attention.prefix_lm import image_rows_attention
            if sinks is not None or alibi_slopes is not None:
                raise ValueError("a prefix LM's images with attention sinks or ALiBi are not supported")
            image_rows_attention(out, q, kv_cache, meta, step_meta.mm_prefix_spans, scale, sliding_window,
                                 logits_soft_cap, self.k_scale, self.v_scale)
        return out

    def _calculate_kv_scales(self, k: torch.Tensor, v: torch.Tensor, kv_dtype: torch.dtype,
                             meta: AttentionMetadata) -> None:
        """vLLM's --calculate-kv-scales, from this batch's real tokens (padding left out)."""
        self.calculate_kv_scales = False
        if not is_fp8(kv_dtype):
            return
        real = meta.slot_mapping[:k.shape[0]] >= 0
        self.k_scale.copy_(calibrated_scale(k[real], K_SCALE_CONSTANT))
        self.v_scale.copy_(calibrated_scale(v[real], V_SCALE_CONSTANT))


class SelfAttention(AttentionLayer):
    """q|k|v projection, optional per-head q/k norm, rotary, paged attention through the
    backend (with this layer's sliding window, if any), output projection."""
    attention_bfloat16 = False      # set_attention_bfloat16: bidirectional layers' products in bfloat16

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_size: int,
                 backend: AttentionBackend, dtype: torch.dtype, *, scale: float,
                 sliding_window: int | None = None, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: Callable[[], nn.Module] | None = None, rotary_dim: int | None = None,
                 use_rope: bool = True, logits_soft_cap: float | None = None, bidirectional: bool = False,
                 qk_norm_whole: Callable[[int], nn.Module] | None = None, sinks: bool = False,
                 alibi_bias_max: float | None = None, output_gate: bool = False) -> None:
        super().__init__(backend)
        # an encoder's layer (Gemma 3 with use_bidirectional_attention): each query sees its whole
        # prompt (within the sliding window on either side), no KV cache read or written
        self.bidirectional = bidirectional
        if bidirectional and logits_soft_cap is not None:
            raise ValueError("bidirectional attention with capped scores is not supported")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.rotary_dim = rotary_dim or head_size     # a partial rotary turns the leading dims only
        self.use_rope = use_rope                      # False: no position encoding in this layer (NoPE)
        self.logits_soft_cap = logits_soft_cap        # Gemma 2's attention score cap (None: none)
        # gpt-oss's attention sinks: a learned logit per head (None: none)
        self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=dtype), requires_grad=False) if sinks else None
        if sinks and bidirectional:
            raise ValueError("bidirectional attention with sinks is not supported")
        # ALiBi (BLOOM, MPT): each head's slope, float32, in place of rotary positions (None: none)
        alibi = alibi_bias_max is not None
        self.register_buffer("alibi_slopes", alibi_slopes(num_heads, alibi_bias_max) if alibi else None,
                             persistent=False)
        if alibi and (use_rope or bidirectional or sinks):
            raise ValueError("ALiBi attention takes no rotary, sinks or bidirectional attention")
        self.q_size, self.kv_size = num_heads * head_size, num_kv_heads * head_size
        self.scale, self.sliding_window = scale, sliding_window
        # Qwen3-Next's gated attention: a sigmoid gate per output feature, projected beside q
        self.output_gate = output_gate
        shards = {"q": self.q_size, "k": self.kv_size, "v": self.kv_size, **({"gate": self.q_size} if output_gate else {})}
        self.qkv_proj = MergedLinear(hidden_size, shards, dtype, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, hidden_size, dtype, bias=o_bias)
        if qk_norm and qk_norm_whole:
            raise ValueError("a q/k norm is per head or over the whole projection, not both")
        # over head_size, per head; or (OLMo 2's, qk_norm_whole(size)) over all of q's and k's features
        self.qk_norm_whole = qk_norm_whole is not None
        self.q_norm = qk_norm() if qk_norm else qk_norm_whole(self.q_size) if qk_norm_whole else None
        self.k_norm = qk_norm() if qk_norm else qk_norm_whole(self.kv_size) if qk_norm_whole else None
        self.custom_ops = True      # rotary through the custom kernels (set_custom_ops)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        if self.output_gate:
            q, k, v, gate = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size, self.q_size], dim=-1)
            return self.o_proj(self._attend(q, k, v, T, cos, sin, kv_cache, meta) * torch.sigmoid(gate))
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self._attend(q, k, v, T, cos, sin, kv_cache, meta))     # (T, hidden)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, T: int, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The attention of the projected q, k, v: (T, H * D), before the output projection."""
        if self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(T, self.num_heads, self.head_size)       # (T, H, D)
        k = k.view(T, self.num_kv_heads, self.head_size)    # (T, KVH, D)
        v = v.view(T, self.num_kv_heads, self.head_size)    # (T, KVH, D)
        if self.q_norm is not None and not self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:       # cos/sin (T, 1, rotary_dim): a partial rotary turns the leading dims only
            q, k = apply_rotary_qk(q, k, cos, sin, self.custom_ops)
        if self.bidirectional:
            out = encoder_attention(q, k, v, whole_prompts(meta, "this encoder"), self.scale, self.sliding_window,
                                    self.attention_bfloat16)
            return out.reshape(T, self.q_size)
        out = self.attend(q, k, v, kv_cache, meta, self.scale, self.sliding_window, self.logits_soft_cap,
                          self.sinks, self.alibi_slopes)
        return out.reshape(T, self.q_size)


def calculate_kv_scales_on_next_batch(model: nn.Module) -> int:
    """Every attention layer of ``model`` sets its fp8 KV scales from the next batch it runs
    (--calculate-kv-scales); returns how many layers will."""
    layers = [m for m in model.modules() if isinstance(m, AttentionLayer)]
    for m in layers:
        m.calculate_kv_scales = True
    return len(layers)


def set_custom_ops(model: nn.Module, enabled: bool) -> None:
    """Whether the model's norms, rotary and SiLU-gated MLPs call the custom kernels
    (torch.ops.troupe.*) or only plain torch ops (--compilation-config levels 0 and 3); the
    same for the per-token activation quantization of 8-bit linear layers on GPUs (their
    matmuls stay custom ops)."""
    for m in model.modules():
        if isinstance(m, (RMSNorm, GatedMLP, SelfAttention)) or hasattr(m, "q_kind"):
            m.custom_ops = enabled


def split_at_attention(model: nn.Module) -> None:
    """torch.compile never traces the model's attention calls (dynamo imported only here: a
    process that never compiles never loads it)."""
    for m in model.modules():
        if isinstance(m, AttentionLayer):
            m.attention = torch.compiler.disable(attention)


def bind_kv_cache_groups(model: nn.Module, layer_groups: list[int]) -> None:
    """Attention layer i (its cache is the runner's KV cache i) reads the block table of KV
    cache group ``layer_groups[i]``."""
    layers = [m for m in model.modules() if isinstance(m, AttentionLayer)]
    if not layers and getattr(model, "encoder_only", False):
        return                   # attends over whole prompts: reads and writes no KV cache
    if len(layers) != len(layer_groups):
        raise ValueError(f"{len(layer_groups)} layers in the KV cache groups, the model has {len(layers)}")
    for i, (m, g) in enumerate(zip(layers, layer_groups)):
        m.kv_cache_group, m.kv_index = g, i


def first_attention(model: nn.Module) -> AttentionLayer | None:
    """The model's first attention layer: while its ``calculate_kv_scales`` is set, the layers
    still wait for a batch to set their KV scales, so a step must run through their forward, not
    a path that skips it (a captured graph, the native decode stack)."""
    return next((m for m in model.modules() if isinstance(m, AttentionLayer)), None)
