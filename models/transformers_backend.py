"""Any causal LM (or bare encoder) transformers implements, served through transformers' own
modeling code: vLLM's Transformers modeling backend (``--model-impl transformers``; ``auto``, the
default, takes it for an architecture Troupe has no implementation of).

transformers builds the model from the checkpoint (its config class, its weight conversions, its
layers) with ``attn_implementation="troupe"``: every attention module then hands its projected,
rotated q, k and v to ``troupe_attention``, which stores them in the paged KV cache and attends
through the engine's backend, so scheduling, chunked prefill, prefix caching, preemption and
sampling are the engine's as for a built-in model. transformers computes everything else (norms,
rotary from the step's positions, MLPs, experts) in torch, its linear layers made Troupe's (packed
for the native kernels). The step's tokens go through as one sequence of a batch of one, as vLLM
passes them; no mask is built (the backend knows each request's span from the step's metadata).
A classifier's checkpoint is built as transformers' classifier (its score head the pooler's), a
multimodal checkpoint whole (its vision tower and projector make an image's embeddings,
``embed_multimodal``) or, with --language-model-only or where its images cannot be served (M-RoPE),
as its language model alone, and a bare encoder (``TransformersEmbeddingModel``) attends each whole
prompt both ways with no KV cache.

What it cannot follow is refused when the model is built, by name: layers that do not attend
through transformers' attention interface (state-space and linear-attention layers), layer types
other than full and sliding attention, chunked local attention, multi-head latent attention,
keys that do not fit one page shape, two attentions a layer or a layer attending twice a step, a
mask of a module's own making (the last three by a trial step at load), quantized checkpoints."""
from __future__ import annotations

import collections
import functools
import inspect
import itertools
import json
import logging
import os
from typing import Any, ClassVar

import torch
from torch import nn

from kernels.attention.base import AttentionBackend, AttentionMetadata
from models.architectures import TRANSFORMERS_BACKEND, TRANSFORMERS_ENCODER, is_mm_prefix_lm
from models.base import CausalLM, TensorMap
from models.config import FULL, SLIDING, ArchConfig
from models.layers import AttentionLayer, Linear

log = logging.getLogger("troupe.models")

ATTN_IMPLEMENTATION = "troupe"                      # the name transformers' attention interface knows it by
_LAYER_TYPES = {FULL: FULL, SLIDING: SLIDING}       # transformers' layer_types this backend attends
_TP_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")   # the tp_plan styles Troupe splits by
_KV_SHAPE = {"head_dim", "num_key_value_heads", "num_attention_heads", "hidden_size"}   # what sizes a KV page


def transformers_config(raw: dict[str, Any]):
    """transformers' config object of a parsed config.json (its class by ``model_type``)."""
    from transformers import CONFIG_MAPPING
    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"config.json's model_type {model_type!r} is not one transformers "
                         f"{_transformers_version()} knows, so its modeling code cannot serve it")
    cls = CONFIG_MAPPING[model_type]
    return cls.from_dict(cls._decode_special_floats(raw))      # as from_pretrained reads config.json


def _class_of(model_type: str | None) -> type | None:
    """AutoModelForCausalLM's class for ``model_type``, or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if name is None:
        return None
    import transformers
    return getattr(transformers, name, None)


def classifier_class(raw: dict[str, Any]) -> type | None:
    """AutoModelForSequenceClassification's class for this config's (text) model type, or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES
    name = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(raw.get("model_type"))
    import transformers
    return getattr(transformers, name, None) if name else None


def causal_lm_class(raw: dict[str, Any]) -> type | None:
    """The transformers class that generates text from this config: AutoModelForCausalLM's choice
    for a text model; for a multimodal checkpoint (a ``text_config``), its language model's causal
    LM, served on text as vLLM's --language-model-only serves it. None when transformers has none."""
    text = raw.get("text_config")
    if isinstance(text, dict):
        try:
            return _class_of(transformers_config(raw).get_text_config().model_type)
        except ValueError:
            return None
    return _class_of(raw.get("model_type"))


def encoder_class(raw: dict[str, Any]) -> type | None:
    """The base model class (AutoModel's) of a bidirectional encoder's checkpoint: a bare
    ``...Model`` of a model type with a masked-LM head (BERT's kin: DistilBERT, ELECTRA, ALBERT),
    served as an embedding model; None otherwise."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES
    archs, model_type = raw.get("architectures") or [], raw.get("model_type")
    if len(archs) != 1 or not archs[0].endswith("Model") or model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return None
    import transformers
    name = MODEL_MAPPING_NAMES.get(model_type)
    return getattr(transformers, name, None) if isinstance(name, str) else None


def image_text_to_text_class(raw: dict[str, Any]) -> type | None:
    """AutoModelForImageTextToText's class for this config's model type (LLaVA's, Mistral 3's, ...), or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(raw.get("model_type"))
    import transformers
    return getattr(transformers, name, None) if isinstance(name, str) else None


@functools.cache
def _text_only(arch: str, why: str) -> None:
    log.info("%s is served on text only: %s", arch, why)


def image_token_id(raw: dict[str, Any], hf) -> int | None:
    """The token whose positions take an image's embeddings, when the transformers backend serves
    this multimodal checkpoint whole (its vision tower and projector in front of the language
    model, as vLLM serves it): transformers has its image-text-to-text class, the class computes
    image features, its language model takes plain positions (a prefix LM's images attend to
    themselves both ways: ``is_mm_prefix_lm``). None otherwise, the reason logged: the checkpoint
    is then served as its language model, on text."""
    arch = (raw.get("architectures") or ["?"])[0]
    cls = image_text_to_text_class(raw)
    token = getattr(hf, "image_token_id", None)
    if token is None:
        token = getattr(hf, "image_token_index", None)
    text = hf.get_text_config().to_dict()
    rope = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
    why = None
    if cls is None or not hasattr(cls, "get_image_features"):
        why = f"transformers {_transformers_version()} has no image-text-to-text class of it that computes image features"
    elif not getattr(cls, "_supports_attention_backend", False):
        why = f"{cls.__name__} does not attend through transformers' attention interface"
    elif "mrope_section" in rope:
        why = "its image tokens take M-RoPE's three-dimensional positions"
    elif not isinstance(token, int):
        why = "its config names no image token"
    if why is not None:
        _text_only(arch, why)
        return None
    return token


def serves(raw: dict[str, Any]) -> bool:
    """Whether transformers has a causal LM class, or an encoder's base model, for this
    config.json (what ``auto`` falls back to)."""
    try:
        return encoder_class(raw) is not None or causal_lm_class(raw) is not None
    except ImportError:
        return False


# a multimodal checkpoint's language model tensors, under transformers 5's names and older saves'
LANGUAGE_MODEL_KEYS = {r"^model\.language_model\.": "model.", r"^language_model\.model\.": "model.",
                       r"^language_model\.lm_head\.": "lm_head."}


def _language_model_config(hf):
    """The config the causal LM is built from: the model's own, or a multimodal checkpoint's text
    config (tied embeddings as the checkpoint ties them)."""
    text = hf.get_text_config()
    if text is not hf and getattr(hf, "tie_word_embeddings", None) is not None:
        text.tie_word_embeddings = hf.tie_word_embeddings
    return text


def _transformers_version() -> str:
    import transformers
    return transformers.__version__


def transformers_arch_config(raw: dict[str, Any], generation: dict[str, Any],
                             language_model_only: bool = False) -> ArchConfig:
    """The ArchConfig of a checkpoint served by the transformers backend: read from the config
    object transformers builds (its defaults for the keys config.json leaves out, its layer
    types), what the engine sizes the KV cache and the context by. A multimodal checkpoint
    takes images where the backend can serve it whole (``image_token_id``), unless
    ``language_model_only`` (vLLM's --language-model-only)."""
    from models.hf_config import _eos_token_ids, rope_parameters
    arch = (raw.get("architectures") or ["?"])[0]
    encoder = encoder_class(raw)
    cls = encoder or causal_lm_class(raw)
    if cls is None:
        raise ValueError(f"{arch} (model_type {raw.get('model_type')!r}) has no causal LM class in transformers "
                         f"{_transformers_version()}: the transformers backend serves text generation models")
    if not getattr(cls, "_supports_attention_backend", False):
        raise ValueError(f"{cls.__name__} does not call its attention through transformers' attention interface "
                         "(its _supports_attention_backend is off), so the transformers backend cannot give it the "
                         "paged KV cache")
    hf = transformers_config(raw)
    text = hf.get_text_config()
    varying = sorted((getattr(text, "per_layer_attributes", None) or set()) & _KV_SHAPE)
    if getattr(text, "is_heterogeneous", False) and varying:
        raise ValueError(f"{arch}'s layers differ in {', '.join(varying)} (per-layer configs): the KV cache takes one "
                         "page shape for all layers")
    t = text.to_dict()
    for key, why in (("kv_lora_rank", "multi-head latent attention"), ("attention_chunk_size", "chunked local attention")):
        if t.get(key):
            raise ValueError(f"{arch} through the transformers backend: its {why} ({key}) is not supported")
    hidden, heads = text.hidden_size, text.num_attention_heads
    layers = text.num_hidden_layers
    window = getattr(text, "sliding_window", None) or None
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        unknown = sorted({kind for kind in layer_types if kind not in _LAYER_TYPES})
        if unknown:
            raise ValueError(f"{arch} has layers of type {', '.join(map(repr, unknown))}: the transformers backend "
                             f"attends full and sliding attention layers only")
        layer_types = tuple(layer_types[:layers])
        if SLIDING not in layer_types:
            window, layer_types = None, None
        elif window is None:
            raise ValueError(f"{arch} has sliding layers but no sliding_window")
    elif getattr(text, "use_sliding_window", True) is False:
        window = None
    positions = (getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
                 or getattr(text, "max_sequence_length", None) or 2048)
    try:            # a context stretched by rope scaling (YaRN's factor), as the built-in models read it
        theta, scaling = rope_parameters({**raw, "max_position_embeddings": positions})
        max_len = scaling.stretched_len(positions)
    except (ValueError, KeyError, TypeError):      # a rope type Troupe's own rotary lacks: transformers turns it
        theta, max_len = 10000.0, positions
    eps = getattr(text, "rms_norm_eps", None) or getattr(text, "layer_norm_eps", None) or 1e-6
    images = None if language_model_only or text is hf or encoder else image_token_id(raw, hf)
    if encoder is not None and window is not None:
        raise ValueError(f"{arch}: an encoder's local attention windows through the transformers backend are not "
                         "supported")
    return ArchConfig(
        architecture=TRANSFORMERS_ENCODER if encoder else TRANSFORMERS_BACKEND, encoder_only=encoder is not None,
        vocab_size=text.vocab_size, hidden_size=hidden,
        intermediate_size=getattr(text, "intermediate_size", 0) or 0, num_layers=layers, num_heads=heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_size=getattr(text, "head_dim", None) or hidden // heads, max_model_len=max_len, rope_theta=theta,
        rms_norm_eps=float(eps), tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"), eos_token_ids=_eos_token_ids(raw, generation),
        sliding_window=window, layer_types=layer_types,
        attn_logit_softcapping=getattr(text, "attn_logit_softcapping", None),
        final_logit_softcapping=getattr(text, "final_logit_softcapping", None),
        image_token_id=images, mm_prefix_lm=images is not None and is_mm_prefix_lm(raw))


# -- attention -------------------------------------------------------------------------------------

# the running forward's caches, metadata and number (each forward a new one)
_step: tuple[list[torch.Tensor], AttentionMetadata, int] | None = None
_forwards = itertools.count()


class TransformersAttention(AttentionLayer):
    """The engine's side of one transformers attention module (its ``troupe_attn``): the layer's
    KV cache binding, its window, and what its keys must look like to fit the cache."""

    def __init__(self, backend: AttentionBackend, layer: int, num_kv_heads: int, head_size: int,
                 sliding_window: int | None) -> None:
        super().__init__(backend)
        self.layer, self.num_kv_heads, self.head_size = layer, num_kv_heads, head_size
        self.sliding_window = sliding_window
        self._step_no = -1         # the forward it last attended in (each attends once a forward)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
                sliding_window: int | None, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
        """transformers' (1, H, T, D) q and (1, KVH, T, D) k, v -> its attention output (1, T, H, D)."""
        if _step is None:
            raise RuntimeError("a transformers attention module ran outside TransformersForCausalLM.forward")
        caches, meta, step_no = _step
        if self._step_no == step_no:
            raise ValueError(f"layer {self.layer} attended twice in one forward (a looped or shared layer): the "
                             "transformers backend gives a layer one KV cache write a step")
        self._step_no = step_no
        if key.shape[1] != self.num_kv_heads or key.shape[-1] != self.head_size or value.shape[-1] != self.head_size:
            raise ValueError(f"layer {self.layer}'s keys and values have {key.shape[1]} heads of {key.shape[-1]} and "
                             f"{value.shape[-1]}, where the KV cache was sized for {self.num_kv_heads} heads of "
                             f"{self.head_size} (config.json's num_key_value_heads and head_dim)")
        if (sliding_window or None) != self.sliding_window:
            raise ValueError(f"layer {self.layer} attends within a window of {sliding_window}, where config.json's "
                             f"layer types and sliding_window gave {self.sliding_window}")
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))     # (T, heads, D)
        scale = self.head_size ** -0.5 if scaling is None else float(scaling)
        out = self.attend(q, k, v, caches[self.kv_index], meta, scale, self.sliding_window, softcap or None, sinks)
        return out.unsqueeze(0)


class EncoderAttention(nn.Module):
    """The engine's side of a bidirectional encoder's attention module: each prompt's queries over
    the same prompt's keys (no KV cache: an encoder's prompts come whole)."""

    def __init__(self, layer: int, num_heads: int, head_size: int) -> None:
        super().__init__()
        self.layer, self.num_heads, self.head_size = layer, num_heads, head_size
        self.attention_bfloat16 = False   # set_attention_bfloat16: the CPU's --dtype bfloat16

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
                sliding_window: int | None, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
        from models.layers import encoder_attention, whole_prompts
        if _step is None:
            raise RuntimeError("a transformers attention module ran outside the transformers backend's forward")
        if sliding_window or softcap or sinks is not None:
            raise ValueError(f"encoder layer {self.layer} attends with a window, a softcap or sinks, which the "
                             "transformers backend's encoder attention does not")
        meta = _step[1]
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))     # (T, heads, D)
        scale = q.shape[-1] ** -0.5 if scaling is None else float(scaling)
        out = encoder_attention(q, k, v, whole_prompts(meta, "this encoder"), scale, None, self.attention_bfloat16)
        return out.unsqueeze(0)


def troupe_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, softcap: float | None = None,
                     s_aux: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface function (``attn_implementation="troupe"``): the paged
    attention of the module's layer over the step's KV cache. transformers builds no mask for
    this implementation, so a mask here is one the module made itself (a learned or dynamic one),
    which the paged kernels cannot apply."""
    if attention_mask is not None:
        raise ValueError(f"{type(module).__name__} (layer {module.troupe_attn.layer}) attends under a mask of its own "
                         "making, which the transformers backend's paged attention cannot apply")
    return module.troupe_attn(query, key, value, scaling, sliding_window, softcap, s_aux), None


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_IMPLEMENTATION, troupe_attention)


@functools.cache
def _interface_calls(cls: type) -> int:
    """How many calls ``cls.forward`` makes through transformers' attention interface (a function
    read from ``ALL_ATTENTION_FUNCTIONS``): the modules ``troupe_attention`` serves make one."""
    import ast
    import textwrap
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward))))
    except (OSError, TypeError, SyntaxError):
        return 0
    names = {t.id for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
             and node.value is not None and "ALL_ATTENTION_FUNCTIONS" in ast.unparse(node.value)
             for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
    return sum(isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names
               for node in ast.walk(tree))


def _own_linears(model: nn.Module) -> int:
    """Each ``nn.Linear`` of ``model`` becomes Troupe's ``Linear`` over the same parameters, so the
    worker packs it for the native kernels as it packs its own models' (models/packed.py); returns
    how many."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
                continue
            own = Linear(child.in_features, child.out_features, child.weight.dtype, weight=child.weight)
            own.bias = child.bias
            setattr(module, name, own)
            replaced += 1
    return replaced


def _lora_slices(module: nn.Module, names: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """LoRA's slices of a transformers layer's projections (each its own, unfused): name -> {"": rows}."""
    out = {}
    for name in names:
        layer = getattr(module, name)
        layer = getattr(layer, "linear", layer)          # a row-parallel layer's own
        out[name] = {"": int(getattr(layer, "out_features", None) or layer.weight.shape[0])}
    return out


class _PassThrough(nn.Module):
    """A decoder layer another pipeline stage holds: its input hidden states pass through."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


class _HiddenStates:
    """A base model's output of hidden states alone: the causal LM's forward reads them as
    ``last_hidden_state`` or ``[0]``, and finds any other output it reads (a cache, attentions,
    a multimodal model's image outputs) absent."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.last_hidden_state = hidden

    def __getitem__(self, key: int | str) -> torch.Tensor:
        if key in (0, "last_hidden_state"):
            return self.last_hidden_state
        raise KeyError(key)

    def __getattr__(self, name: str) -> None:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _Decoder(nn.Module):
    """Where the causal LM keeps its decoder stack: the stack itself, or, while ``hidden`` is set,
    the hidden states already computed. The causal LM's own forward then makes the logits of
    those rows with everything it does after the stack (its LM head, a logit scale, a softcap)."""

    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        self.decoder = decoder
        self.hidden: torch.Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.hidden is None:
            return self.decoder(*args, **kwargs)
        return _HiddenStates(self.hidden)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("decoder"), name)


class TransformersForCausalLM(CausalLM):
    """A transformers causal LM whose attention runs over the engine's paged KV cache. The
    checkpoint is read by transformers (``load_checkpoint``), not through a tensor map."""
    hf_tensor_map: ClassVar[TensorMap] = {}
    gguf_tensor_map: ClassVar[TensorMap] = {}
    bidirectional_layers: ClassVar[bool] = False

    intermediate_keys: ClassVar[tuple[str, ...]] = ("hidden_states",)   # between pipeline stages

    def __init__(self, config: ArchConfig, attn_backend: AttentionBackend, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config, self.backend, self.dtype = config, attn_backend, dtype
        self.hf: nn.Module | None = None
        self.vision: nn.Module | None = None     # a multimodal model's base model, when it takes images
        self.start_layer, self.end_layer = 0, config.num_layers     # a pipeline stage's (split_pipeline_stage)

    def load_checkpoint(self, path: str, overrides: dict[str, Any] | None = None) -> None:
        """Build transformers' model of the checkpoint directory ``path`` (config.json with
        ``overrides``, the --hf-overrides), its weights read by transformers, and bind each
        layer's attention module to the engine's KV cache."""
        from transformers.utils import logging as hf_logging

        from models.hf_config import with_overrides
        _register()
        with open(os.path.join(path, "config.json")) as f:
            raw = with_overrides(json.load(f), overrides or {})
        cls, raw = self._hf_class(raw)
        whole = transformers_config(raw)
        attn: str | dict[str, str] = ATTN_IMPLEMENTATION
        if self.config.image_token_id is not None:     # served whole: the encoders attend as transformers does
            hf_config, keys = whole, None
            attn = {key: ATTN_IMPLEMENTATION if getattr(whole, key) is whole.get_text_config() else "sdpa"
                    for key in whole.sub_configs}
            attn[""] = "sdpa"
        else:
            hf_config = _language_model_config(whole)      # a multimodal checkpoint: its language model alone
            keys = LANGUAGE_MODEL_KEYS if hf_config is not whole else None
        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()         # its notes on weights it initialized itself are checked below
        hf_logging.disable_progress_bar()        # the worker logs the load itself
        try:
            hf, info = cls.from_pretrained(path, config=hf_config, dtype=self.dtype, key_mapping=keys,
                                           attn_implementation=attn, output_loading_info=True)
        finally:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()
        if info.get("missing_keys"):
            missing = sorted(info["missing_keys"])
            raise ValueError(f"{cls.__name__}: the checkpoint left {len(missing)} parameters unloaded: {missing[:8]}")
        self.hf = hf.eval()
        if self.config.num_labels:         # the pooler's score head, in float32 (vLLM's head dtype)
            head = hf.score
            self.score = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None,
                                   dtype=torch.float32)
            self.score.load_state_dict({k: v.float() for k, v in head.state_dict().items()})
        linears = _own_linears(hf)
        self._wire(hf)
        self._bind_attention(cls.__name__)
        log.info("%s built by transformers %s (the transformers backend): %d attention layers, %d linear layers "
                 "Troupe's%s", cls.__name__, _transformers_version(), self.config.num_layers, linears,
                 ", image input" if self.vision is not None else "")
        if "cpu" in type(self.backend).devices:
            self._trial_step()

    def _hf_class(self, raw: dict[str, Any]) -> tuple[type, dict[str, Any]]:
        """The transformers class to build and the config.json it is built from: the causal LM, or
        a classifier's (--convert classify: its score head, no LM head)."""
        if self.config.num_labels:
            cls = classifier_class(raw)
            if cls is None:
                raise ValueError(f"model_type {raw.get('model_type')!r} has no sequence classifier in transformers")
            return cls, {**raw, "num_labels": self.config.num_labels}
        cls = image_text_to_text_class(raw) if self.config.image_token_id is not None else causal_lm_class(raw)
        if cls is None:
            raise ValueError(f"model_type {raw.get('model_type')!r} has no causal LM class in transformers")
        return cls, raw

    def _wire(self, hf: nn.Module) -> None:
        """The decoder stack the forward runs, and the causal LM's own forward kept for the logits.
        A multimodal model served whole: its language model is the stack, and its base model
        (vision tower and projector) makes the images' embeddings (``embed_multimodal``)."""
        prefix = hf.base_model_prefix
        base = getattr(hf, prefix)
        self.vision = base if self.config.image_token_id is not None else None
        self.decoder = base.language_model if self.vision is not None else base
        self._hf_decoder_path = next(path for path, m in hf.named_modules() if m is self.decoder)
        setattr(hf, prefix, _Decoder(base))
        params = inspect.signature(self.decoder.forward).parameters
        self._cache_position = "cache_position" in params
        self._lora_targets()

    def _trial_step(self) -> None:
        """One step of two tokens over a scratch cache, so that what the checks of
        ``troupe_attention`` refuse (a layer attending twice, a mask of its own, keys that do not
        fit the cache) stops the start rather than the first request."""
        from kernels.attention import allocate_kv_caches, build_attention_metadata
        caches = allocate_kv_caches(self.config, 2, 16, self.dtype)
        meta = build_attention_metadata([2], [2], [[1]], 16)
        with torch.inference_mode():
            hidden = self(torch.tensor([1, 2]), torch.tensor([0, 1]), caches, meta)
            if not self.config.num_labels:        # (a classifier's head is the pooler's)
                self.compute_logits(hidden)

    def _bind_attention(self, name: str) -> None:
        c = self.config
        found: dict[int, nn.Module] = {}
        for module in self.decoder.modules():
            idx = getattr(module, "layer_idx", None)
            calls = _interface_calls(type(module)) if isinstance(idx, int) else 0
            if not calls:
                continue
            if calls > 1:
                raise ValueError(f"{name}'s layer {idx} ({type(module).__name__}) attends {calls} times over its keys "
                                 "and values (differential attention): the transformers backend gives a layer one "
                                 "KV cache write a step")
            if getattr(module, "is_causal", True) is False:
                raise ValueError(f"{name}'s layer {idx} attends both ways: the transformers backend serves causal "
                                 "attention")
            if idx in found:
                raise ValueError(f"{name}'s layer {idx} attends in two modules, which one KV cache cannot serve")
            found[idx] = module
        missing = [i for i in range(c.num_layers) if i not in found]
        if missing:
            raise ValueError(f"{name}'s layers {missing[:8]} do not attend through transformers' attention "
                             "interface (state-space or linear-attention layers): the transformers backend cannot "
                             "give them a cache")
        for idx in sorted(found):
            attn = TransformersAttention(self.backend, idx, c.num_kv_heads, c.head_size, c.layer_sliding_window(idx))
            attn.kv_index = idx          # cache i is layer i's (the runner binds them again, in the same order)
            found[idx].troupe_attn = attn

    @property
    def layers(self) -> nn.ModuleList:
        """transformers' decoder layers (``num_hidden_layers`` of them, by the base model's
        ``base_model_pp_plan`` or its ``layers``)."""
        plan = getattr(self.hf.config.get_text_config(), "base_model_pp_plan", None) or {}
        names = [n for n in plan if isinstance(getattr(self.decoder, n, None), nn.ModuleList)] or ["layers"]
        layers = getattr(self.decoder, names[0], None)
        if not isinstance(layers, nn.ModuleList) or len(layers) != self.config.num_layers:
            raise AttributeError(f"{type(self.hf).__name__} has no list of its {self.config.num_layers} decoder layers")
        return layers

    def split_pipeline_stage(self, pp_size: int, pp_rank: int) -> None:
        """Keep stage ``pp_rank``'s layers of ``pp_size`` (vLLM's split, models/pp_layout.py): the
        others pass their input through, the final norm runs on the last stage only, and a stage
        after the first starts from the previous one's hidden states (as input embeddings)."""
        from models.pp_layout import pp_layers
        try:
            layers = self.layers
        except AttributeError as exc:
            raise ValueError(f"{exc}: the transformers backend cannot cut it into pipeline stages") from None
        if "= decoder_layer(" not in inspect.getsource(inspect.unwrap(type(self.decoder).forward)):
            raise ValueError(f"{type(self.hf).__name__}'s decoder layers do not hand their hidden states on as they "
                             "are: the transformers backend cannot cut it into pipeline stages")
        start, end = pp_layers(len(layers), pp_size, pp_rank)
        for i in range(len(layers)):
            if not start <= i < end:
                layers[i] = _PassThrough()
        if pp_rank < pp_size - 1:
            norm = next((n for n in ("norm", "final_layernorm", "ln_f") if hasattr(self.decoder, n)), None)
            if norm is None:
                raise ValueError(f"{type(self.hf).__name__}: no final norm to leave to the last pipeline stage")
            setattr(self.decoder, norm, nn.Identity())
        for module in self.hf.modules():
            if isinstance(module, TransformersAttention):
                module.kv_index = module.layer - start      # this stage's caches are its own layers'
        self.start_layer, self.end_layer = start, end

    def shard_tensor_parallel(self, world: int, rank: int, group: Any) -> None:
        """This rank's share of the layers, as the checkpoint's transformers config plans it
        (``base_model_tp_plan``): "colwise" q, k and v projections take the rank's heads (a KV
        head replicated where there are fewer than ranks), "colwise" MLP projections an even run
        of rows, "rowwise" ones the matching columns with their products summed over the ranks;
        per-head norms stay whole. Embeddings and the LM head stay whole on every rank. A plan
        with other styles (experts, gathered outputs) is refused by name."""
        import re

        from models.tensor_parallel import TPShard, column_parallel, row_parallel
        from models.tp_layout import head_split, split
        c, name = self.config, type(self.hf).__name__
        plan = getattr(self.hf.config.get_text_config(), "base_model_tp_plan", None) or {}
        styles = sorted({style for style in plan.values() if style not in _TP_STYLES})
        if styles:
            raise ValueError(f"{name}'s tensor-parallel plan splits by {', '.join(styles)}, which the transformers "
                             "backend does not: serve it without --tensor-parallel-size")
        rules = [(re.compile(re.escape(key).replace(r"\*", r"\d+") + "$"), style) for key, style in plan.items()]
        D = c.head_size
        q0, qn, k0, kn = head_split(c.num_heads, c.num_kv_heads, world, rank)
        heads = {"q_proj": (q0 * D, qn * D), "k_proj": (k0 * D, kn * D), "v_proj": (k0 * D, kn * D),
                 "o_proj": (q0 * D, qn * D)}
        split_heads = collections.Counter()
        for path, module in list(self.decoder.named_modules()):
            style = next((st for pattern, st in rules if pattern.match(path)), None)
            if style is None or style.startswith("replicated"):
                continue
            parent, _, leaf = path.rpartition(".")
            if not isinstance(module, Linear):
                raise ValueError(f"{name}: {path} is planned {style!r} but is not a linear layer")
            owner = self.decoder.get_submodule(parent)
            if style == "colwise":
                rows = heads.get(leaf) or split(module.out_features, world, rank)
                part, share = column_parallel(module, [rows]), TPShard(rows={"": rows})
            else:
                cols = heads.get(leaf) or split(module.in_features, world, rank)
                part, share = row_parallel(module, cols, rank, group), TPShard(cols=cols)
            setattr(owner, leaf, part)
            owner.tp_shards = {**getattr(owner, "tp_shards", {}), leaf: share}     # a LoRA adapter's share
            split_heads[leaf] += leaf in heads
        if any(split_heads[p] != c.num_layers for p in heads):
            raise ValueError(f"{name}'s tensor-parallel plan does not split every layer's q, k, v and o projections "
                             f"({dict(split_heads)}): serve it without --tensor-parallel-size")
        for module in self.hf.modules():
            sinks = getattr(module, "sinks", None)
            if isinstance(sinks, nn.Parameter) and sinks.shape[0] == c.num_heads:
                module.sinks = nn.Parameter(sinks.data[q0:q0 + qn].clone(), requires_grad=False)
            if isinstance(module, TransformersAttention):
                module.num_kv_heads = kn

    def _lora_targets(self) -> None:
        """What LoRA adapts (models/lora_layers.py): each decoder layer's ``self_attn`` and ``mlp``
        projections of PEFT's names, with the adapter's module names mapped onto them."""
        from models.lora import TARGET_MODULES
        prefix = self._hf_decoder_path
        where = next(path for path, m in self.named_modules() if m is self.decoder)
        for path, module in self.decoder.named_modules():
            parts = path.split(".")
            if len(parts) != 3 or not parts[1].isdigit() or parts[2] not in ("self_attn", "mlp"):
                continue
            names = [n for n in TARGET_MODULES if isinstance(getattr(module, n, None), Linear)]
            if names:
                module.lora_slices = functools.partial(_lora_slices, module, tuple(names))
        layers = next((n for n, m in self.decoder.named_children() if isinstance(m, nn.ModuleList)), "layers")
        self.hf_tensor_map = {f"{prefix}.{layers}.{{i}}.{part}.{n}.weight": (f"{where}.{layers}.{{i}}.{part}.{n}.weight",
                                                                              None)
                              for part in ("self_attn", "mlp") for n in TARGET_MODULES}

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf.get_input_embeddings()(input_ids)

    def embed_multimodal(self, modality: str, data: dict[str, Any]) -> torch.Tensor:
        """One image's embeddings (its placeholder tokens, hidden) from what the checkpoint's
        processor made of it (``pixel_values`` and the like, a batch of one), by the model's own
        vision tower and projector (``get_image_features``)."""
        if self.vision is None or modality != "image":
            raise ValueError(f"{type(self.hf).__name__} takes no {modality} input")
        device = self.hf.get_input_embeddings().weight.device
        if "image_embeds" in data:           # given as its embeddings (--enable-mm-embeds)
            return torch.as_tensor(data["image_embeds"], device=device).to(self.dtype)
        kwargs = {key: torch.as_tensor(value, device=device) for key, value in data.items()}
        kwargs["pixel_values"] = kwargs["pixel_values"].to(self.dtype)
        out = self.vision.get_image_features(return_dict=True, **kwargs)
        features = getattr(out, "pooler_output", out)
        if not isinstance(features, torch.Tensor):       # one tensor per image
            features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
        return features.reshape(-1, features.shape[-1])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, intermediate: Any = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The step's tokens (T,) at ``positions`` (T,) as one sequence -> hidden states (T, hidden)."""
        global _step
        kwargs: dict[str, Any] = {"position_ids": positions[None], "use_cache": False, "return_dict": True}
        if self._cache_position:
            kwargs["cache_position"] = positions
        if intermediate is not None:       # a later pipeline stage: the previous stage's hidden states
            kwargs["inputs_embeds"] = intermediate["hidden_states"][None]
        elif inputs_embeds is not None:
            kwargs["inputs_embeds"] = inputs_embeds[None]
        else:
            kwargs["input_ids"] = input_ids[None]
        previous, _step = _step, (kv_caches, meta, next(_forwards))
        try:
            out = self.decoder(**kwargs)
        finally:
            _step = previous
        if self.end_layer < self.config.num_layers:
            return {"hidden_states": out.last_hidden_state[0]}
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (N, vocab) float32 of hidden states (N, hidden), by the causal LM's own forward
        over them (so any logit scale or softcap it applies is applied)."""
        head = getattr(self.hf, self.hf.base_model_prefix)
        head.hidden = hidden[None]
        try:
            ids = torch.zeros(1, hidden.shape[0], dtype=torch.long, device=hidden.device)
            logits = self.hf(input_ids=ids, use_cache=False, return_dict=True, logits_to_keep=0).logits
        finally:
            head.hidden = None
        return logits[0].float()


class TransformersEmbeddingModel(TransformersForCausalLM):
    """A bidirectional encoder's base model (DistilBERT, ELECTRA, ALBERT: a bare ``...Model``
    checkpoint without a Troupe class) served as an embedding model: its attention modules take
    each prompt whole, both ways (no KV cache; the engine gives an encoder's prompts whole), its
    last hidden states pooled by the engine (the checkpoint's sentence-transformers pooling)."""
    encoder_only = True         # bind_kv_cache_groups: no layer reads or writes the KV cache

    def _hf_class(self, raw: dict[str, Any]) -> tuple[type, dict[str, Any]]:
        cls = encoder_class(raw)
        if cls is None:
            raise ValueError(f"model_type {raw.get('model_type')!r} has no encoder base model in transformers")
        if self.config.num_labels:
            raise ValueError(f"{cls.__name__} through the transformers backend embeds; its classifiers need one of "
                             "Troupe's own encoder architectures")
        return cls, raw

    def _bind_attention(self, name: str) -> None:
        # (a module may serve several layers, as ALBERT's one shared layer: an encoder keeps no cache)
        found = [m for m in self.hf.modules() if _interface_calls(type(m))]
        if not found or any(getattr(m, "is_causal", False) for m in found):
            raise ValueError(f"{name}: its layers do not attend both ways through transformers' attention interface")
        for i, module in enumerate(found):
            module.troupe_attn = EncoderAttention(i, self.config.num_heads, self.config.head_size)

    def _wire(self, hf: nn.Module) -> None:
        embeddings = getattr(hf, "embeddings", None)
        if getattr(embeddings, "padding_idx", None) is not None:
            raise ValueError(f"{type(hf).__name__} numbers its positions after its padding index (RoBERTa's): the "
                             "transformers backend does not")
        self.decoder = hf
        params = inspect.signature(hf.forward).parameters
        self._cache_position = False
        self._token_types = "token_type_ids" in params

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, intermediate: Any = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The step's whole prompts (T,) at their positions, as one sequence -> hidden states (T, hidden)."""
        global _step
        if intermediate is not None:
            raise ValueError("an encoder runs in one pipeline stage")
        kwargs: dict[str, Any] = {"position_ids": positions[None], "return_dict": True}
        if inputs_embeds is not None:
            kwargs["inputs_embeds"] = inputs_embeds[None]
        else:
            kwargs["input_ids"] = input_ids[None]
        if self._token_types:         # one segment (an embedding model's text)
            kwargs["token_type_ids"] = torch.zeros_like(positions)[None]
        previous, _step = _step, (kv_caches, meta, next(_forwards))
        try:
            out = self.decoder(**kwargs)
        finally:
            _step = previous
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"{type(self.hf).__name__} is an encoder: it embeds, it generates no tokens")

    def _trial_step(self) -> None:
        from kernels.attention import build_attention_metadata
        with torch.inference_mode():
            self(torch.tensor([1, 2]), torch.tensor([0, 1]), [], build_attention_metadata([2], [2], [[1]], 16))
