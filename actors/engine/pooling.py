"""Pooling models (vLLM's ``--runner pooling``): a request's prompt goes through the model once
and the answer is a vector pooled from its hidden states (an embedding), not generated tokens.
Here: which runner a checkpoint gets (``--runner``, ``--convert``: vLLM's names and defaults),
the pooler's settings (``--pooler-config``, completed from a sentence-transformers checkpoint's
own ``modules.json``), and a request's ``PoolingParams``. The worker pools
(``actors/worker/pooler.py``); the engine carries the params inside the request's
SamplingParams (``SamplingParams.pooling``), so a pooling request takes every path a generating
one does, and finishes when its prompt has been computed."""
from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any, Callable

import msgspec

from models.architectures import (BIDIRECTIONAL_MODELS, ENCODER_ONLY_ARCHITECTURES, LATE_INTERACTION_MODELS,
                                  transformers_bare_model)

log = logging.getLogger("troupe.engine")

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify", "reward")
SEQ_POOLING_TYPES = ("CLS", "LAST", "MEAN")      # one vector per prompt
TOK_POOLING_TYPES = ("ALL", "STEP")              # one vector per prompt token
POOLING_TASKS = ("embed", "token_embed", "classify", "token_classify", "embed&token_classify")
CONVERT_TASKS = {"embed": ("embed", "token_embed"), "classify": ("classify",)}   # what each conversion serves
ACTIVATIONS = ("sigmoid", "softmax", "identity", "auto")   # auto: sigmoid for one score a row, else softmax
# vLLM's reward models: (their labels, their token pooling): a score MLP on every token's hidden
# state (task token_classify); a process reward model's default pooling keeps the rows of the
# step tag's tokens (STEP, with the pooler config's step_tag_id and returned_token_ids)
REWARD_MODELS: dict[str, tuple[int, str]] = {"Qwen2ForRewardModel": (1, "ALL"),
                                             "Qwen2ForProcessRewardModel": (2, "STEP")}
# a cross-encoder's activation as sentence-transformers names it (config.json), and what it is here
_ST_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "identity",
                   "torch.nn.modules.activation.Softmax": "softmax"}

# vLLM's: the runner and conversion a checkpoint's architecture name implies, by its suffix
_SUFFIX_DEFAULTS = (
    ("ForCausalLM", ("generate", "none")), ("ForConditionalGeneration", ("generate", "none")),
    ("ChatModel", ("generate", "none")), ("LMHeadModel", ("generate", "none")),
    ("ForTextEncoding", ("pooling", "embed")), ("EmbeddingModel", ("pooling", "embed")),
    ("ForSequenceClassification", ("pooling", "classify")), ("ForTokenClassification", ("pooling", "classify")),
    ("ClassificationModel", ("pooling", "classify")), ("ForRewardModeling", ("pooling", "embed")),
    ("RewardModel", ("pooling", "embed")), ("Model", ("pooling", "embed")),
    ("ForMaskedLM", ("pooling", "embed")))       # RobertaForMaskedLM: its stack's embeddings (vLLM's registry)

# sentence-transformers' module types (its old and new paths), as vLLM reads them
_ST_POOLING = ("sentence_transformers.models.Pooling",
               "sentence_transformers.sentence_transformer.modules.pooling.Pooling")
_ST_NORMALIZE = ("sentence_transformers.models.Normalize", "sentence_transformers.base.modules.normalize.Normalize",
                 "sentence_transformers.sentence_transformer.modules.normalize.Normalize")
_ST_DENSE = ("sentence_transformers.models.Dense", "sentence_transformers.base.modules.dense.Dense",
             "sentence_transformers.sentence_transformer.modules.dense.Dense", "pylate.models.Dense.Dense")
# a Dense layer's activation as sentence-transformers names it (torch.nn.modules.X.Name), vLLM's names
DENSE_ACTIVATIONS = ("identity", "tanh", "relu", "sigmoid", "silu", "swish", "gelu", "gelu_pytorch_tanh",
                     "gelu_new", "gelu_fast", "quick_gelu")


class PoolerConfig(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """vLLM's ``--pooler-config`` (its JSON keys). ``pooling_type`` fills ``seq_pooling_type``
    (CLS, LAST, MEAN) or ``tok_pooling_type`` (ALL); ``use_activation``: the embedding
    normalized (None: yes); ``dimensions``: a default Matryoshka size for requests that give
    none. ``enable_chunked_processing``: an embeddings request's prompt longer than the context
    is embedded in pieces of max_model_len tokens, their vectors averaged by their tokens
    (vLLM's long-text embedding); ``max_embed_len``: the most tokens such a prompt may have
    (None: no bound; without chunking, the bound below max_model_len)."""
    task: str | None = None
    pooling_type: str | None = None
    seq_pooling_type: str | None = None
    tok_pooling_type: str | None = None
    use_activation: bool | None = None
    dimensions: int | None = None
    enable_chunked_processing: bool = False
    max_embed_len: int | None = None
    enable_flash_late_interaction: bool = True
    logit_mean: float | None = None
    logit_sigma: float | None = None
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None

    def check(self) -> PoolerConfig:
        """The config with ``pooling_type`` resolved; ValueError naming what it cannot take."""
        p = self
        if p.pooling_type is not None:
            if p.seq_pooling_type is not None:
                raise ValueError("Cannot set both `pooling_type` and `seq_pooling_type`")
            if p.tok_pooling_type is not None:
                raise ValueError("Cannot set both `pooling_type` and `tok_pooling_type`")
            kind = p.pooling_type.upper()
            if kind in SEQ_POOLING_TYPES:
                p = msgspec.structs.replace(p, seq_pooling_type=kind)
            elif kind in TOK_POOLING_TYPES:
                p = msgspec.structs.replace(p, tok_pooling_type=kind)
            else:
                raise ValueError(f"pooling_type {p.pooling_type!r} is not one of "
                                 f"{', '.join(SEQ_POOLING_TYPES + TOK_POOLING_TYPES)}")
        if p.seq_pooling_type is not None and p.seq_pooling_type.upper() not in SEQ_POOLING_TYPES:
            raise ValueError(f"seq_pooling_type {p.seq_pooling_type!r} is not one of {', '.join(SEQ_POOLING_TYPES)}")
        if p.tok_pooling_type is not None and p.tok_pooling_type.upper() not in TOK_POOLING_TYPES:
            raise ValueError(f"tok_pooling_type {p.tok_pooling_type!r} is not one of {', '.join(TOK_POOLING_TYPES)}")
        if p.logit_sigma == 0:
            raise ValueError("logit_sigma cannot be 0 (division by zero)")
        if p.max_embed_len is not None and p.max_embed_len < 1:
            raise ValueError(f"pooler_config.max_embed_len must be at least 1, got {p.max_embed_len}")
        if p.dimensions is not None and p.dimensions < 1:
            raise ValueError(f"pooler_config.dimensions must be at least 1, got {p.dimensions}")
        return msgspec.structs.replace(
            p, pooling_type=None,
            seq_pooling_type=p.seq_pooling_type.upper() if p.seq_pooling_type else None,
            tok_pooling_type=p.tok_pooling_type.upper() if p.tok_pooling_type else None)


class DenseLayer(msgspec.Struct, frozen=True, kw_only=True):
    """One of a sentence-transformers checkpoint's Dense projections after its pooling (vLLM's
    ST projector): ``in_features`` -> ``out_features``, with a bias or not, then ``activation``
    (one of DENSE_ACTIVATIONS); its weights in the file ``weights`` (safetensors or a torch
    pickle)."""
    in_features: int
    out_features: int
    bias: bool = True
    activation: str = "identity"
    weights: str = ""
    key: str = ""              # its weight's tensor name in that file ("": linear.weight, weight or dense.weight)


class TokenHead(msgspec.Struct, frozen=True, kw_only=True):
    """A model's own head of a per-token task (BGE-M3's): ``layer`` on each prompt token's hidden
    state, the first token left out when it is ``drop_first`` and the last when it is
    ``drop_last``; then, with use_activation, ``activation`` ("normalize": each row L2-normalized;
    "relu")."""
    task: str
    layer: DenseLayer
    activation: str
    drop_first: int | None = None
    drop_last: int | None = None


class PoolingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """vLLM's ``PoolingParams``: what a pooling request asks. ``task``: "embed" (one vector for
    the prompt), "token_embed" (one per prompt token) or a classifier's "classify" (its labels'
    scores); ``dimensions``: keep the first d (a Matryoshka model's); ``use_activation``:
    L2-normalize an embedding, put a classifier's scores through its activation (None: the
    pooler's default, yes).
    ``pooling_type`` is the engine's, resolved from the server's pooler config
    (``ModelPooling.params``): how the worker pools."""
    task: str | None = None              # None: the model's (--pooler-config's task, else its first)
    dimensions: int | None = None
    use_activation: bool | None = None
    pooling_type: str = ""
    # STEP pooling (a process reward model's): the rows of the prompt tokens equal to step_tag_id
    # (None: every row), their columns returned_token_ids (None: all); unset, the pooler config's
    step_tag_id: int | None = None
    returned_token_ids: tuple[int, ...] | None = None
    # a text pair read by an encoder with token types (BERT's cross-encoders): the position from
    # which the prompt's tokens are of type 1, the second text's (vLLM's extra_kwargs
    # "compressed_token_type_ids"); None: every token of type 0
    compressed_token_type_ids: int | None = None

    @property
    def needs_all_positions(self) -> bool:
        """Whether every prompt position's hidden state is pooled (so none may come from the
        prefix cache: a cached block's hidden states were never kept)."""
        return self.pooling_type != "LAST"


class ModelPooling(msgspec.Struct, frozen=True, kw_only=True):
    """A pooling model's resolved settings: the conversion (vLLM's ``convert_type``), the
    pooler's config, and the model's Matryoshka sizes (config.json's ``is_matryoshka`` /
    ``matryoshka_dimensions``). A classifier (``convert`` "classify"): its labels (config.json's
    ``id2label``, in order), the activation of its scores (vLLM's rule, as transformers' loss:
    ``problem_type``, a cross-encoder's sentence-transformers activation, else sigmoid for one
    label and softmax for more) and whether a scored pair is encoded as the tokenizer encodes a
    text pair (``use_sep_token``, vLLM's) or as the two texts joined."""
    convert: str = "embed"
    pooler: PoolerConfig = PoolerConfig()
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    labels: tuple[str, ...] = ()
    activation: str = "softmax"
    use_sep_token: bool = True
    # a token classifier (...ForTokenClassification): labels per prompt token (task token_classify),
    # its head with a bias (config.json's token_classification_bias, transformers' default true)
    per_token: bool = False
    head_bias: bool = False
    # vLLM's classifier_from_token: a causal LM's head rows made the score head (the token ids, in
    # config.json's order); with one label, two tokens give row[second] - row[first] (vLLM's
    # from_2_way_softmax: Qwen3-Reranker); otherwise each token's row is a label's (no_post_processing)
    score_from_tokens: tuple[int, ...] = ()
    # Cohere's input_type (/v2/embed): each type's instruction put before its texts (config.json's
    # task_instructions, else config_sentence_transformers.json's prompts; vLLM's)
    task_instructions: tuple[tuple[str, str], ...] = ()
    # a reward model's score head is an MLP (hidden -> hidden, ReLU, -> labels; REWARD_MODELS),
    # applied before STEP pooling picks its columns
    score_mlp: bool = False
    # a sentence-transformers checkpoint's Dense projections of the pooled vector, in order
    dense: tuple[DenseLayer, ...] = ()
    # a model of several heads (BGE-M3's): its tasks, in place of its conversion's, and the heads
    # of its per-token ones
    own_tasks: tuple[str, ...] = ()
    token_heads: tuple[TokenHead, ...] = ()

    def embedding_size(self, hidden_size: int) -> int:
        """An embedding's size: the last Dense projection's, else the model's hidden size."""
        return self.dense[-1].out_features if self.dense else hidden_size

    @property
    def tasks(self) -> tuple[str, ...]:
        if self.own_tasks:
            return self.own_tasks
        return ("token_classify",) if self.per_token else CONVERT_TASKS[self.convert]

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def params(self, params: PoolingParams | None, hidden_size: int) -> PoolingParams:
        """``params`` checked and completed (vLLM's ``PoolingParams.verify``): the pooler's
        defaults for what it leaves unset, the pooling type its task uses; ValueError, in
        vLLM's words, for what this model cannot do."""
        params = params or PoolingParams()
        if params.task is None:
            params = msgspec.structs.replace(params, task=self.pooler.task or self.tasks[0])
        if params.task not in POOLING_TASKS:
            raise ValueError(f"Unknown pooling task: {params.task!r}")
        if params.task not in self.tasks:
            raise ValueError(f"Task {params.task} is not supported by this model (it supports "
                             f"{', '.join(self.tasks)})")
        p = self.pooler
        dims = params.dimensions if params.dimensions is not None else p.dimensions
        use = params.use_activation if params.use_activation is not None else p.use_activation
        hidden_size, model_hidden = self.embedding_size(hidden_size), hidden_size
        if params.dimensions is not None:
            if not self.is_matryoshka:
                raise ValueError(f"Model does not support Matryoshka embeddings; dimensions must be unset "
                                 f"(received dimensions={params.dimensions}).")
            if not 1 <= params.dimensions <= hidden_size:
                raise ValueError(f"Model only supports dimensions in range [1, {hidden_size}], "
                                 f"got {params.dimensions}.")
            if self.matryoshka_dimensions and params.dimensions not in self.matryoshka_dimensions:
                raise ValueError(f"Model only supports Matryoshka dimensions {list(self.matryoshka_dimensions)}, "
                                 f"got {params.dimensions}.")
        per_token = params.task in ("token_embed", "token_classify")
        kind = (p.tok_pooling_type or "ALL") if per_token else (p.seq_pooling_type or "LAST")
        step_tag, returned = params.step_tag_id, params.returned_token_ids
        if kind == "STEP":
            step_tag = p.step_tag_id if step_tag is None else step_tag
            returned = p.returned_token_ids if returned is None else returned
            # a reward model's columns are its labels (picked after its head); otherwise, as vLLM
            # pools, the hidden state's, before the head
            columns = self.num_labels if self.score_mlp else model_hidden
            if returned is not None:
                returned = tuple(int(t) for t in returned)
                if not all(0 <= t < columns for t in returned):
                    raise ValueError(f"returned_token_ids must be in [0, {columns}), got {list(returned)}")
        elif step_tag is not None or returned is not None:
            valid = ["dimensions", "use_activation"] if "embed" in params.task else ["use_activation"]
            given = [k for k, v in (("step_tag_id", step_tag), ("returned_token_ids", returned)) if v is not None]
            raise ValueError(f"Task {params.task} only supports {valid} parameters, does not support {given} "
                             "parameters")
        return PoolingParams(task=params.task, dimensions=dims if "classify" not in params.task else None,
                             use_activation=True if use is None else use, pooling_type=kind,
                             step_tag_id=step_tag, returned_token_ids=returned,
                             compressed_token_type_ids=params.compressed_token_type_ids)


def embed_lens(pooling: ModelPooling | None) -> tuple[int | None, int | None]:
    """The Tokenizer's bounds on a pooling prompt: (max_embed_len, the bound on a prompt
    rendered whole to be embedded in pieces: max_embed_len, or sys.maxsize, with
    enable_chunked_processing; None without)."""
    if pooling is None:
        return None, None
    p = pooling.pooler
    return p.max_embed_len, (p.max_embed_len or sys.maxsize) if p.enable_chunked_processing else None


def default_runner(architecture: str) -> tuple[str, str]:
    """vLLM's (runner, convert) for an architecture name, by its suffix (a late-interaction
    model's, whatever its name: pooling)."""
    if architecture in LATE_INTERACTION_MODELS:
        return "pooling", "embed"
    for suffix, defaults in _SUFFIX_DEFAULTS:
        if architecture.endswith(suffix):
            return defaults
    return "generate", "none"


def resolve_runner(architecture: str, runner: str, convert: str) -> tuple[str, str]:
    """(runner, convert) as vLLM resolves ``--runner`` and ``--convert`` for a checkpoint of
    ``architecture``; ValueError, in vLLM's words, for a pair it cannot serve."""
    if runner not in RUNNERS:
        raise ValueError(f"--runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"--convert must be one of {', '.join(CONVERTS)}, got {convert!r}")
    native_runner, native_convert = default_runner(architecture)
    if architecture in REWARD_MODELS and runner != "generate":      # a pooling model with a head of its own
        if convert not in ("auto", "none", "classify"):
            raise ValueError(f"{architecture} is a reward model: it scores every token with its own head "
                             f"(task token_classify); --convert {convert} does not apply to it")
        return "pooling", "classify"
    if runner == "auto":
        runner = native_runner if convert in ("auto", "none") else "pooling"
    if convert == "auto":
        convert = native_convert if runner == native_runner else ("embed" if runner == "pooling" else "none")
    if runner == "generate":
        if native_runner == "pooling":
            raise ValueError(f"Embedding models do not support `--runner generate` ({architecture}). "
                             "Use `--runner pooling` or `--runner auto` for embedding models.")
        if convert != "none":
            raise ValueError(f"--convert {convert} makes a pooling model: it goes with --runner pooling")
        return runner, convert
    if convert == "none":
        raise ValueError(f"This model does not support `--runner pooling` as it is ({architecture}). "
                         "You can pass `--convert embed` to adapt it into a pooling model.")
    if convert not in CONVERT_TASKS:
        raise ValueError(f"--convert {convert} ({architecture}) is not supported yet: pooling models serve "
                         "embeddings (--convert embed) and classifiers (--convert classify)")
    return runner, convert


def pooler_config(value: dict[str, Any] | str | PoolerConfig | None) -> PoolerConfig | None:
    """vLLM's --pooler-config: JSON text, a dict (the offline API's), or the struct."""
    if value is None or isinstance(value, PoolerConfig):
        return value.check() if value is not None else None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--pooler-config takes a JSON object, got {value!r} ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"--pooler-config takes a JSON object, got {value!r}")
    if "normalize" in value:
        raise ValueError("Parameter `normalize` was removed; use `use_activation` instead.")
    try:
        return msgspec.convert(value, PoolerConfig).check()
    except msgspec.ValidationError as exc:
        raise ValueError(f"--pooler-config: {exc}") from None


def sentence_transformers_pooling(path: str) -> dict[str, Any]:
    """A sentence-transformers checkpoint's pooling (its ``modules.json`` and the Pooling
    module's ``config.json``) as pooler-config fields, as vLLM reads them: the pooling type,
    and ``use_activation`` from whether it normalizes. {} for another checkpoint."""
    modules = _st_modules(path)
    types = [m.get("type") for m in modules]
    pooling = next((m for m in modules if m.get("type") in _ST_POOLING), None)
    if pooling is None:
        return {}
    found: dict[str, Any] = {"use_activation": any(t in _ST_NORMALIZE for t in types)}
    pooling_file = os.path.join(path, pooling.get("path", ""), "config.json")
    settings = {}
    if os.path.isfile(pooling_file):
        with open(pooling_file) as f:
            settings = json.load(f)
    for key, value in settings.items():
        if key == "pooling_mode" and isinstance(value, str):
            name = value
        elif value is True:
            name = key
        else:
            continue
        name = name.replace("pooling_mode_", "").split("_", 1)[0]
        kind = "LAST" if "lasttoken" in name else name.upper()
        if kind in SEQ_POOLING_TYPES:
            found["seq_pooling_type"] = kind
        elif kind in TOK_POOLING_TYPES:
            found["tok_pooling_type"] = kind
    if "seq_pooling_type" not in found and "tok_pooling_type" not in found:
        log.warning("could not tell the sentence-transformers pooling type from %s; the model's default "
                    "(LAST) is used unless --pooler-config says", pooling_file)
    return found


def _st_modules(path: str) -> list[dict[str, Any]]:
    """A sentence-transformers checkpoint's modules (modules.json), [] for another checkpoint."""
    modules_file = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_file):
        return []
    with open(modules_file) as f:
        modules = json.load(f)
    if isinstance(modules, dict):
        modules = modules.get("modules", [])
    return [m for m in modules if isinstance(m, dict)]


def dense_activation(name: str | None) -> str:
    """A Dense layer's activation_function (sentence-transformers' torch class path, or a
    name) as one of DENSE_ACTIVATIONS; ValueError for another, in vLLM's words."""
    if not name:
        return "identity"
    name = name.lower()
    if name.startswith("torch.nn.modules."):
        name = name.rsplit(".", 1)[-1]
    if name not in DENSE_ACTIVATIONS:
        raise ValueError(f"Activation function {name!r} is not supported.")
    return name


def sentence_transformers_dense(path: str) -> tuple[DenseLayer, ...]:
    """A sentence-transformers checkpoint's Dense projections after its pooling, in order (each
    module folder's config.json and weights), as vLLM loads them; ValueError naming a folder
    whose weights are missing."""
    layers = []
    for module in _st_modules(path):
        if module.get("type") not in _ST_DENSE:
            continue
        folder = os.path.join(path, module.get("path", ""))
        config_file = os.path.join(folder, "config.json")
        if not os.path.isfile(config_file):
            continue
        with open(config_file) as f:
            config = json.load(f)
        weights = next((os.path.join(folder, name) for name in ("model.safetensors", "pytorch_model.bin")
                        if os.path.isfile(os.path.join(folder, name))), None)
        if weights is None:
            raise ValueError(f"{folder}: the sentence-transformers Dense projection has no weights "
                             "(model.safetensors or pytorch_model.bin)")
        layers.append(DenseLayer(in_features=int(config["in_features"]), out_features=int(config["out_features"]),
                                 bias=bool(config.get("bias", True)),
                                 activation=dense_activation(config.get("activation_function")), weights=weights))
    return tuple(layers)


def model_pooling(user: PoolerConfig | None, convert: str, checkpoint_dir: str | None,
                  hf_config: dict[str, Any], token_id: Callable[[str], int | None] | None = None) -> ModelPooling:
    """A pooling model's settings: the user's pooler config, completed by the checkpoint's
    sentence-transformers modules, then by the model's defaults (LAST pooling for a converted
    decoder, ALL for token embeddings). ``token_id``: the tokenizer's id of a token (for a
    classifier made from its LM head's rows, ``classifier_from_token``)."""
    pooler = user or PoolerConfig()
    found = sentence_transformers_pooling(checkpoint_dir) if checkpoint_dir else {}
    filled = {k: v for k, v in found.items() if getattr(pooler, k) is None}
    if filled:
        pooler = msgspec.structs.replace(pooler, **filled)
    architecture = str((hf_config.get("architectures") or [""])[0])
    reward = REWARD_MODELS.get(architecture)
    # vLLM's defaults: CLS for encoders and for bare models its transformers backend embeds, else LAST
    default_seq = "CLS" if architecture in ENCODER_ONLY_ARCHITECTURES or transformers_bare_model(architecture) else "LAST"
    if architecture == "ModernBertForSequenceClassification":      # its own (vLLM reads it so)
        default_seq = str(hf_config.get("classifier_pooling") or "cls").upper()
    if architecture in BIDIRECTIONAL_MODELS:      # config.json's "pooling", which vLLM requires
        default_seq = bidirectional_pooling(hf_config)
    pooler = msgspec.structs.replace(pooler, seq_pooling_type=pooler.seq_pooling_type or default_seq,
                                     tok_pooling_type=pooler.tok_pooling_type or (reward[1] if reward else "ALL"))
    if architecture == "BgeM3EmbeddingModel" and checkpoint_dir and convert == "embed":
        tasks, heads = bge_m3_heads(checkpoint_dir, hf_config)
        return ModelPooling(convert=convert, pooler=pooler, own_tasks=tasks, token_heads=heads,
                            task_instructions=task_instructions(hf_config, checkpoint_dir))
    dense = sentence_transformers_dense(checkpoint_dir) if checkpoint_dir and convert == "embed" else ()
    if architecture in LATE_INTERACTION_MODELS:      # ColBERT's: token embeddings, through its projection
        pooler = msgspec.structs.replace(pooler, task=pooler.task or "token_embed")
        if checkpoint_dir and convert == "embed":
            dense = checkpoint_projection(checkpoint_dir, LATE_INTERACTION_MODELS[architecture],
                                          int(hf_config["hidden_size"])) or dense
    dims = hf_config.get("matryoshka_dimensions")
    settings = ModelPooling(convert=convert, pooler=pooler,
                            is_matryoshka=bool(dims) or bool(hf_config.get("is_matryoshka", False)),
                            matryoshka_dimensions=tuple(dims) if dims else None,
                            task_instructions=task_instructions(hf_config, checkpoint_dir), dense=dense)
    if convert != "classify":
        return settings
    if reward is not None:          # vLLM's: its labels fixed, their activation by the columns kept
        labels = tuple(f"LABEL_{i}" for i in range(reward[0]))
        return msgspec.structs.replace(settings, labels=labels, per_token=True, head_bias=True, score_mlp=True,
                                       activation=classifier_activation({**hf_config, "num_labels": reward[0]},
                                                                        per_token=True))
    per_token = architecture.endswith("ForTokenClassification")
    if hf_config.get("classifier_from_token"):
        labels, from_tokens = tokens_classifier(hf_config, token_id)
        return msgspec.structs.replace(settings, labels=labels, score_from_tokens=from_tokens,
                                       activation=classifier_activation({**hf_config, "num_labels": len(labels),
                                                                         "id2label": None}),
                                       use_sep_token=bool(hf_config.get("use_sep_token", True)))
    return msgspec.structs.replace(settings, labels=classifier_labels(hf_config), per_token=per_token,
                                   head_bias=per_token and bool(hf_config.get("token_classification_bias", True)),
                                   activation=classifier_activation(hf_config, per_token),
                                   use_sep_token=bool(hf_config.get("use_sep_token", hf_config.get("use_pad_token",
                                                                                                   True))))


def checkpoint_projection(checkpoint_dir: str, names: tuple[str, ...], hidden_size: int) -> tuple[DenseLayer, ...]:
    """A late-interaction model's projection held in its own checkpoint (ColBERT's ``linear``:
    hidden -> its dimension, no bias), as the one Dense layer after pooling; () without one.
    Found from the safetensors files' headers, without reading their tensors."""
    from models.lora import read_safetensors_header
    files = sorted(f for f in os.listdir(checkpoint_dir) if f.endswith(".safetensors"))
    for file in files:
        path = os.path.join(checkpoint_dir, file)
        header = read_safetensors_header(path)
        for name in names:
            key = next((k for k in header if k == name or k.endswith("." + name)), None)
            if key is None:
                continue
            shape = header[key].get("shape", [])
            if len(shape) != 2 or shape[1] != hidden_size:
                raise ValueError(f"{path}: {key} has shape {shape}; a projection of the {hidden_size} hidden "
                                 "features is (dim, hidden)")
            return (DenseLayer(in_features=hidden_size, out_features=int(shape[0]), bias=False, weights=path,
                               key=key),)
    return ()


BGE_M3_FILES = ("colbert_linear.pt", "sparse_linear.pt")


def bge_m3_heads(checkpoint_dir: str, hf_config: dict[str, Any]) -> tuple[tuple[str, ...], tuple[TokenHead, ...]]:
    """BGE-M3's tasks and heads, as vLLM's BgeM3EmbeddingModel serves them: embed, the CLS
    vector; token_embed, its multi-vector (ColBERT) form: colbert_linear.pt (hidden -> hidden)
    on every token but a first BOS, normalized; token_classify, its lexical weights:
    sparse_linear.pt (hidden -> 1) on every token but a first BOS and a last EOS, through relu;
    embed&token_classify, the two joined."""
    missing = [f for f in BGE_M3_FILES if not os.path.isfile(os.path.join(checkpoint_dir, f))]
    if missing:
        raise ValueError(f"BgeM3EmbeddingModel reads {', '.join(BGE_M3_FILES)} beside the checkpoint; "
                         f"{checkpoint_dir} has no {', '.join(missing)}")
    hidden, bos, eos = int(hf_config["hidden_size"]), hf_config.get("bos_token_id"), hf_config.get("eos_token_id")
    colbert = DenseLayer(in_features=hidden, out_features=hidden, weights=os.path.join(checkpoint_dir, BGE_M3_FILES[0]))
    sparse = DenseLayer(in_features=hidden, out_features=1, weights=os.path.join(checkpoint_dir, BGE_M3_FILES[1]))
    return (("embed", "token_embed", "token_classify", "embed&token_classify"),
            (TokenHead(task="token_embed", layer=colbert, activation="normalize", drop_first=bos),
             TokenHead(task="token_classify", layer=sparse, activation="relu", drop_first=bos, drop_last=eos)))


def bidirectional_pooling(hf_config: dict[str, Any]) -> str:
    """A LlamaBidirectional model's pooling type, from its config.json's ``pooling`` (vLLM's
    names and errors)."""
    pooling = hf_config.get("pooling")
    if pooling is None:
        raise ValueError("This bidirectional model requires a 'pooling' field in its HF config (one of 'avg', 'cls', "
                         "'last'), but none was found. Unlike the VL variants, no default is assumed here because "
                         "silently picking a pooling for an embedding model can produce wrong embeddings.")
    kinds = {"avg": "MEAN", "cls": "CLS", "last": "LAST"}
    if pooling not in kinds:
        raise ValueError(f"pool_type {pooling!r} not supported")
    return kinds[pooling]


def task_instructions(hf_config: dict[str, Any], checkpoint_dir: str | None) -> tuple[tuple[str, str], ...]:
    """(input type, instruction) pairs, as vLLM reads them: config.json's ``task_instructions``,
    else a sentence-transformers checkpoint's ``prompts`` (config_sentence_transformers.json)."""
    found = hf_config.get("task_instructions")
    if not (isinstance(found, dict) and found) and checkpoint_dir:
        st_file = os.path.join(checkpoint_dir, "config_sentence_transformers.json")
        if os.path.isfile(st_file):
            with open(st_file) as f:
                found = json.load(f).get("prompts")
    if not isinstance(found, dict):
        return ()
    return tuple((k, v) for k, v in found.items() if isinstance(k, str) and isinstance(v, str))


def tokens_classifier(hf_config: dict[str, Any], token_id: Callable[[str], int | None] | None
                      ) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(labels, token ids) of a classifier made from a causal LM's head rows, as vLLM makes it
    (``classifier_from_token`` with ``method``; ``is_original_qwen3_reranker`` means
    from_2_way_softmax): from_2_way_softmax, one label scored row[true] - row[false] of the two
    tokens (false first, as config.json lists them); no_post_processing, a label per token."""
    tokens = hf_config["classifier_from_token"]
    method = hf_config.get("method") or ("from_2_way_softmax" if hf_config.get("is_original_qwen3_reranker") else None)
    if method not in ("from_2_way_softmax", "no_post_processing"):
        raise ValueError(f"classifier_from_token needs a method: from_2_way_softmax (or is_original_qwen3_reranker) "
                         f"or no_post_processing, got {method!r}")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"classifier_from_token must be a list of tokens, got {tokens!r}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(f"from_2_way_softmax takes two tokens (false, true), got {tokens}")
    if token_id is None:
        raise ValueError("classifier_from_token needs the model's tokenizer")
    ids = []
    for t in tokens:
        i = token_id(t)
        if i is None:
            raise ValueError(f"classifier_from_token {t!r} is not a token of the model's tokenizer")
        ids.append(i)
    if method == "from_2_way_softmax":
        return ("LABEL_0",), tuple(ids)
    return tuple(tokens), tuple(ids)


def classifier_labels(hf_config: dict[str, Any]) -> tuple[str, ...]:
    """A classifier's labels in order: config.json's ``id2label``, else ``num_labels`` of them
    named as transformers names them (LABEL_0, ...); transformers' default is two."""
    id2label = hf_config.get("id2label")
    if isinstance(id2label, dict) and id2label:
        try:
            by_id = {int(k): str(v) for k, v in id2label.items()}
        except ValueError:
            raise ValueError(f"config.json id2label keys must be label ids, got {sorted(id2label)}") from None
        if sorted(by_id) != list(range(len(by_id))):
            raise ValueError(f"config.json id2label must number its labels 0 to {len(by_id) - 1}")
        return tuple(by_id[i] for i in range(len(by_id)))
    n = int(hf_config.get("num_labels", 2))
    if n < 1:
        raise ValueError(f"a classifier needs at least one label, config.json says num_labels {n}")
    return tuple(f"LABEL_{i}" for i in range(n))


def classifier_activation(hf_config: dict[str, Any], per_token: bool = False) -> str:
    """vLLM's (transformers' loss's) activation of a classifier's scores; a token classifier's
    default is "auto" (vLLM's: sigmoid or softmax by the scores a row keeps)."""
    problem = hf_config.get("problem_type") or ""
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification":
        return "sigmoid"
    if problem != "single_label_classification":
        st = hf_config.get("sentence_transformers")
        name = (st.get("activation_fn") if isinstance(st, dict) else None) \
            or hf_config.get("sbert_ce_default_activation_function")
        if name is not None:
            if name not in _ST_ACTIVATIONS:
                raise ValueError(f"the cross-encoder's activation {name!r} is not supported; supported: "
                                 f"{', '.join(_ST_ACTIVATIONS)}")
            return _ST_ACTIVATIONS[name]
    if per_token:
        return "auto"
    return "sigmoid" if len(classifier_labels(hf_config)) < 2 else "softmax"
