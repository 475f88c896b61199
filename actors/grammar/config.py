"""vLLM's --structured-outputs-config, as Troupe takes it: the backend is always xgrammar (vLLM's
"auto" picks it first), and ``disable_any_whitespace`` decides whether JSON may carry whitespace
between its tokens (vLLM's default: it may; set, the output is compact)."""
from __future__ import annotations

import json
from typing import Any

import msgspec

BACKENDS = ("auto", "xgrammar")


class StructuredOutputsConfig(msgspec.Struct, frozen=True, kw_only=True):
    backend: str = "auto"
    disable_fallback: bool = False          # Troupe never falls back to another backend anyway
    disable_any_whitespace: bool = False    # JSON without whitespace between its tokens
    disable_additional_properties: bool = False   # vLLM's guidance backend's option; xgrammar ignores it
    reasoning_parser: str = ""              # the same as --reasoning-parser
    enable_in_reasoning: bool = True        # Troupe's grammar constrains a request from its first token

    @property
    def any_whitespace(self) -> bool:
        return not self.disable_any_whitespace


FIELDS = tuple(StructuredOutputsConfig.__struct_fields__) + ("reasoning_parser_plugin",)


def structured_outputs_config(value: StructuredOutputsConfig | dict[str, Any] | str | None) -> StructuredOutputsConfig:
    """--structured-outputs-config (JSON text) or the offline API's dict; ValueError naming what
    Troupe does not do."""
    if value is None:
        return StructuredOutputsConfig()
    if isinstance(value, StructuredOutputsConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--structured-outputs-config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--structured-outputs-config takes a JSON object, got {value!r}")
    unknown = set(value) - set(FIELDS)
    if unknown:
        raise ValueError(f"--structured-outputs-config: unknown field(s) {sorted(unknown)}; accepted: {', '.join(FIELDS)}")
    fields = dict(value)
    if fields.get("backend", "auto") not in BACKENDS:
        raise ValueError(f"--structured-outputs-config: backend {fields['backend']!r} is not one Troupe runs; "
                         "Troupe's structured outputs always use xgrammar (\"auto\" or \"xgrammar\")")
    if fields.pop("reasoning_parser_plugin", ""):
        raise ValueError("--structured-outputs-config: Troupe loads no reasoning parser plugins "
                         "(reasoning_parser: deepseek_r1 or qwen3)")
    if fields.get("enable_in_reasoning") is False:
        raise ValueError("--structured-outputs-config: enable_in_reasoning false is not implemented: Troupe's "
                         "grammar constrains a request from its first token, reasoning included")
    for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties", "enable_in_reasoning"):
        if name in fields and not isinstance(fields[name], bool):
            raise ValueError(f"--structured-outputs-config: {name} must be true or false, got {fields[name]!r}")
    if not isinstance(fields.get("reasoning_parser", ""), str):
        raise ValueError("--structured-outputs-config: reasoning_parser must be a string")
    return StructuredOutputsConfig(**fields)
