"""What an endpoint takes from a decoded request body beside its sampling parameters (those come
from the request's ``to_sampling_params``): choices, prompts, chat messages, streaming flags."""
from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from actors.engine.sampling_params import SamplingParams
from actors.frontend.protocol import (MAX_N, PRIORITY_RANGE, BadRequest, GenerationRequest, or_default,
                                      require, require_in)

MAX_CHOICES = 256            # choices per request (prompts x n)


class PromptInput(NamedTuple):
    text: str | None
    token_ids: list[int] | None


def num_choices(req: GenerationRequest) -> int:
    n = or_default(req.n, 1)
    require(1 <= n <= MAX_N, f"n must be in [1, {MAX_N}], got {n}", "n")
    return n


def for_choice(params: SamplingParams, i: int) -> SamplingParams:
    """Choice ``i`` of n: a seeded request gives choice i the seed ``seed + i`` (as vLLM does),
    so the choices differ and each is reproducible."""
    if i == 0 or params.seed is None:
        return params
    return msgspec.structs.replace(params, seed=params.seed + i)


class StreamFlags(NamedTuple):
    stream: bool
    include_usage: bool          # a last chunk with the usage and no choices


def stream_flags(req: GenerationRequest) -> StreamFlags:
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise BadRequest("stream_options may only be set when stream is true", "stream_options")
    return StreamFlags(stream, bool(stream and req.stream_options and req.stream_options.include_usage))


def check_priority(req: GenerationRequest, scheduling_policy: str) -> int:
    priority = or_default(req.priority, 0)
    require_in(priority, *PRIORITY_RANGE, "priority")
    if priority != 0 and scheduling_policy != "priority":
        raise BadRequest(f"priority {priority} needs a server started with --scheduling-policy "
                         "priority", "priority")
    return priority


def completion_prompts(prompt: Any, vocab_size: int) -> list[PromptInput]:
    """A string, a list of token ids, or a list of strings / token-id lists."""
    if isinstance(prompt, str):
        return [PromptInput(prompt, None)]
    require(isinstance(prompt, list) and len(prompt) > 0, "prompt must not be empty", "prompt")
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
    require(not bad, f"token ids must be in [0, {vocab_size}), got {bad[:5]}", "prompt")
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
