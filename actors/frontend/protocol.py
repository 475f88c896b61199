"""OpenAI (and vLLM) request bodies as msgspec structs: decoding is the first validation, then
``to_sampling_params`` checks ranges and builds the engine's SamplingParams. Field names and
meanings follow the OpenAI API and vLLM's extensions. Optional fields accept JSON null."""
from __future__ import annotations

import logging
import re
from typing import Any, Literal

import msgspec

from actors.engine.sampling_params import SamplingParams

log = logging.getLogger("troupe.http")

MAX_UNKNOWN_FIELDS = 64          # lenient mode drops at most this many before giving up
MAX_N = 128                      # choices per prompt
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_STOP_STRINGS = 64
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
DEFAULT_COMPLETION_MAX_TOKENS = 16     # OpenAI's default for completions


class BadRequest(ValueError):
    """Invalid input: an HTTP 400 naming the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def require(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise BadRequest(message, param)


def or_default(value: Any, default: Any) -> Any:
    return default if value is None else value


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = False


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class GenerationRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What chat and text completion requests share."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = None
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    user: str | None = None
    priority: int | None = None
    bad_words: list[str] | None = None

    def _sampling_params(self, vocab_size: int, max_tokens: int | None, max_tokens_param: str,
                         logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
        """Validate ranges and build the engine's parameters (one choice; see ``for_choice``)."""
        t, p, k = or_default(self.temperature, 1.0), or_default(self.top_p, 1.0), or_default(self.top_k, 0)
        require(0.0 <= t <= 2.0, f"temperature must be in [0, 2], got {t}", "temperature")
        require(0.0 < p <= 1.0, f"top_p must be in (0, 1], got {p}", "top_p")
        require(k >= -1, f"top_k must be -1 or 0 (off) or at least 1, got {k}", "top_k")
        min_p = or_default(self.min_p, 0.0)
        require(0.0 <= min_p <= 1.0, f"min_p must be in [0, 1], got {min_p}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            v = or_default(getattr(self, name), 0.0)
            require(-2.0 <= v <= 2.0, f"{name} must be in [-2, 2], got {v}", name)
        rep = or_default(self.repetition_penalty, 1.0)
        require(0.0 < rep <= 10.0, f"repetition_penalty must be in (0, 10], got {rep}", "repetition_penalty")
        require(max_tokens is None or max_tokens >= 1,
                f"{max_tokens_param} must be at least 1, got {max_tokens}", max_tokens_param)
        min_tokens = or_default(self.min_tokens, 0)
        require(0 <= min_tokens and (max_tokens is None or min_tokens <= max_tokens),
                f"min_tokens must be in [0, max_tokens], got {min_tokens}", "min_tokens")
        if self.seed is not None:
            require(SEED_RANGE[0] <= self.seed <= SEED_RANGE[1] - MAX_N,
                    f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1] - MAX_N}], got {self.seed}", "seed")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        require(all(stop), "stop strings must not be empty", "stop")
        require(len(stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings", "stop")
        stop_ids = list(self.stop_token_ids or [])
        require(all(0 <= t < vocab_size for t in stop_ids),
                f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
        bad_words = list(self.bad_words or [])
        require(all(w.strip() for w in bad_words), "bad_words must not be empty or blank", "bad_words")
        require(len(bad_words) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} bad words", "bad_words")
        return SamplingParams(
            max_tokens=max_tokens, temperature=t, top_p=p, top_k=max(k, 0), min_p=min_p,
            seed=self.seed, stop=stop, stop_token_ids=stop_ids, ignore_eos=bool(self.ignore_eos),
            min_tokens=min_tokens, presence_penalty=or_default(self.presence_penalty, 0.0),
            frequency_penalty=or_default(self.frequency_penalty, 0.0), repetition_penalty=rep,
            logit_bias=_logit_bias(self.logit_bias, vocab_size), logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=or_default(self.skip_special_tokens, True),
            include_stop_str_in_output=bool(self.include_stop_str_in_output), bad_words=bad_words)


class ChatCompletionRequest(GenerationRequest, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None

    def to_sampling_params(self, vocab_size: int) -> SamplingParams:
        """Unset max_completion_tokens / max_tokens: until the end of the context."""
        if self.max_completion_tokens is not None:
            return self._sampling_params(vocab_size, self.max_completion_tokens, "max_completion_tokens",
                                         self.requested_logprobs())
        return self._sampling_params(vocab_size, self.max_tokens, "max_tokens", self.requested_logprobs())

    def requested_logprobs(self) -> int | None:
        """Top alternatives per token, or None when log-probs are not asked for."""
        top = self.top_logprobs
        if top is not None:
            require(0 <= top <= MAX_CHAT_TOP_LOGPROBS,
                    f"top_logprobs must be in [0, {MAX_CHAT_TOP_LOGPROBS}], got {top}", "top_logprobs")
            require(bool(self.logprobs), "top_logprobs needs logprobs set to true", "top_logprobs")
        return (top or 0) if self.logprobs else None


class CompletionRequest(GenerationRequest, kw_only=True):
    prompt: str | list[Any]          # a string, token ids, or a list of either (params.prompts)
    logprobs: int | None = None
    echo: bool | None = False
    add_special_tokens: bool | None = True

    def to_sampling_params(self, vocab_size: int) -> SamplingParams:
        """Unset max_tokens: OpenAI's 16. With ``echo``, the prompt's log-probs too."""
        lp = self.logprobs
        require(lp is None or 0 <= lp <= MAX_COMPLETION_LOGPROBS,
                f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {lp}", "logprobs")
        return self._sampling_params(vocab_size, or_default(self.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS),
                                     "max_tokens", lp, lp if self.echo else None)


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise BadRequest(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        require(0 <= token < vocab_size, f"logit_bias token {token} is not in [0, {vocab_size})",
                "logit_bias")
        require(-100.0 <= value <= 100.0, f"logit_bias values must be in [-100, 100], got {value}",
                "logit_bias")
        out[token] = value
    return out


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's /tokenize: a completion ``prompt`` or chat ``messages`` (exactly one)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None      # default: True for a prompt, False for messages
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    tokens: list[int]


_UNKNOWN = re.compile(r"Object contains unknown field `(.+?)`(?: - at `\$(.*)`)?$")
_PATH_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def decode_body(body: bytes, typ: type, lenient: bool = False) -> Any:
    """Decode a JSON body; a type error names the field (``param``) it is about. ``lenient``
    drops unknown fields (logging each) instead of refusing them."""
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as exc:
        if not (lenient and _UNKNOWN.match(str(exc))):
            raise _bad(exc) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    obj = msgspec.json.decode(body)
    for _ in range(MAX_UNKNOWN_FIELDS):
        try:
            return msgspec.convert(obj, typ)
        except msgspec.ValidationError as exc:
            m = _UNKNOWN.match(str(exc))
            if m is None:
                raise _bad(exc) from None
            container = obj
            for key, index in _PATH_STEP.findall(m.group(2) or ""):
                container = container[key] if key else container[int(index)]
            log.warning("ignoring unknown field `%s%s%s` (--lenient)", (m.group(2) or "").lstrip("."),
                        "." if m.group(2) else "", m.group(1))
            del container[m.group(1)]
    raise BadRequest(f"more than {MAX_UNKNOWN_FIELDS} unknown fields")


def _bad(exc: msgspec.ValidationError) -> BadRequest:
    text, param = str(exc), None
    m = _UNKNOWN.match(text)
    if m is not None:
        param = ((m.group(2) or "").lstrip(".") + "." if m.group(2) else "") + m.group(1)
    elif text.startswith("Object missing required field `") and " - at `$." not in text:
        param = text.split("`")[1]
    elif " - at `$." in text:
        text, _, where = text.partition(" - at `$.")
        param = where.rstrip("`")
    return BadRequest(text, param)
