"""OpenAI (and vLLM) request bodies as msgspec structs: decoding is the first validation, then
``to_sampling_params`` checks ranges and builds the engine's SamplingParams. Field names and
meanings follow the OpenAI API and vLLM's extensions. Optional fields accept JSON null.

What the server's configuration adds (the bound on log-probs, the generation config's sampling
defaults: ``ServerDefaults``) is attached to a decoded request by the server that decoded it
(``with_server_defaults``); a request without it gets vLLM's defaults."""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import msgspec

from actors.engine.config import DEFAULT_MAX_LOGPROBS, media_io_problem
from actors.engine.sampling_params import SEED_RANGE, RepetitionDetectionParams, SamplingDefaults, SamplingParams
from actors.frontend.structured import Constraint, NotStructured, StructuredOutputsFields, constraint_of
from actors.frontend.tools import Tool, ToolChoice, check_tools, tool_constraint

log = logging.getLogger("troupe.http")

MAX_UNKNOWN_FIELDS = 64
MAX_STREAM_INTERVAL = 1 << 20          # lenient mode drops at most this many before giving up
MAX_N = 128                      # choices per prompt
MAX_STOP_STRINGS = 64
MAX_REQUEST_ID_CHARS = 256      # a client's request_id
# The engine's messages carry integers as msgspec int64 / uint64 and its tensors as int64: a
# value outside these ranges would fail the encoding (a 500) or a whole engine step.
PRIORITY_RANGE = (-(1 << 63), (1 << 63) - 1)
DEFAULT_COMPLETION_MAX_TOKENS = 16     # OpenAI's default for completions


class BadRequest(ValueError):
    """Invalid input: an HTTP 400 naming the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def require(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise BadRequest(message, param)


def require_in(value: float, lo: float, hi: float, param: str, *, lo_open: bool = False) -> None:
    """``value`` in [lo, hi], or (lo, hi] with ``lo_open``. NaN fails every comparison and
    infinities fail a finite bound, so a value that passes is finite."""
    ok = (lo < value if lo_open else lo <= value) and value <= hi
    require(ok, f"{param} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}", param)


def or_default(value: Any, default: Any) -> Any:
    return default if value is None else value


@dataclass(frozen=True, slots=True)
class ServerDefaults:
    """What a server's configuration adds to every request it decodes: the most log-probs a
    request may ask for (--max-logprobs; -1: no bound but the vocabulary) and the defaults of
    sampling fields a request leaves unset (--generation-config)."""
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)

    def logprobs_bound(self, vocab_size: int) -> int:
        return vocab_size if self.max_logprobs < 0 else self.max_logprobs


VLLM_DEFAULTS = ServerDefaults()


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False    # vLLM's: with include_usage, the usage so far in every chunk


class ImageURL(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    detail: str | None = None           # OpenAI's "auto" | "low" | "high": the processor decides the resolution


class InputAudio(msgspec.Struct, forbid_unknown_fields=True):
    """OpenAI's ``input_audio``: an audio file's bytes in base64, and its format."""
    data: str
    format: str = ""                    # "wav", "mp3", ...: the file says its own format, read as it is


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    """A content part: a text, or (for a model that takes images) an image by URL, or (one that
    takes videos) a video by URL, or (one that takes audio) an audio clip, by URL or inline."""
    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None
    video_url: ImageURL | str | None = None
    audio_url: ImageURL | str | None = None
    input_audio: InputAudio | None = None
    audio_embeds: str | None = None     # vLLM's (--enable-mm-embeds): a clip's torch.save'd rows, base64
    # vLLM's (--enable-mm-embeds): a torch.save'd tensor, base64, or (Qwen-VL's) a dict of them (or
    # JSON lists) with the grid: {"image_embeds": ..., "image_grid_thw": ...}
    image_embeds: str | dict[str, Any] | None = None
    video_embeds: str | dict[str, Any] | None = None   # the same for a video: video_embeds, video_grid_thw


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str | dict[str, Any]     # OpenAI: JSON text (tokenizer.chat parses it); vLLM: an object too


class ToolCall(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """OpenAI's message; ``params.chat_messages`` checks what the types cannot (content is
    required but for an assistant's tool calls, each field on the roles that have it)."""
    role: str       # system, developer, user, assistant, tool, or a role of the template's own (vLLM's custom roles)
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None    # an assistant's calls
    tool_call_id: str | None = None             # a tool's result: the call it answers
    # an assistant's reasoning (vLLM's; ``reasoning_content`` is its older name): the template's
    # ``reasoning_content`` and ``thinking`` (gpt-oss's), which thinking models' templates read
    reasoning: str | None = None
    reasoning_content: str | None = None


class GenerationRequest(StructuredOutputsFields, forbid_unknown_fields=True, kw_only=True, dict=True):
    """What chat and text completion requests share. (``dict``: the server's defaults are
    attached to a decoded request; see ``with_server_defaults``.)"""
    prompt_param: ClassVar[str]         # what a context-length error names, as OpenAI does
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
    cache_salt: str | None = None       # vLLM's: mixed into the first block's hash (params.cache_salt)
    truncate_prompt_tokens: int | None = None   # vLLM's: keep the prompt's last k tokens (-1: max_model_len)
    truncation_side: Literal["left", "right"] | None = None   # vLLM's: "right" keeps the first k instead
    allowed_token_ids: list[int] | None = None  # vLLM's: the only tokens it may generate
    request_timeout: float | None = None  # seconds before it is aborted (params.request_timeout)
    # vLLM's: per prompt token (but the first) its log-prob and this many alternatives; not streamed
    prompt_logprobs: int | None = None
    return_token_ids: bool | None = False             # vLLM's: the prompt's and each choice's token ids too
    # vLLM's: the /render endpoints give each prompt token's (start, end) characters in the prompt
    # text (a chat's: the rendered template); ignored when generating
    return_token_offsets: bool | None = False
    return_tokens_as_token_ids: bool | None = None    # vLLM's: log-prob tokens as "token_id:N" (None: the server's flag)
    request_id: str | None = None                     # vLLM's: the answer's id is the id prefix and this
    stream_interval: int | None = None                # vLLM's: new tokens per streamed chunk, at least the server's
    session_id: str | None = None                     # vLLM's: names the conversation in its KV events; none here
    logprob_token_ids: list[int] | None = None        # vLLM's: these tokens' log-probs in place of the top ones
    # vLLM's: end the request when its output repeats a short pattern (finish_reason "repetition")
    repetition_detection: RepetitionDetectionParams | None = None
    use_beam_search: bool | None = False              # vLLM's: n beams (see frontend/beam_search.py)
    length_penalty: float | None = 1.0                # vLLM's: beams ranked by logprob / length ** this
    # vLLM's: arguments for the server's logits processors (plugins), SamplingParams.extra_args
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    # vLLM's prefill/decode disaggregation: {"do_remote_decode": true} on a prefill instance, the
    # prefill's returned params on a decode instance (SamplingParams.extra_args["kv_transfer_params"])
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM 0.32's other fields: taken where they ask for what Troupe does, refused by name (400)
    # when they ask for what it does not (``unserved``)
    return_mm_kwargs: bool | None = False             # a text prompt has no multimodal kwargs to return
    routed_experts_prompt_start: int | None = 0       # for routed-expert data, never returned here
    thinking_token_budget: int | None = None
    watermarking: bool | None = None
    ec_transfer_params: dict[str, Any] | None = None
    mm_payload: Any = None

    def unserved(self) -> list[tuple[str, str]]:
        """(field, why) of each field set to something Troupe does not do."""
        out = []
        for name in ("ec_transfer_params", "mm_payload"):
            if getattr(self, name):
                out.append((name, f"{name} is not supported: Troupe serves text-only models"))
        return out

    def with_server_defaults(self, defaults: ServerDefaults) -> GenerationRequest:
        """Attach the server's log-probs bound and sampling defaults (``to_sampling_params``
        reads them); returns the request."""
        self._server_defaults = defaults
        return self

    @property
    def server_defaults(self) -> ServerDefaults:
        return getattr(self, "_server_defaults", VLLM_DEFAULTS)

    def check_logprobs(self, value: int, param: str, vocab_size: int) -> None:
        """At most the server's --max-logprobs alternatives per token (vLLM's bound)."""
        bound = self.server_defaults.logprobs_bound(vocab_size)
        require(0 <= value <= bound, f"{param} must be in [0, {bound}] (the server's --max-logprobs), "
                f"got {value}", param)

    def requested_prompt_logprobs(self, vocab_size: int) -> int | None:
        """Alternatives per prompt token (-1: the whole vocabulary, as vLLM's), or None when the
        prompt's log-probs are not asked for; vLLM's rules and messages."""
        k = self.prompt_logprobs
        if k is None:
            return None
        require(k >= -1, "`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs")
        require(not (self.stream and k != 0), "`prompt_logprobs` are not available when `stream=True`.",
                "prompt_logprobs")
        k = vocab_size if k == -1 else k
        self.check_logprobs(k, "prompt_logprobs", vocab_size)
        return k

    def shown_id(self) -> str | None:
        """The client's ``request_id`` for the answer's id (None: the server's own)."""
        rid = self.request_id
        if rid is None:
            return None
        require(0 < len(rid) <= MAX_REQUEST_ID_CHARS and rid.isprintable(),
                f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} printable characters", "request_id")
        return rid

    def _sampling_params(self, vocab_size: int, max_model_len: int, max_tokens: int | None,
                         max_tokens_param: str, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        """Validate and build the engine's parameters (one choice; see ``for_choice``). Every
        value that reaches SamplingParams is in range: one the engine cannot hold would fail a
        whole step, and with it every request in the step. Unset sampling fields take the
        server's generation-config defaults, else the API's."""
        for name, why in self.unserved():
            raise BadRequest(why, name)
        require(self.routed_experts_prompt_start is None or self.routed_experts_prompt_start >= 0,
                "routed_experts_prompt_start must be at least 0", "routed_experts_prompt_start")
        d = self.server_defaults.sampling
        t = or_default(self.temperature, or_default(d.temperature, 1.0))
        p = or_default(self.top_p, or_default(d.top_p, 1.0))
        k = or_default(self.top_k, or_default(d.top_k, 0))
        require_in(t, 0.0, 2.0, "temperature")
        require_in(p, 0.0, 1.0, "top_p", lo_open=True)
        require(k in (-1, 0) or 1 <= k <= vocab_size,
                f"top_k must be -1 or 0 (off) or in [1, {vocab_size}], got {k}", "top_k")
        min_p = or_default(self.min_p, or_default(d.min_p, 0.0))
        require_in(min_p, 0.0, 1.0, "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            require_in(or_default(getattr(self, name), 0.0), -2.0, 2.0, name)
        rep = or_default(self.repetition_penalty, or_default(d.repetition_penalty, 1.0))
        require_in(rep, 0.0, 10.0, "repetition_penalty", lo_open=True)
        require(self.stream_interval is None or 1 <= self.stream_interval <= MAX_STREAM_INTERVAL,
                f"stream_interval must be in [1, {MAX_STREAM_INTERVAL}], got {self.stream_interval}", "stream_interval")
        label_ids = self.logprob_token_ids or None
        if label_ids is not None:
            require(logprobs is not None, "when using `logprob_token_ids`, `logprobs` must be set.", "logprob_token_ids")
            require(not self.use_beam_search, "`logprob_token_ids` is not supported with beam search.",
                    "logprob_token_ids")
            outside = [t for t in label_ids if not 0 <= t < vocab_size]
            require(not outside, f"logprob_token_ids must be token ids in [0, {vocab_size}), got {outside[:5]}",
                    "logprob_token_ids")
            bound = self.server_defaults.logprobs_bound(vocab_size)
            require(len(label_ids) <= bound, f"logprob_token_ids may hold at most {bound} tokens (the server's "
                    f"--max-logprobs), got {len(label_ids)}", "logprob_token_ids")
        if self.repetition_detection is not None:
            try:
                self.repetition_detection.check()
            except ValueError as exc:
                raise BadRequest(str(exc), "repetition_detection") from None
        b = self.thinking_token_budget
        require(b is None or b >= 0, f"`thinking_token_budget` must be a non-negative integer or None, got {b}",
                "thinking_token_budget")
        min_tokens = or_default(self.min_tokens, 0)
        _check_output_length(max_tokens, max_tokens_param, min_tokens, max_model_len, self.prompt_param)
        if self.seed is not None:
            require_in(self.seed, SEED_RANGE[0], SEED_RANGE[1] - MAX_N, "seed")   # choice i: seed + i
        truncate = self.truncate_prompt_tokens
        require(truncate is None or truncate == -1 or 1 <= truncate <= max_model_len,
                f"truncate_prompt_tokens must be -1 (the last max_model_len) or in [1, {max_model_len}], "
                f"got {truncate}", "truncate_prompt_tokens")
        stop, stop_ids, bad_words = self._stop_conditions(vocab_size)
        allowed = self.allowed_token_ids
        if allowed is not None:
            outside = [t for t in allowed if not 0 <= t < vocab_size]
            require(bool(allowed) and not outside, f"allowed_token_ids must be a non-empty list of token ids in "
                    f"[0, {vocab_size}), got {outside[:5] or allowed}", "allowed_token_ids")
        constraint = self.constraint()
        return SamplingParams(
            max_tokens=max_tokens, temperature=t, top_p=p, top_k=max(k, 0), min_p=min_p,
            seed=self.seed, stop=stop, stop_token_ids=stop_ids, ignore_eos=bool(self.ignore_eos),
            min_tokens=min_tokens, presence_penalty=or_default(self.presence_penalty, 0.0),
            frequency_penalty=or_default(self.frequency_penalty, 0.0), repetition_penalty=rep,
            logit_bias=_logit_bias(self.logit_bias, vocab_size), logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=or_default(self.skip_special_tokens, True),
            include_stop_str_in_output=bool(self.include_stop_str_in_output), bad_words=bad_words,
            structured_outputs=constraint.params if constraint else None,
            truncate_prompt_tokens=truncate, allowed_token_ids=allowed, extra_args=self._extra_args(),
            repetition_detection=self.repetition_detection, logprob_token_ids=label_ids,
            thinking_token_budget=self.thinking_token_budget, watermarking=self.watermarking)

    def _extra_args(self) -> dict[str, Any] | None:
        extra: dict[str, Any] = dict(self.vllm_xargs or {})
        if self.kv_transfer_params is not None:
            extra["kv_transfer_params"] = check_kv_transfer_params(self.kv_transfer_params)
        return extra or None

    def constraint(self) -> Constraint | None:
        """The structured outputs the request asks for (and the field that asks)."""
        try:
            return constraint_of(self)
        except NotStructured as exc:
            raise BadRequest(str(exc), exc.param) from None

    def _stop_conditions(self, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        require(all(stop), "stop strings must not be empty", "stop")
        require(len(stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings", "stop")
        stop_ids = list(self.stop_token_ids or [])
        bad = [t for t in stop_ids if not 0 <= t < vocab_size]
        require(not bad, f"stop_token_ids must be in [0, {vocab_size}), got {bad[:5]}", "stop_token_ids")
        bad_words = list(self.bad_words or [])
        require(all(w.strip() for w in bad_words), "bad_words must not be empty or blank", "bad_words")
        require(len(bad_words) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} bad words", "bad_words")
        return stop, stop_ids, bad_words


def _check_output_length(max_tokens: int | None, param: str, min_tokens: int, max_model_len: int,
                         prompt_param: str) -> None:
    """``max_tokens`` (None: until the end of the context) leaves room for a prompt of at least
    one token, else the Tokenizer's context-length error comes early (naming ``prompt_param``, as
    the Tokenizer's does); ``min_tokens`` is at most what may be generated."""
    require(max_tokens is None or max_tokens >= 1, f"{param} must be at least 1, got {max_tokens}", param)
    if max_tokens is not None and max_tokens >= max_model_len:
        raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. However, you "
                         f"requested {max_tokens} tokens for the completion alone, which leaves no room "
                         f"for the prompt. Please reduce {param}.", prompt_param)
    limit, what = (max_model_len - 1, "the context less a prompt token") if max_tokens is None \
        else (max_tokens, param)
    require(0 <= min_tokens <= limit, f"min_tokens must be in [0, {limit}] (at most {what}), got {min_tokens}",
            "min_tokens")


class Prediction(msgspec.Struct, forbid_unknown_fields=True):
    """OpenAI's predicted output: a hint for speed; the output is the same without it."""
    type: Literal["content"]
    content: str | list[TextPart]


class ChatCompletionRequest(GenerationRequest, kw_only=True):
    prompt_param: ClassVar[str] = "messages"
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool | None = False     # vLLM's: the answer starts with the last message's content when it is the assistant's
    documents: list[dict[str, str]] | None = None   # vLLM's: the template's ``documents`` (RAG)
    chat_template: str | None = None    # vLLM's: this request's template (with --trust-request-chat-template)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: the template's ``reasoning_effort``, and its ``enable_thinking`` unless the kwargs set it
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    add_special_tokens: bool | None = False     # vLLM's: BOS / EOS as the tokenizer adds them, besides the template's
    spaces_between_special_tokens: bool | None = True   # vLLM's; a fast tokenizer's output does not depend on it
    # OpenAI's, about its platform (storage, billing, its own caches, abuse ids, a latency hint):
    # accepted and without effect here, as vLLM accepts them
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prediction: Prediction | None = None
    modalities: list[Literal["text"]] | None = None     # audio output is refused
    include_reasoning: bool | None = True     # vLLM's: with --reasoning-parser, show the reasoning part
    return_prompt_text: bool | None = False   # vLLM's: the answer shows the prompt as the template rendered it
    media_io_kwargs: dict[str, Any] | None = None   # vLLM's: how videos are read ({"video": {"num_frames": 8}})
    mm_processor_kwargs: dict[str, Any] | None = None

    def unserved(self) -> list[tuple[str, str]]:
        out = super().unserved()
        problem = media_io_problem(self.media_io_kwargs)
        if problem:
            out.append(("media_io_kwargs", problem))
        return out

    def constraint(self) -> Constraint | None:
        """What the structured-output fields ask for, or what ``tool_choice`` "required" or a
        named function does (not both)."""
        asked = super().constraint()
        try:
            check_tools(self)
            tools = tool_constraint(self)
        except NotStructured as exc:
            raise BadRequest(str(exc), exc.param) from None
        if asked is not None and tools is not None:
            raise BadRequest(f"{asked.param} cannot be combined with tool_choice "
                             f"{self.tool_choice if isinstance(self.tool_choice, str) else 'naming a function'}",
                             asked.param)
        return asked or tools

    def to_sampling_params(self, vocab_size: int, max_model_len: int) -> SamplingParams:
        """Unset max_completion_tokens / max_tokens: the generation config's max_new_tokens,
        else until the end of the context."""
        logprobs = self.requested_logprobs(vocab_size)
        prompt_logprobs = self.requested_prompt_logprobs(vocab_size)
        if self.max_completion_tokens is not None:
            return self._sampling_params(vocab_size, max_model_len, self.max_completion_tokens,
                                         "max_completion_tokens", logprobs, prompt_logprobs)
        max_tokens = self.max_tokens
        default = self.server_defaults.sampling.max_tokens
        if max_tokens is None and default is not None:
            max_tokens = min(default, max_model_len - 1)     # a default leaves room for the prompt
        return self._sampling_params(vocab_size, max_model_len, max_tokens, "max_tokens", logprobs,
                                     prompt_logprobs)

    def requested_logprobs(self, vocab_size: int) -> int | None:
        """Top alternatives per token, or None when log-probs are not asked for."""
        top = self.top_logprobs
        if top is not None:
            self.check_logprobs(top, "top_logprobs", vocab_size)
            require(bool(self.logprobs), "top_logprobs needs logprobs set to true", "top_logprobs")
        return (top or 0) if self.logprobs else None


class CompletionRequest(GenerationRequest, kw_only=True):
    prompt_param: ClassVar[str] = "prompt"
    prompt: str | list[Any] | None = None   # a string, token ids, or a list of either (params.prompts)
    logprobs: int | None = None
    echo: bool | None = False
    add_special_tokens: bool | None = True
    best_of: int | None = None       # OpenAI's: sample this many per prompt, return the n most likely
    spaces_between_special_tokens: bool | None = True   # vLLM's; a fast tokenizer's output does not depend on it
    suffix: str | None = None        # OpenAI's: refused, as vLLM refuses it
    # vLLM's (--enable-prompt-embeds): base64 of a torch.save'd (tokens, hidden) tensor, or a list
    # of them, each a prompt before those of ``prompt`` (actors/tokenizer/prompt_embeds.py)
    prompt_embeds: str | list[str] | None = None

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt alone is the answer (with its log-probs)."""
        return bool(self.echo) and self.max_tokens == 0

    def unserved(self) -> list[tuple[str, str]]:
        out = super().unserved()
        if self.suffix is not None:
            out.append(("suffix", "suffix is not currently supported"))       # vLLM's words
        return out

    def to_sampling_params(self, vocab_size: int, max_model_len: int) -> SamplingParams:
        """Unset max_tokens: OpenAI's 16 (vLLM's too, whatever the generation config says).
        With ``echo``, the prompt's log-probs too (``prompt_logprobs`` alternatives where given,
        else ``logprobs``); with ``echo`` and max_tokens 0 (scoring a text: OpenAI's and vLLM's),
        one token is computed and only the prompt is answered (``echo_only``)."""
        lp = self.logprobs
        if lp is not None:
            self.check_logprobs(lp, "logprobs", vocab_size)
        prompt_lp = self.requested_prompt_logprobs(vocab_size)
        return self._sampling_params(vocab_size, max_model_len,
                                     1 if self.echo_only else or_default(self.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS),
                                     "max_tokens", lp, prompt_lp if prompt_lp is not None or not self.echo else lp)


_TOKEN_ID = re.compile(r"[0-9]{1,10}")


_KV_PARAM_TYPES = {"do_remote_decode": bool, "do_remote_prefill": bool, "remote_engine_id": str,
                   "remote_host": str, "remote_port": int, "remote_request_id": str, "remote_num_tokens": int,
                   "remote_prompt_hash": str,
                   "tp_size": int}


def check_kv_transfer_params(params: dict[str, Any]) -> dict[str, Any]:
    """vLLM's kv_transfer_params: the known keys with their types (others pass to the connector)."""
    for key, typ in _KV_PARAM_TYPES.items():
        value = params.get(key)
        if value is not None and (not isinstance(value, typ) or (typ is int and isinstance(value, bool))):
            raise BadRequest(f"kv_transfer_params.{key} must be a {typ.__name__}, got {value!r}", "kv_transfer_params")
    ids = params.get("remote_block_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                                              and i >= 0 for i in ids)):
        raise BadRequest("kv_transfer_params.remote_block_ids must be a list of block ids (integers >= 0)",
                         "kv_transfer_params")
    port = params.get("remote_port")
    if port is not None and not 0 < port < 65536:
        raise BadRequest(f"kv_transfer_params.remote_port must be in [1, 65535], got {port}", "kv_transfer_params")
    return params


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        require(_TOKEN_ID.fullmatch(key) is not None and int(key) < vocab_size,
                f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}", "logit_bias")
        require_in(value, -100.0, 100.0, "logit_bias")
        out[int(key)] = value
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
    chat_template: str | None = None            # vLLM's: this request's template (with --trust-request-chat-template)
    tools: list[Tool] | None = None             # vLLM's: rendered by the template as a chat request's are
    return_token_strs: bool | None = False


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    tokens: list[int]


_UNKNOWN = re.compile(r"Object contains unknown field `(.+?)`(?: - at `\$(.*)`)?$")
_PATH_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


MAX_BODY_DEPTH = 950          # arrays and objects inside each other, at most (under the default recursion limit)
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = bytes(c for c in range(256) if c not in b"[]{}")


def body_depth(body: bytes) -> int:
    """How deeply the JSON body's arrays and objects nest (brackets inside strings not counted)."""
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKET)
    if not brackets:
        return 0
    import numpy as np
    steps = np.frombuffer(brackets, dtype=np.uint8)
    return int(np.cumsum(np.where((steps == 0x5B) | (steps == 0x7B), 1, -1)).max())


def decode_body(body: bytes, typ: type, lenient: bool = False) -> Any:
    """Decode a JSON body; a type error names the field (``param``) it is about. ``lenient``
    drops unknown fields (logging each) instead of refusing them. A body nested deeper than
    MAX_BODY_DEPTH is refused before decoding (whatever the interpreter's recursion limit, which
    torch.compile raises), and whatever the decoder or the converter raises is the body's fault:
    a BadRequest."""
    if body.count(b"[") + body.count(b"{") > MAX_BODY_DEPTH and body_depth(body) > MAX_BODY_DEPTH:
        raise BadRequest(f"the request body is nested too deeply to decode (more than {MAX_BODY_DEPTH} levels)")
    try:
        return _decode(body, typ, lenient)
    except BadRequest:
        raise
    except RecursionError:
        raise BadRequest("the request body is nested too deeply to decode") from None
    except Exception as exc:
        raise BadRequest(f"the request body could not be decoded: {exc}") from None


def _decode(body: bytes, typ: type, lenient: bool) -> Any:
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
        param = where.rstrip("`").replace("[...]", "")     # msgspec's "[...]": a value of a mapping
    return BadRequest(text, param)
