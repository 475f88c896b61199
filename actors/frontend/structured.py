"""The request fields that ask for structured outputs, with vLLM's names: OpenAI's
``response_format`` (``json_object``, ``json_schema``, and vLLM's ``structural_tag``), vLLM's
``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``,
``structural_tag``), and its older ``guided_json``,
``guided_regex``, ``guided_choice`` and ``guided_grammar`` aliases. At most one of them may be
set; it becomes the engine's StructuredOutputsParams (compiled, and refused if it cannot be, by
the engine's GrammarCompiler before the request is admitted)."""
from __future__ import annotations

import json
from typing import Any, Literal, NamedTuple

import msgspec

from actors.engine.sampling_params import StructuredOutputsParams


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | bool | None = None     # OpenAI's field name; none: any object
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # structural_tag, vLLM's two forms: structures ({"begin", "schema", "end"}) with triggers, or a format
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None
    format: Any = None


class StructuredOutputsRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    json: dict[str, Any] | bool | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None       # vLLM's: the structural tag as JSON text


class StructuredOutputsFields(msgspec.Struct, kw_only=True):
    """The fields of a chat or completion request that ask for structured outputs."""
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class Constraint(NamedTuple):
    params: StructuredOutputsParams
    param: str                  # the request field it came from, for errors


class NotStructured(ValueError):
    """``message`` about request field ``param``."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def constraint_of(req: StructuredOutputsFields) -> Constraint | None:
    """The one constraint the request asks for, or None; NotStructured if it asks for more than
    one or for none of the kinds a field allows."""
    found = [c for c in (_response_format(req.response_format), _structured(req.structured_outputs),
                         _guided(req)) if c is not None]
    if len(found) > 1:
        raise NotStructured(f"give only one of {', '.join(c.param for c in found)}", found[1].param)
    return found[0] if found else None


def _response_format(rf: ResponseFormat | None) -> Constraint | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return Constraint(StructuredOutputsParams(json_object=True), "response_format")
    if rf.type == "structural_tag":
        if rf.format is not None and rf.structures is None and rf.triggers is None:
            tag: dict[str, Any] = {"type": "structural_tag", "format": rf.format}
        elif rf.format is None and rf.structures is not None and rf.triggers is not None:
            tag = {"type": "structural_tag", "structures": rf.structures, "triggers": rf.triggers}
        else:
            raise NotStructured("Invalid response_format structural_tag specification: give structures and "
                                "triggers, or a format", "response_format")
        return Constraint(StructuredOutputsParams(structural_tag=json.dumps(tag)), "response_format")
    if rf.json_schema is None:
        raise NotStructured("response_format of type json_schema needs json_schema", "response_format")
    schema = rf.json_schema.schema
    if schema is None:
        return Constraint(StructuredOutputsParams(json_object=True), "response_format")
    return Constraint(StructuredOutputsParams(json=json.dumps(schema)), "response_format")


def _structured(so: StructuredOutputsRequest | None) -> Constraint | None:
    if so is None:
        return None
    kinds = [k for k in ("json", "regex", "choice", "grammar", "structural_tag") if getattr(so, k) is not None]
    kinds += ["json_object"] if so.json_object else []
    if len(kinds) != 1:
        raise NotStructured(f"structured_outputs takes exactly one of json, json_object, regex, choice, grammar "
                            f"and structural_tag, got {', '.join(kinds) or 'none'}", "structured_outputs")
    return Constraint(_params(kinds[0], getattr(so, kinds[0])), "structured_outputs")


def _guided(req: StructuredOutputsFields) -> Constraint | None:
    given = [(k, getattr(req, f"guided_{k}")) for k in ("json", "regex", "choice", "grammar")
             if getattr(req, f"guided_{k}") is not None]
    if not given:
        return None
    if len(given) > 1:
        raise NotStructured(f"give only one of {', '.join('guided_' + k for k, _ in given)}", f"guided_{given[1][0]}")
    kind, value = given[0]
    return Constraint(_params(kind, value), f"guided_{kind}")


def _params(kind: str, value: Any) -> StructuredOutputsParams:
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json":
        return StructuredOutputsParams(json=value if isinstance(value, str) else json.dumps(value))
    return StructuredOutputsParams(**{kind: value})
