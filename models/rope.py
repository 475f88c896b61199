"""Rotary position embeddings and their scaling: a checkpoint's rope parameters (transformers'
``rope_type`` and keys, vLLM's meaning) read into a ``RopeScaling``, and the cos/sin tables
models/layers.py's RotaryEmbedding looks positions up in.

Every type changes only the tables (the frequencies, and a multiplier on cos and sin), so every
kernel that rotates q and k serves them all. Two types depend on the context the engine serves
(its --max-model-len), fixed for the engine's life as vLLM fixes them (a KV cache holds keys
rotated once): ``longrope`` takes its long factors when that context exceeds the original one,
and ``dynamic`` (NTK) stretches its base for that context as transformers does for a sequence
of that length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:      # the config side (RopeScaling) stays free of torch: the engine core reads it
    import torch

DEFAULT_ROPE_THETA = 10_000.0   # transformers' default when a config names none
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope", "ntk")
# rope types whose factor stretches the context a config's max_position_embeddings gives (vLLM's
# rule); the others' max_position_embeddings is already the stretched context
STRETCHING_TYPES = ("linear", "dynamic", "ntk")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """One attention type's rope scaling. ``default`` with no ``freq_factors`` is plain rope."""
    rope_type: str = "default"
    factor: float = 1.0
    # the context the model was trained at before the scaling (llama3, yarn, longrope, dynamic)
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0             # llama3
    high_freq_factor: float = 4.0            # llama3
    beta_fast: float = 32.0                  # yarn
    beta_slow: float = 1.0                   # yarn
    mscale: float | None = None              # yarn (DeepSeek's form of the attention factor)
    mscale_all_dim: float | None = None      # yarn
    truncate: bool = True                    # yarn: the correction range rounded outwards
    attention_factor: float | None = None    # yarn, longrope: cos and sin multiplied; None: from factor
    short_factor: tuple[float, ...] = ()     # longrope: a divisor per frequency, within the original context
    long_factor: tuple[float, ...] = ()      # longrope: beyond it
    short_mscale: float | None = None        # longrope (vLLM's keys): the attention factor of each set
    long_mscale: float | None = None
    alpha: float | None = None               # dynamic, alpha form: base * alpha ** (d / (d - 2))
    mixed_b: float | None = None             # ntk: the mixed form's exponent (None: fixed NTK)
    # llama.cpp's rope_freqs tensor (its form of llama3 scaling): a divisor per frequency
    freq_factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {self.rope_type!r} is not supported; "
                             f"supported: {', '.join(map(repr, ROPE_TYPES))}")
        if not self.factor > 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor}")
        if self.rope_type in ("llama3", "yarn", "longrope") and not self.original_max_position_embeddings:
            raise ValueError(f"{self.rope_type} rope scaling needs original_max_position_embeddings")
        if self.rope_type == "longrope" and not (self.short_factor and self.long_factor):
            raise ValueError("longrope rope scaling needs short_factor and long_factor")

    @property
    def is_default(self) -> bool:
        return self.rope_type == "default" and not self.freq_factors

    def stretched_len(self, max_position_embeddings: int) -> int:
        """The context a config's max_position_embeddings allows with this scaling (vLLM's derived
        max_model_len): times the factor for the types that stretch it."""
        if self.rope_type in STRETCHING_TYPES and self.alpha is None:
            return int(max_position_embeddings * self.factor)
        return max_position_embeddings

    def default_len(self, max_model_len: int) -> int:
        """The context an engine serves when not told: longrope keeps the original one (vLLM's
        default: its short factors, the better ones there), and so does dynamic NTK (its base
        unstretched, transformers' own for every sequence that fits; vLLM serves the stretched
        context with that base); the others all of ``max_model_len``."""
        if self.rope_type == "longrope" or (self.rope_type == "dynamic" and self.alpha is None):
            return min(max_model_len, self.original_max_position_embeddings)
        return max_model_len

    def to_hf(self) -> dict[str, Any] | None:
        """The config.json ``rope_scaling`` of this scaling (None: plain rope; for linear and
        dynamic, config.json's max_position_embeddings is ``original_max_position_embeddings``);
        a GGUF file's per-frequency divisors have no config.json form."""
        if self.freq_factors:
            raise ValueError("rope scaling by llama.cpp's rope_freqs tensor (a Llama 3.1 GGUF's) has no config.json "
                             "form: start from the model's Hugging Face checkpoint instead")
        if self.is_default:
            return None
        out: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type not in STRETCHING_TYPES:      # theirs is config.json's max_position_embeddings
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        for key in _TYPE_KEYS.get(self.rope_type, ()):
            value = getattr(self, key)
            if value is not None:
                out[key] = list(value) if isinstance(value, tuple) else value
        return out


DEFAULT = RopeScaling()
# the keys of each type beside factor and original_max_position_embeddings
_TYPE_KEYS = {"llama3": ("low_freq_factor", "high_freq_factor"),
              "yarn": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"),
              "longrope": ("short_factor", "long_factor", "attention_factor", "short_mscale", "long_mscale"),
              "dynamic": ("alpha",), "ntk": ("mixed_b",)}


def rope_scaling_from(params: dict[str, Any] | None, max_position_embeddings: int,
                      original_max_position_embeddings: int | None = None) -> RopeScaling:
    """A config's rope parameters (transformers 5.x's ``rope_parameters`` entry or 4.x's
    ``rope_scaling``; 4.x's ``type`` and Phi-3's ``su`` spelling accepted) as a RopeScaling.
    ``original_max_position_embeddings``: a config's top-level key of that name (Phi-3's), which
    wins over the parameters' own, as transformers has it."""
    params = dict(params or {})
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    # M-RoPE (Qwen2-VL's and later): a text token has one position in all sections, so on text,
    # which is all Troupe serves, it is plain rope
    kind = {"su": "longrope", "mrope": "default"}.get(kind, kind)
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope type {kind!r} is not supported; supported: {', '.join(map(repr, ROPE_TYPES))}")
    if kind == "default":
        return DEFAULT
    # the context before the scaling: a config's max_position_embeddings where the type stretches it
    original = int(original_max_position_embeddings or params.get("original_max_position_embeddings")
                   or max_position_embeddings)
    factor = params.get("factor")
    if factor is None:
        if kind in ("yarn", "longrope"):
            factor = max_position_embeddings / original
        elif kind == "dynamic" and params.get("alpha") is not None:
            factor = 1.0
        else:
            raise ValueError(f"{kind} rope scaling needs a factor")
    out: dict[str, Any] = {"rope_type": kind, "factor": float(factor), "original_max_position_embeddings": original}
    for key in _TYPE_KEYS.get(kind, ()):
        value = params.get(key)
        if value is None:
            continue
        if key in ("short_factor", "long_factor"):
            value = tuple(float(v) for v in value)
        elif key == "truncate":
            value = bool(value)
        else:
            value = float(value)
        out[key] = value
    if kind == "llama3" and ("low_freq_factor" not in out or "high_freq_factor" not in out):
        raise ValueError("llama3 rope scaling needs low_freq_factor and high_freq_factor")
    return RopeScaling(**out)


def inv_freq_and_scale(head_size: int, theta: float, scaling: RopeScaling,
                       serving_len: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (head_size/2,), float32; the multiplier of cos and sin) of rope
    with base ``theta`` and ``scaling`` for an engine serving contexts of ``serving_len``."""
    import torch
    dim = head_size
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base = theta
    s = scaling
    scale = 1.0
    if s.rope_type == "dynamic":
        if s.alpha is not None:
            base = theta * s.alpha ** (dim / (dim - 2))
        elif serving_len > s.original_max_position_embeddings:
            base = theta * ((s.factor * serving_len / s.original_max_position_embeddings)
                            - (s.factor - 1)) ** (dim / (dim - 2))
    if s.rope_type == "ntk" and s.mixed_b is None:
        base = theta * s.factor
    # the same arithmetic as transformers' rope init functions, so float32 tables match theirs
    inv_freq = 1.0 / (base ** exponents)
    if s.rope_type == "linear":
        inv_freq = inv_freq / s.factor
    elif s.rope_type == "ntk":      # fixed NTK (GTE's "ntk" type, vLLM's NTKScalingRotaryEmbedding)
        if s.mixed_b is None:
            inv_freq = inv_freq / s.factor ** (2 / dim)
        else:                       # mixed NTK: frequency i divided by exp(a i^b)
            a = torch.tensor(s.factor).log() / (dim / 2) ** s.mixed_b
            inv_freq = inv_freq / (a * torch.arange(1, dim // 2 + 1).float() ** s.mixed_b).exp()
    elif s.rope_type == "llama3":
        inv_freq = _llama3(inv_freq, s)
    elif s.rope_type == "yarn":
        inv_freq, scale = _yarn(base, exponents, dim, s)
    elif s.rope_type == "longrope":
        long = serving_len > s.original_max_position_embeddings
        factors = s.long_factor if long else s.short_factor
        if len(factors) != dim // 2:
            raise ValueError(f"longrope's {'long' if long else 'short'}_factor has {len(factors)} entries; "
                             f"a head of {dim} rotates {dim // 2} frequencies")
        inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** exponents)
        mscale = s.long_mscale if long else s.short_mscale
        scale = (s.attention_factor if s.attention_factor is not None else mscale if mscale is not None
                 else 1.0 if s.factor <= 1.0
                 else math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_position_embeddings)))
    if s.freq_factors:
        if len(s.freq_factors) != dim // 2:
            raise ValueError(f"rope_freqs has {len(s.freq_factors)} entries; a head of {dim} rotates "
                             f"{dim // 2} frequencies")
        inv_freq = inv_freq / torch.tensor(s.freq_factors, dtype=torch.float32)
    return inv_freq, float(scale)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's: high frequencies kept, low ones divided by the factor, a smooth ramp between."""
    import torch
    old_len = s.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_len / s.low_freq_factor, old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    if s.high_freq_factor == s.low_freq_factor:
        return scaled
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(base: float, exponents: torch.Tensor, dim: int, s: RopeScaling) -> tuple[torch.Tensor, float]:
    """YaRN: interpolation for the frequencies that rotate less than ``beta_slow`` times over
    the original context, extrapolation for those above ``beta_fast``, a linear ramp between;
    cos and sin scaled by the attention factor."""
    import torch
    if s.attention_factor is not None:
        scale = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        scale = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        scale = _yarn_mscale(s.factor)
    pos_freqs = base ** exponents
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    original = s.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolated = 1 - ramp
    return interpolation * (1 - extrapolated) + extrapolation * extrapolated, float(scale)


def rope_tables(head_size: int, num_positions: int, theta: float, scaling: RopeScaling = DEFAULT,
                serving_len: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (num_positions, head_size), float32, half-split (NeoX) layout: frequency j
    at columns j and j + head_size/2."""
    import torch
    inv_freq, scale = inv_freq_and_scale(head_size, theta, scaling, serving_len or num_positions)
    freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32), inv_freq)   # (P, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)                                           # (P, D)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos, sin


def interleaved_to_half_split(rows: torch.Tensor, head_size: int, rotary_dim: int) -> torch.Tensor:
    """``rows`` (heads * head_size, ...) with each head's first ``rotary_dim`` rows reordered from
    interleaved rotary pairs to half-split ones: even rows, then odd rows, then the rest."""
    import torch                    # (this module is read without torch: the engine's config imports it)
    order = torch.cat([torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2),
                       torch.arange(rotary_dim, head_size)])
    heads = rows.shape[0] // head_size
    index = (torch.arange(heads)[:, None] * head_size + order[None]).reshape(-1)
    return rows[index]
