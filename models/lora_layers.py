"""LoRA on the model's linear layers, as a transformation applied after loading, quantizing and
packing (the model files know nothing of it): ``wrap_lora_modules`` puts a ``LoRALinear``
around each q|k|v, o, gate|up and down projection. The base layer (float, packed, GGUF
quantized) computes as before; the wrapper adds the LoRA delta in float32.

Each wrapper holds ``max_loras`` slots of stacked adapter weights in stable buffers (vLLM's
``set_lora`` / ``reset_lora`` copy into them), and all wrappers share one ``LoRAMapping``: the
adapter slot of each token of the step, set once per step by the worker. A step without LoRA
tokens adds nothing and keeps every fast path (the fused SiLU-gated projection, the native
decode stack); a step with some takes the per-layer path, where the delta of every adapter of
the batch is computed together: the native kernel on the CPU (kernels/cpu/lora.c), two Triton
launches on CUDA (kernels/triton/lora.py), segmented torch ops otherwise.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch
from torch import nn

from kernels.cpu import lora as lora_ops
from models.layers import GatedMLP, SelfAttention
from models.tensor_parallel import RowParallel, take_rows


class LoRAMapping:
    """The step's token -> adapter slot map that every LoRALinear reads (-1: no adapter)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.active = False                    # some token of the step has an adapter
        self.token_slots_np = np.empty(0, dtype=np.int64)       # (T,) the step's slots
        self.token_slots = torch.empty(0, dtype=torch.int64)    # (T,) on the model's device
        self.segments: lora_ops.TokenSegments | None = None     # for the torch path
        # a CUDA graph's persistent slot buffer (padding -1): while set, every LoRALinear adds its
        # delta through it, whatever the step, so a graph captured with it replays any slots
        self.static: torch.Tensor | None = None

    def set(self, token_slots: np.ndarray) -> None:
        """Slots (T,) int64 of the step's tokens, in the step's token order."""
        self.active = bool((token_slots >= 0).any())
        self.token_slots_np = np.ascontiguousarray(token_slots, dtype=np.int64)
        self.token_slots = torch.from_numpy(self.token_slots_np).to(self.device)
        self.segments = lora_ops.token_segments(token_slots, self.device) if self.active else None

    def clear(self) -> None:
        self.active, self.segments = False, None
        self.token_slots_np = np.empty(0, dtype=np.int64)

    @contextmanager
    def use_static(self, slots: torch.Tensor) -> Iterator[None]:
        """Within: the layers read their tokens' slots from ``slots`` (a graph's buffer view)."""
        if self.static is not None:
            raise RuntimeError("LoRAMapping.use_static does not nest")
        self.static = slots
        try:
            yield
        finally:
            self.static = None

    @property
    def applies(self) -> bool:
        """Whether the layers add LoRA deltas in this forward (the fast paths are off then)."""
        return self.active or self.static is not None


class LoRALinear(nn.Module):
    """``base_layer`` (T, in) -> (T, out) plus, per token, its slot's ``s B A x``; the output's
    ``slices`` (name -> rows: "q", "k", "v" of a fused q|k|v; "" for a plain layer) each have
    their own A and B.

    lora_a (S, in, num_slices * R): slice j's A^T in columns j R .. j R + r;
    lora_b (S, R, out): slice j's (s B)^T in its slice's columns; zeros elsewhere."""

    def __init__(self, base_layer: nn.Module, in_features: int, slices: dict[str, int], max_loras: int,
                 max_rank: int, mapping: LoRAMapping, device: torch.device, shard=None) -> None:
        super().__init__()
        self.base_layer = base_layer
        # a tensor-parallel rank's layer (models/tensor_parallel.TPShard): adapters come whole and
        # each rank keeps its share, B's rows of a column-parallel layer, A's columns of a
        # row-parallel one (whose partial deltas the layer's all-reduce sums with its outputs)
        self.shard = shard
        self.slice_names = list(slices)
        offsets = np.concatenate([[0], np.cumsum(list(slices.values()))]).astype(np.int64)
        self.offsets_list = offsets.tolist()
        self.register_buffer("offsets", torch.from_numpy(offsets).to(device), persistent=False)
        self.in_features, self.out_features, self.max_rank = in_features, int(offsets[-1]), max_rank
        n = len(slices)
        self.register_buffer("lora_a", torch.zeros(max_loras, in_features, n * max_rank, device=device),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, max_rank, self.out_features, device=device),
                             persistent=False)
        self.slot_ranks = [0] * max_loras
        self.register_buffer("slot_ranks_t", torch.zeros(max_loras, dtype=torch.int64, device=device),
                             persistent=False)
        self.mapping = mapping

    def reset_lora(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.slot_ranks[slot] = 0
        self.slot_ranks_t[slot] = 0

    def set_lora(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot ``slot`` takes, per slice name, (A (r, in), s B (rows, r)); slices not given stay zero."""
        self.reset_lora(slot)
        R, rank = self.max_rank, 0
        for name, (a, b) in weights.items():
            if self.shard is not None and self.shard.cols is not None:
                c0, n = self.shard.cols
                a = a[:, c0:c0 + n]
            if self.shard is not None and self.shard.rows is not None:
                b = take_rows(b, self.shard.rows[name])
            j = self.slice_names.index(name)
            r = a.shape[0]
            o0, o1 = self.offsets_list[j], self.offsets_list[j + 1]
            if a.shape != (r, self.in_features) or b.shape != (o1 - o0, r) or r > R:
                raise ValueError(f"LoRA slice {name!r}: A {tuple(a.shape)}, B {tuple(b.shape)} do not fit "
                                 f"({self.in_features} inputs, {o1 - o0} outputs, rank <= {R})")
            self.lora_a[slot, :, j * R:j * R + r] = a.t().to(self.lora_a.device)
            self.lora_b[slot, :r, o0:o1] = b.t().to(self.lora_b.device)
            rank = max(rank, r)
        self.slot_ranks[slot] = rank
        self.slot_ranks_t[slot] = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:              # (T, in) -> (T, out)
        if x.dim() > 2:           # (..., T, in): a transformers layer's batch of one (the transformers backend)
            return self.forward(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        y = self.base_layer(x)
        m = self.mapping
        if not m.applies:
            return y
        slots = m.static if m.static is not None else m.token_slots          # (T,)
        if slots.shape[0] != x.shape[0]:
            raise ValueError(f"LoRA slots for {slots.shape[0]} tokens, the layer got {x.shape[0]}")
        if x.is_cuda:
            from kernels.triton import lora as triton_lora      # triton only where it runs
            triton_lora.lora_shrink_expand(y, x, self.lora_a, self.lora_b, slots, self.slot_ranks_t, self.offsets)
        elif lora_ops.native_supports(y, x, self.lora_a):
            lora_ops.lora_shrink_expand(y, x, self.lora_a, self.lora_b, slots, self.slot_ranks_t, self.offsets)
        else:
            seg = m.segments if m.static is None else lora_ops.token_segments(slots.numpy(), x.device)
            if seg is not None:
                lora_ops.lora_shrink_expand_ref(y, x, self.lora_a, self.lora_b, seg, self.slot_ranks,
                                                self.offsets_list)
        return y

    def gated_act_forward(self, x: torch.Tensor, act: str, bfloat16_out: bool = False) -> torch.Tensor | None:
        """The base layer's fused gate|up + activation when the step has no LoRA token; None
        otherwise (the caller then takes the two-step path through ``forward``)."""
        fused = getattr(self.base_layer, "gated_act_forward", None)
        return None if self.mapping.applies or fused is None else fused(x, act, bfloat16_out)

    def act_forward(self, x: torch.Tensor, act: str, bfloat16_out: bool = False) -> torch.Tensor | None:
        """The base layer's product with its activation in one pass when the step has no LoRA
        token; None otherwise (as ``gated_act_forward``)."""
        fused = getattr(self.base_layer, "act_forward", None)
        return None if self.mapping.applies or fused is None else fused(x, act, bfloat16_out)

    def residual_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | None:
        """The base layer's product with the residual added in one pass when the step has no LoRA
        token; None otherwise (as ``gated_act_forward``)."""
        fused = getattr(self.base_layer, "residual_forward", None)
        return None if self.mapping.applies or fused is None else fused(x, residual)


def _in_features(layer: nn.Module) -> int:
    layer = getattr(layer, "linear", layer)                  # a row-parallel layer's own
    n = getattr(layer, "in_features", None)
    return int(n) if n is not None else int(layer.weight.shape[1])


def wrap_lora_modules(model: nn.Module, max_loras: int, max_rank: int, mapping: LoRAMapping,
                      device: torch.device) -> dict[str, LoRALinear]:
    """Wrap every attention and MLP projection of ``model`` (and those a layer names in its
    ``lora_slices()``: projection attribute -> its output slices); returns them by module name
    ("layers.3.self_attn.qkv_proj")."""
    wrapped: dict[str, LoRALinear] = {}
    for parent_name, parent in list(model.named_modules()):
        if isinstance(parent, SelfAttention):
            targets = {"qkv_proj": {"q": parent.q_size, "k": parent.kv_size, "v": parent.kv_size},
                       "o_proj": {"": _out_features(parent.o_proj)}}
        elif isinstance(parent, GatedMLP):
            inter = _in_features(parent.down_proj)
            targets = {"gate_up_proj": {"gate": inter, "up": inter}, "down_proj": {"": _out_features(parent.down_proj)}}
        elif hasattr(parent, "lora_slices"):       # a layer of its own kind (an encoder's)
            targets = parent.lora_slices()
        else:
            continue
        shards = getattr(parent, "tp_shards", {})          # split by tensor parallelism
        for name, slices in targets.items():
            holder, attr = parent, name
            if isinstance(getattr(parent, name), RowParallel):   # the delta joins its all-reduce
                holder, attr = getattr(parent, name), "linear"
            base = getattr(holder, attr)
            layer = LoRALinear(base, _in_features(base), slices, max_loras, max_rank, mapping, device,
                               shards.get(name))
            setattr(holder, attr, layer)
            wrapped[f"{parent_name}.{name}"] = layer
    return wrapped


def _out_features(layer: nn.Module) -> int:
    layer = getattr(layer, "linear", layer)
    n = getattr(layer, "out_features", None)
    return int(n) if n is not None else int(layer.weight.shape[0])


class LoRAAwareDecode:
    """The native decode stack with the model's LoRA slots: a step with LoRA tokens passes the
    layers' slot buffers (``words``, decode_stack.c's LoRA words) and its token slots, and the
    stack adds each linear's delta with the same kernel as the per-layer path. Without words
    (a layer the stack cannot give LoRA to), a step with LoRA tokens goes the per-layer way
    (``run`` answers None, the model falls back); so does one through a graph's slot buffer."""

    def __init__(self, stack, mapping: LoRAMapping, words: torch.Tensor | None) -> None:
        self.stack, self.mapping, self.words = stack, mapping, words     # words (L, 24) int64

    def run(self, *args, **kwargs):
        m = self.mapping
        if m.static is not None or (m.active and self.words is None):
            return None
        return self.stack.run(*args, **kwargs, lora=(self.words, m.token_slots) if m.active else None)

    @staticmethod
    def lora_words(layers, wrapped: dict[str, LoRALinear]) -> torch.Tensor | None:
        """Per layer, for its q|k|v, o, gate|up and down projections: their slots' A and B
        addresses, R, slice count, offsets and ranks addresses (float32 CPU buffers, stable)."""
        rows = []
        for i in range(len(layers)):
            row = []
            for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
                m = wrapped.get(f"layers.{i}.{name}")
                if m is None or m.lora_a.device.type != "cpu" or m.lora_a.dtype != torch.float32:
                    return None
                row += [m.lora_a.data_ptr(), m.lora_b.data_ptr(), m.max_rank, len(m.slice_names),
                        m.offsets.data_ptr(), m.slot_ranks_t.data_ptr()]
            rows.append(row)
        return torch.tensor(rows, dtype=torch.int64)

    def __getattr__(self, name: str):
        return getattr(self.stack, name)
