"""Tool-call parsers: what each format's text says, and that streaming it in any chunking sends
deltas that add up to the plain reading (name first, arguments in pieces, content held back only
while it may be the start of a tag)."""
from __future__ import annotations

import json
import os
import random

import jsonschema
import msgspec
import pytest

from actors.frontend.protocol import ChatCompletionRequest
from actors.frontend.structured import NotStructured
from actors.frontend.tool_parsers import (TOOL_PARSERS, Call, GraniteToolParser, HermesToolParser,
                                          Llama3JsonToolParser, NamedToolParser, Phi4MiniJsonToolParser, Reading,
                                          RequiredToolParser, ToolCallStream, ToolParserManager, tool_parser)
from actors.frontend.tools import required_schema, tool_constraint, tool_use

HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], '
          '"note": "a } and a \\" inside"}}\n</tool_call>\n<tool_call>\n{"arguments": {"a": -1.5e3}, "name": "add"}'
          '\n</tool_call>')
LLAMA = '<|python_tag|>{"name": "f", "parameters": {"x": [1, {"y": "}"}]}}; {"name": "g", "parameters": {}}'
GRANITE = '<|tool_call|>[{"name": "f", "arguments": {"x": "a], {b"}}, {"name": "g", "arguments": {}}]'
PHI4 = 'functools[{"name": "f", "arguments": {"x": [1, 2]}}, {"name": "g", "parameters": {"y": "z"}}]'


def stream_all(parser, text: str, sizes: list[int], max_calls=None) -> tuple[str, list[dict], ToolCallStream]:
    s = ToolCallStream(parser, max_calls)
    content, calls, pos = "", {}, 0
    for size in sizes:
        piece, pos = text[pos:pos + size], pos + size
        got, entries = s.feed(piece, pos >= len(text))
        content += got
        for e in entries:
            if "id" in e:
                assert e["index"] not in calls and e["type"] == "function"
                calls[e["index"]] = {"id": e["id"], "name": e["function"]["name"], "arguments": ""}
            calls[e["index"]]["arguments"] += e["function"]["arguments"]
        if pos >= len(text):
            break
    return content, [calls[i] for i in sorted(calls)], s


@pytest.mark.parametrize("parser, text", [(HermesToolParser(), HERMES), (Llama3JsonToolParser(), LLAMA),
                                          (GraniteToolParser(), GRANITE), (Phi4MiniJsonToolParser(), PHI4),
                                          (RequiredToolParser(), '[{"name": "f", "parameters": {"a": "b,c"}}, '
                                                                 '{"name": "g", "parameters": {}}]'),
                                          (NamedToolParser("f"), '{"a": [1, 2, "]"]}')])
def test_any_chunking_of_a_stream_adds_up_to_the_plain_reading(parser, text):
    final = parser.read(text, True)
    assert final.calls
    rng = random.Random(0)
    for sizes in ([1] * len(text), [len(text)], *([rng.randint(1, 7) for _ in text] for _ in range(30))):
        content, calls, s = stream_all(parser, text, sizes)
        assert content == final.content
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in final.calls]
        assert [c["id"] for c in s.message_calls()] == [c["id"] for c in calls]
        for c in calls:
            json.loads(c["arguments"])


def test_hermes_reads_content_then_calls_with_their_raw_arguments():
    r = HermesToolParser().read(HERMES, True)
    assert r.content == "Let me look.\n"
    assert [c.name for c in r.calls] == ["get_weather", "add"]
    assert json.loads(r.calls[0].arguments)["note"] == 'a } and a " inside'
    assert json.loads(r.calls[1].arguments) == {"a": -1500.0}


def test_hermes_holds_back_what_may_start_a_tag_and_keeps_it_when_it_does_not():
    p = HermesToolParser()
    assert p.read("Hi <tool_", False).content == "Hi "
    assert p.read("Hi <tool_", True).content == "Hi <tool_"
    assert p.read("Hi <b>", False).content == "Hi <b>"


def test_hermes_arguments_sent_as_a_json_string_come_whole():
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>'
    assert HermesToolParser().read(text, True).calls == [Call("f", '{"x": 1}')]
    assert HermesToolParser().read(text[:-25], False).calls == [Call("f", "")]


def test_a_cut_off_call_shows_its_name_and_the_arguments_so_far():
    r = HermesToolParser().read('<tool_call>\n{"name": "f", "arguments": {"city": "Par', True)
    assert r.calls == [Call("f", '{"city": "Par')] and r.content == ""


def test_malformed_json_in_a_block_ends_the_reading_without_raising():
    r = HermesToolParser().read('<tool_call>\n{"name": "f" "arguments": 1}\n</tool_call>', True)
    assert r.calls == []


def test_llama3_json_reads_calls_joined_by_semicolons_and_other_output_as_content():
    p = Llama3JsonToolParser()
    r = p.read(LLAMA, True)
    assert [(c.name, json.loads(c.arguments)) for c in r.calls] == [("f", {"x": [1, {"y": "}"}]}), ("g", {})]
    assert p.read("The answer is 4.", True).content == "The answer is 4."
    assert p.read('{"answer": 4}', False).content == ""          # may still become a call
    assert p.read('{"answer": 4}', True).content == '{"answer": 4}'
    assert p.read("<|pyth", False).content == ""


@pytest.mark.parametrize("parser, text, tag", [(GraniteToolParser(), GRANITE, "<|tool_call|>"),
                                               (Phi4MiniJsonToolParser(), PHI4, "functools")])
def test_json_array_formats_read_their_calls_and_leave_other_output_as_content(parser, text, tag):
    """Granite's and Phi-4-mini's: a tag, then a JSON array of calls; anything else is content,
    held back only while it may still be the tag."""
    r = parser.read(text, True)
    assert r.content == "" and [c.name for c in r.calls] == ["f", "g"]
    assert [json.loads(c.arguments) for c in r.calls][1] in ({}, {"y": "z"})
    assert parser.read("The answer is 4.", True).content == "The answer is 4."
    assert parser.read(tag[:4], False).content == "" and parser.read(tag[:4], True).content == tag[:4]
    assert parser.read(tag + " not a list", True).content == tag + " not a list"
    assert parser.read(tag + "[{", True).content == tag + "[{"                  # no call came: all content


def test_granite_reads_its_older_tag_and_a_bare_array():
    p = GraniteToolParser()
    for text in ('<tool_call>[{"name": "f", "arguments": {"a": 1}}]', '  [{"name": "f", "arguments": {"a": 1}}]'):
        r = p.read(text, True)
        assert [(c.name, json.loads(c.arguments)) for c in r.calls] == [("f", {"a": 1})] and r.content == ""


def test_parallel_tool_calls_false_keeps_the_first_call():
    content, calls, _ = stream_all(HermesToolParser(), HERMES, [5] * len(HERMES), max_calls=1)
    assert [c["name"] for c in calls] == ["get_weather"]


def test_the_registry_names_vllms_parsers_and_refuses_others():
    assert isinstance(tool_parser("hermes"), HermesToolParser)
    assert isinstance(tool_parser("llama3_json"), Llama3JsonToolParser)
    assert isinstance(tool_parser("granite"), GraniteToolParser)
    assert isinstance(tool_parser("phi4_mini_json"), Phi4MiniJsonToolParser)
    with pytest.raises(ValueError, match="hermes"):
        tool_parser("mistral_v9")


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
             "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"],
             "$defs": {"P": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "g"}}]


def request(**fields) -> ChatCompletionRequest:
    return msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **fields}, ChatCompletionRequest)


def test_required_is_an_array_of_the_tools_calls_with_their_defs_at_the_top():
    req = request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(tool_constraint(req).params.json)
    assert schema == required_schema(req.tools, 1) and schema["maxItems"] == 1 and "P" in schema["$defs"]
    jsonschema.validate([{"name": "f", "parameters": {"p": 3}}], schema)
    for bad in ([], [{"name": "h", "parameters": {}}], [{"name": "f", "parameters": {"p": "x"}}],
                [{"name": "g", "parameters": {}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_a_named_function_holds_the_output_to_its_parameters():
    req = request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}})
    assert json.loads(tool_constraint(req).params.json) == {"type": "object", "properties": {}}
    assert tool_use(req, None).finish_as_tool_calls is False


def test_auto_needs_the_servers_parser_and_tools_without_a_choice_mean_auto():
    with pytest.raises(NotStructured, match="--enable-auto-tool-choice"):
        tool_use(request(tools=TOOLS), None)
    assert isinstance(tool_use(request(tools=TOOLS), "hermes").parser, HermesToolParser)
    assert tool_use(request(tools=TOOLS, tool_choice="none"), None) is None
    assert tool_use(request(), None) is None


PLUGIN = os.path.join(os.path.dirname(__file__), "..", "plugins", "troupe_example_plugins", "tool_parser.py")


def test_a_tool_parser_plugin_file_registers_a_parser_the_server_can_name(tmp_path, capsys):
    """vLLM's --tool-parser-plugin: the file runs at start-up and registers its parser, which
    --tool-call-parser then names; its calls stream as the built-in parsers' do."""
    from tools import serve
    args = serve.parse_args(["--tool-parser-plugin", PLUGIN, "--tool-call-parser", "example_xml",
                             "--enable-auto-tool-choice"])
    assert args.tool_call_parser == "example_xml" and "example_xml" in TOOL_PARSERS
    text = 'Checking. <call name="get_weather">{"city": "Paris"}</call> and <call name="add">{"a": 1}</call>'
    whole = tool_parser("example_xml").read(text, True)
    assert whole.content == "Checking.  and " and [(c.name, json.loads(c.arguments)) for c in whole.calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1})]
    for sizes in ([1] * len(text), [7, 30, 100]):
        content, calls, _ = stream_all(tool_parser("example_xml"), text, sizes)
        assert content == whole.content and [c["name"] for c in calls] == ["get_weather", "add"]
    bad = tmp_path / "broken.py"
    bad.write_text("raise RuntimeError('no parser here')\n")
    for argv, words in ((["--tool-parser-plugin", str(bad)], "broken.py failed: RuntimeError: no parser here"),
                        (["--tool-parser-plugin", str(tmp_path / "none.py")], "none.py: no such file"),
                        (["--tool-call-parser", "no_such_parser"], "invalid tool call parser: no_such_parser")):
        with pytest.raises(SystemExit) as exc:
            serve.parse_args(argv)
        assert exc.value.code == 2 and words in capsys.readouterr().err
    with pytest.raises(KeyError):
        ToolParserManager.register_module("example_xml", force=False, module=HermesToolParser)
    with pytest.raises(TypeError):
        ToolParserManager.register_module("x", module=dict)


PYTHONIC = ('[get_weather(city="Paris, FR", days=[1, 2], note=\'a ] and a ) inside\'), add(a=-1.5e3, b=True), '
            'tools.search(q=None, opts={"k": (1, 2)})]')


def test_pythonic_calls_read_as_json_arguments_whole_and_streamed():
    """vLLM's pythonic (Llama 3.2 / 4): a Python list of keyword-argument calls; each call's
    arguments become JSON; streamed, each call shows once it is whole, and the pieces add up to
    the plain reading in any chunking; other output is content."""
    whole = tool_parser("pythonic").read(PYTHONIC, True)
    assert whole.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [
        ("get_weather", {"city": "Paris, FR", "days": [1, 2], "note": "a ] and a ) inside"}),
        ("add", {"a": -1500.0, "b": True}), ("tools.search", {"q": None, "opts": {"k": [1, 2]}})]
    rng = random.Random(3)
    for sizes in ([1] * len(PYTHONIC), [rng.randint(1, 12) for _ in range(len(PYTHONIC))]):
        content, calls, _ = stream_all(tool_parser("pythonic"), PYTHONIC, sizes)
        assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            (c.name, json.loads(c.arguments)) for c in whole.calls]
    for text in ("The answer is 4.", "[1, 2, 3]", "[get_weather('Paris')]", "[f(a=open('x'))]"):
        assert tool_parser("pythonic").read(text, True) == Reading(text, []), text
    tagged = tool_parser("llama4_pythonic").read('<|python_start|>[f(a=1)]<|python_end|>', True)
    assert [(c.name, c.arguments) for c in tagged.calls] == [("f", '{"a": 1}')]
    assert tool_parser("llama4_pythonic").read("<|python_st", False) == Reading("", [])


MISTRAL_ARRAY = 'Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", ' \
                '"arguments": {"a": [1, {"b": "}"}]}}]'
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add{"a": [1, {"b": "}"}]} and then text'


@pytest.mark.parametrize("text, content", [(MISTRAL_ARRAY, "Let me check. "), (MISTRAL_V11, "")])
def test_mistral_calls_after_its_tool_calls_token_in_both_formats(text, content):
    """vLLM's mistral: the text before [TOOL_CALLS] is content; after it, a JSON array of
    {"name", "arguments"} (tokenizers before v11) or each call's name then its JSON arguments
    (v11 on, [ARGS] between them or not); text after a call's arguments is dropped. Streamed in
    any chunking, the pieces add up to the plain reading."""
    whole = tool_parser("mistral").read(text, True)
    assert whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": [1, {"b": "}"}]})]
    rng = random.Random(5)
    for sizes in ([1] * len(text), [rng.randint(1, 9) for _ in range(len(text))]):
        got, calls, _ = stream_all(tool_parser("mistral"), text, sizes)
        assert got == content and [(c["name"], c["arguments"]) for c in calls] == [
            (c.name, c.arguments) for c in whole.calls]
    assert tool_parser("mistral").read("No tools [TOOL_C", False) == Reading("No tools ", [])
    assert tool_parser("mistral").read("No tools at all.", True) == Reading("No tools at all.", [])


REASONING_PLUGIN = os.path.join(os.path.dirname(__file__), "..", "plugins", "troupe_example_plugins",
                                "reasoning_parser.py")


@pytest.mark.parametrize("text, reasoning, content", [
    ("Here is my thought process:\nTwo and two.\nHere is my response:\nFour.", "\nTwo and two.\n", "\nFour."),
    ("Here's my thought process: sum. Here's my response: 4", " sum. ", " 4"),
    ("Here is my thought process: sum. Here's my response: 4", " sum. ", " 4"),
    ("Four.", None, "Four."),                                  # thinking off: all content
    ("Here is my thought process: still thinking", " still thinking", None),
])
def test_granites_plain_text_markers_split_its_reasoning_whole_and_streamed(text, reasoning, content):
    """Granite 3.2 / 3.3's thinking: its markers are plain text in two spellings; any chunking of
    the stream adds up to the whole output's split, a marker held back until it is whole."""
    from actors.frontend.reasoning import REASONING_PARSERS
    parser = REASONING_PARSERS["granite"]
    parser.check(None)                               # text markers: no token check
    assert parser.split(text) == (reasoning, content)
    rng = random.Random(0)
    for _ in range(20):
        stream, got, pos = parser.stream(), ["", ""], 0
        while pos < len(text):
            n = rng.randint(1, 6)
            r, c = stream.feed(text[pos:pos + n], final=pos + n >= len(text))
            got[0], got[1], pos = got[0] + r, got[1] + c, pos + n
        assert (got[0] or None, got[1] or None) == (reasoning, content)


def test_a_reasoning_parser_plugin_file_registers_a_parser_the_server_can_name(tmp_path, capsys):
    """vLLM's --reasoning-parser-plugin: the file runs at start-up and registers its parser (here
    a subclass with tags of its own), which --reasoning-parser then names; it splits whole and
    streamed output as the built-in parsers do; a broken file, a missing one and an unknown
    parser stop the start naming them."""
    from tools import serve
    from actors.frontend.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningParserManager
    args = serve.parse_args(["--reasoning-parser-plugin", REASONING_PLUGIN, "--reasoning-parser", "example_thought"])
    parser = REASONING_PARSERS[args.reasoning_parser]
    assert isinstance(parser, ReasoningParser) and (parser.start, parser.end) == ("<thought>", "</thought>")
    text = "<thought>two and two</thought>Four."
    assert parser.split(text) == ("two and two", "Four.") and parser.split("Four.") == (None, "Four.")
    stream = parser.stream()
    pieces = [stream.feed(text[i:i + 3], final=i + 3 >= len(text)) for i in range(0, len(text), 3)]
    assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == ("two and two", "Four.")
    bad = tmp_path / "broken_reasoning.py"
    bad.write_text("raise RuntimeError('no parser here')\n")
    for argv, words in ((["--reasoning-parser-plugin", str(bad)], "broken_reasoning.py failed: RuntimeError"),
                        (["--reasoning-parser-plugin", str(tmp_path / "none.py")], "none.py: no such file"),
                        (["--reasoning-parser", "no_such_parser"], "invalid choice: 'no_such_parser'")):
        with pytest.raises(SystemExit) as exc:
            serve.parse_args(argv)
        assert exc.value.code == 2 and words in capsys.readouterr().err
    ReasoningParserManager.register_module("plain_thought", module=ReasoningParser("plain_thought", "<t>", "</t>"))
    assert ReasoningParserManager.get_reasoning_parser("plain_thought").end == "</t>"
    with pytest.raises(KeyError):
        ReasoningParserManager.register_module("plain_thought", force=False, module=parser)
    with pytest.raises(TypeError):
        ReasoningParserManager.register_module("x", module=dict)
    del REASONING_PARSERS["plain_thought"], REASONING_PARSERS["example_thought"]


QWEN3_CODER = ("I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis, FR\n</parameter>\n"
               "<parameter=days>\n3\n</parameter>\n<parameter=hourly>\ntrue\n</parameter>\n<parameter=zip>\n75001\n"
               "</parameter>\n<parameter=where>\n{\"lat\": 48.85, \"lon\": 2.35}\n</parameter>\n</function>\n"
               "</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n-1.5\n<parameter=b>\nnull\n</parameter>\n"
               "<parameter=note>\na <b>bold</b>\nsecond line\n</parameter>\n</function>\n</tool_call>")
QWEN3_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "hourly": {"type": "boolean"},
    "zip": {"type": "string"}, "where": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "number"}, "b": {"anyOf": [{"type": "number"}, {"type": "null"}]}, "note": {"type": "str"}}}}}]


def test_qwen3_coder_calls_type_each_parameter_by_its_tools_schema_whole_or_streamed():
    """vLLM's qwen3_coder (and qwen3_xml): XML calls whose values are text, typed by the
    request's tool schemas (an integer, a boolean, an object where the schema says so; "75001"
    stays a string where the schema says string); a parameter without </parameter> ends where
    the next begins; streamed in any chunking, the deltas add up to the whole reading."""
    req = msgspec.convert({"messages": [{"role": "user", "content": "x"}], "tools": QWEN3_TOOLS,
                           "tool_choice": "auto"}, ChatCompletionRequest)
    use = tool_use(req, "qwen3_coder")
    whole = use.parser.read(QWEN3_CODER, True)
    assert whole.content == "I will check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [
        ("get_weather", {"city": "Paris, FR", "days": 3, "hourly": True, "zip": "75001",
                         "where": {"lat": 48.85, "lon": 2.35}}),
        ("add", {"a": -1.5, "b": None, "note": "a <b>bold</b>\nsecond line"})]
    rng = random.Random(3)
    for sizes in ([1] * len(QWEN3_CODER), [rng.randint(1, 12) for _ in QWEN3_CODER], [len(QWEN3_CODER)]):
        parser = tool_use(req, "qwen3_xml").parser
        content, calls, _ = stream_all(parser, QWEN3_CODER, sizes)
        assert content == whole.content
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in whole.calls]
    untyped = tool_parser("qwen3_coder").read("<function=f>\n<parameter=n>\n7\n</parameter>\n</function>", True)
    assert untyped.content == "" and json.loads(untyped.calls[0].arguments) == {"n": "7"}   # no schema: the text
    plain = tool_parser("qwen3_coder").read("No call: a <function and 1 < 2.", True)
    assert plain == Reading("No call: a <function and 1 < 2.", [])
