"""SamplingParams: everything a request asks of sampling and stopping, the one struct that
carries it from the API (``to_sampling_params`` of the OpenAI request classes, or the offline
API) through the tokenizer, the scheduler and the worker to the sampler
(``SamplingMetadata.from_params``). Names and meanings are vLLM's."""
from __future__ import annotations

from typing import Any, Literal

import msgspec

# vLLM's --logprobs-mode: what the log-probs a request asks for are. "raw_*": the model's own
# distribution, before any processor; "processed_*": the one sampled from (after penalties,
# temperature, truncation); "*_logits": the values before the softmax.
LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
LOGPROBS_MODES: tuple[str, ...] = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, frozen=True):
    """vLLM's structured outputs: exactly one of these constrains what the request generates.
    ``json``: a JSON schema as JSON text; ``json_object``: any JSON object; ``regex``: a regular
    expression the whole output matches; ``choice``: one of these strings; ``grammar``: an EBNF
    (xgrammar's, as GBNF) or Lark grammar."""
    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def kind(self) -> str:
        """Which constraint it is; ValueError unless exactly one is set."""
        kinds = [name for name, on in (("json", self.json is not None), ("json_object", self.json_object),
                                       ("regex", self.regex is not None), ("choice", self.choice is not None),
                                       ("grammar", self.grammar is not None)) if on]
        if len(kinds) != 1:
            raise ValueError(f"give exactly one of json, json_object, regex, choice and grammar, got "
                             f"{', '.join(kinds) or 'none'}")
        return kinds[0]


class SamplingParams(msgspec.Struct, omit_defaults=True):
    max_tokens: int | None = 16          # None: until the end of the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = []            # never generated; the Tokenizer adds their token ids below
    bad_words_token_ids: list[list[int]] = []
    logprobs: int | None = None          # top alternatives per sampled token (0: its own only)
    prompt_logprobs: int | None = None   # the same for every prompt token but the first
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None   # the grammar the output follows
    # arguments for the logits processors plugins add (vLLM's extra_args; the OpenAI field vllm_xargs)
    extra_args: dict[str, Any] | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len); None: the whole prompt
    truncate_prompt_tokens: int | None = None
    # sequences per prompt, for the offline API's results (a served request fans out by its own n,
    # and each engine request samples one sequence)
    n: int = 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class SamplingDefaults(msgspec.Struct, omit_defaults=True, frozen=True):
    """Defaults for the sampling fields a request leaves unset, read from the model's
    generation_config.json (vLLM's --generation-config auto, or a folder's); None: the API's own
    default. ``max_tokens`` is generation_config.json's ``max_new_tokens``."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def as_dict(self) -> dict[str, float | int]:
        return {f: v for f in self.__struct_fields__ if (v := getattr(self, f)) is not None}
