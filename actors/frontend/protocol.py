"""OpenAI (and vLLM) request bodies as msgspec structs: decoding is the first validation.
Field names and meanings follow the OpenAI API and vLLM's extensions; ``params.py`` checks
ranges and builds the engine's sampling parameters. Optional fields accept JSON null."""
from __future__ import annotations

import logging
import re
from typing import Any, Literal

import msgspec

log = logging.getLogger("troupe.http")

MAX_UNKNOWN_FIELDS = 64          # lenient mode drops at most this many before giving up


class BadRequest(ValueError):
    """Invalid input: an HTTP 400 naming the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = False


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


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]          # a string, token ids, or a list of either (params.prompts)
    logprobs: int | None = None
    echo: bool | None = False
    add_special_tokens: bool | None = True


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
