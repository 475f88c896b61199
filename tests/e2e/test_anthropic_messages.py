"""vLLM's Anthropic Messages API through the real server and Anthropic's own SDK: a message and
its stream carry the chat completion's text with Anthropic's blocks, events, stop reasons and
usage; a forced tool is a tool_use block whose result continues the conversation; count_tokens
counts the rendered prompt; errors are the SDK's typed errors."""
from __future__ import annotations

import anthropic
import jsonschema
import openai
import pytest

from server import ROOT, Server

pytestmark = pytest.mark.slow

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
GREEDY = {"temperature": 0}     # a request field the SDK sends in its body (its newer releases dropped the argument)
TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}]


@pytest.fixture(scope="module")
def server():
    s = Server("--threads", "1", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--chat-template", f"{ROOT}/tools/chat_templates/chatml_tools.jinja")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def test_a_message_has_the_chat_completions_text_as_a_text_block(server, client):
    message = client.messages.create(model=MODEL, max_tokens=24, messages=CAPITAL, extra_body=GREEDY)
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key="unused").chat.completions.create(
        model=MODEL, max_tokens=24, messages=CAPITAL, extra_body=GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content and "Paris" in message.content[0].text
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.output_tokens == chat.usage.completion_tokens
    assert _prompt_tokens(message) == chat.usage.prompt_tokens


def test_a_streamed_message_is_anthropics_events_adding_up_to_the_same_message(client):
    whole = client.messages.create(model=MODEL, max_tokens=24, messages=CAPITAL, extra_body=GREEDY,
                                   system="You are a helpful assistant.")
    with client.messages.stream(model=MODEL, max_tokens=24, messages=CAPITAL, extra_body=GREEDY,
                                system="You are a helpful assistant.") as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    assert kinds[1] == "content_block_start" and kinds.count("content_block_stop") == 1
    assert final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)


def test_max_tokens_and_a_stop_sequence_are_anthropics_stop_reasons(client):
    cut = client.messages.create(model=MODEL, max_tokens=3, messages=CAPITAL, extra_body=GREEDY)
    assert (cut.stop_reason, cut.usage.output_tokens) == ("max_tokens", 3)
    stopped = client.messages.create(model=MODEL, max_tokens=24, messages=CAPITAL, extra_body=GREEDY,
                                     stop_sequences=["France"])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "France")
    assert "France" not in stopped.content[0].text


def test_a_forced_tool_is_a_tool_use_block_and_its_result_continues_the_conversation(client):
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    message = client.messages.create(model=MODEL, max_tokens=64, messages=ask, tools=TOOLS, extra_body=GREEDY,
                                     tool_choice={"type": "tool", "name": "get_weather"})
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather" and message.stop_reason == "tool_use"
    jsonschema.validate(use.input, WEATHER)
    with client.messages.stream(model=MODEL, max_tokens=64, messages=ask, tools=TOOLS, extra_body=GREEDY,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        streamed = stream.get_final_message()
    (streamed_use,) = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed_use.input == use.input and streamed.stop_reason == "tool_use"
    follow_up = client.messages.create(model=MODEL, max_tokens=24, tools=TOOLS, extra_body=GREEDY, messages=[
        *ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}]}])
    assert follow_up.content and _prompt_tokens(follow_up) > _prompt_tokens(message)
    assert follow_up.usage.cache_read_input_tokens        # the first turn's prompt, from the prefix cache


def _prompt_tokens(message) -> int:
    return message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


def test_count_tokens_counts_the_prompt_a_message_would_have(client):
    counted = client.messages.count_tokens(model=MODEL, messages=CAPITAL, system="Be brief.")
    message = client.messages.create(model=MODEL, max_tokens=1, messages=CAPITAL, system="Be brief.")
    assert counted.input_tokens == _prompt_tokens(message)
    assert counted.input_tokens > len("What is the capital of France?".split())


def test_errors_are_the_sdks_typed_errors_in_anthropics_shape(client):
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=8, messages=CAPITAL)
    assert missing.value.body == {"type": "error", "error": {
        "type": "NotFoundError", "message": "The model `claude-sonnet-4-5` does not exist."}}
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}])
    assert "this model takes no images" in bad.value.body["error"]["message"]
