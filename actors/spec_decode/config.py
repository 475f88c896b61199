"""SpeculativeConfig: what ``--speculative-config`` says, parsed from vLLM's JSON object and
validated at the edge, with vLLM's defaults.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    {"method": "draft_model", "model": "HuggingFaceTB/SmolLM2-135M", "num_speculative_tokens": 3}
    {"method": "self_draft", "quantization": "gguf-i8", "num_speculative_tokens": 3}

Methods:
  ngram        prompt lookup (actors/spec_decode/ngram.py): no model. vLLM's defaults: neither
               bound given -> both 5; one given -> the other equals it; 1 <= min <= max.
  draft_model  a smaller model of the same vocabulary, named by ``model``, optionally quantized.
  self_draft   the target's own weights in a cheaper ``quantization`` draft for the exact ones
               (Troupe's own method: no ``model``; ``quantization`` required).
As in vLLM, ``method`` may be left out when ``model`` says it: "ngram" (or "[ngram]") means
ngram, any other name means draft_model.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import msgspec

from actors.engine.json_flags import checked_fields, convert, parse_object

if TYPE_CHECKING:
    from actors.engine.sampling_params import SamplingParams

METHODS = ("ngram", "draft_model", "self_draft")
NGRAM_MODEL_NAMES = ("ngram", "[ngram]")      # vLLM's spellings of "no model, prompt lookup"
DEFAULT_PROMPT_LOOKUP = 5                     # vLLM's default for both bounds
# models.quant.QUANT_MODES, spelled out: importing models.quant loads torch, and the engine's
# config (read by the frontend) carries this one
QUANT_MODES = ("gguf", "gguf-i8")


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    method: str                               # METHODS
    num_speculative_tokens: int               # k: drafts proposed per request and step, > 0
    prompt_lookup_min: int | None = None      # ngram: shortest suffix n-gram matched
    prompt_lookup_max: int | None = None      # ngram: longest suffix n-gram matched
    model: str | None = None                  # draft_model: the draft checkpoint
    quantization: str | None = None           # draft_model, self_draft: QUANT_MODES

    def __post_init__(self) -> None:
        check_speculative_config(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> SpeculativeConfig:
        """vLLM's JSON object -> a validated config with its defaults filled in. ValueError names
        the field that is wrong and what it accepts."""
        fields = checked_fields(cls, raw, "speculative config")
        fields["method"] = _method(fields.get("method"), fields.get("model"))
        if fields["method"] == "ngram":
            if fields.get("model") in NGRAM_MODEL_NAMES:
                fields["model"] = None
            lo, hi = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
            if lo is None and hi is None:
                lo = hi = DEFAULT_PROMPT_LOOKUP
            fields["prompt_lookup_min"] = hi if lo is None else lo
            fields["prompt_lookup_max"] = lo if hi is None else hi
        if "num_speculative_tokens" not in fields:
            raise ValueError("num_speculative_tokens is required (the number of draft tokens per step, > 0)")
        return convert(cls, fields, "speculative config")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """The command line's form: one JSON object."""
        return cls.from_dict(parse_object(text, "--speculative-config"))


def _method(method: Any, model: Any) -> str:
    if method is None:
        if model is None:
            raise ValueError(f"method is required (one of {', '.join(METHODS)}) unless model names "
                             "the draft model or is \"ngram\"")
        return "ngram" if model in NGRAM_MODEL_NAMES else "draft_model"
    return "ngram" if method == "[ngram]" else method


def check_speculative_config(c: SpeculativeConfig) -> None:
    """Raise ValueError naming the first field that is out of range or does not fit the method."""
    if c.method not in METHODS:
        raise ValueError(f"method {c.method!r} is not supported; accepted: {', '.join(METHODS)}")
    if c.num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be > 0, got {c.num_speculative_tokens}")
    lookup = {"prompt_lookup_min": c.prompt_lookup_min, "prompt_lookup_max": c.prompt_lookup_max}
    if c.method == "ngram":
        for name, value in lookup.items():
            if value is None or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 for method ngram, got {value}")
        if c.prompt_lookup_min > c.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={c.prompt_lookup_min} must be <= "
                             f"prompt_lookup_max={c.prompt_lookup_max}")
        for name in ("model", "quantization"):
            if getattr(c, name) is not None:
                raise ValueError(f"{name} does not apply to method ngram, got {getattr(c, name)!r}")
        return
    for name, value in lookup.items():
        if value is not None:
            raise ValueError(f"{name} only applies to method ngram, not {c.method}")
    if c.method == "draft_model" and not c.model:
        raise ValueError("model is required for method draft_model (the draft checkpoint's name or path)")
    if c.method == "self_draft" and c.model is not None:
        raise ValueError(f"model does not apply to method self_draft (it drafts with the target's "
                         f"own weights), got {c.model!r}")
    if c.method == "self_draft" and c.quantization is None:
        raise ValueError(f"quantization is required for method self_draft: one of {', '.join(QUANT_MODES)}")
    if c.quantization is not None and c.quantization not in QUANT_MODES:
        raise ValueError(f"quantization {c.quantization!r} is not supported; accepted: {', '.join(QUANT_MODES)}")


def accepts_drafts(p: SamplingParams) -> bool:
    """Whether a request with these parameters is given draft tokens. Every logits processor
    (structured outputs through a bitmask row per position, penalties, bad words and min_tokens
    over the tokens so far and the drafts before the position, logit bias, allowed token ids)
    applies at each verified position, and the rejection sampler applies temperature, min_p,
    top-k and top-p; it does not report log-probs, so requests that ask for them decode one
    token per step, in the same batches. (Plugins' logits processors are not applied per
    position: the worker also turns drafts off for the requests they may change.)"""
    return p.logprobs is None and p.prompt_logprobs is None
