"""Tool calling on the real default model, through the real server (``--enable-auto-tool-choice
--tool-call-parser hermes`` and the ChatML tools template) and the openai client: "required"
and named calls give arguments that validate against the function's parameters; "auto" reads
the model's <tool_call> blocks; streamed calls (name first, arguments in pieces) add up to the
plain answer; a history with tool calls and tool results is rendered; bad tool requests are 400s
that name the field."""
from __future__ import annotations

import json
import urllib.request

import jsonschema
import openai
import pytest

from server import ROOT, Server

pytestmark = pytest.mark.slow

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 1000},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 1000}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}}]
PARAMETERS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def call_turn(i: int, city: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}]}


# Two earlier questions answered with calls: the 135M model then answers the third the same way.
FEW_SHOT = [{"role": "user", "content": "Weather in Paris?"}, call_turn(1, "Paris"),
            {"role": "user", "content": "Weather in Rome?"}, call_turn(2, "Rome"),
            {"role": "user", "content": "Weather in Berlin?"}]


@pytest.fixture(scope="module")
def server():
    s = Server("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--chat-template", f"{ROOT}/tools/chat_templates/chatml_tools.jinja")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def streamed(client, **kwargs) -> tuple[str, list[dict], str | None, list]:
    """The content, the calls put together from their deltas, the finish reason, the chunks."""
    content, calls, finish, chunks = "", {}, None, []
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        chunks.append(chunk)
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                assert call["id"] is None, "a call's id comes once"
                call.update(id=d.id, name=d.function.name)
            call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, chunks


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def plain_calls(message) -> list[dict]:
    return [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]


def validate(calls: list[dict]) -> None:
    assert calls
    for c in calls:
        jsonschema.validate(json.loads(c["arguments"]), PARAMETERS[c["name"]])


def test_required_tool_choice_gives_calls_whose_arguments_validate_streamed_or_not(client):
    kw = dict(messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_tokens=100, temperature=0)
    r = client.chat.completions.create(model=MODEL, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1 and choice.message.tool_calls[0].id.startswith("chatcmpl-tool-")
    validate(plain_calls(choice.message))
    content, calls, finish, _ = streamed(client, **kw)
    assert finish == "tool_calls" and content == ""
    assert [{k: c[k] for k in ("name", "arguments")} for c in calls] == plain_calls(choice.message)


def test_a_named_function_is_called_with_arguments_that_validate(client):
    kw = dict(messages=[{"role": "user", "content": "What is 12 plus 30?"}], tools=TOOLS,
              tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=60, temperature=0)
    r = client.chat.completions.create(model=MODEL, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"        # a forced function finishes as "stop", as OpenAI's does
    assert [c["name"] for c in plain_calls(choice.message)] == ["add"]
    validate(plain_calls(choice.message))
    content, calls, finish, chunks = streamed(client, **kw)
    assert finish == "stop" and [{k: c[k] for k in ("name", "arguments")} for c in calls] == plain_calls(choice.message)
    pieces = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or [] if not d.id]
    assert len(pieces) > 1, "the arguments are streamed in pieces"


def test_auto_reads_the_models_tool_call_blocks_streamed_or_not(client):
    kw = dict(messages=FEW_SHOT, tools=TOOLS, max_tokens=60, temperature=0)     # tools alone: "auto"
    r = client.chat.completions.create(model=MODEL, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = plain_calls(choice.message)
    assert [c["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["arguments"])["city"] == "Berlin"
    content, streamed_calls, finish, _ = streamed(client, **kw)
    assert finish == "tool_calls" and content.strip() == (choice.message.content or "").strip()
    assert [{k: c[k] for k in ("name", "arguments")} for c in streamed_calls] == calls


def test_a_strict_tools_auto_calls_follow_its_schema_where_the_model_would_not(client):
    """--tool-strict-level auto (vLLM's default): a tool that says "strict": true has its calls held
    to its schema by the format's structural tag; the model, left free, writes another unit."""
    kelvin = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                               "unit": {"type": "string", "enum": ["kelvin"]}},
              "required": ["city", "unit"], "additionalProperties": False}
    strict = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                "parameters": kelvin, "strict": True}}, TOOLS[1]]
    free = client.chat.completions.create(model=MODEL, messages=FEW_SHOT, tools=TOOLS, max_tokens=60, temperature=0)
    held = client.chat.completions.create(model=MODEL, messages=FEW_SHOT, tools=strict, max_tokens=60, temperature=0)
    assert json.loads(plain_calls(free.choices[0].message)[0]["arguments"])["unit"] in ("celsius", "fahrenheit")
    (call,) = plain_calls(held.choices[0].message)
    assert held.choices[0].finish_reason == "tool_calls" and call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), kelvin)


def test_auto_without_a_call_is_plain_content_and_none_ignores_the_tools(client):
    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=24, temperature=0)
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                          max_tokens=24, temperature=0)
    for r in (auto, none):
        assert r.choices[0].message.content and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "length"
    assert "<|im_end|>" not in auto.choices[0].message.content


def test_a_history_with_tool_calls_and_results_is_rendered_and_answered(server, client):
    history = ASK + [call_turn(1, "Paris"), {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                       max_tokens=40, temperature=0)
    assert r.choices[0].message.content
    ids = post(server.url + "/tokenize", {"model": MODEL, "messages": history})["tokens"]
    prompt = post(server.url + "/detokenize", {"model": MODEL, "tokens": ids})["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in prompt


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),                                     # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name"),                          # a name twice
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(unclosed"}}}}}], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_requests_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **body)
    assert e.value.body["param"] == param, e.value.body
    assert client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2).choices[0].message.content


def test_responses_api_function_call_round_trip(client):
    """/v1/responses with a function tool: the call comes as a function_call item (the same call
    the chat endpoint makes), streamed too; its output item goes back as function_call_output."""
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
              "parameters": WEATHER}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    model = client.models.list().data[0].id
    r = client.responses.create(model=model, input=ask, tools=tools, tool_choice="required", max_output_tokens=60,
                                temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    chat = client.chat.completions.create(model=model, messages=ask, tools=[{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}}],
        tool_choice="required", max_completion_tokens=60, temperature=0)
    assert calls[0].arguments == chat.choices[0].message.tool_calls[0].function.arguments
    events = list(client.responses.create(model=model, input=ask, tools=tools, tool_choice="required",
                                          max_output_tokens=60, temperature=0, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [(c.name, c.arguments) for c in done] == [(c.name, c.arguments) for c in calls]
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 degrees"}
    after = client.responses.create(model=model, input=[*ask, calls[0].model_dump(exclude_none=True), result],
                                    tools=tools, max_output_tokens=30, temperature=0)
    assert after.status in ("completed", "incomplete") and after.output_text
