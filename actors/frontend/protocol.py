"""OpenAI request bodies as msgspec structs (decoding is validation), and their conversion to
engine sampling parameters. Field names and meanings follow the OpenAI API and vLLM."""
from __future__ import annotations

from typing import Any, Literal

import msgspec

from transport.messages import SamplingParams


class BadRequest(ValueError):
    """Invalid input: an HTTP 400 naming the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class _Common(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    priority: int = 0


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]          # a string, token ids, or a list of either (checked later)


def decode_body(body: bytes, typ: type) -> Any:
    """Decode a JSON body; a type error names the field (``param``) it is about."""
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = None
        if " - at `$." in text:
            text, _, where = text.partition(" - at `$.")
            param = where.rstrip("`")
        elif "unknown field" in text:
            param = text.split("`")[1] if "`" in text else None
        raise BadRequest(text, param) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None


def sampling_params(req: _Common, max_tokens: int | None) -> SamplingParams:
    """Validate ranges and build the engine's parameters."""
    t = 1.0 if req.temperature is None else req.temperature
    p = 1.0 if req.top_p is None else req.top_p
    k = 0 if req.top_k is None or req.top_k == -1 else req.top_k
    if not 0.0 <= t <= 2.0:
        raise BadRequest(f"temperature must be in [0, 2], got {t}", "temperature")
    if not 0.0 < p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {p}", "top_p")
    if k < 0:
        raise BadRequest(f"top_k must be -1 (off) or at least 1, got {req.top_k}", "top_k")
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if req.n != 1:
        raise BadRequest(f"n must be 1 for now, got {req.n}", "n")
    if req.min_tokens < 0 or (max_tokens is not None and req.min_tokens > max_tokens):
        raise BadRequest(f"min_tokens must be in [0, max_tokens], got {req.min_tokens}", "min_tokens")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stop):
        raise BadRequest("stop strings must not be empty", "stop")
    return SamplingParams(
        max_tokens=max_tokens or 0, temperature=t, top_p=p, top_k=k, seed=req.seed, stop=stop,
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens, skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output)


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    if not req.messages:
        raise BadRequest("messages must not be empty", "messages")
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise BadRequest(f"content part of type {part.type!r} is not supported; "
                                     "only 'text' parts are", f"messages[{i}].content[{j}]")
                texts.append(part.text)
            content = "".join(texts)
        out.append({"role": m.role, "content": content or ""})
    return out
