"""config.json (+ generation_config.json) -> ArchConfig: the keys all architectures share; a class reads its own."""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from typing import TYPE_CHECKING, Any

from models.architectures import BARE_MODELS, BIDIRECTIONAL_MODELS, RENAMED_ARCHITECTURES
from models.config import FULL, ArchConfig
from models.rope import DEFAULT_ROPE_THETA, RopeScaling, rope_scaling_from

if TYPE_CHECKING:
    from models.base import CausalLM

log = logging.getLogger("troupe.models")


def read_hf_config(checkpoint_dir: str, overrides: dict[str, Any] | None = None,
                   model_impl: str = "auto", language_model_only: bool = False) -> ArchConfig:
    """The ArchConfig of the checkpoint in ``checkpoint_dir`` (config.json required), with
    ``overrides`` over config.json's keys (vLLM's --hf-overrides: a key's value replaced, a
    sub-config's keys merged); ``model_impl`` as vLLM's --model-impl (``model_implementation``),
    ``language_model_only`` as its --language-model-only."""
    raw = with_overrides(_read_json(os.path.join(checkpoint_dir, "config.json")), overrides or {})
    gen_path = os.path.join(checkpoint_dir, "generation_config.json")
    generation = _read_json(gen_path) if os.path.isfile(gen_path) else {}
    try:
        config = hf_model_config(raw, generation, model_impl, language_model_only)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{checkpoint_dir}/config.json is missing or has a malformed field: {exc!r}") from exc
    st = sentence_transformers_config(checkpoint_dir)
    seq_len = st.get("max_seq_length")
    if seq_len is not None and "max_position_embeddings" not in (overrides or {}):
        config = dataclasses.replace(config, max_model_len=min(int(seq_len), config.max_model_len))
    if st.get("do_lower_case"):
        config = dataclasses.replace(config, do_lower_case=True)
    return config


# sentence-transformers' tokenization settings, by the base model's kind (vLLM reads the same files)
SENTENCE_TRANSFORMERS_CONFIGS = ("sentence_bert_config.json", "sentence_roberta_config.json",
                                 "sentence_distilbert_config.json", "sentence_camembert_config.json",
                                 "sentence_albert_config.json", "sentence_xlm-roberta_config.json",
                                 "sentence_xlnet_config.json")


def sentence_transformers_config(checkpoint_dir: str) -> dict[str, Any]:
    """A sentence-transformers checkpoint's tokenization settings (sentence_bert_config.json and
    its kin; {} without one): ``max_seq_length``, the context vLLM serves it with, and
    ``do_lower_case``, whether vLLM lower-cases a pooling request's text before tokenizing it."""
    for name in SENTENCE_TRANSFORMERS_CONFIGS:
        path = os.path.join(checkpoint_dir, name)
        if os.path.isfile(path):
            return _read_json(path)
    return {}


def with_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with ``overrides``: as transformers' ``PretrainedConfig.update``, and a nested
    config (``text_config``) updated key by key, as vLLM applies --hf-overrides."""
    out = dict(raw)
    for key, value in overrides.items():
        if key.endswith("_config") and isinstance(out.get(key), dict) and isinstance(value, dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    # transformers 4.x's rope keys over a 5.x checkpoint's rope_parameters (one for every layer):
    # what transformers 5 makes of them when it loads such a config
    params = out.get("rope_parameters")
    if isinstance(params, dict) and ("rope_type" in params or "rope_theta" in params):
        params = dict(params)
        if "rope_theta" in overrides:
            params["rope_theta"] = overrides["rope_theta"]
        scaling = overrides.get("rope_scaling")
        if isinstance(scaling, dict):
            params.update({("rope_type" if k == "type" else k): v for k, v in scaling.items()})
        out["rope_parameters"] = params
    return out


def read_quantization_config(checkpoint_dir: str) -> dict[str, Any] | None:
    """config.json's ``quantization_config`` (None when the checkpoint is not quantized)."""
    return _read_json(os.path.join(checkpoint_dir, "config.json")).get("quantization_config")


MODEL_IMPLS = ("auto", "vllm", "transformers")   # vLLM's --model-impl values ("vllm": Troupe's own classes)


def model_implementation(raw: dict[str, Any], model_impl: str = "auto") -> str:
    """Which implementation serves a parsed config.json: "vllm" (Troupe's class of its
    architecture) or "transformers" (transformers' modeling code through the transformers
    backend: asked for, named as the architecture, or, with "auto", the architecture's only one)."""
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"--model-impl must be one of {', '.join(MODEL_IMPLS)}, got {model_impl!r}")
    from models.architectures import TRANSFORMERS_BACKENDS, ModelRegistry, own_text_model
    from models.transformers_backend import serves
    archs = raw.get("architectures") or []
    if model_impl == "transformers" or (len(archs) == 1 and archs[0] in TRANSFORMERS_BACKENDS):
        return "transformers"
    if not own_text_model(raw):
        text_type = raw["text_config"].get("model_type")
        if model_impl == "auto" and serves(raw):
            log.info("%s with a %s language model has no Troupe implementation: it is served by transformers' "
                     "modeling code (the transformers backend)", archs[0], text_type)
            return "transformers"
        raise ValueError(f"Troupe's {archs[0]} serves a Llama language model, not {text_type!r}: "
                         "--model-impl transformers serves it through transformers' modeling code")
    if model_impl == "auto" and len(archs) == 1 and not ModelRegistry.is_supported(archs[0]) \
            and archs[0] not in BARE_MODELS and archs[0] not in RENAMED_ARCHITECTURES and serves(raw):
        log.info("%s has no Troupe implementation: it is served by transformers' modeling code (the transformers "
                 "backend, vLLM's --model-impl transformers)", archs[0])
        return "transformers"
    return "vllm"


@functools.cache
def _own_class_on_text(arch: str) -> None:
    log.info("%s is served on text by Troupe's own class (its language model); --model-impl transformers serves "
             "it whole, images too, where transformers' class can (not with M-RoPE positions)", arch)


def hf_model_config(raw: dict[str, Any], generation: dict[str, Any] | None = None,
                    model_impl: str = "auto", language_model_only: bool = False) -> ArchConfig:
    """The ArchConfig of a parsed config.json (``generation``: its generation_config.json) for
    the implementation ``model_impl`` chooses (``model_implementation``); a multimodal
    checkpoint the transformers backend serves whole takes images unless ``language_model_only``
    (Troupe's own classes serve a multimodal checkpoint's language model)."""
    if model_implementation(raw, model_impl) == "transformers":
        from models.transformers_backend import transformers_arch_config
        return transformers_arch_config(raw, generation or {}, language_model_only)
    archs = raw.get("architectures") or []
    if len(archs) == 1 and archs[0] in BARE_MODELS:      # a bare decoder stack: its causal LM's layers
        raw = {**raw, "architectures": [BARE_MODELS[archs[0]]]}
        if archs[0] in BIDIRECTIONAL_MODELS:              # attending both ways
            raw["use_bidirectional_attention"] = True
    model_class = _model_class(raw)
    images: dict[str, Any] = {}
    if model_class.hf_text_config is not None:     # a multimodal checkpoint: its language model's keys
        if isinstance(raw.get("vision_config"), dict) and not language_model_only:
            images = _image_fields(raw, model_class)
        elif isinstance(raw.get("audio_config"), dict) and not language_model_only:
            images = _audio_fields(raw, model_class)
        raw = language_model_config(raw, model_class.hf_text_config)
    raw = model_class.hf_raw({**model_class.hf_defaults, **raw})   # a key present as null stays null
    fields = _generic_fields(raw, generation or {})
    fields = {**fields, **model_class.hf_fields(raw, fields)}
    if raw.get("use_bidirectional_attention") and model_class.bidirectional_layers:
        fields["encoder_only"] = True            # an encoder (LlamaBidirectionalModel)
    return ArchConfig(**fields, **images)


def _image_fields(raw: dict[str, Any], model_class: type[CausalLM]) -> dict[str, Any]:
    """A multimodal checkpoint's image fields where Troupe's own class takes its images (its
    ``takes_images``): the image token, and whether an image's positions attend to each other
    both ways; {} where it serves the language model on text (the log says so)."""
    token = raw.get("image_token_id", raw.get("image_token_index"))
    if not model_class.takes_images or not isinstance(token, int):
        _own_class_on_text((raw.get("architectures") or ["?"])[0])
        return {}
    from models.architectures import is_mm_prefix_lm
    fields = {"image_token_id": token, "mm_prefix_lm": is_mm_prefix_lm(raw),
              "image_merge_size": int(raw["vision_config"].get("spatial_merge_size", 1))}
    video = raw.get("video_token_id")
    if model_class.takes_videos and isinstance(video, int):
        fields.update(video_token_id=video,
                      video_tokens_per_second=float(raw["vision_config"].get("tokens_per_second", 1.0)))
    return fields


def _audio_fields(raw: dict[str, Any], model_class: type[CausalLM]) -> dict[str, Any]:
    """A checkpoint with an audio tower, where Troupe's own class takes its audio (its
    ``takes_audio``): the audio token; {} where it serves the language model on text."""
    token = raw.get("audio_token_id", raw.get("audio_token_index"))
    if not model_class.takes_audio or not isinstance(token, int):
        _own_class_on_text((raw.get("architectures") or ["?"])[0])
        return {}
    return {"audio_token_id": token}


def language_model_config(raw: dict[str, Any], key: str) -> dict[str, Any]:
    """A multimodal config.json's language model, as one config: the keys under ``key``
    (``text_config``) over the top level's own (eos_token_id, ...), the other modalities'
    sub-configs left out; but the top level's ``tie_word_embeddings`` where it has one, as
    transformers ties the whole model's LM head by it."""
    text = raw.get(key)
    if text is None and "num_hidden_layers" in raw:     # an older save: the language model's keys at the top
        text = {}
    if not isinstance(text, dict):
        raise ValueError(f"config.json of {raw.get('architectures')} has no {key} object (its language model's keys)")
    top = {k: v for k, v in raw.items() if not (k.endswith("_config") and isinstance(v, dict))}
    tied = {"tie_word_embeddings": top["tie_word_embeddings"]} if "tie_word_embeddings" in top else {}
    return {**top, **text, **tied, "architectures": raw["architectures"]}


def rope_parameters(raw: dict[str, Any], layer_type: str = FULL) -> tuple[float, RopeScaling]:
    """(theta, rope scaling) of the layers of ``layer_type``: from transformers 5.x's
    ``rope_parameters`` (one dict, or one per layer type), else 4.x's ``rope_theta`` and
    ``rope_scaling``. Refuses rope types other than models/rope.py's ROPE_TYPES."""
    params = raw.get("rope_parameters")
    if params is not None and layer_type in params:
        params = params[layer_type]
    if params is None:
        params = {"rope_theta": raw.get("rope_theta", DEFAULT_ROPE_THETA), **(raw.get("rope_scaling") or {})}
    scaling = rope_scaling_from({k: v for k, v in params.items() if k != "rope_theta"},
                                raw["max_position_embeddings"], raw.get("original_max_position_embeddings"))
    return float(params.get("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA))), scaling


def _read_json(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def _model_class(raw: dict[str, Any]) -> type[CausalLM]:
    """The registered class of config.json's one architecture (plugins' included)."""
    from models.architectures import ModelRegistry
    archs = raw.get("architectures") or []
    if len(archs) != 1 or not ModelRegistry.is_supported(archs[0]):
        hint = f"; {RENAMED_ARCHITECTURES[archs[0]]}" if len(archs) == 1 and archs[0] in RENAMED_ARCHITECTURES else ""
        from models.transformers_backend import serves
        if not hint and len(archs) == 1 and serves(raw):
            hint = "; --model-impl transformers (or auto) serves it through transformers' modeling code"
        raise ValueError(f"config.json architectures {archs} is not supported{hint}; supported: "
                         f"{', '.join(ModelRegistry.get_supported_archs())}")
    return ModelRegistry.get_model_class(archs[0])


def _generic_fields(raw: dict[str, Any], generation: dict[str, Any]) -> dict[str, Any]:
    """The ArchConfig fields every architecture's config.json gives the same way."""
    arch = raw["architectures"][0]
    if raw.get("mlp_bias"):
        raise ValueError(f"{arch} with mlp_bias=true is not supported")
    hidden, num_heads = raw["hidden_size"], raw["num_attention_heads"]
    theta, rope_scaling = rope_parameters(raw)
    head_size = raw.get("head_dim") or hidden // num_heads
    partial = _partial_rotary_factor(raw)
    attention_bias = bool(raw.get("attention_bias", False))
    return dict(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_size=head_size,
        max_model_len=rope_scaling.stretched_len(raw["max_position_embeddings"]),
        rope_theta=theta,
        rms_norm_eps=float(raw["rms_norm_eps"]),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_token_ids(raw, generation),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        hidden_act=raw.get("hidden_act") or "silu",
        rope_scaling=rope_scaling,
        rotary_dim=None if partial == 1.0 else int(head_size * partial),
        mrope_section=_mrope_section(raw),
        mrope_interleaved=any(isinstance(p, dict) and bool(p.get("mrope_interleaved"))
                              for p in (raw.get("rope_parameters"), raw.get("rope_scaling"))),
        attn_logit_softcapping=raw.get("attn_logit_softcapping"),
        final_logit_softcapping=raw.get("final_logit_softcapping"),
    )


def _mrope_section(raw: dict[str, Any]) -> tuple[int, ...]:
    """M-RoPE's sections (Qwen2-VL's ``mrope_section``, in transformers 5.x's rope_parameters or
    4.x's rope_scaling); () without them."""
    for params in (raw.get("rope_parameters"), raw.get("rope_scaling")):
        if isinstance(params, dict) and params.get("mrope_section"):
            return tuple(int(n) for n in params["mrope_section"])
    return ()


def _partial_rotary_factor(raw: dict[str, Any]) -> float:
    """The share of each head the rotary turns: transformers 5.x's rope_parameters key, else a
    config's own (under the names vLLM reads: partial_rotary_factor, rotary_pct,
    rotary_emb_fraction); 1.0 when none says."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and FULL in params:
        params = params[FULL]
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    for name in ("partial_rotary_factor", "rotary_pct", "rotary_emb_fraction"):
        if factor is None:
            factor = raw.get(name)
    factor = 1.0 if factor is None else float(factor)
    if not 0.0 < factor <= 1.0:
        raise ValueError(f"partial_rotary_factor={factor} must be in (0, 1]")
    return factor


def _eos_token_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    """generation_config.json's eos_token_id, else config.json's: one id or a list."""
    eos = generation.get("eos_token_id", raw.get("eos_token_id"))
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
