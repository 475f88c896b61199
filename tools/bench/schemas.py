"""Fifty JSON schemas of varied shape, for the structured-output tests and benchmark."""
from __future__ import annotations


def schemas() -> list[dict]:
    """50 schemas: nested objects, bounded arrays, enums, bounded numbers, optional and required
    fields, anyOf, patterns, formats, consts and nullables, in ten shapes of five variants."""
    def text(n: int) -> dict:
        return {"type": "string", "maxLength": n}
    shapes = [
        lambda i: {"type": "object", "properties": {"name": text(8 + i), "count": {"type": "integer", "minimum": i,
                   "maximum": 10 + i}, "ok": {"type": "boolean"}}, "required": ["name", "count", "ok"][:2 + i % 2]},
        lambda i: {"type": "object", "properties": {"person": {"type": "object", "properties": {
                   "name": text(10), "age": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["name", "age"]}, "tags": {"type": "array", "items": text(6), "minItems": 1,
                   "maxItems": 1 + i}}, "required": ["person", "tags"]},
        lambda i: {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue", "black"][:2 + i % 3]},
                   "size": {"enum": [1, 2, 3 + i]}}, "required": ["color", "size"]},
        lambda i: {"type": "object", "properties": {"x": {"type": "number", "minimum": -10 - i, "maximum": 10},
                   "y": {"type": "integer", "minimum": 0, "maximum": 5 + i}}, "required": ["x", "y"]},
        lambda i: {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0,
                   "maximum": 9}, text(5 + i)]}}, "required": ["value"]},
        lambda i: {"type": "object", "properties": {"code": {"type": "string",
                   "pattern": f"^[A-Z]{{{2 + i % 3}}}-[0-9]{{2}}$"}}, "required": ["code"]},
        lambda i: {"type": "object", "properties": {"day": {"type": "string", "format": "date"},
                   "note": text(4 + i)}, "required": ["day"] + (["note"] if i % 2 else [])},
        lambda i: {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object",
                   "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 50}, "ok": {"type": "boolean"}},
                   "required": ["id", "ok"]}, "minItems": 1, "maxItems": 1 + i % 3}}, "required": ["items"]},
        lambda i: {"type": "object", "properties": {"a": text(5), "b": {"type": "integer", "minimum": 0,
                   "maximum": 3}}, "required": ["a"], "additionalProperties": False},
        lambda i: {"type": "object", "properties": {"kind": {"const": f"point{i}"},
                   "note": {"type": ["string", "null"], "maxLength": 6}}, "required": ["kind", "note"]},
    ]
    return [shape(i) for shape in shapes for i in range(5)]
