"""Tool calling on chat completions, with OpenAI's and vLLM's names and rules: ``tools``,
``tool_choice`` (``"none"``, ``"auto"``, ``"required"`` or a named function) and
``parallel_tool_calls``. ``"required"`` and a named function are enforced by constrained decoding
(a JSON schema made of the functions' ``parameters``), so their arguments always parse and
validate; ``"auto"`` reads the model's own format with the server's ``--tool-call-parser``
(``--enable-auto-tool-choice``). Tools given without ``tool_choice`` mean ``"auto"``.

vLLM's ``--tool-strict-level`` holds ``"auto"`` calls to the parser's format where xgrammar knows
it (hermes, llama3_json, qwen3_coder): the model writes text freely, and once it begins a call
(the format's trigger, ``<tool_call>`` for hermes) the rest of the call is constrained
(``strict_tool_constraint``). ``auto``: only when a tool says ``"strict": true`` (its arguments
then follow its schema; the other tools' calls are well-formed with any arguments), or
``parallel_tool_calls`` is false (one call at most); ``function``: every request with tools
(a known function's name, arguments any JSON object unless the tool is strict); ``parameter``:
every tool's arguments follow its schema, as if each were strict."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import msgspec

from actors.engine.sampling_params import StructuredOutputsParams
from actors.frontend.structured import Constraint, NotStructured
from actors.frontend.tool_parsers import (NamedToolParser, RequiredToolParser, ToolCallStream, ToolParser,
                                          tool_parser)

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None      # a JSON schema; none: no arguments
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    function: NamedFunction
    type: Literal["function"] = "function"


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolFields(Protocol):
    """The fields of a chat request about tools (ChatCompletionRequest's)."""
    tools: list[Tool] | None
    tool_choice: ToolChoice | None
    parallel_tool_calls: bool | None


@dataclass(frozen=True, slots=True)
class ToolUse:
    """How a request's output is read for tool calls."""
    parser: ToolParser
    finish_as_tool_calls: bool      # a "stop" with calls made finishes as "tool_calls"
    max_calls: int | None           # parallel_tool_calls false: 1

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.parser, self.max_calls)


def choice_of(req: ToolFields) -> str | NamedToolChoice:
    """The effective tool_choice (vLLM's rule: tools without one mean "auto"), checked against
    the tools: NotStructured naming the field otherwise."""
    choice = req.tool_choice
    if choice is None:
        return "auto" if req.tools else "none"
    if choice == "none":
        return choice
    if not req.tools:
        raise NotStructured("when using `tool_choice`, `tools` must be set", "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in _names(req):
        raise NotStructured(f"tool_choice names the function {choice.function.name!r}, which is not "
                            f"among the tools ({', '.join(_names(req))})", "tool_choice")
    return choice


def check_tools(req: ToolFields) -> None:
    names = _names(req)
    for i, name in enumerate(names):
        if not name:
            raise NotStructured("a function needs a non-empty name", f"tools[{i}].function.name")
        if name in names[:i]:
            raise NotStructured(f"two tools are named {name!r}", f"tools[{i}].function.name")


def tool_constraint(req: ToolFields) -> Constraint | None:
    """The JSON schema ``"required"`` or a named function holds the output to."""
    choice = choice_of(req)
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in req.tools or [] if t.function.name == choice.function.name)
        return Constraint(StructuredOutputsParams(json=json.dumps(_parameters(tool))), "tool_choice")
    if choice == "required":
        schema = required_schema(req.tools or [], 1 if req.parallel_tool_calls is False else None)
        return Constraint(StructuredOutputsParams(json=json.dumps(schema)), "tools")
    return None


TOOL_STRICT_LEVELS = ("auto", "function", "parameter")


def strict_tool_constraint(req: ToolFields, use: ToolUse | None, level: str) -> Constraint | None:
    """The structural tag (xgrammar's, for the parser's format) that ``--tool-strict-level``
    ``level`` holds a tool_choice "auto" request's calls to; None where nothing is held."""
    model = use.parser.structural_tag_model if use is not None else None
    if model is None or choice_of(req) != "auto" or not req.tools:
        return None
    rank = TOOL_STRICT_LEVELS.index(level)
    single = req.parallel_tool_calls is False
    if single:                   # at most one call: the call's envelope has to be in the grammar
        rank = max(rank, 1)
    if rank == 0 and not any(t.function.strict is True for t in req.tools):
        return None
    tools = [{"type": "function", "function": {"name": t.function.name, "parameters": _parameters(t),
                                               "strict": rank >= 2 or t.function.strict is True}}
             for t in req.tools]
    import xgrammar              # the frontend's first strict request pays for the import
    tag = xgrammar.get_model_structural_tag(model, tools=tools, tool_choice="auto", reasoning="disabled",
                                            parallel_tool_calls=not single)
    return Constraint(StructuredOutputsParams(structural_tag=tag.model_dump_json()), "tools")


def required_schema(tools: list[Tool], max_calls: int | None = None) -> dict[str, Any]:
    """An array of at least one (and at most ``max_calls``) ``{"name": <a tool's name>,
    "parameters": <its arguments>}`` (vLLM's shape for "required"); the tools' ``$defs``
    gathered at the top."""
    defs: dict[str, Any] = {}
    variants = []
    for t in tools:
        params = dict(_parameters(t))
        defs.update(params.pop("$defs", {}))
        variants.append({"properties": {"name": {"type": "string", "enum": [t.function.name]},
                                        "parameters": params},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    if defs:
        schema["$defs"] = defs
    return schema


def tool_use(req: ToolFields, auto_parser: str | None) -> ToolUse | None:
    """How the output is read, or None when it is plain content. ``auto_parser``: the server's
    --tool-call-parser when --enable-auto-tool-choice is set."""
    choice = choice_of(req)
    max_calls = 1 if req.parallel_tool_calls is False else None
    if isinstance(choice, NamedToolChoice):
        return ToolUse(NamedToolParser(choice.function.name), False, 1)
    if choice == "required":
        return ToolUse(RequiredToolParser(), True, max_calls)
    if choice == "auto":
        if auto_parser is None:
            raise NotStructured('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                'to be set', "tool_choice")
        parser = tool_parser(auto_parser)
        parser.tools = req.tools            # a format that types its arguments reads their schemas
        return ToolUse(parser, True, max_calls)
    return None


def template_tools(req: ToolFields, exclude_when_none: bool = False) -> list[dict[str, Any]] | None:
    """The tools as a chat template reads them (OpenAI's shape, as plain objects); none for
    tool_choice "none" with ``exclude_when_none`` (vLLM's --exclude-tools-when-tool-choice-none)."""
    if not req.tools or (exclude_when_none and req.tool_choice == "none"):
        return None
    return [{"type": "function", "function": {k: v for k, v in msgspec.structs.asdict(t.function).items()
                                              if v is not None}} for t in req.tools]


def _names(req: ToolFields) -> list[str]:
    return [t.function.name for t in req.tools or []]


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or EMPTY_PARAMETERS
