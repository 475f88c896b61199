"""The safetensors checkpoints' formats, named as vLLM names them (config.json's
``quantization_config.quant_method``):

- ``fp8``: vLLM's / llm-compressor's fp8 layout: ``weight`` float8_e4m3fn and ``weight_scale``
  per tensor (or per channel), optional ``input_scale`` (static activations; dynamic per token
  otherwise); ``--quantization fp8`` on a float checkpoint quantizes it at load, per tensor.
- ``compressed-tensors``: one scheme over every Linear: 8-bit float (fp8, as above) or 8-bit int
  (symmetric, per tensor, per channel or per group of input features; groups run on the CPU
  only), with or without 8-bit activations (dynamic per token or static per tensor); an
  ``ignore`` list.
- ``awq``: 4-bit GEMM layout (``qweight`` / ``qzeros`` (K, N / 8) int32 in AWQ's nibble order,
  ``scales`` (K / G, N) float16), zero points, ``modules_to_not_convert``.
- ``gptq``: 4- or 8-bit (``qweight`` (K / 8, N) packed along the input features, ``qzeros``
  (K / G, N / 8), ``scales``, ``g_idx``: act-order (``desc_act``) included), sym or not,
  checkpoint_format gptq (stored zero points are zero - 1) or gptq_v2.

The LM head stays unquantized (as vLLM's configs leave it unless told otherwise).
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from models.layers import Linear
from models.quantization.base import QuantizationConfig, is_ignored, shards_of, shard_tensors
from models.quantization.kernels import Fp8Weights, IntWeights, PackedLinearMethod, group_columns, natural_groups, \
    per_feature_scale

FP8_MAX = 448.0
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)   # nibble of column 8 j + c within AWQ's int32


class _SafetensorsConfig(QuantizationConfig):
    """Shared by the formats below: the model's dtype and device, the ignore list."""
    ignore: list[str] = []
    ignore_match = "exact"

    def __init__(self) -> None:
        self.dtype = torch.float32

    def get_quant_method(self, layer: Linear, prefix: str, hf_names: dict[str | None, str]):
        if prefix == "lm_head" or prefix.endswith(".lm_head") or is_ignored(hf_names, prefix, self.ignore,
                                                                            self.ignore_match):
            return None
        return self.method()

    def method(self) -> PackedLinearMethod:
        raise NotImplementedError


def _refuse(what: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"{what} {value!r} is not supported; supported: {supported}")


def _rows_of(t: torch.Tensor, rows: tuple[int, int] | None, dim: int = 0, per: int = 1,
             what: str = "") -> torch.Tensor:
    """Rows (first, count) of ``t`` along ``dim``, where each entry holds ``per`` of them (words
    packing several output features)."""
    if rows is None:
        return t
    r0, n = rows
    if r0 % per or n % per:
        raise ValueError(f"{what} packs {per} features a word: tensor parallelism splits it at multiples of "
                         f"{per} only, not at {r0} + {n}")
    return t.narrow(dim, r0 // per, n // per)


def _scale_rows(scale: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    """A per-tensor scale whole, a per-channel one's rows."""
    return scale if rows is None or scale.numel() == 1 else scale.reshape(scale.shape[0], -1)[rows[0]:sum(rows)]


# --- fp8 ------------------------------------------------------------------------------------

class Fp8LinearMethod(PackedLinearMethod):
    checkpoint_tensors = ("weight", "weight_scale")
    optional_tensors = ("input_scale",)

    def unpack(self, layer: nn.Module) -> Fp8Weights:
        parts = []
        for shard, w, s, x in zip(shards_of(layer), shard_tensors(layer, "weight"),
                                  shard_tensors(layer, "weight_scale"), shard_tensors(layer, "input_scale")):
            if w.dtype != torch.float8_e4m3fn:
                raise ValueError(f"an fp8 weight{f' (shard {shard})' if shard else ''} is stored as {w.dtype}; "
                                 "expected float8_e4m3fn")
            parts.append(Fp8Weights(w, per_feature_scale(s, w.shape[0], "weight_scale"),
                                    None if x is None else x.float().reshape(-1).max()))
        return Fp8Weights.cat(parts)

    def part_tensors(self, tensors, rows, cols):
        w = tensors["weight"]
        out = dict(tensors, weight=w[rows[0]:sum(rows)] if rows is not None else w[:, cols[0]:sum(cols)])
        out["weight_scale"] = _scale_rows(tensors["weight_scale"], rows)
        return out


class Fp8OnlineMethod(PackedLinearMethod):
    """--quantization fp8 on a float checkpoint: the float weight loads as usual, then becomes
    fp8 with one scale per tensor (vLLM's dynamic fp8); a tensor-parallel rank's part keeps the
    whole layer's scale, so the ranks hold the codes one worker holds."""
    amax: torch.Tensor | None = None        # a part's: the whole layer's largest magnitude

    def unpack(self, layer: nn.Module) -> Fp8Weights:
        return quantize_fp8(layer.weight.detach().float(), per_channel=False, amax=self.amax)

    def shard(self, whole, part, rows=None, cols=None) -> None:
        method = copy.copy(self)
        method.amax = whole.weight.detach().float().abs().max() if self.amax is None else self.amax
        part.quant_method = method

    def process_weights_after_loading(self, layer: nn.Module) -> nn.Module:
        out = super().process_weights_after_loading(layer)
        if out is layer:
            del layer.weight
            layer.weight = None
        return out


def quantize_fp8(w: torch.Tensor, per_channel: bool, amax: torch.Tensor | None = None) -> Fp8Weights:
    """w (N, K) float -> fp8 e4m3 codes with scale amax / 448 (per tensor or per output row;
    ``amax``: the tensor's, given)."""
    if amax is not None:
        amax = amax.float().expand(w.shape[0])
    elif per_channel:
        amax = w.abs().amax(dim=1)
    else:
        amax = w.abs().max().expand(w.shape[0])
    scale = (amax.float() / FP8_MAX).clamp(min=1e-12)
    codes = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8Weights(codes, scale, None)


def quantize_int8(w: torch.Tensor, per_channel: bool, group_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) float -> (int8 codes, float32 scale: () per tensor, (N,) per channel, (N, K / g)
    per group of ``group_size`` input features): symmetric, scale amax / 127."""
    n, k = w.shape
    if group_size:
        if k % group_size:
            raise ValueError(f"group size {group_size} does not divide the input size {k}")
        amax = w.abs().reshape(n, k // group_size, group_size).amax(dim=2)
        scale = (amax.float() / 127.0).clamp(min=1e-12)                               # (N, G)
        codes = (w.float() / scale.repeat_interleave(group_size, dim=1)).round().clamp(-127, 127)
        return codes.to(torch.int8), scale
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().max()
    scale = (amax.float() / 127.0).clamp(min=1e-12)
    return (w.float() / scale).round().clamp(-127, 127).to(torch.int8), scale.reshape(-1) if per_channel else scale


class Fp8Config(_SafetensorsConfig):
    name = "fp8"

    def __init__(self, serialized: bool = True, activation_scheme: str = "dynamic",
                 ignored_layers: list[str] | None = None) -> None:
        super().__init__()
        self.serialized, self.activation_scheme = serialized, activation_scheme
        self.ignore = list(ignored_layers or [])

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Fp8Config":
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise _refuse("fp8 activation_scheme", scheme, "'dynamic', 'static'")
        if config.get("weight_block_size") is not None:
            raise _refuse("fp8 weight_block_size", config["weight_block_size"], "null (per-tensor scales)")
        return cls(True, scheme, config.get("ignored_layers") or config.get("modules_to_not_convert"))

    @classmethod
    def from_flag(cls, source_path: str) -> "Fp8Config":
        return cls(serialized=False)

    def method(self) -> PackedLinearMethod:
        return (Fp8LinearMethod if self.serialized else Fp8OnlineMethod)(self.device, self.dtype)


# --- compressed-tensors ---------------------------------------------------------------------

class Int8LinearMethod(PackedLinearMethod):
    checkpoint_tensors = ("weight", "weight_scale")
    optional_tensors = ("input_scale",)

    def __init__(self, device: str, dtype: torch.dtype, int8_activations: bool) -> None:
        super().__init__(device, dtype)
        self.int8_activations = int8_activations

    def unpack(self, layer: nn.Module) -> IntWeights:
        parts = []
        for w, s in zip(shard_tensors(layer, "weight"), shard_tensors(layer, "weight_scale")):
            if w.dtype != torch.int8:
                raise ValueError(f"an int8 weight is stored as {w.dtype}; expected int8")
            if s.dim() == 2 and s.shape[1] > 1:          # strategy "group": (N, K / group_size)
                if s.shape[0] != w.shape[0] or (w.shape[1] % s.shape[1] if self.groups is None
                                                else int(self.groups.max()) >= s.shape[1]):
                    raise ValueError(f"weight_scale of shape {tuple(s.shape)} does not group a weight of shape "
                                     f"{tuple(w.shape)}")
                scales = s.float()
            else:
                scales = per_feature_scale(s, w.shape[0], "weight_scale")[:, None]
            g = natural_groups(self.groups, w.shape[1], scales.shape[1]) if scales.shape[1] > 1 else None
            parts.append(IntWeights(w, scales, g, self.int8_activations))
        return IntWeights.cat(parts)

    def part_tensors(self, tensors, rows, cols):
        w, s = tensors["weight"], tensors["weight_scale"]
        if rows is not None:
            return dict(tensors, weight=w[rows[0]:sum(rows)], weight_scale=_scale_rows(s, rows))
        out = dict(tensors, weight=w[:, cols[0]:sum(cols)])
        if s.dim() == 2 and s.shape[1] > 1:               # groups: those the columns touch
            k, g = w.shape[1], s.shape[1]
            touched, self.groups = group_columns(torch.arange(k) // (k // g), cols)
            out["weight_scale"] = s[:, touched]
        return out


class CompressedTensorsConfig(_SafetensorsConfig):
    """One config group targeting every Linear (what llm-compressor's FP8 / W8A8 recipes write)."""
    name = "compressed-tensors"
    FORMATS = ("float-quantized", "int-quantized", "naive-quantized")

    def __init__(self, kind: str, activations: bool, ignore: list[str]) -> None:
        super().__init__()
        self.kind, self.activations, self.ignore = kind, activations, list(ignore)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "CompressedTensorsConfig":
        fmt = config.get("format", "float-quantized")
        if fmt not in cls.FORMATS:
            raise _refuse("compressed-tensors format", fmt, ", ".join(map(repr, cls.FORMATS)))
        groups = config.get("config_groups") or {}
        if len(groups) != 1:
            raise ValueError(f"compressed-tensors with {len(groups)} config groups is not supported; "
                             "supported: one group targeting every Linear")
        (group_name, group), = groups.items()
        if group.get("targets") not in (["Linear"], ["re:.*"]):
            raise _refuse(f"compressed-tensors group {group_name} targets", group.get("targets"), "['Linear']")
        w = group.get("weights") or {}
        kind = {("float", 8): "fp8", ("int", 8): "int8"}.get((w.get("type"), w.get("num_bits")))
        if kind is None:
            raise _refuse("compressed-tensors weights", f"{w.get('num_bits')}-bit {w.get('type')}",
                          "8-bit float, 8-bit int")
        strategies = ("tensor", "channel") + (("group",) if kind == "int8" else ())
        if w.get("strategy") not in strategies:
            raise _refuse(f"compressed-tensors {kind} weight strategy", w.get("strategy"),
                          ", ".join(map(repr, strategies)))
        if not w.get("symmetric", True) or w.get("dynamic", False):
            raise ValueError("compressed-tensors weights that are asymmetric or dynamic are not supported")
        a = group.get("input_activations")
        if a is not None:
            if (a.get("type", w.get("type")), a.get("num_bits")) != (w.get("type"), 8):
                raise _refuse("compressed-tensors input_activations", f"{a.get('num_bits')}-bit {a.get('type')}",
                              f"8-bit {w.get('type')} with {w.get('type')} weights")
            if a.get("strategy") not in ("token", "tensor") or not a.get("symmetric", True):
                raise _refuse("compressed-tensors input_activations strategy", a.get("strategy"),
                              "'token' (dynamic), 'tensor' (static or dynamic), symmetric")
        return cls(kind, a is not None, config.get("ignore") or [])

    def method(self) -> PackedLinearMethod:
        if self.kind == "fp8":
            return Fp8LinearMethod(self.device, self.dtype)
        return Int8LinearMethod(self.device, self.dtype, self.activations)


# --- AWQ and GPTQ ---------------------------------------------------------------------------

def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32 / bits unsigned values, first value in the low bits, unpacked
    along ``dim`` (each word becomes 32 / bits consecutive entries)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    x = packed.to(torch.int32).unsqueeze(-1) >> shifts                          # (..., per) arithmetic shift
    x = x & ((1 << bits) - 1)
    if dim == 1:
        return x.reshape(packed.shape[0], packed.shape[1] * per)
    return x.permute(0, 2, 1).reshape(packed.shape[0] * per, packed.shape[1])


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of ``unpack_int32`` (values 0 .. 2^bits - 1)."""
    per = 32 // bits
    v = values.to(torch.int64)
    v = v.reshape(v.shape[0], -1, per) if dim == 1 else v.reshape(-1, per, v.shape[1]).permute(0, 2, 1)
    word = (v << torch.arange(0, 32, bits, dtype=torch.int64)).sum(-1)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def quantize_int4(w: torch.Tensor, g_idx: torch.Tensor,
                  symmetric: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w (N, K) float -> 4-bit codes per group of input features, round to nearest: (codes (K, N)
    0..15, zeros (G, N) 0..15, scales (G, N) float16), where ``g_idx`` (K,) names each input
    feature's group; w ~ (codes - zeros[g_idx]) * scales[g_idx], transposed. Asymmetric: each
    group's [min, max] in 15 steps; symmetric: zero 8 and scale 2 amax / 15 (GPTQ's sym)."""
    wt = w.float().t()                                                        # (K, N)
    groups = int(g_idx.max()) + 1
    lo = torch.stack([wt[g_idx == g].amin(0) for g in range(groups)]).clamp(max=0)
    hi = torch.stack([wt[g_idx == g].amax(0) for g in range(groups)]).clamp(min=0)
    if symmetric:
        scales = (2 * torch.maximum(-lo, hi) / 15).clamp(min=1e-4).half()
        zeros = torch.full_like(scales, 8, dtype=torch.int32)
    else:
        scales = ((hi - lo) / 15).clamp(min=1e-4).half()
        zeros = (-lo / scales.float()).round().clamp(0, 15).int()
    codes = (wt / scales.float()[g_idx] + zeros[g_idx]).round().clamp(0, 15).int()
    return codes, zeros, scales


class AWQLinearMethod(PackedLinearMethod):
    checkpoint_tensors = ("qweight", "qzeros", "scales")

    def __init__(self, device: str, dtype: torch.dtype, group_size: int) -> None:
        super().__init__(device, dtype)
        self.group_size = group_size

    def unpack(self, layer: nn.Module) -> IntWeights:
        order = torch.tensor(AWQ_REVERSE_ORDER)
        parts = []
        for qw, qz, s in zip(*(shard_tensors(layer, n) for n in self.checkpoint_tensors)):
            q = awq_unorder(unpack_int32(qw, 4, 1), order)                     # (K, N)
            z = awq_unorder(unpack_int32(qz, 4, 1), order)                     # (K / G, N)
            k, n = q.shape
            g = self._groups(k)
            parts.append(IntWeights((q - z[g]).t().contiguous().to(torch.int8), s.t().contiguous(),
                                    natural_groups(g, k, z.shape[0]), False, z.t().contiguous().to(torch.int8)))
        return IntWeights.cat(parts)

    def _groups(self, k: int) -> torch.Tensor:
        if self.groups is not None:
            return self.groups.long()
        return torch.arange(k) // (self.group_size if self.group_size > 0 else k)

    def part_tensors(self, tensors, rows, cols):
        qw, qz, s = tensors["qweight"], tensors["qzeros"], tensors["scales"]
        if rows is not None:             # (K, N / 8) words of 8 output features
            return {"qweight": _rows_of(qw, rows, 1, 8, "awq's qweight"), "qzeros": _rows_of(qz, rows, 1, 8, "awq's qzeros"),
                    "scales": _rows_of(s, rows, 1)}
        touched, self.groups = group_columns(self._groups(qw.shape[0]), cols)
        return {"qweight": qw[cols[0]:sum(cols)], "qzeros": qz[touched], "scales": s[touched]}


def awq_unorder(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Columns of AWQ's packing order (word j's nibble i is column 8 j + ORDER[i]) to natural order."""
    rows, cols = x.shape
    return x.reshape(rows, cols // 8, 8)[:, :, order].reshape(rows, cols)


def awq_order(x: torch.Tensor) -> torch.Tensor:
    """Natural columns to AWQ's packing order (the inverse of ``awq_unorder``)."""
    rows, cols = x.shape
    inverse = torch.argsort(torch.tensor(AWQ_REVERSE_ORDER))
    return x.reshape(rows, cols // 8, 8)[:, :, inverse].reshape(rows, cols)


class AWQConfig(_SafetensorsConfig):
    name = "awq"
    ignore_match = "substring"

    def __init__(self, group_size: int, modules_to_not_convert: list[str]) -> None:
        super().__init__()
        self.group_size, self.ignore = group_size, list(modules_to_not_convert)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "AWQConfig":
        bits = config.get("bits", config.get("w_bit"))
        if bits != 4:
            raise _refuse("awq bits", bits, "4")
        if not config.get("zero_point", True):
            raise _refuse("awq zero_point", False, "true")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise _refuse("awq version", version, "'gemm'")
        return cls(int(config.get("group_size", config.get("q_group_size", 128))),
                   config.get("modules_to_not_convert") or [])

    def method(self) -> PackedLinearMethod:
        return AWQLinearMethod(self.device, self.dtype, self.group_size)


class GPTQLinearMethod(PackedLinearMethod):
    checkpoint_tensors = ("qweight", "qzeros", "scales")
    optional_tensors = ("g_idx",)

    def __init__(self, device: str, dtype: torch.dtype, bits: int, group_size: int, zero_offset: int) -> None:
        super().__init__(device, dtype)
        self.bits, self.group_size, self.zero_offset = bits, group_size, zero_offset

    def unpack(self, layer: nn.Module) -> IntWeights:
        parts = []
        for qw, qz, s, g_idx in zip(*(shard_tensors(layer, n) for n in ("qweight", "qzeros", "scales", "g_idx"))):
            q = unpack_int32(qw, self.bits, 0)                                 # (K, N)
            z = unpack_int32(qz, self.bits, 1) + self.zero_offset              # (G, N)
            k = q.shape[0]
            g = torch.arange(k) // (self.group_size if self.group_size > 0 else k) if g_idx is None else g_idx.long()
            if g.numel() != k or int(g.max()) >= z.shape[0]:
                raise ValueError(f"g_idx of {g.numel()} entries up to {int(g.max())} does not fit {k} input "
                                 f"features in {z.shape[0]} groups")
            parts.append(IntWeights((q - z[g]).t().contiguous().to(torch.int8), s.t().contiguous(),
                                    natural_groups(g, k, z.shape[0]), False,
                                    z.t().contiguous().to(torch.int8)))
        return IntWeights.cat(parts)

    def part_tensors(self, tensors, rows, cols):
        qw, qz, s, g_idx = (tensors.get(n) for n in ("qweight", "qzeros", "scales", "g_idx"))
        per = 32 // self.bits
        if rows is not None:             # qweight (K / per, N); qzeros (G, N / per)
            out = {"qweight": _rows_of(qw, rows, 1), "qzeros": _rows_of(qz, rows, 1, per, "gptq's qzeros"),
                   "scales": _rows_of(s, rows, 1)}
            return out if g_idx is None else dict(out, g_idx=g_idx)
        k = qw.shape[0] * per
        groups = g_idx.long() if g_idx is not None else torch.arange(k) // (self.group_size if self.group_size > 0 else k)
        touched, part = group_columns(groups, cols)
        return {"qweight": _rows_of(qw, cols, 0, per, "gptq's qweight"), "qzeros": qz[touched], "scales": s[touched],
                "g_idx": part.to(torch.int32)}


class GPTQConfig(_SafetensorsConfig):
    name = "gptq"
    ignore_match = "substring"

    def __init__(self, bits: int, group_size: int, zero_offset: int, modules_to_not_convert: list[str]) -> None:
        super().__init__()
        self.bits, self.group_size, self.zero_offset = bits, group_size, zero_offset
        self.ignore = list(modules_to_not_convert)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GPTQConfig":
        bits = config.get("bits")
        if bits not in (4, 8):
            raise _refuse("gptq bits", bits, "4, 8")
        if config.get("lm_head"):
            raise _refuse("gptq lm_head", True, "false (an unquantized LM head)")
        if config.get("dynamic"):
            raise _refuse("gptq dynamic", config["dynamic"], "none (one scheme for every layer)")
        fmt = config.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise _refuse("gptq checkpoint_format", fmt, "'gptq', 'gptq_v2'")
        return cls(bits, int(config.get("group_size", 128)), 1 if fmt == "gptq" else 0,
                   config.get("modules_to_not_convert") or [])

    def method(self) -> PackedLinearMethod:
        return GPTQLinearMethod(self.device, self.dtype, self.bits, self.group_size, self.zero_offset)
