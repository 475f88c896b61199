"""A tool parser plugin, given to the server as a file: ``--tool-parser-plugin
tool_parser.py --tool-call-parser example_xml --enable-auto-tool-choice``. Its format:
``<call name="NAME">{JSON arguments}</call>``, any number of them; the text outside the tags is
the message's content."""
from __future__ import annotations

import re

from actors.frontend.tool_parsers import Call, Reading, ToolParser, ToolParserManager, held_back

OPEN = "<call"
CALL = re.compile(r'<call name="([^"]*)">(.*?)</call>', re.S)


@ToolParserManager.register_module("example_xml")
class ExampleXmlToolParser(ToolParser):
    def read(self, text: str, final: bool) -> Reading:
        """Each reading extends the one before (what streaming sends): while the text may still
        be inside a call, or at the start of one, that part is held back."""
        content: list[str] = []
        calls: list[Call] = []
        i = 0
        for m in CALL.finditer(text):
            content.append(text[i:m.start()])
            calls.append(Call(m.group(1), m.group(2).strip()))
            i = m.end()
        rest = text[i:]
        if not final:
            start = rest.find(OPEN)
            rest = rest[:start] if start >= 0 else held_back(rest, OPEN)
        content.append(rest)
        return Reading("".join(content), calls)
