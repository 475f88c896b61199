"""Chat messages -> prompt text: OpenAI message normalization and the sandboxed Jinja chat-template renderer."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Collection, Iterable, Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger("troupe.tokenizer")

# Appended to the final message's content when it is to be continued; the render is cut where it reappears.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _placeholders(placeholder: str | Mapping[str, str] | None) -> dict[str, str]:
    """Each modality the model takes and its placeholder text (a string alone: images')."""
    if placeholder is None:
        return {}
    return {"image": placeholder} if isinstance(placeholder, str) else dict(placeholder)


def content_to_text(content: Any, image_placeholder: str | Mapping[str, str] | None = None) -> str:
    """OpenAI message content -> one string (vLLM's "string" content format).

    Accepts a string, None (-> ""), or a list of parts where each part is a string or a
    `{"type": "text", "text": ...}` dict; the texts are joined with newlines, as vLLM joins them.
    With ``image_placeholder`` (a model that takes images: its placeholder, or each modality's
    as a mapping, ``{"image": ..., "video": ...}``), `{"type": "image"}` (and `{"type": "video"}`)
    parts are allowed: each item the text does not already place gets the placeholder before
    the text, as vLLM places them. Any other part type (image_url, input_audio, file, ...) raises
    ValueError naming it.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    placeholders = _placeholders(image_placeholder)
    parts = _parts(content, placeholders)
    text = "\n".join(p["text"] for p in parts if p["type"] == "text")
    missing = []
    for modality, placeholder in placeholders.items():
        missing += [placeholder] * (sum(p["type"] == modality for p in parts) - text.count(placeholder))
    return "\n".join(missing + [text]) if missing else text


def content_to_parts(content: Any, images: bool | Collection[str] = False) -> list[dict[str, str]]:
    """OpenAI message content -> a list of ``{"type": "text", "text": ...}`` parts (vLLM's
    "openai" content format: a string is one part; None is no part), and, with ``images`` (a
    model that takes them: True, or the modalities it takes), ``{"type": "image"}`` (and
    ``{"type": "video"}``) parts where the items are."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return _parts(content, ("image",) if images is True else images or ())


def _parts(content: Any, modalities: Collection[str]) -> list[dict[str, str]]:
    images = "image" in modalities
    if not isinstance(content, list):
        raise ValueError(f"message content must be a string or a list of parts, got {type(content).__name__}")
    parts = []
    for part in content:
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
            continue
        part_type = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        if part_type in modalities:
            parts.append({"type": part_type})
            continue
        if part_type != "text":
            raise ValueError(f"message content part of type {part_type!r} is not supported; only 'text' parts are"
                             + ("" if images else " (this model takes no images)" if part_type in _IMAGE_PARTS
                                else "")
                             + (" (this model takes no videos)" if part_type in ("video", "video_url", "video_embeds") else "")
                             + (" (this model takes no audio)" if part_type in ("audio", "input_audio", "audio_url", "audio_embeds")
                                else ""))
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"a 'text' content part needs a string 'text' field, got {text!r}")
        parts.append({"type": "text", "text": text})
    return parts


_IMAGE_PARTS = ("image_url", "image_pil", "image", "image_embeds")


def normalize_messages(messages: Iterable[Mapping[str, Any]], content_format: str = "string",
                       image_placeholder: str | Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """OpenAI chat messages -> fresh dicts a chat template can render.

    Keys whose value is None are dropped (APIs send `content: null` beside `tool_calls`, and
    templates handle a missing key better than a literal None); `content`, when present, becomes
    a string (`content_to_text`) or, with the "openai" content format, a list of text parts
    (`content_to_parts`; with ``image_placeholder``, a model that takes images, image parts
    too, as the placeholder text in the string format; a tool's result stays a string, as vLLM keeps it, since most templates
    read it as one); an assistant's `tool_calls` get their `arguments` as objects
    (`tool_calls_for_template`). Every message needs a string `role`.
    """
    if content_format not in ("string", "openai"):
        raise ValueError(f"content_format must be 'string' or 'openai', got {content_format!r}")
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be an object, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] needs a string 'role', got {message.get('role')!r}")
        out = {key: value for key, value in message.items() if value is not None}
        try:
            if "content" in out:
                if content_format == "openai" and out["role"] != "tool":
                    out["content"] = content_to_parts(out["content"], tuple(_placeholders(image_placeholder)))
                else:
                    out["content"] = content_to_text(out["content"], image_placeholder)
            if "tool_calls" in out:
                out["tool_calls"] = tool_calls_for_template(out["tool_calls"])
                if not out["tool_calls"]:
                    del out["tool_calls"]    # an empty list: the template's plain assistant path
        except ValueError as e:
            raise ValueError(f"messages[{i}]: {e}") from None
        normalized.append(out)
    return normalized


def detect_content_format(source: str) -> str:
    """How a chat template reads message content, by vLLM's rule for
    ``--chat-template-content-format auto``: "openai" (a list of ``{"type": "text", "text": ...}``
    parts) when the template loops over a message's content, else "string". A template that
    does not parse is "string"."""
    return _detect_content_format(source)


@functools.lru_cache(maxsize=32)
def _detect_content_format(source: str) -> str:
    try:
        tree = jinja2.Environment(extensions=[_GenerationTag, jinja2.ext.loopcontrols]).parse(source)
    except jinja2.TemplateError:
        return "string"
    return "openai" if any(True for _ in _content_loops(tree)) else "string"


def _reads(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """Whether ``node`` is ``name`` (or ``name.key`` / ``name['key']``), under any filters, tests
    and slices."""
    while True:
        if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
            node = node.node
        else:
            break
    if key is not None:
        if isinstance(node, jinja2.nodes.Getattr) and node.attr == key:
            node = node.node
        elif (isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const)
              and node.arg.value == key):
            node = node.node
        else:
            return False
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _content_loops(tree: jinja2.nodes.Template):
    """The ``for`` loops of ``tree`` that iterate over a message's content."""
    lists, todo = {"messages"}, ["messages"]            # the messages and the names set from them
    while todo:
        name = todo.pop()
        for assign in tree.find_all(jinja2.nodes.Assign):
            if (isinstance(assign.target, jinja2.nodes.Name) and assign.target.name not in lists
                    and _reads(assign.node, name)):
                lists.add(assign.target.name)
                todo.append(assign.target.name)
    loops = list(tree.find_all(jinja2.nodes.For))
    items = {loop.target.name for loop in loops if isinstance(loop.target, jinja2.nodes.Name)
             and any(_reads(loop.iter, name) for name in lists)}
    in_macros: set[int] = set()
    macro_params: dict[int, set[str]] = {}               # a loop in a macro -> its parameters given content
    for macro in tree.find_all(jinja2.nodes.Macro):
        params = [a.name for a in macro.args]
        given: set[str] = set()
        for call in tree.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            given.update(params[i] for i, arg in enumerate(call.args[:len(params)])
                         if any(_reads(arg, item, "content") for item in items))
            given.update(kw.key for kw in call.kwargs if kw.key in params
                         and any(_reads(kw.value, item, "content") for item in items))
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if given:
                macro_params[id(loop)] = given
    for loop in loops:
        if not isinstance(loop.target, jinja2.nodes.Name):
            continue
        if any(_reads(loop.iter, item, "content") for item in items):
            yield loop
        elif isinstance(loop.iter, jinja2.nodes.Name) and (
                loop.iter.name in macro_params.get(id(loop), ())
                or (id(loop) not in in_macros and loop.iter.name == "content")):
            yield loop


def tool_calls_for_template(tool_calls: Any) -> list[dict[str, Any]]:
    """OpenAI tool calls -> fresh dicts whose `function.arguments` is an object, as Hugging Face
    templates read them (`tool_call.function.arguments | tojson`, `.items()`).

    OpenAI sends `arguments` as JSON text. Text that is not a JSON object becomes `{}` with a
    warning (vLLM's rule): it is history the model wrote, and refusing it would fail every later
    turn of the conversation too. Missing or empty arguments are `{}` as well.
    """
    if not isinstance(tool_calls, list):
        raise ValueError(f"tool_calls must be a list, got {type(tool_calls).__name__}")
    out = []
    for j, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or call.get("type", "function") != "function":
            raise ValueError(f"tool_calls[{j}] must be an object of type 'function' with a 'function' object")
        out.append({**call, "function": {**function, "arguments": _arguments(function)}})
    return out


def _arguments(function: Mapping[str, Any]) -> dict[str, Any]:
    arguments = function.get("arguments")
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if not arguments:
        return {}
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except (ValueError, RecursionError):     # not JSON (JSONDecodeError), or past json's limits
        parsed = None
    if not isinstance(parsed, dict):
        log.warning("tool call %r: arguments are not a JSON object (%d characters); rendered as {}",
                    function.get("name"), len(str(arguments)))
        return {}
    return parsed


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; we render the body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON (as in transformers).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template, rendered the way transformers' `apply_chat_template` renders it.

    The template is untrusted code from the model file, so it runs in Jinja's immutable sandbox.
    """

    def __init__(self, source: str):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self._template = env.from_string(source)

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, **variables: Any) -> str:
        """Render normalized `messages`; `variables` (tools, documents, bos_token, ...) become template globals.

        With `continue_final_message` the text ends inside the last message, right after its content,
        so the model continues it; `add_generation_prompt` is then ignored.
        """
        if continue_final_message:
            content = messages[-1].get("content") if messages else None
            if isinstance(content, str):
                final = content
                content = final + _CONTINUE_TAG
            elif isinstance(content, list) and content and isinstance(content[-1].get("text"), str):
                final = content[-1]["text"]            # the "openai" content format: the last part
                content = [*content[:-1], {**content[-1], "text": final + _CONTINUE_TAG}]
            else:
                raise ValueError("continue_final_message needs a final message with text content")
            messages = [*messages[:-1], {**messages[-1], "content": content}]
            add_generation_prompt = False
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        if not continue_final_message:
            return text
        return _cut_at_continue_tag(text, final)


def _cut_at_continue_tag(text: str, final: str) -> str:
    tag_at = text.rfind(_CONTINUE_TAG.strip())
    if tag_at < 0 or final.strip() not in text:
        raise ValueError("continue_final_message: the chat template dropped or altered the final message's content")
    if text.startswith(_CONTINUE_TAG, tag_at):
        return text[:tag_at]
    return text[:tag_at].rstrip()  # the template trimmed the content's trailing whitespace (and our tag's space)
