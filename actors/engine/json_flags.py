"""vLLM's JSON-object options (``--kv-transfer-config``, ``--speculative-config``,
``--kv-events-config``): the command line's JSON text or the offline API's dict, checked at the
edge into their config structs, every error a ValueError naming what is wrong."""
from __future__ import annotations

import json
from typing import Any, Mapping, TypeVar

import msgspec

S = TypeVar("S", bound=msgspec.Struct)


def parse_object(text: str, flag: str) -> Any:
    """The JSON value of ``flag``'s text."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{flag} is not valid JSON ({exc}): {text!r}") from None


def checked_fields(cls: type[S], raw: Any, what: str) -> dict[str, Any]:
    """``raw`` as a dict of ``cls``'s fields: a JSON object with no key ``cls`` lacks."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"the {what} must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(cls.__struct_fields__))
    if unknown:
        raise ValueError(f"unsupported {what} field(s) {', '.join(unknown)}; "
                         f"accepted: {', '.join(cls.__struct_fields__)}")
    return dict(raw)


def convert(cls: type[S], fields: dict[str, Any], what: str) -> S:
    """``fields`` as ``cls`` (types checked, its ``__post_init__`` run)."""
    try:
        return msgspec.convert(fields, cls)
    except msgspec.ValidationError as exc:      # a wrong type, or a check of __post_init__
        raise ValueError(f"invalid {what}: {exc}") from None


def struct_of(cls: type[S], value: Mapping[str, Any] | str, flag: str, what: str) -> S:
    """``value`` (``flag``'s JSON text, or a dict) as ``cls``."""
    raw = parse_object(value, flag) if isinstance(value, str) else value
    return convert(cls, checked_fields(cls, raw, what), what)
