"""Structured outputs in the engine core, with xgrammar and the default model's vocabulary: the
grammar cache (one compile per schema, clear refusals), and the scheduler's side: a request that
waits for its grammar holds nobody back, constrained rows get their bitmask, the grammar ends
the request, preemption keeps its matcher's state and an abort frees it."""
from __future__ import annotations

import json

import numpy as np
import pytest

from actors.engine.args import EngineArgs
from actors.engine.messages import EngineCoreRequest, ModelRunnerOutput, SchedulerOutput
from actors.engine.sampling_params import SamplingParams, StructuredOutputsParams
from actors.grammar.actor import xgrammar_compiler
from actors.grammar.compiler import GrammarCache, GrammarError, grammar_key
from actors.grammar.matchers import StructuredOutputs
from actors.kv_manager.manager import KVCacheManager
from actors.scheduler.scheduler import Scheduler
from actors.tokenizer.gguf_tokenizer import TextTokenizer
from models.registry import model_config
from sched_utils import FakeWorker, engine_config

CHOICES = ["yes", "no", "maybe later"]


@pytest.fixture(scope="module")
def setup():
    config = EngineArgs().create_engine_config()
    arch = model_config(config.model.source)
    resolved = config.resolve(cuda_available=False, cpu_count=2, arch=arch)
    tokenizer = TextTokenizer.from_source(config.model.source.kind, config.model.source.path)
    return GrammarCache(lambda: xgrammar_compiler(resolved)), arch, tokenizer


def test_the_same_schema_compiles_once_whatever_its_spacing(setup):
    cache, _, _ = setup
    a = grammar_key(StructuredOutputsParams(json='{"type": "object", "properties": {"b": {"type": "integer"}}}'))
    b = grammar_key(StructuredOutputsParams(json='{"type":"object","properties":{"b":{"type":"integer"}}}'))
    assert a == b and cache.get(a) is None
    assert cache.compile(a) is cache.compile(b) is cache.get(b)


@pytest.mark.parametrize("spec,message", [
    (StructuredOutputsParams(json="{not json"), "not valid JSON"),
    (StructuredOutputsParams(json='{"type": "objectx"}'), "objectx"),
    (StructuredOutputsParams(regex="(unclosed"), "parenthesis is not closed"),
    (StructuredOutputsParams(grammar='root ::= "a" |'), "EBNF parser error"),
    (StructuredOutputsParams(choice=[]), "at least one"),
    (StructuredOutputsParams(regex="a", choice=["b"]), "exactly one"),
])
def test_a_spec_xgrammar_cannot_compile_is_refused_with_the_reason(setup, spec, message):
    cache, _, _ = setup
    with pytest.raises(GrammarError, match=message):
        cache.compile(grammar_key(spec))


class GrammarWorker(FakeWorker):
    """Samples, for a constrained row, the first token its bitmask allows (else ``token``)."""

    def run(self, so: SchedulerOutput, token: int) -> ModelRunnerOutput:
        out = super().run(so, token)
        for i, rid in enumerate(so.grammar_req_ids):
            bits = np.unpackbits(so.grammar_bitmask[i].view(np.uint8), bitorder="little")
            row = out.req_ids.index(rid)
            out.sampled_token_ids[row] = [int(np.flatnonzero(bits)[0])]
            self.tokens[rid][-1] = out.sampled_token_ids[row][0]
        return out


def _scheduler(setup, num_blocks: int = 64, **cfg) -> tuple[Scheduler, KVCacheManager, StructuredOutputs]:
    cache, arch, _ = setup
    config = engine_config(num_blocks, **cfg)
    kv = KVCacheManager(num_blocks, 4)
    structured = StructuredOutputs(cache, arch.vocab_size)
    return Scheduler(config, kv, structured), kv, structured


def _request(rid: str, prompt: list[int], spec: StructuredOutputsParams | None, eos: int, **params) -> EngineCoreRequest:
    return EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=40, temperature=0, structured_outputs=spec,
                                                         **params), 0.0, [eos])


def _run(s: Scheduler, worker: GrammarWorker, steps: int = 60) -> dict[str, tuple[list[int], str | None]]:
    done: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}
    for _ in range(steps):
        if not s.has_work():
            break
        so = s.schedule()
        for o in s.update_from_output(so, worker.run(so, token=100)):
            done.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                reasons[o.request_id] = o.finish_reason
    return {rid: (ids, reasons.get(rid)) for rid, ids in done.items()}


def test_a_request_waiting_for_its_grammar_holds_nobody_back_and_its_grammar_ends_it(setup):
    cache, arch, tokenizer = setup
    s, kv, structured = _scheduler(setup)
    eos = arch.eos_token_ids[0]
    spec = StructuredOutputsParams(choice=CHOICES)
    assert s.add_request(_request("constrained", list(range(1000, 1010)), spec, eos)) is None
    assert "constrained" in s.awaiting_grammar
    s.add_request(_request("free", list(range(2000, 2010)), None, eos, ignore_eos=True))
    worker = GrammarWorker(64, 4)
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["free"]            # the free one ran, not held back
    s.update_from_output(so, worker.run(so, token=100))
    cache.compile(grammar_key(spec))                            # what the GrammarCompiler does
    assert s.grammar_ready("constrained") == []
    results = _run(s, worker)
    ids, reason = results["constrained"]
    assert reason == "stop" and ids[-1] == eos
    assert tokenizer.decode(ids) in CHOICES
    assert "constrained" not in structured and not s.has_work()


def test_a_request_whose_grammar_is_ready_keeps_its_place_ahead_of_later_arrivals(setup):
    cache, arch, _ = setup
    s, _, _ = _scheduler(setup, max_num_seqs=1)
    eos = arch.eos_token_ids[0]
    spec = StructuredOutputsParams(choice=["first", "second"])
    s.add_request(EngineCoreRequest("free-1", [2000, 2001], SamplingParams(max_tokens=2, ignore_eos=True), 1.0, [eos]))
    s.add_request(EngineCoreRequest("constrained", [1000, 1001], SamplingParams(max_tokens=8, structured_outputs=spec),
                                    2.0, [eos]))
    s.add_request(EngineCoreRequest("free-3", [3000, 3001], SamplingParams(max_tokens=2, ignore_eos=True), 3.0, [eos]))
    worker = GrammarWorker(64, 4)
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["free-1"]
    s.update_from_output(so, worker.run(so, token=100))
    cache.compile(grammar_key(spec))
    s.grammar_ready("constrained")
    order = ["free-1"]
    for _ in range(40):
        if not s.has_work():
            break
        so = s.schedule()
        order += [rid for rid in so.num_scheduled_tokens if rid not in order]
        s.update_from_output(so, worker.run(so, token=100))
    assert order == ["free-1", "constrained", "free-3"]


def test_a_grammar_that_cannot_compile_fails_its_request_alone(setup):
    s, _, _ = _scheduler(setup)
    s.add_request(_request("bad", [1000, 1001], StructuredOutputsParams(regex="(x"), 2))
    outs = s.grammar_ready("bad", "the grammar cannot be compiled: parenthesis")
    assert [(o.request_id, o.finish_reason) for o in outs] == [("bad", "error")]
    assert not s.requests and not s.awaiting_grammar


def test_preemption_keeps_the_matcher_and_an_abort_frees_it(setup):
    cache, arch, tokenizer = setup
    eos = arch.eos_token_ids[0]
    schema = '{"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 8}}, ' \
             '"required": ["n", "s"]}'
    spec = StructuredOutputsParams(json=schema)
    cache.compile(grammar_key(spec))
    s, kv, structured = _scheduler(setup, num_blocks=12, watermark=0.0, enable_prefix_caching=False)
    for i in range(3):                                          # 11 usable blocks of 4: they preempt
        s.add_request(_request(f"r{i}", list(range(1000 + 100 * i, 1008 + 100 * i)), spec, eos))
    results = _run(s, GrammarWorker(12, 4), steps=400)
    assert s.counters.num_preemptions > 0
    for i in range(3):
        ids, reason = results[f"r{i}"]
        assert reason == "stop", (i, tokenizer.decode(ids))
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert set(json.loads(text)) == {"n", "s"}
    s.add_request(_request("gone", [3000, 3001, 3002], spec, eos))
    s.schedule()
    assert "gone" in structured and s.requests["gone"].status.name == "RUNNING"
    s.abort_requests(["gone"])
    assert "gone" not in structured and not s.has_work()


def test_drafts_are_cut_to_what_the_grammar_allows_and_get_a_bitmask_row_per_position(setup):
    """Speculative decoding: the drafts a grammar refuses are dropped when proposed, and verifying
    k drafts takes k + 1 bitmask rows, each the one decoding the drafts one by one would get;
    the matcher is left where its accepted tokens put it."""
    cache, arch, tokenizer = setup
    structured = StructuredOutputs(cache, arch.vocab_size)
    spec = StructuredOutputsParams(choice=["yes", "no"])
    cache.compile(grammar_key(spec))
    assert structured.start("r", spec)
    yes = tokenizer.encode("yes", add_special_tokens=False)
    assert len(yes) == 1
    drafts = yes + [arch.eos_token_ids[0], 7]
    assert structured.allowed_drafts("r", drafts) == 2            # "yes", then the end: nothing after it
    assert structured.allowed_drafts("r", [7] + yes) == 0
    rows = structured.fill_bitmask(["r"], {"r": drafts[:2]})
    assert rows.shape == (3, structured.words)
    one_by_one = [structured.fill_bitmask(["r"])[0]]
    assert not structured.accept("r", yes[0])
    one_by_one.append(structured.fill_bitmask(["r"])[0])
    assert np.array_equal(rows[:2], np.stack(one_by_one)) and not np.array_equal(rows[0], rows[1])
    assert (rows[2] == -1).all()              # after the end: never used, left open
    assert structured.accept("r", drafts[1])  # the matcher was where "yes" put it: the end is next


def test_json_may_carry_whitespace_unless_the_config_disables_it(setup):
    """vLLM's default: whitespace between a JSON output's tokens is allowed; with
    --structured-outputs-config '{"disable_any_whitespace": true}' the output is compact."""
    import xgrammar
    cache, _, _ = setup
    compact = GrammarCache(lambda: cache._xgrammar_compiler(), any_whitespace=False)
    key = grammar_key(StructuredOutputsParams(json='{"type": "object", "properties": {"a": {"type": "integer"}}}'))

    def accepts(grammar, text: str) -> bool:
        return xgrammar.GrammarMatcher(grammar).accept_string(text)
    assert accepts(cache.compile(key), '{\n  "a": 1\n}') and accepts(cache.compile(key), '{"a":1}')
    assert accepts(compact.compile(key), '{"a":1}')
    assert not accepts(compact.compile(key), '{ "a": 1}') and not accepts(compact.compile(key), '{"a": 1}')


def _tool_request(strict: bool | None = None, parallel: bool | None = None, choice=None):
    """A chat request's tool fields: get_weather (city, days) and get_time (any arguments)."""
    from dataclasses import dataclass

    import msgspec

    from actors.frontend.tools import Tool

    @dataclass
    class Fields:
        tools: list
        tool_choice: object
        parallel_tool_calls: bool | None

    weather = {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"], "additionalProperties": False}}
    if strict is not None:
        weather["strict"] = strict
    tools = [msgspec.convert({"type": "function", "function": f}, Tool)
             for f in (weather, {"name": "get_time", "parameters": {"type": "object", "properties": {
                 "zone": {"type": "string"}}}})]
    return Fields(tools, choice, parallel)


def _held(setup, level: str, parser: str = "hermes", **fields):
    """The grammar --tool-strict-level ``level`` holds an "auto" request's calls to (None: none)."""
    import xgrammar

    from actors.frontend.tools import strict_tool_constraint, tool_use
    cache, _, _ = setup
    req = _tool_request(**fields)
    held = strict_tool_constraint(req, tool_use(req, parser), level)
    if held is None:
        return None
    assert held.param == "tools"
    grammar = cache.compile(grammar_key(held.params))
    return lambda text: xgrammar.GrammarMatcher(grammar).accept_string(text)


CALL = '<tool_call>\n{"name": "get_weather", "arguments": %s}\n</tool_call>'


def test_tool_strict_level_parameter_holds_auto_calls_to_known_functions_and_their_schemas(setup):
    accepts = _held(setup, "parameter")
    assert accepts("Let me look that up. " + CALL % '{"city": "Paris", "days": 3}')
    assert accepts("No tool needed: it is sunny.")                        # text stays free
    assert not accepts('<tool_call>\n{"name": "get_forecast"')            # no such function
    assert not accepts(CALL % '{"city": "Paris", "days": "3"}')           # days is an integer
    assert not accepts(CALL % '{"city": "Paris", "days": 3, "unit": "C"}')


def test_tool_strict_level_function_holds_the_envelope_and_leaves_non_strict_arguments_free(setup):
    accepts = _held(setup, "function")
    assert accepts(CALL % '{"city": "Paris", "days": "three", "unit": "C"}')
    assert not accepts('<tool_call>\n{"name": "get_forecast"')
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris')   # still JSON
    strict = _held(setup, "function", strict=True)                                # a strict tool: its schema
    assert not strict(CALL % '{"city": "Paris", "days": "three"}')
    assert strict(CALL % '{"city": "Paris", "days": 3}')


def test_tool_strict_level_auto_holds_only_strict_tools_or_a_single_call(setup):
    assert _held(setup, "auto") is None and _held(setup, "auto", strict=False) is None
    accepts = _held(setup, "auto", strict=True)
    assert not accepts(CALL % '{"city": "Paris", "days": "3"}')
    assert accepts('<tool_call>\n{"name": "get_time", "arguments": {"anything": [1, 2]}}\n</tool_call>')
    single = _held(setup, "auto", parallel=False)                      # parallel_tool_calls false: one call
    assert single(CALL % '{"city": "Paris", "days": "3"}')
    assert not single(CALL % '{"city": "Paris", "days": 3}' + "\n" + CALL % '{"city": "Rome", "days": 1}')
    assert _held(setup, "parameter", choice="required") is None       # required: the JSON schema holds it
    assert _held(setup, "parameter", parser="mistral") is None         # a format xgrammar does not know


def test_tool_strict_level_holds_llama3_json_and_qwen3_coder_calls_in_their_own_formats(setup):
    llama = _held(setup, "parameter", parser="llama3_json")
    assert llama('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}')
    assert not llama('{"name": "get_weather", "parameters": {"city": 3')
    coder = _held(setup, "parameter", parser="qwen3_coder")
    assert coder("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                 "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    assert not coder("<tool_call>\n<function=get_forecast>")
