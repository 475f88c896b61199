"""Tool calls read out of generated text. One parser per format: the model formats chosen with
``--tool-call-parser`` (vLLM's names, ``TOOL_PARSERS``: ``hermes``, the
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` of Hermes and Qwen2.5 models, and
``llama3_json``, ``{"name": ..., "parameters": ...}`` objects joined by ``;``, and ``pythonic`` /
``llama4_pythonic``, a Python list of calls ``[name(key=value, ...)]``, and ``mistral``, calls after
its ``[TOOL_CALLS]`` token, and ``qwen3_coder``, XML calls whose values the tools' schemas type,
and ``openai``, gpt-oss's harmony messages to ``functions.NAME``),
and the two that
constrained decoding produces for ``tool_choice`` ``"required"`` (a JSON array of
``{"name", "parameters"}``) and a named function (its arguments alone).

A parser reads the whole text so far and says what is safely known of it: the content, and each
call whose name is known with the raw JSON text of its arguments so far. Each reading extends
the one before, so a stream sends what a reading adds (``ToolCallStream``) and the
concatenated stream equals the plain answer, which is the final reading."""
from __future__ import annotations

import ast
import json
import math
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from actors.frontend import harmony


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str          # JSON text; whole once the call is


@dataclass(frozen=True, slots=True)
class Reading:
    content: str
    calls: list[Call] = field(default_factory=list)


class Malformed(ValueError):
    """Text that cannot be the JSON a format expects."""


# -- scanning JSON that may still be arriving -------------------------------------------------
_WS = re.compile(r"\s*")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_PLAIN = re.compile(r'[^"{}\[\]]+')
_LITERAL = re.compile(r"-?[0-9][0-9.eE+\-]*|-|true|false|null|t|tr|tru|f|fa|fal|fals|n|nu|nul")


def skip_ws(s: str, i: int) -> int:
    return _WS.match(s, i).end()


def value_end(s: str, i: int) -> int | None:
    """Where the JSON value starting at ``s[i]`` ends, or None while it is incomplete."""
    c = s[i]
    if c == '"':
        m = _STRING.match(s, i)
        return m.end() if m else None
    if c in "{[":
        depth, j = 0, i
        while j < len(s):
            ch = s[j]
            if ch == '"':
                m = _STRING.match(s, j)
                if m is None:
                    return None
                j = m.end()
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            else:
                j = _PLAIN.match(s, j).end()
                continue
            j += 1
        return None
    m = _LITERAL.match(s, i)
    if m is None:
        raise Malformed(f"not a JSON value at {s[i:i + 20]!r}")
    return m.end() if m.end() < len(s) else None       # a literal at the end may go on


@dataclass(slots=True)
class ObjectScan:
    members: dict[str, tuple[int, int | None]]   # key -> the span of its value (end None: incomplete)
    end: int | None                              # past the closing brace; None: incomplete


def scan_object(s: str, i: int) -> ObjectScan:
    """The members of the JSON object starting at ``s[i] == "{"``, as far as the text goes."""
    scan = ObjectScan({}, None)
    j = skip_ws(s, i + 1)
    if j < len(s) and s[j] == "}":
        scan.end = j + 1
        return scan
    while j < len(s):
        if s[j] != '"':
            raise Malformed(f"expected a key at {s[j:j + 20]!r}")
        m = _STRING.match(s, j)
        if m is None:
            return scan
        key = json.loads(m.group())
        j = skip_ws(s, m.end())
        if j >= len(s):
            return scan
        if s[j] != ":":
            raise Malformed(f"expected ':' at {s[j:j + 20]!r}")
        j = skip_ws(s, j + 1)
        if j >= len(s):
            return scan
        end = value_end(s, j)
        scan.members[key] = (j, end)
        if end is None:
            return scan
        j = skip_ws(s, end)
        if j >= len(s):
            return scan
        if s[j] == "}":
            scan.end = j + 1
            return scan
        if s[j] != ",":
            raise Malformed(f"expected ',' or '}}' at {s[j:j + 20]!r}")
        j = skip_ws(s, j + 1)
    return scan


def call_of(s: str, scan: ObjectScan, argument_keys: tuple[str, ...]) -> Call | None:
    """The call an object states, once its name is whole; arguments under the first of
    ``argument_keys`` present (raw JSON text, or the text of a JSON string holding it)."""
    span = scan.members.get("name")
    if span is None or span[1] is None:
        return None
    name = json.loads(s[span[0]:span[1]])
    if not isinstance(name, str):
        raise Malformed(f"a tool call's name must be a string, got {name!r}")
    key = next((k for k in argument_keys if k in scan.members), None)
    if key is None:
        return Call(name, "{}" if scan.end is not None else "")
    start, end = scan.members[key]
    if s[start] == '"':                 # arguments sent as a JSON string: whole or nothing
        return Call(name, json.loads(s[start:end]) if end is not None else "")
    return Call(name, s[start:end if end is not None else len(s)])


def held_back(text: str, tag: str) -> str:
    """``text`` less a tail that may be the start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return text[:-k]
    return text


def _objects(text: str, j: int, argument_keys: tuple[str, ...], sep: str) -> tuple[list[Call], int | None]:
    """Calls stated by objects from ``text[j]`` on, separated by ``sep``; and where the last
    whole one ends (None: the text stops inside one, or is not such a list)."""
    calls: list[Call] = []
    while True:
        j = skip_ws(text, j)
        if j >= len(text) or text[j] != "{":
            return calls, None
        try:
            scan = scan_object(text, j)
            call = call_of(text, scan, argument_keys)
        except (Malformed, ValueError):
            return calls, None
        if call is not None:
            calls.append(call)
        if scan.end is None:
            return calls, None
        j = skip_ws(text, scan.end)
        if j < len(text) and text[j] == sep:
            j += 1
            continue
        return calls, j


# -- parsers --------------------------------------------------------------------------------
class ToolParser(ABC):
    name: ClassVar[str]
    # the format's markers are special tokens in some vocabularies: keep them in the text
    keeps_special_tokens: ClassVar[bool] = False
    # the request's tools (set by the server before the first reading): a format that writes
    # arguments as text types them by their schemas
    tools: list[Any] | None = None
    # xgrammar's name of the format (``get_model_structural_tag``), for --tool-strict-level to hold
    # tool_choice "auto" calls to it; None: the format is not held
    structural_tag_model: ClassVar[str | None] = None

    @abstractmethod
    def read(self, text: str, final: bool) -> Reading:
        """What ``text`` (the whole output so far; ``final``: all of it) says."""


TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register(cls: type[ToolParser]) -> type[ToolParser]:
    TOOL_PARSERS[cls.name] = cls
    return cls


class ToolParserManager:
    """vLLM's registry interface for tool parsers, over ``TOOL_PARSERS``: a file given to
    ``--tool-parser-plugin`` registers its parsers with it (vLLM's flag), and
    ``--tool-call-parser`` then names one::

        from actors.frontend.tool_parsers import Call, Reading, ToolParser, ToolParserManager

        @ToolParserManager.register_module("pipe")
        class PipeToolParser(ToolParser):
            def read(self, text, final):          # "name|{json arguments}" is one call
                ...
    """
    tool_parsers = TOOL_PARSERS

    @classmethod
    def register_module(cls, name: str | list[str] | None = None, force: bool = True,
                        module: type[ToolParser] | None = None) -> Any:
        """Register ``module`` under ``name`` (names; default: its ``name``, else its class
        name), or, without ``module``, return a decorator that does. ``force`` off: a name
        already taken is a KeyError."""
        if not isinstance(force, bool):
            raise TypeError(f"force must be a boolean, but got {type(force)}")

        def add(parser: type[ToolParser]) -> type[ToolParser]:
            if not (isinstance(parser, type) and issubclass(parser, ToolParser)):
                raise TypeError(f"a tool parser must subclass ToolParser, got {parser!r}")
            names = [name] if isinstance(name, str) else list(name or [getattr(parser, "name", parser.__name__)])
            for n in names:
                if not force and n in TOOL_PARSERS:
                    raise KeyError(f"{n} is already registered as a tool parser")
            if not isinstance(getattr(parser, "name", None), str):
                parser.name = names[0]
            for n in names:
                TOOL_PARSERS[n] = parser
            return parser

        return add(module) if module is not None else add

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        if name not in TOOL_PARSERS:
            raise KeyError(f"tool helper parser '{name}' not found.")
        return TOOL_PARSERS[name]

    @classmethod
    def import_tool_parser(cls, plugin_path: str) -> None:
        """Run the Python file ``plugin_path`` (its parsers register themselves); ValueError
        naming it when it cannot be read or fails."""
        from actors.frontend.reasoning import import_plugin_file
        import_plugin_file(plugin_path, "--tool-parser-plugin")


def tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose from {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


@register
class HermesToolParser(ToolParser):
    """Content, then ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes,
    Qwen2.5). Text between and after the blocks joins the content, stripped."""
    name = "hermes"
    keeps_special_tokens = True
    structural_tag_model = "qwen_3"          # xgrammar's name of Hermes' envelope
    START, END = "<tool_call>", "</tool_call>"

    def read(self, text: str, final: bool) -> Reading:
        content: list[str] = []
        calls: list[Call] = []
        i = 0
        while True:
            k = text.find(self.START, i)
            if k < 0:
                tail = text[i:] if final else held_back(text[i:], self.START)
                content.append(tail if not calls else tail.strip())
                break
            content.append(text[i:k] if not calls else text[i:k].strip())
            found, end = _objects(text, k + len(self.START), ("arguments", "parameters"), "\0")
            calls += found[:1]
            if end is None:
                break
            close = text.find(self.END, end)
            if close < 0:
                break
            i = close + len(self.END)
        return Reading("".join(content), calls)


@register
class OpenAIToolParser(ToolParser):
    """gpt-oss's tool calls in its harmony messages (actors/frontend/harmony.py): each message to
    a recipient (``to=functions.get_weather``) is a call of that function, its body the
    arguments; the final and commentary channels' bodies are the content (analysis messages are
    left out: the ``openai_gptoss`` reasoning parser shows them)."""
    name = "openai"
    keeps_special_tokens = True

    def read(self, text: str, final: bool) -> Reading:
        messages = harmony.read(text, final)
        calls = [Call(harmony.function_name(m.recipient), m.body) for m in messages if harmony.is_call(m)]
        content = "".join(m.body for m in messages if not harmony.is_call(m) and not harmony.is_builtin(m)
                          and m.channel != harmony.ANALYSIS)
        return Reading(content, calls)


@register
class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: the output is ``{"name": ..., "parameters": {...}}`` objects joined
    by ``;``, after an optional ``<|python_tag|>``; any other output is content."""
    name = "llama3_json"
    keeps_special_tokens = True
    structural_tag_model = "llama"
    TAG = "<|python_tag|>"

    def read(self, text: str, final: bool) -> Reading:
        s = text.lstrip()
        start = len(text) - len(s)
        if s.startswith(self.TAG):
            start += len(self.TAG)
        elif not s.startswith("{"):
            return Reading("" if not final and self.TAG.startswith(s) else text)
        calls, _ = _objects(text, start, ("parameters", "arguments"), ";")
        if final and not calls:
            return Reading(text)
        return Reading("", calls)


class _JsonArrayToolParser(ToolParser):
    """Calls as a JSON array of ``{"name", "arguments"}`` objects (``"parameters"`` read too)
    after one of ``TAGS``; an output that is not such a call is content."""
    TAGS: ClassVar[tuple[str, ...]]
    BARE_ARRAY: ClassVar[bool] = False       # an array without a tag is calls too

    def read(self, text: str, final: bool) -> Reading:
        s = text.lstrip()
        start = len(text) - len(s)
        tag = next((t for t in self.TAGS if s.startswith(t)), None)
        if tag is not None:
            start += len(tag)
        elif not (self.BARE_ARRAY and s.startswith("[")):
            may_start = not final and any(t.startswith(s) for t in self.TAGS)
            return Reading("" if may_start else text)
        j = skip_ws(text, start)
        if j >= len(text):
            return Reading(text if final else "")
        if text[j] != "[":
            return Reading(text)
        calls, _ = _objects(text, j + 1, ("arguments", "parameters"), ",")
        if final and not calls:
            return Reading(text)
        return Reading("", calls)


@register
class GraniteToolParser(_JsonArrayToolParser):
    """Granite 3.x's calls (vLLM's ``granite``): ``<|tool_call|>`` (Granite 3.0 8B:
    ``<tool_call>``) then a JSON array of ``{"name", "arguments"}`` objects, or the bare array."""
    name = "granite"
    keeps_special_tokens = True
    TAGS = ("<|tool_call|>", "<tool_call>")
    BARE_ARRAY = True


@register
class Phi4MiniJsonToolParser(_JsonArrayToolParser):
    """Phi-4-mini's calls (vLLM's ``phi4_mini_json``): ``functools[{"name": ..., "arguments":
    {...}}, ...]``."""
    name = "phi4_mini_json"
    TAGS = ("functools",)


# JSON Schema type names and the spellings models and schemas use for them (vLLM's aliases)
_TYPE_NAMES = {"str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
               "int": "integer", "int32": "integer", "int64": "integer", "uint": "integer", "uint32": "integer",
               "uint64": "integer", "long": "integer", "short": "integer", "unsigned": "integer",
               "float": "number", "float32": "number", "float64": "number", "double": "number",
               "bool": "boolean", "dict": "object", "arr": "array", "list": "array", "sequence": "array"}


def schema_types(schema: Any) -> set[str]:
    """The JSON types a schema allows: its ``type`` (one or a list), its ``enum`` values' types,
    those of its ``anyOf`` / ``oneOf`` / ``allOf``; {"string"} when it says none."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    given = schema.get("type")
    for t in [given] if isinstance(given, str) else given if isinstance(given, list) else []:
        if isinstance(t, str):
            types.add(_TYPE_NAMES.get(t.strip().lower(), t.strip().lower()))
    for v in schema.get("enum") or []:
        types.add("null" if v is None else "boolean" if isinstance(v, bool) else "integer" if isinstance(v, int)
                  else "number" if isinstance(v, float) else "array" if isinstance(v, list)
                  else "object" if isinstance(v, dict) else "string")
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or []:
            types |= schema_types(sub)
    return types or {"string"}


def _finite(v: Any) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, list):
        return all(_finite(x) for x in v)
    if isinstance(v, dict):
        return all(_finite(x) for x in v.values())
    return True


def typed_value(text: str, schema: Any) -> Any:
    """A parameter's text as the first of its schema's types it reads as (null, integer, number,
    boolean, object, array, string: vLLM's order); without a fitting type, its JSON value, else
    the text."""
    types = schema_types(schema)
    for t in ("null", "integer", "number", "boolean", "object", "array", "string"):
        if t not in types:
            continue
        if t == "string":
            return text
        if t == "null" and text.strip().lower() == "null":
            return None
        if t == "integer":
            try:
                return int(text)
            except ValueError:
                continue
        if t == "number":
            try:
                v = float(text)
            except ValueError:
                continue
            if math.isfinite(v):
                return int(v) if v == int(v) else v
        if t == "boolean" and text.strip().lower() in ("true", "1", "false", "0"):
            return text.strip().lower() in ("true", "1")
        if t in ("object", "array"):
            try:
                v = json.loads(text)
            except ValueError:
                continue
            if _finite(v):
                return v
    try:
        v = json.loads(text)
    except ValueError:
        return text
    return v if _finite(v) else text


@register
class Qwen3CoderToolParser(ToolParser):
    """Qwen3-Coder's XML calls (vLLM's ``qwen3_coder``, also named ``qwen3_xml``)::

        <tool_call>
        <function=get_weather>
        <parameter=city>
        Paris
        </parameter>
        <parameter=days>
        3
        </parameter>
        </function>
        </tool_call>

    Each value is text (one newline either side is the template's), typed by the parameter's
    schema in the request's tools (``typed_value``: ``3`` is the integer 3 where the schema says
    integer, the string "3" where it says string). A ``<function=`` without ``<tool_call>`` is a
    call too (vLLM's fallback); text outside the calls is the content. A parameter joins the
    arguments once its value is whole, so the streamed arguments are the final ones' prefixes."""
    name = "qwen3_coder"
    keeps_special_tokens = True
    structural_tag_model = "qwen_3_coder"
    START, END, FUNC, FUNC_END = "<tool_call>", "</tool_call>", "<function=", "</function>"
    PARAM = re.compile(r"<parameter=([^>]*)>(.*?)(</parameter>|(?=<parameter=)|\Z)", re.S)

    def read(self, text: str, final: bool) -> Reading:
        content: list[str] = []
        calls: list[Call] = []
        i = 0
        while True:
            starts = [k for k in (text.find(self.START, i), text.find(self.FUNC, i)) if k >= 0]
            if not starts:
                tail = text[i:]
                if not final:
                    for tag in (self.START, self.FUNC, self.END):
                        tail = held_back(tail, tag)
                content.append(tail if not calls else tail.strip())
                break
            k = min(starts)
            content.append(text[i:k] if not calls else text[i:k].strip())
            f = text.find(self.FUNC, k)
            gt = text.find(">", f + len(self.FUNC)) if f >= 0 else -1
            if gt < 0:                              # the call's name is still coming
                break
            name = text[f + len(self.FUNC):gt].strip()
            end = text.find(self.FUNC_END, gt + 1)
            closed = end >= 0 or final
            calls.append(Call(name, self._arguments(name, text[gt + 1:end if end >= 0 else len(text)], closed)))
            if end < 0:
                break
            i = end + len(self.FUNC_END)
            after = skip_ws(text, i)
            if text.startswith(self.END, after):     # its </tool_call> (vLLM takes calls without one too)
                i = after + len(self.END)
        return Reading("".join(content), calls)

    def _arguments(self, name: str, body: str, closed: bool) -> str:
        """The JSON text of the parameters whose values are whole (all of them once ``closed``)."""
        tool = next((t for t in self.tools or () if t.function.name == name), None)
        properties = ((tool.function.parameters or {}).get("properties") or {}) if tool is not None else {}
        members = []
        for m in self.PARAM.finditer(body):
            if not m.group(3) and not closed and not body.startswith("<parameter=", m.end()):
                break                                # its value may go on
            value = m.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            key = m.group(1).strip()
            members.append(f"{json.dumps(key, ensure_ascii=False)}: "
                           f"{json.dumps(typed_value(value, properties.get(key)), ensure_ascii=False)}")
        return "{" + ", ".join(members) + ("}" if closed else "")


TOOL_PARSERS["qwen3_xml"] = Qwen3CoderToolParser


@register
class MistralToolParser(ToolParser):
    """Mistral's calls after its ``[TOOL_CALLS]`` token (vLLM's ``mistral``), in either of its
    tokenizers' formats: a JSON array of ``{"name", "arguments"}`` objects (before v11:
    ``[TOOL_CALLS] [{"name": "f", "arguments": {...}}]``), or each call as its name then its JSON
    arguments (v11 and later: ``[TOOL_CALLS]f[ARGS]{...}``, or ``[TOOL_CALLS]f{...}``), a
    ``[TOOL_CALLS]`` before each. The text before the first ``[TOOL_CALLS]`` is content; text
    after a call's arguments is dropped, as vLLM drops it."""
    name = "mistral"
    keeps_special_tokens = True
    BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def read(self, text: str, final: bool) -> Reading:
        k = text.find(self.BOT)
        if k < 0:
            return Reading(text if final else held_back(text, self.BOT))
        content = text[:k]
        j = skip_ws(text, k + len(self.BOT))
        if j < len(text) and text[j] == "[":            # before v11: a JSON array of calls
            calls, _ = _objects(text, j + 1, ("arguments",), ",")
            return Reading(content, calls)
        calls: list[Call] = []
        for segment in text[k + len(self.BOT):].split(self.BOT):
            name, sep, args = segment.partition(self.ARGS)
            if not sep:
                brace = segment.find("{")
                if brace < 0:                            # the name may still be coming
                    if final and segment.strip():
                        calls.append(Call(segment.strip(), "{}"))
                    break
                name, args = segment[:brace], segment[brace:]
            a = skip_ws(args, 0)
            if a >= len(args):
                calls.append(Call(name.strip(), "{}" if final else ""))
                continue
            try:
                end = value_end(args, a)
            except Malformed:
                end = None
            calls.append(Call(name.strip(), args[a:end] if end is not None else args[a:]))
            if end is None:
                break
        return Reading(content, calls)


def _python_elements(s: str, i: int) -> tuple[list[str], bool]:
    """The whole top-level elements of the Python list opening at ``s[i] == "["`` (as text), and
    whether the list is closed; strings (with escapes) and nested brackets are skipped over."""
    elements: list[str] = []
    depth, quote, start, j = 0, "", i + 1, i + 1
    while j < len(s):
        ch = s[j]
        if quote:
            if ch == "\\":
                j += 1
            elif s.startswith(quote, j):
                j += len(quote) - 1
                quote = ""
        elif ch in "'\"":
            quote = s[j:j + 3] if s[j:j + 3] in ("'''", '"""') else ch
            j += len(quote) - 1
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                if ch != "]":
                    raise Malformed(f"unbalanced {ch!r} in a call list")
                if s[start:j].strip():
                    elements.append(s[start:j])
                return elements, True
            depth -= 1
        elif ch == "," and depth == 0:
            elements.append(s[start:j])
            start = j + 1
        j += 1
    return elements, False


def _python_call(element: str) -> Call:
    """``name(key=value, ...)`` (keyword arguments, Python literals) as a call with JSON arguments."""
    try:
        node = ast.parse(element.strip(), mode="eval").body
    except SyntaxError as exc:
        raise Malformed(f"not a Python call: {element.strip()[:40]!r}") from exc
    if not isinstance(node, ast.Call) or node.args:
        raise Malformed(f"a tool call is name(key=value, ...), got {element.strip()[:40]!r}")
    name = []
    func = node.func
    while isinstance(func, ast.Attribute):       # a dotted name stays dotted, as vLLM keeps it
        name.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        raise Malformed(f"a tool call's name must be a name, got {ast.dump(node.func)[:40]!r}")
    name.append(func.id)
    try:
        arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
    except ValueError as exc:
        raise Malformed(f"a tool call's arguments must be Python literals: {exc}") from exc
    return Call(".".join(reversed(name)), json.dumps(arguments, ensure_ascii=False))


@register
class PythonicToolParser(ToolParser):
    """Llama 3.2's and Llama 4's pythonic calls (vLLM's ``pythonic``): the whole output is a Python
    list of calls with keyword arguments, ``[get_weather(city="Paris"), add(a=1, b=2.5)]``, each
    call's arguments answered as JSON; any other output is content. A call shows once it is whole
    (its arguments are Python, not JSON, so they cannot stream piece by piece)."""
    name = "pythonic"
    TAGS = ("", "")              # what the list may come between (llama4_pythonic's tags)

    def read(self, text: str, final: bool) -> Reading:
        s = text.lstrip()
        open_tag, close_tag = self.TAGS
        start = len(text) - len(s)
        if open_tag and s.startswith(open_tag):
            start += len(open_tag)
            start += len(text[start:]) - len(text[start:].lstrip())
        elif open_tag and not final and open_tag.startswith(s):
            return Reading("")
        if start >= len(text):
            return Reading("" if not final else text)
        if text[start] != "[":
            return Reading(text)
        calls: list[Call] = []
        try:
            elements, _ = _python_elements(text, start)
            for element in elements:         # the calls before one that is not a call stand
                calls.append(_python_call(element))
        except Malformed:
            pass
        if final and not calls:
            return Reading(text)
        return Reading("", calls)


@register
class Llama4PythonicToolParser(PythonicToolParser):
    """Llama 4's pythonic calls between ``<|python_start|>`` and ``<|python_end|>`` (vLLM's
    ``llama4_pythonic``), or without them."""
    name = "llama4_pythonic"
    keeps_special_tokens = True
    TAGS = ("<|python_start|>", "<|python_end|>")


class RequiredToolParser(ToolParser):
    """``tool_choice: "required"``: the constrained output is ``[{"name", "parameters"}, ...]``."""
    name = "required"

    def read(self, text: str, final: bool) -> Reading:
        j = skip_ws(text, 0)
        if j >= len(text) or text[j] != "[":
            return Reading(text if final else "")
        calls, _ = _objects(text, j + 1, ("parameters",), ",")
        return Reading("", calls)


class NamedToolParser(ToolParser):
    """A named ``tool_choice``: the constrained output is that function's arguments."""
    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def read(self, text: str, final: bool) -> Reading:
        return Reading("", [Call(self.function, text)])


# -- streaming ------------------------------------------------------------------------------
def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolCallStream:
    """One choice's output read through a parser as it arrives: each ``feed`` gives the content
    and the ``tool_calls`` delta entries (OpenAI's shape: the first entry of a call carries its
    id, type and name; later ones pieces of its arguments) that the new text adds."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls          # parallel_tool_calls false: the first call only
        self.text = ""
        self.reading = Reading("")
        self.ids: list[str] = []
        self.sent: list[int] = []           # argument characters sent, per call

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        before = self.reading
        self.reading = self.read(final)
        entries: list[dict[str, Any]] = []
        for i, call in enumerate(self.reading.calls):
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.sent.append(0)
                entries.append({"index": i, "id": self.ids[i], "type": "function",
                                "function": {"name": call.name, "arguments": ""}})
            piece = call.arguments[self.sent[i]:]
            if piece:
                if entries and entries[-1]["index"] == i and "id" in entries[-1]:
                    entries[-1]["function"]["arguments"] = piece
                else:
                    entries.append({"index": i, "function": {"arguments": piece}})
                self.sent[i] = len(call.arguments)
        return self.reading.content[len(before.content):], entries

    def read(self, final: bool) -> Reading:
        r = self.parser.read(self.text, final)
        if self.max_calls is not None and len(r.calls) > self.max_calls:
            r = Reading(r.content, r.calls[:self.max_calls])
        return r

    def message_calls(self) -> list[dict[str, Any]]:
        """The calls of the final reading in a message's shape, with the ids streamed."""
        while len(self.ids) < len(self.reading.calls):
            self.ids.append(new_call_id())
        return [{"id": self.ids[i], "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for i, c in enumerate(self.reading.calls)]
