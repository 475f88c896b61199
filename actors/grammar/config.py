"""vLLM's --structured-outputs-config, as Troupe takes it: the backend is always xgrammar (vLLM's
"auto" picks it first), and ``disable_any_whitespace`` decides whether JSON may carry whitespace
between its tokens (vLLM's default: it may; set, the output is compact)."""
from __future__ import annotations

from typing import Any, Mapping

import msgspec

from actors.engine.json_flags import checked_fields, convert, parse_object

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


WHAT = "structured outputs config"


def structured_outputs_config(value: StructuredOutputsConfig | Mapping[str, Any] | str | None) -> StructuredOutputsConfig:
    """--structured-outputs-config (JSON text) or the offline API's dict; ValueError naming what
    Troupe does not do."""
    if value is None:
        return StructuredOutputsConfig()
    if isinstance(value, StructuredOutputsConfig):
        return value
    raw = parse_object(value, "--structured-outputs-config") if isinstance(value, str) else value
    if isinstance(raw, Mapping):
        if raw.get("reasoning_parser_plugin"):
            raise ValueError("--structured-outputs-config: Troupe loads no reasoning parser plugins "
                             "(reasoning_parser: deepseek_r1 or qwen3)")
        raw = {k: v for k, v in raw.items() if k != "reasoning_parser_plugin"}
    fields = checked_fields(StructuredOutputsConfig, raw, WHAT)
    if fields.get("backend", "auto") not in BACKENDS:
        raise ValueError(f"--structured-outputs-config: backend {fields['backend']!r} is not one Troupe runs; "
                         "Troupe's structured outputs always use xgrammar (\"auto\" or \"xgrammar\")")
    if fields.get("enable_in_reasoning") is False:
        raise ValueError("--structured-outputs-config: enable_in_reasoning false is not implemented: Troupe's "
                         "grammar constrains a request from its first token, reasoning included")
    return convert(StructuredOutputsConfig, fields, WHAT)
