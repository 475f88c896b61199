"""A reasoning parser plugin, given to the server as a file: ``--reasoning-parser-plugin
reasoning_parser.py --reasoning-parser example_thought``. Its model thinks between
``<thought>`` and ``</thought>``, and opens its thinking itself (as qwen3's does)."""
from __future__ import annotations

from dataclasses import dataclass

from actors.frontend.reasoning import ReasoningParser, ReasoningParserManager


@ReasoningParserManager.register_module("example_thought")
@dataclass(frozen=True)
class ThoughtReasoningParser(ReasoningParser):
    name: str = "example_thought"
    start: str = "<thought>"
    end: str = "</thought>"
    opened_by_prompt: bool = False
