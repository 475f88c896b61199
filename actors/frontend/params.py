"""Range checks on decoded request bodies, and their conversion to the engine's inputs:
sampling parameters per choice, completion prompts, chat messages."""
from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from actors.frontend.protocol import BadRequest, ChatCompletionRequest, CompletionRequest, _Common
from transport.messages import SamplingParams

MAX_N = 128                  # choices per prompt
MAX_CHOICES = 256            # choices per request (prompts x n)
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_STOP_STRINGS = 64
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)


class PromptInput(NamedTuple):
    text: str | None
    token_ids: list[int] | None


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise BadRequest(message, param)


def _opt(value: Any, default: Any) -> Any:
    return default if value is None else value


def num_choices(req: _Common) -> int:
    n = _opt(req.n, 1)
    _check(1 <= n <= MAX_N, f"n must be in [1, {MAX_N}], got {n}", "n")
    return n


def sampling_params(req: _Common, max_tokens: int | None, vocab_size: int,
                    logprobs: int | None = None, prompt_logprobs: int | None = None,
                    max_tokens_param: str = "max_tokens") -> SamplingParams:
    """Validate ranges and build the engine's parameters (one choice; see ``for_choice``)."""
    t, p, k = _opt(req.temperature, 1.0), _opt(req.top_p, 1.0), _opt(req.top_k, 0)
    _check(0.0 <= t <= 2.0, f"temperature must be in [0, 2], got {t}", "temperature")
    _check(0.0 < p <= 1.0, f"top_p must be in (0, 1], got {p}", "top_p")
    _check(k >= -1, f"top_k must be -1 or 0 (off) or at least 1, got {k}", "top_k")
    min_p = _opt(req.min_p, 0.0)
    _check(0.0 <= min_p <= 1.0, f"min_p must be in [0, 1], got {min_p}", "min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        v = _opt(getattr(req, name), 0.0)
        _check(-2.0 <= v <= 2.0, f"{name} must be in [-2, 2], got {v}", name)
    rep = _opt(req.repetition_penalty, 1.0)
    _check(0.0 < rep <= 10.0, f"repetition_penalty must be in (0, 10], got {rep}", "repetition_penalty")
    _check(max_tokens is None or max_tokens >= 1,
           f"{max_tokens_param} must be at least 1, got {max_tokens}", max_tokens_param)
    min_tokens = _opt(req.min_tokens, 0)
    _check(0 <= min_tokens and (max_tokens is None or min_tokens <= max_tokens),
           f"min_tokens must be in [0, max_tokens], got {min_tokens}", "min_tokens")
    if req.seed is not None:
        _check(SEED_RANGE[0] <= req.seed <= SEED_RANGE[1] - MAX_N,
               f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1] - MAX_N}], got {req.seed}", "seed")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    _check(all(stop), "stop strings must not be empty", "stop")
    _check(len(stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    stop_ids = list(req.stop_token_ids or [])
    _check(all(0 <= t < vocab_size for t in stop_ids),
           f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens or 0, temperature=t, top_p=p, top_k=max(k, 0), min_p=min_p,
        seed=req.seed, stop=stop, stop_token_ids=stop_ids, ignore_eos=bool(req.ignore_eos),
        min_tokens=min_tokens, presence_penalty=_opt(req.presence_penalty, 0.0),
        frequency_penalty=_opt(req.frequency_penalty, 0.0), repetition_penalty=rep,
        logit_bias=_logit_bias(req.logit_bias, vocab_size), logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, skip_special_tokens=_opt(req.skip_special_tokens, True),
        include_stop_str_in_output=bool(req.include_stop_str_in_output))


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise BadRequest(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        _check(0 <= token < vocab_size, f"logit_bias token {token} is not in [0, {vocab_size})",
               "logit_bias")
        _check(-100.0 <= value <= 100.0, f"logit_bias values must be in [-100, 100], got {value}",
               "logit_bias")
        out[token] = value
    return out


def for_choice(params: SamplingParams, i: int) -> SamplingParams:
    """Choice ``i`` of n: a seeded request gives choice i the seed ``seed + i`` (as vLLM does),
    so the choices differ and each is reproducible."""
    if i == 0 or params.seed is None:
        return params
    return msgspec.structs.replace(params, seed=params.seed + i)


class StreamFlags(NamedTuple):
    stream: bool
    include_usage: bool          # a last chunk with the usage and no choices


def stream_flags(req: _Common) -> StreamFlags:
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise BadRequest("stream_options may only be set when stream is true", "stream_options")
    return StreamFlags(stream, bool(stream and req.stream_options and req.stream_options.include_usage))


def check_priority(req: _Common, scheduling_policy: str) -> int:
    priority = _opt(req.priority, 0)
    if priority != 0 and scheduling_policy != "priority":
        raise BadRequest(f"priority {priority} needs a server started with --scheduling-policy "
                         "priority", "priority")
    return priority


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    top = req.top_logprobs
    if top is not None:
        _check(0 <= top <= MAX_CHAT_TOP_LOGPROBS,
               f"top_logprobs must be in [0, {MAX_CHAT_TOP_LOGPROBS}], got {top}", "top_logprobs")
        _check(bool(req.logprobs), "top_logprobs needs logprobs set to true", "top_logprobs")
    return (top or 0) if req.logprobs else None


def completion_logprobs(req: CompletionRequest) -> int | None:
    lp = req.logprobs
    _check(lp is None or 0 <= lp <= MAX_COMPLETION_LOGPROBS,
           f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {lp}", "logprobs")
    return lp


def completion_prompts(prompt: Any, vocab_size: int) -> list[PromptInput]:
    """A string, a list of token ids, or a list of strings / token-id lists."""
    if isinstance(prompt, str):
        return [PromptInput(prompt, None)]
    _check(isinstance(prompt, list) and len(prompt) > 0, "prompt must not be empty", "prompt")
    if all(_is_token(t) for t in prompt):
        return [PromptInput(None, _token_ids(prompt, vocab_size))]
    out = []
    for item in prompt:
        if isinstance(item, str):
            out.append(PromptInput(item, None))
        elif isinstance(item, list) and item and all(_is_token(t) for t in item):
            out.append(PromptInput(None, _token_ids(item, vocab_size)))
        else:
            raise BadRequest("prompt must be a string, a list of token ids, or a list of "
                             "strings or of non-empty token-id lists", "prompt")
    return out


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _token_ids(ids: list[int], vocab_size: int) -> list[int]:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    _check(not bad, f"token ids must be in [0, {vocab_size}), got {bad[:5]}", "prompt")
    return ids


def chat_messages(messages: list[Any]) -> list[dict[str, Any]]:
    if not messages:
        raise BadRequest("messages must not be empty", "messages")
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise BadRequest(f"content part of type {part.type!r} is not supported; "
                                     "only 'text' parts are", f"messages[{i}].content[{j}]")
                texts.append(part.text)
            content = "".join(texts)
        msg = {"role": m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def check_chat_flags(add_generation_prompt: bool, continue_final_message: bool) -> None:
    if add_generation_prompt and continue_final_message:
        raise BadRequest("continue_final_message and add_generation_prompt cannot both be true; "
                         "set add_generation_prompt to false to continue the final message",
                         "continue_final_message")
