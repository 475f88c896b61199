"""What an endpoint takes from a decoded request body beside its sampling parameters (those come
from the request's ``to_sampling_params``): choices, prompts, chat messages, streaming flags."""
from __future__ import annotations

from typing import Any, NamedTuple

import msgspec
import numpy as np

from actors.engine.sampling_params import SamplingParams
from actors.frontend.protocol import (MAX_N, PRIORITY_RANGE, BadRequest, ChatMessage, GenerationRequest,
                                      or_default, require, require_in)

MAX_CHOICES = 256            # choices per request (prompts x n)
MAX_REQUEST_TIMEOUT_S = 86_400.0


class PromptInput(NamedTuple):
    text: str | None
    token_ids: list[int] | None
    embeds: np.ndarray | None = None     # vLLM's prompt embeds: (tokens, hidden) float32 rows


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


def stream_flags(req: GenerationRequest, force_usage: bool = False) -> StreamFlags:
    """``force_usage``: the server's --enable-force-include-usage (a stream sends its usage
    whatever its stream_options say)."""
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise BadRequest("stream_options may only be set when stream is true", "stream_options")
    return StreamFlags(stream, bool(stream and (force_usage or (req.stream_options and req.stream_options.include_usage))))


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


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template reads them: content as a string or text parts, an assistant's
    ``tool_calls`` in OpenAI's shape (tokenizer.chat parses their arguments), a tool's
    ``tool_call_id``."""
    if not messages:
        raise BadRequest("messages must not be empty", "messages")
    return [_chat_message(i, m) for i, m in enumerate(messages)]


def _chat_message(i: int, m: ChatMessage) -> dict[str, Any]:
    require(m.role.strip() != "", "role must be a non-empty string (system, developer, user, assistant, tool "
            "or a role the chat template knows)", f"messages[{i}].role")
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        raise BadRequest(f"messages[{i}].content is required (a string or a list of text parts); "
                         "only an assistant message with tool_calls may leave it out or null",
                         f"messages[{i}].content")
    require(m.tool_calls is None or m.role == "assistant",
            f"tool_calls may only be set on assistant messages, not on a {m.role!r} message",
            f"messages[{i}].tool_calls")
    require(m.tool_call_id is None or m.role == "tool",
            f"tool_call_id may only be set on tool messages, not on a {m.role!r} message",
            f"messages[{i}].tool_call_id")
    msg: dict[str, Any] = {"role": m.role, "content": _content(i, m.content)}
    if m.name is not None:
        msg["name"] = m.name
    if m.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": c.type,
                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
    if reasoning is not None:
        require(m.role == "assistant", f"reasoning may only be set on assistant messages, not on a {m.role!r} "
                "message", f"messages[{i}].reasoning")
        # under each name a template reads it by (gpt-oss's reads ``thinking``)
        msg["reasoning_content"] = msg["reasoning"] = msg["thinking"] = reasoning
    return msg


def _content(i: int, content: Any) -> str | list[dict[str, Any]]:
    """A string, or the parts as the chat template's content format takes them (tokenizer.chat
    joins the texts with newlines or keeps them as parts); image and video parts go on to the
    tokenizer, which reads them for a model that takes them and refuses them otherwise."""
    if not isinstance(content, list):
        return content or ""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if part.type == "text" and part.text is not None:
            parts.append({"type": "text", "text": part.text})
        elif part.type in ("image_url", "video_url", "audio_url") and getattr(part, part.type) is not None:
            given = getattr(part, part.type)
            url = given if isinstance(given, str) else given.url
            require(bool(url), f"{'a' if part.type == 'video_url' else 'an'} {part.type} part needs a non-empty url",
                    f"messages[{i}].content[{j}].{part.type}")
            parts.append({"type": part.type, part.type: {"url": url}})
        elif part.type == "input_audio" and part.input_audio is not None:
            require(bool(part.input_audio.data), "an input_audio part needs its file's bytes in base64 as data",
                    f"messages[{i}].content[{j}].input_audio.data")
            parts.append({"type": "input_audio", "input_audio": {"data": part.input_audio.data,
                                                                 "format": part.input_audio.format}})
        elif part.type in ("image_embeds", "video_embeds", "audio_embeds") and getattr(part, part.type) is not None:
            given = getattr(part, part.type)
            require(isinstance(given, str) or all(isinstance(v, (str, list)) for v in given.values()),
                    f"{part.type} must be the base64 of a torch.save'd tensor, or a dict of those or lists of "
                    "numbers", f"messages[{i}].content[{j}].{part.type}")
            parts.append({"type": part.type, part.type: given})
        else:
            raise BadRequest(f"content part of type {part.type!r} is not supported; only 'text', 'image_url', "
                             "'video_url', 'image_embeds', 'video_embeds', 'input_audio', 'audio_url' and "
                             "'audio_embeds' parts are (with the field of their type)", f"messages[{i}].content[{j}]")
    return parts


def served_name(client, model: str | None) -> str:
    """The model name a response reports: the adapter's when the request named one (as vLLM),
    else the first served name."""
    return model if model is not None and model in client.lora_requests else client.model_name


def cache_salt(req: GenerationRequest) -> str | None:
    """vLLM's rule: a non-empty string when set. It is mixed into the hash of the prompt's first
    block, so only requests with equal salts share cached prefixes."""
    require(req.cache_salt != "", "cache_salt must be a non-empty string if provided", "cache_salt")
    return req.cache_salt


def request_timeout(req: GenerationRequest) -> float | None:
    """Seconds the request may take before it is aborted (None: the server's --request-timeout)."""
    t = req.request_timeout
    require(t is None or 0.0 < t <= MAX_REQUEST_TIMEOUT_S,
            f"request_timeout must be in (0, {MAX_REQUEST_TIMEOUT_S:g}] seconds, got {t}", "request_timeout")
    return t


def reasoning_kwargs(effort: str, template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's ``reasoning_effort``: a template variable of that name, and ``enable_thinking``
    (off for "none") unless the request's chat_template_kwargs set it."""
    kwargs = {**(template_kwargs or {}), "reasoning_effort": effort}
    kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs


def check_chat_flags(add_generation_prompt: bool, continue_final_message: bool) -> None:
    if add_generation_prompt and continue_final_message:
        raise BadRequest("continue_final_message and add_generation_prompt cannot both be true; "
                         "set add_generation_prompt to false to continue the final message",
                         "continue_final_message")
