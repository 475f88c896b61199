"""SamplingParams: everything a request asks of sampling and stopping, the one struct that
carries it from the API (``to_sampling_params`` of the OpenAI request classes, or the offline
API) through the tokenizer, the scheduler and the worker to the sampler
(``SamplingMetadata.from_params``). Names and meanings are vLLM's."""
from __future__ import annotations

import enum
import math
from typing import Any, Literal

import msgspec

from actors.engine.pooling import PoolingParams

# vLLM's --logprobs-mode: what the log-probs a request asks for are. "raw_*": the model's own
# distribution, before any processor; "processed_*": the one sampled from (after penalties,
# temperature, truncation); "*_logits": the values before the softmax.
LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
LOGPROBS_MODES: tuple[str, ...] = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, frozen=True):
    """vLLM's structured outputs: exactly one of these constrains what the request generates.
    ``json``: a JSON schema as JSON text; ``json_object``: any JSON object; ``regex``: a regular
    expression the whole output matches; ``choice``: one of these strings; ``grammar``: an EBNF
    (xgrammar's, as GBNF) or Lark grammar; ``structural_tag``: vLLM's structural tag as JSON text
    (free text in which each tag's content, once a trigger begins it, follows its schema)."""
    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None

    def kind(self) -> str:
        """Which constraint it is; ValueError unless exactly one is set."""
        kinds = [name for name, on in (("json", self.json is not None), ("json_object", self.json_object),
                                       ("regex", self.regex is not None), ("choice", self.choice is not None),
                                       ("grammar", self.grammar is not None),
                                       ("structural_tag", self.structural_tag is not None)) if on]
        if len(kinds) != 1:
            raise ValueError(f"give exactly one of json, json_object, regex, choice, grammar and structural_tag, "
                             f"got {', '.join(kinds) or 'none'}")
        return kinds[0]


class RepetitionDetectionParams(msgspec.Struct, omit_defaults=True, frozen=True, forbid_unknown_fields=True):
    """vLLM's: end the request (finish reason "repetition") once its output ends in a pattern of
    ``min_pattern_size`` (0: 1) to ``max_pattern_size`` tokens repeated ``min_count`` times in a row
    (``max_pattern_size`` 0: off)."""
    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def check(self) -> None:
        if self.max_pattern_size < 0 or self.min_pattern_size < 0 or self.min_pattern_size > self.max_pattern_size:
            raise ValueError("max_pattern_size, min_pattern_size must be >=0, with min_pattern_size <= "
                             "max_pattern_size. Set both to 0 to disable repetitive pattern detection.")
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError("min_count must be >= 2 to detect repetitive patterns in engine output. If you do "
                             "not wish to detect repetitive patterns, set max_pattern_size to 0.")
        lo = max(self.min_pattern_size, 1)
        work = self.min_count * (self.max_pattern_size * (self.max_pattern_size + 1) - lo * (lo - 1)) // 2
        if self.max_pattern_size > 0 and work > MAX_REPETITION_WORK:
            raise ValueError(f"repetition detection would compare {work} tokens at every step: min_count times "
                             f"the sum of the pattern sizes must be at most {MAX_REPETITION_WORK}")

    def repeats(self, tokens: list[int]) -> bool:
        """Whether ``tokens`` end in a repeated pattern of a size in range."""
        count = self.min_count
        if self.max_pattern_size <= 0 or count < 2:
            return False
        for size in range(max(self.min_pattern_size, 1), self.max_pattern_size + 1):
            span = size * count
            if span > len(tokens):
                return False
            tail = tokens[-span:]
            if tail[:-size] == tail[size:]:      # each size-block equals the one after it
                return True
        return False


# the most token comparisons repetition detection may make per request and step
MAX_REPETITION_WORK = 1 << 18

# The engine's messages carry integers as msgspec int64 / uint64 and its tensors as int64: a value
# outside these ranges would fail the encoding or a whole engine step.
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)


class RequestOutputKind(enum.IntEnum):
    """vLLM's: each output of a stream holds everything so far, only what is new, or the stream
    has one output, the finished request."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


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
    # vLLM's: these tokens' log-probs at every position instead of the top alternatives (logprobs set)
    logprob_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None   # the same for every prompt token but the first
    # vLLM's: token ids to score at each prompt row from prompt_logprob_start on (row i predicts
    # prompt token i + 1, so the last row is not scored); -1 pads a row (its score: -inf)
    prompt_logprob_token_ids: list[list[int]] | None = None
    prompt_logprob_start: int | None = None   # the first row scored (None: 0)
    # vLLM's: with --watermark-config, None or True watermarks the sampled tokens, False opts out
    watermarking: bool | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None   # the grammar the output follows
    # arguments for the logits processors plugins add (vLLM's extra_args; the OpenAI field vllm_xargs)
    extra_args: dict[str, Any] | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len); None: the whole prompt
    truncate_prompt_tokens: int | None = None
    # vLLM's: end the request when its output starts repeating a short pattern (finish reason "repetition")
    repetition_detection: RepetitionDetectionParams | None = None
    # vLLM's: at most this many tokens of reasoning (the model's thinking section), then the end of
    # the reasoning is forced (the engine's reasoning config says which tokens); None: no cap
    thinking_token_budget: int | None = None
    # sequences per prompt, for the offline API's results (a served request fans out by its own n,
    # and each engine request samples one sequence)
    n: int = 1
    # vLLM's: what each of AsyncLLM.generate's outputs holds (the offline API's alone reads it)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    detokenize: bool = True              # vLLM's: False, the output is its token ids (text empty)
    # vLLM's: the offline result's logprobs and prompt_logprobs as FlatLogprobs (a few flat lists,
    # not an object per token); the server's JSON is the same either way
    flat_logprobs: bool = False
    skip_reading_prefix_cache: bool | None = None   # vLLM's: True, no prompt block read from the cache
    # vLLM's: an offline stream's output holds at least this many new tokens (None: each step's)
    stream_interval: int | None = None
    spaces_between_special_tokens: bool = True   # vLLM's (its fast tokenizers' decoding ignores it too)
    skip_clone: bool = False             # vLLM's: whether its engine may skip copying the params (never copied here)
    # a pooling model's request (--runner pooling): its prompt is pooled into its answer, and it
    # finishes when the prompt is computed, sampling nothing (actors/engine/pooling.py)
    pooling: PoolingParams | None = None

    def check(self, vocab_size: int, max_logprobs: int) -> None:
        """ValueError naming the first field the engine cannot take (vLLM's checks, and the ranges
        its tensors hold): a value that fails here would otherwise fail a whole engine step, and
        every request in it. ``max_logprobs``: the most log-probs a request may ask for (-1: the
        vocabulary)."""
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(what)

        def finite(value: float, lo: float, hi: float, name: str, lo_open: bool = False) -> None:
            ok = (isinstance(value, (int, float)) and math.isfinite(value)
                  and (lo < value if lo_open else lo <= value) and value <= hi)
            need(ok, f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value!r}")

        def token_ids(ids: Any, name: str) -> None:
            bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
            need(not bad, f"{name} must be token ids in [0, {vocab_size}), got {bad[:5]}")

        need(self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}")
        need(isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature must be a finite number of at least 0, got {self.temperature!r}")
        finite(self.top_p, 0.0, 1.0, "top_p", lo_open=True)
        need(self.top_k in (-1, 0) or 1 <= self.top_k <= vocab_size,
             f"top_k must be -1 or 0 (off) or in [1, {vocab_size}], got {self.top_k}")
        finite(self.min_p, 0.0, 1.0, "min_p")
        finite(self.presence_penalty, -2.0, 2.0, "presence_penalty")
        finite(self.frequency_penalty, -2.0, 2.0, "frequency_penalty")
        finite(self.repetition_penalty, 0.0, 1e6, "repetition_penalty", lo_open=True)
        need(self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1],
             f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed}")
        need(0 <= self.min_tokens and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
             f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        need(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        need(not self.stop or self.detokenize,
             "stop strings are only supported when detokenize is True. Set detokenize=True to use stop.")
        need(self.stream_interval is None or (isinstance(self.stream_interval, int) and self.stream_interval >= 1),
             f"stream_interval must be at least 1, got {self.stream_interval}.")
        token_ids(self.stop_token_ids, "stop_token_ids")
        for key, value in (self.logit_bias or {}).items():
            token_ids([key], "logit_bias keys")
            finite(value, -100.0, 100.0, "logit_bias values")
        if self.allowed_token_ids is not None:
            need(len(self.allowed_token_ids) > 0, "allowed_token_ids must not be empty (None: no restriction)")
            token_ids(self.allowed_token_ids, "allowed_token_ids")
        for ids in self.bad_words_token_ids:
            need(len(ids) > 0, "bad_words_token_ids must not hold an empty list")
            token_ids(ids, "bad_words_token_ids")
        bound = vocab_size if max_logprobs < 0 else max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            need(value is None or 0 <= value <= bound, f"{name} must be in [0, {bound}] (max_logprobs), got {value}")
        if self.logprob_token_ids is not None:
            need(self.logprobs is not None, "when using logprob_token_ids, logprobs must be set")
            need(0 < len(self.logprob_token_ids) <= bound,
                 f"logprob_token_ids must hold 1 to {bound} token ids (max_logprobs), got {len(self.logprob_token_ids)}")
            token_ids(self.logprob_token_ids, "logprob_token_ids")
        if self.prompt_logprob_token_ids is not None:
            widths = {len(row) for row in self.prompt_logprob_token_ids}
            need(len(widths) <= 1 and 0 not in widths,
                 "prompt_logprob_token_ids must be rows of one length, at least 1 (-1 pads a row)")
            token_ids([t for row in self.prompt_logprob_token_ids for t in row if t != -1], "prompt_logprob_token_ids")
        s = self.prompt_logprob_start
        need(s is None or (isinstance(s, int) and not isinstance(s, bool) and s >= 0),
             f"prompt_logprob_start must be a non-negative integer, got {s!r}")
        need(self.truncate_prompt_tokens is None or self.truncate_prompt_tokens == -1
             or self.truncate_prompt_tokens >= 1,
             f"truncate_prompt_tokens must be -1 (the last max_model_len) or at least 1, "
             f"got {self.truncate_prompt_tokens}")
        if self.repetition_detection is not None:
            self.repetition_detection.check()
        b = self.thinking_token_budget
        need(b is None or (isinstance(b, int) and not isinstance(b, bool) and b >= 0),
             f"`thinking_token_budget` must be a non-negative integer or None, got {b!r}")

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per sampled token the request gets: its logprob_token_ids, else the top
        ``logprobs``; None without log-probs."""
        if self.logprobs is None:
            return None
        return len(self.logprob_token_ids) if self.logprob_token_ids else self.logprobs

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
