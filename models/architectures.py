"""The architecture registry: Hugging Face architecture name -> the class that serves it, the one
list of architectures. Entries are "module:Class" imported when a checkpoint first asks for them,
so registering one (a plugin does, in every process) imports neither torch nor the models."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from models.base import CausalLM

_ARCHITECTURES: dict[str, type[CausalLM] | str] = {   # built in: the models/ module of the class of that name
    name: f"models.{module}:{name}" for name, module in (
        ("LlamaForCausalLM", "llama"), ("MistralForCausalLM", "mistral"), ("Qwen2ForCausalLM", "qwen2"),
        ("Qwen3ForCausalLM", "qwen3"), ("Gemma3ForCausalLM", "gemma3"), ("Phi3ForCausalLM", "phi3"),
        ("Qwen3MoeForCausalLM", "qwen3_moe"), ("MixtralForCausalLM", "mixtral"),
        ("GraniteForCausalLM", "granite"), ("SmolLM3ForCausalLM", "smollm3"), ("Gemma2ForCausalLM", "gemma2"),
        ("Olmo2ForCausalLM", "olmo2"), ("Olmo3ForCausalLM", "olmo2"), ("OlmoeForCausalLM", "olmo2"),
        ("GptOssForCausalLM", "gpt_oss"), ("OPTForCausalLM", "layernorm_lm"),
        ("GraniteMoeForCausalLM", "granite"), ("Exaone4ForCausalLM", "olmo2"),
        ("Qwen2MoeForCausalLM", "qwen3_moe"), ("DeepseekV2ForCausalLM", "deepseek"), ("Glm4MoeForCausalLM", "glm"),
        ("DeepseekV3ForCausalLM", "deepseek"),
        ("StableLmForCausalLM", "layernorm_lm"), ("BloomForCausalLM", "layernorm_lm"), ("GPTBigCodeForCausalLM", "layernorm_lm"),
        ("FalconForCausalLM", "layernorm_lm"), ("GPTJForCausalLM", "layernorm_lm"),
        ("MptForCausalLM", "layernorm_lm"), ("MPTForCausalLM", "layernorm_lm"), ("GraniteMoeSharedForCausalLM", "granite"),
        ("GlmForCausalLM", "glm"), ("Glm4ForCausalLM", "glm"), ("GemmaForCausalLM", "gemma2"),
        ("CohereForCausalLM", "cohere"), ("Cohere2ForCausalLM", "cohere"), ("Starcoder2ForCausalLM", "layernorm_lm"),
        ("PhiForCausalLM", "layernorm_lm"), ("GPTNeoXForCausalLM", "layernorm_lm"),
        ("GPT2LMHeadModel", "layernorm_lm"), ("HeliumForCausalLM", "llama_variants"),
        ("Ernie4_5ForCausalLM", "llama_variants"), ("Ernie4_5_MoeForCausalLM", "llama_variants"), ("SeedOssForCausalLM", "llama_variants"),
        ("MinistralForCausalLM", "llama_variants"),
        # any causal LM transformers implements, through its modeling code (--model-impl transformers)
        ("TransformersForCausalLM", "transformers_backend"), ("TransformersEmbeddingModel", "transformers_backend"),
        # state-space models (a recurrent state per request, no KV cache)
        ("MambaForCausalLM", "mamba"), ("FalconMambaForCausalLM", "mamba"), ("Mamba2ForCausalLM", "mamba"),
        ("GraniteMoeHybridForCausalLM", "mamba"), ("BambaForCausalLM", "mamba"), ("JambaForCausalLM", "mamba"),
        ("NemotronHForCausalLM", "nemotron_h"), ("Lfm2ForCausalLM", "lfm2"), ("Qwen3NextForCausalLM", "qwen3_next"),
        ("Qwen3_5ForCausalLM", "qwen3_next"), ("Qwen3_5MoeForCausalLM", "qwen3_next"),
        ("Qwen3_5ForConditionalGeneration", "qwen3_next"), ("Qwen3_5MoeForConditionalGeneration", "qwen3_next"),
        # multimodal checkpoints: their language model, on text (vLLM's --language-model-only)
        ("Gemma3ForConditionalGeneration", "gemma3"), ("Mistral3ForConditionalGeneration", "mistral"),
        ("Qwen2VLForConditionalGeneration", "qwen2"), ("Qwen2_5_VLForConditionalGeneration", "qwen2"),
        ("Qwen3VLForConditionalGeneration", "qwen3"), ("LlavaForConditionalGeneration", "llama"),
        ("Qwen2AudioForConditionalGeneration", "qwen2"), ("GlmAsrForConditionalGeneration", "llama"),
        ("AudioFlamingo3ForConditionalGeneration", "qwen2"),
        # encoder-only models (bidirectional attention): embedding models and cross-encoders
        ("BertModel", "bert"), ("BertForSequenceClassification", "bert"), ("RobertaModel", "bert"),
        ("RobertaForSequenceClassification", "bert"), ("XLMRobertaModel", "bert"),
        ("XLMRobertaForSequenceClassification", "bert"), ("ModernBertModel", "modernbert"),
        ("ModernBertForSequenceClassification", "modernbert"), ("BertForTokenClassification", "bert"),
        ("RobertaForTokenClassification", "bert"), ("XLMRobertaForTokenClassification", "bert"),
        ("ModernBertForTokenClassification", "modernbert"), ("NomicBertModel", "bert_rope"), ("GteNewModel", "bert_rope"),
        ("GteModel", "bert_rope"), ("GteNewForSequenceClassification", "bert_rope"), ("HF_ColBERT", "bert"), ("BertSpladeSparseEmbeddingModel", "bert"), ("BgeM3EmbeddingModel", "bert"),
        ("RobertaForMaskedLM", "bert"),
        ("ColBERTModernBertModel", "modernbert"))}
BUILTIN_ARCHITECTURES = tuple(_ARCHITECTURES)
# multimodal architectures whose language model may be of several kinds: those Troupe's class
# serves (text_config's model_type); the transformers backend serves the others whole (``auto``)
TEXT_MODEL_TYPES: dict[str, tuple[str, ...]] = {"LlavaForConditionalGeneration": ("llama",)}


def own_text_model(raw: dict) -> bool:
    """Whether Troupe's class of a config.json's one architecture serves its language model's kind."""
    archs = raw.get("architectures") or []
    kinds = TEXT_MODEL_TYPES.get(archs[0]) if len(archs) == 1 else None
    text = raw.get("text_config")
    return kinds is None or (text or {}).get("model_type", kinds[0]) in kinds
TRANSFORMERS_BACKEND = "TransformersForCausalLM"    # transformers' modeling code (vLLM's name for the class)
TRANSFORMERS_ENCODER = "TransformersEmbeddingModel"  # the same for a bidirectional encoder (vLLM's name)
TRANSFORMERS_BACKENDS = (TRANSFORMERS_BACKEND, TRANSFORMERS_ENCODER)
# model types whose language model attends both ways among an image's tokens (vLLM's is_mm_prefix_lm list)
PREFIX_LM_TYPES = ("bagel", "gemma3", "molmo2", "moondream3", "paligemma")


def is_mm_prefix_lm(raw: dict) -> bool:
    """Whether a multimodal config.json's image positions attend to each other both ways (vLLM's
    rule: its ``is_mm_prefix_lm``, else its list of model types)."""
    if "is_mm_prefix_lm" in raw:
        return bool(raw["is_mm_prefix_lm"])
    return raw.get("model_type") in PREFIX_LM_TYPES
# config.json names served only under another (vLLM's overrides): what the refusal of each says
RENAMED_ARCHITECTURES: dict[str, str] = {
    "BertForMaskedLM": "a SPLADE checkpoint (a BERT masked LM) is served as vLLM serves it, with "
                       "--hf-overrides '{\"architectures\": [\"BertSpladeSparseEmbeddingModel\"]}'",
    "NewModel": "a GTE v1.5 checkpoint (model_type 'new') is served as vLLM serves it, with "
                "--hf-overrides '{\"architectures\": [\"GteNewModel\"]}'"}
# transformers' bare decoder stacks (a checkpoint of the model without its LM head, as embedding
# models are saved) and sequence classifiers: served as pooling models by the causal LM class of
# the same layers
BARE_MODELS: dict[str, str] = {
    "LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM", "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM", "Gemma3TextModel": "Gemma3ForCausalLM", "Phi3Model": "Phi3ForCausalLM",
    "Qwen3MoeModel": "Qwen3MoeForCausalLM", "MixtralModel": "MixtralForCausalLM", "GraniteModel": "GraniteForCausalLM",
    "SmolLM3Model": "SmolLM3ForCausalLM", "Gemma2Model": "Gemma2ForCausalLM", "Olmo2Model": "Olmo2ForCausalLM",
    "Olmo3Model": "Olmo3ForCausalLM", "OlmoeModel": "OlmoeForCausalLM", "GlmModel": "GlmForCausalLM",
    "Glm4Model": "Glm4ForCausalLM", "GemmaModel": "GemmaForCausalLM",
    "CohereModel": "CohereForCausalLM", "Cohere2Model": "Cohere2ForCausalLM",
    "Starcoder2Model": "Starcoder2ForCausalLM", "PhiModel": "PhiForCausalLM",
    "GPTNeoXModel": "GPTNeoXForCausalLM", "GPT2Model": "GPT2LMHeadModel",
    "HeliumModel": "HeliumForCausalLM", "Ernie4_5Model": "Ernie4_5ForCausalLM", "SeedOssModel": "SeedOssForCausalLM",
    "MinistralModel": "MinistralForCausalLM",
    # transformers' sequence and token classifiers: the same stack and a ``score`` head (--convert classify)
    **{f"{name}For{kind}Classification": f"{name}ForCausalLM" for kind in ("Sequence", "Token") for name in (
        "Llama", "Mistral", "Qwen2", "Qwen3", "Phi3", "Qwen3Moe", "Mixtral", "Gemma2", "Granite", "SmolLM3")},
    "Gemma3TextForSequenceClassification": "Gemma3ForCausalLM",
    # vLLM's reward models: the stack and a score MLP on every token (actors/engine/pooling.py)
    "Qwen2ForRewardModel": "Qwen2ForCausalLM", "Qwen2ForProcessRewardModel": "Qwen2ForCausalLM",
    # Llama's layers attending both ways (NVIDIA's Llama embedding and reranking models, vLLM's names)
    "LlamaBidirectionalModel": "LlamaForCausalLM", "LlamaBidirectionalForSequenceClassification": "LlamaForCausalLM"}
# the bare stacks above whose layers attend both ways (an encoder's: use_bidirectional_attention)
BIDIRECTIONAL_MODELS = ("LlamaBidirectionalModel", "LlamaBidirectionalForSequenceClassification")
# the encoder-only ones: each prompt computed whole (no chunked prefill, no prefix caching), CLS
# pooling by default (vLLM's)
ENCODER_ONLY_ARCHITECTURES = ("BertModel", "BertForSequenceClassification", "RobertaModel",
                              "RobertaForSequenceClassification", "XLMRobertaModel",
                              "XLMRobertaForSequenceClassification", "ModernBertModel",
                              "ModernBertForSequenceClassification", "BertForTokenClassification",
                              "RobertaForTokenClassification", "XLMRobertaForTokenClassification",
                              "ModernBertForTokenClassification", "NomicBertModel", "GteNewModel", "GteModel",
                              "GteNewForSequenceClassification", "HF_ColBERT", "ColBERTModernBertModel",
                              "BertSpladeSparseEmbeddingModel", "RobertaForMaskedLM", "BgeM3EmbeddingModel",
                              *BIDIRECTIONAL_MODELS)
# late-interaction models (ColBERT's): each prompt token's embedding (task token_embed), projected by
# the checkpoint tensor of one of these names, or else by a sentence-transformers Dense folder
LATE_INTERACTION_MODELS: dict[str, tuple[str, ...]] = {
    name: ("linear.weight", "colbert_linear.weight") for name in ("HF_ColBERT", "ColBERTModernBertModel")}


def transformers_bare_model(architecture: str) -> bool:
    """A bare ``...Model`` checkpoint no Troupe class serves: the transformers backend embeds it
    (``--model-impl auto``), pooled by CLS by default as vLLM's transformers backend pools."""
    return (architecture.endswith("Model") and architecture not in _ARCHITECTURES and architecture not in BARE_MODELS
            and architecture not in RENAMED_ARCHITECTURES)


class ModelRegistry:
    """vLLM's ``ModelRegistry``: plugins add architectures here (``troupe.general_plugins``)."""

    @staticmethod
    def register_model(architecture: str, model_cls: type[CausalLM] | str) -> None:
        """Serve checkpoints whose config.json "architectures" names ``architecture`` with
        ``model_cls``: a CausalLM subclass, or "module:Class" imported only when a checkpoint
        needs it. Registering a name again replaces it."""
        if isinstance(model_cls, str) and ":" not in model_cls:
            raise ValueError(f"register_model({architecture!r}, {model_cls!r}): give a class or 'module:Class'")
        if not isinstance(model_cls, (str, type)):
            raise ValueError(f"register_model({architecture!r}, {model_cls!r}): give a class or 'module:Class'")
        _ARCHITECTURES[architecture] = model_cls

    @staticmethod
    def get_supported_archs() -> list[str]:
        return sorted(_ARCHITECTURES)

    @staticmethod
    def is_supported(architecture: str) -> bool:
        return architecture in _ARCHITECTURES

    @staticmethod
    def get_model_class(architecture: str) -> type[CausalLM]:
        """The class of ``architecture`` (imported now if it was registered by name)."""
        from models.base import CausalLM
        entry = _ARCHITECTURES.get(architecture)
        if entry is None:
            raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                             f"{ModelRegistry.get_supported_archs()}")
        if isinstance(entry, str):
            module, _, name = entry.partition(":")
            try:
                entry = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError) as exc:
                raise ValueError(f"architecture {architecture!r}: its class {_ARCHITECTURES[architecture]!r} "
                                 f"cannot be imported ({exc})") from exc
            _ARCHITECTURES[architecture] = entry
        if not (isinstance(entry, type) and issubclass(entry, CausalLM)):
            raise ValueError(f"architecture {architecture!r}: {entry!r} is not a CausalLM subclass (models/base.py)")
        return entry
