"""Structured outputs on the real default model, through the real server and the openai client:
50 JSON schemas of varied shape each give output that validates, regexes fullmatch, choices are
members, json_object parses; streamed and plain answers agree; free requests beside constrained
ones get the tokens they get alone; a spec xgrammar refuses is a 400 and the server serves on.
Offline: constrained requests survive preemption through a tiny KV cache, and an abort frees
their matchers."""
from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from server import Server
from tools.bench.schemas import schemas

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Describe a thing as JSON."}]
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    """A maker of clients: each asyncio.run needs its own (its connections belong to its loop)."""
    return lambda: openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_fifty_json_schemas_each_give_output_that_validates(client):
    async def one(c: openai.AsyncOpenAI, schema: dict) -> str:
        r = await c.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=256, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}})
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        return r.choices[0].message.content

    async def main():
        async with client() as c:
            return await asyncio.gather(*(one(c, s) for s in schemas()))
    outputs = asyncio.run(main())
    for schema, out in zip(schemas(), outputs):
        jsonschema.validate(json.loads(out), schema, format_checker=jsonschema.FormatChecker())


def test_regex_choice_and_json_object_outputs_hold(client):
    async def main():
        async with client() as c:
            return await parts(c)

    async def parts(c: openai.AsyncOpenAI):
        regex = await c.completions.create(model=MODEL, prompt="A phone number:", max_tokens=20, temperature=0,
                                                extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
        choice = await c.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=10,
                                                 temperature=0.8, seed=1,
                                                 extra_body={"guided_choice": ["yes", "no", "maybe"]})
        obj = await c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=120, temperature=0,
                                                   response_format={"type": "json_object"})
        grammar = await c.completions.create(
            model=MODEL, prompt="Count:", max_tokens=20, temperature=0,
            extra_body={"structured_outputs": {"grammar": 'root ::= "one" (", " ("two" | "three")){0,2}'}})
        return regex, choice, obj, grammar
    regex, choice, obj, grammar = asyncio.run(main())
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", regex.choices[0].text)
    assert choice.choices[0].text in ("yes", "no", "maybe")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    assert re.fullmatch(r"one(, (two|three)){0,2}", grammar.choices[0].text)
    assert grammar.choices[0].finish_reason == "stop"


def test_structural_tags_in_vllms_two_forms_constrain_what_follows_a_tag(client):
    """vLLM's structural tags: xgrammar's form (a tag whose content is a JSON schema: the whole
    output is the tag around a valid object) and the legacy form (free text, each structure's
    schema enforced once its trigger begins it)."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    tag = {"type": "tag", "begin": "<weather>", "content": {"type": "json_schema", "json_schema": schema},
           "end": "</weather>"}
    legacy = {"type": "structural_tag", "triggers": ["<function="],
              "structures": [{"begin": "<function=get_weather>", "schema": schema, "end": "</function>"}]}

    async def main():
        async with client() as c:
            whole = await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "The weather in Paris?"}], max_tokens=40,
                temperature=0, response_format={"type": "structural_tag", "format": tag})
            free = await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0,
                response_format=legacy)
            plain = await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0)
            return whole, free, plain
    whole, free, plain = asyncio.run(main())
    text = whole.choices[0].message.content
    assert text.startswith("<weather>") and text.endswith("</weather>"), text
    jsonschema.validate(json.loads(text[len("<weather>"):-len("</weather>")]), schema)
    assert free.choices[0].message.content == plain.choices[0].message.content     # no trigger: free text


def test_streamed_and_plain_constrained_answers_agree(server, client):
    schema = schemas()[1]
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}

    async def main():
        async with client() as c:
            return await both(c)

    async def both(c: openai.AsyncOpenAI):
        plain = await c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, temperature=0,
                                                     response_format=fmt)
        stream = await c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, temperature=0,
                                                      response_format=fmt, stream=True)
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        return plain.choices[0].message.content, "".join(pieces)
    plain, streamed = asyncio.run(main())
    assert plain == streamed
    jsonschema.validate(json.loads(plain), schema)


def test_free_requests_beside_constrained_ones_get_the_tokens_they_get_alone(client):
    prompts = [f"Write about the number {i}:" for i in range(4)]

    async def free(c: openai.AsyncOpenAI, prompt: str) -> str:
        r = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                            extra_body={"ignore_eos": True})
        return r.choices[0].text

    async def main():
        async with client() as c:
            return await runs(c)

    async def runs(c: openai.AsyncOpenAI):
        alone = [await free(c, p) for p in prompts]
        constrained = [c.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=120, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": s}})
            for s in schemas()[:8]]
        mixed = await asyncio.gather(*(free(c, p) for p in prompts), *constrained)
        return alone, mixed[:len(prompts)]
    alone, beside = asyncio.run(main())
    assert beside == alone


@pytest.mark.parametrize("extra,param,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "objectx"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "parenthesis"),
    ({"guided_grammar": 'root ::= "a" |'}, "guided_grammar", "EBNF"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f>"]}}, "response_format", "structures and triggers"),
    ({"structured_outputs": {"structural_tag": '{"type": "structural_tag", "format": {"type": "bogus"}}'}},
     "structured_outputs", "bogus"),
])
def test_a_spec_that_cannot_compile_is_a_400_and_the_server_serves_on(client, extra, param, message):
    async def main():
        async with client() as c:
            return await refused(c)

    async def refused(c: openai.AsyncOpenAI):
        with pytest.raises(openai.BadRequestError) as err:
            await c.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)
        after = await c.completions.create(model=MODEL, prompt="Still here:", max_tokens=4)
        return err.value.body, after
    body, after = asyncio.run(main())
    assert body["param"] == param and message in body["message"], body
    assert after.choices[0].text


def test_constrained_requests_survive_preemption_and_an_abort_frees_their_matchers():
    from actors import topology
    from actors.api import LLM, SamplingParams
    from actors.engine.sampling_params import StructuredOutputsParams
    per_token = 2 * 30 * 3 * 64 * 4                   # SmolLM2: layers x K/V x heads x dims x fp32
    picked = [schemas()[i] for i in (0, 11, 15, 26, 36, 41)]
    with LLM(kv_cache_bytes=9 * 16 * per_token) as llm:              # 8 usable blocks of 16 tokens
        results = [llm.generate(f"Thing {i} as JSON:", SamplingParams(
            max_tokens=100, temperature=0, structured_outputs=StructuredOutputsParams(json=json.dumps(s))),
            use_tqdm=False)[0] for i, s in enumerate(picked)]
        batch = llm.generate([f"Thing {i} as JSON:" for i in range(len(picked))], [SamplingParams(
            max_tokens=100, temperature=0, structured_outputs=StructuredOutputsParams(json=json.dumps(s)))
            for s in picked], use_tqdm=False)
        preemptions = llm._llm.client.stats.last.num_preemptions

        async def leave_early():
            params = SamplingParams(max_tokens=100, temperature=0,
                                    structured_outputs=StructuredOutputsParams(json=json.dumps(picked[1])))
            async for _ in llm._llm.generate("Leave early:", params):
                break                                    # closing the iterator aborts the request
            await asyncio.sleep(0.2)
        llm._run(leave_early())
        core = llm._llm._fe.node.cells[topology.SCHEDULER].actor.core
        matchers = len(core.structured._matchers)
    assert preemptions > 0
    for r, b, s in zip(results, batch, picked):
        jsonschema.validate(json.loads(r.text), s)
        assert b.text == r.text
    assert matchers == 0
