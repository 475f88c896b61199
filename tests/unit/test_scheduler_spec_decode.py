"""The scheduler with speculative decoding, driven by a fake worker whose "model" is a function of
the tokens so far and whose proposer is a function too: drafts scheduled after a request's own
tokens, partial acceptance and the rollback of computed tokens, stops mid-draft, the token budget,
preemption, and the blocks and prefix cache around drafts."""
from __future__ import annotations

from typing import Callable

import json

import msgspec
import pytest

from actors.engine.args import EngineArgs
from actors.engine.messages import ModelRunnerOutput, SchedulerOutput
from actors.kv_manager.manager import KVCacheManager
from actors.scheduler.scheduler import Scheduler
from actors.spec_decode.config import SpeculativeConfig
from tests.unit.test_engine_config import ARCH
from tests.unit.sched_utils import EOS, FakeWorker, Harness, check_cached_contents, engine_config

K = 4
Tokens = list[int]


def model(tokens: Tokens) -> int:
    """The fake target's greedy next token: a cycle of seven tokens after the last one."""
    return 100 + (tokens[-1] - 99) % 7


def truth(tokens: Tokens, n: int, target: Callable[[Tokens], int] = model) -> Tokens:
    """The next ``n`` tokens the fake target generates."""
    out: Tokens = []
    for _ in range(n):
        out.append(target(tokens + out))
    return out


def right_then_wrong(num_right: int) -> Callable[[Tokens], Tokens]:
    """A proposer whose first ``num_right`` drafts are what the target generates, the rest not."""
    return lambda tokens: truth(tokens, num_right) + [9999] * (K - num_right)


class SpecWorker(FakeWorker):
    """FakeWorker that also writes the scheduled draft tokens into their KV slots (as a real
    worker computes their keys and values), verifies them greedily against ``model`` (accepted
    while equal to the target's token; then the target's token: recovered or bonus), and
    proposes drafts for the next step with ``propose``."""

    def __init__(self, num_blocks: int, block_size: int, propose: Callable[[Tokens], Tokens],
                 target: Callable[[Tokens], int] = model, draft_model: bool = False) -> None:
        super().__init__(num_blocks, block_size)
        self.propose = propose
        self.target = target
        self.draft_model = draft_model     # writes its drafts' KV (but the last's) in the step

    def run(self, so: SchedulerOutput, token=None) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.tokens.pop(rid, None)
            self.blocks.pop(rid, None)
        for r in so.new_reqs:
            self.tokens[r.req_id] = r.prompt_token_ids + r.output_token_ids
            self.blocks[r.req_id] = list(r.block_ids[0])
        for rid, blocks in zip(so.cached_reqs.req_ids, so.cached_reqs.new_block_ids):
            self.blocks[rid].extend(blocks[0])
        starts = dict(zip(so.cached_reqs.req_ids, so.cached_reqs.num_computed_tokens))
        starts |= {r.req_id: r.num_computed_tokens for r in so.new_reqs}
        sampled, spec = [], {}
        for rid, n in so.num_scheduled_tokens.items():
            tokens, drafts = self.tokens[rid], so.scheduled_spec_decode_tokens.get(rid, [])
            seq = tokens + drafts
            start = starts[rid]
            assert start + n <= len(seq), "scheduled past the request's tokens and drafts"
            for pos in range(start, start + n):
                self.slots[self.blocks[rid][pos // self.bs] * self.bs + pos % self.bs] = seq[pos]
            if start + n < len(seq):
                assert not drafts, "drafts scheduled before the request's own tokens were all computed"
                sampled.append([])
                continue
            emitted: Tokens = []
            for d in drafts:
                emitted.append(self.target(tokens + emitted))
                if emitted[-1] != d:
                    break
            else:
                emitted.append(self.target(tokens + emitted))      # the bonus token
            tokens.extend(emitted)
            sampled.append(emitted)
            proposal = self.propose(tokens)
            if proposal:
                spec[rid] = proposal
            if self.draft_model and proposal:
                # as the draft model does, no drafts past the context length (engine_config's)
                num = min(len(proposal), len(self.slots) - self.bs - 1 - len(tokens))
                last = len(tokens) + num - 2                  # the position of the last KV written
                assert last < len(self.blocks[rid]) * self.bs, f"{rid}: no slot for the draft's KV at {last}"
        return ModelRunnerOutput(list(so.num_scheduled_tokens), sampled, spec_token_ids=spec)


class SpecHarness(Harness):
    def __init__(self, propose: Callable[[Tokens], Tokens], num_blocks: int = 64,
                 target: Callable[[Tokens], int] = model, k: int = K, method: str = "ngram", **cfg) -> None:
        config = engine_config(num_blocks, **cfg)
        spec = {"method": method, "num_speculative_tokens": k}
        model_cfg = config.model
        if method != "ngram":                  # a draft model (its checkpoint: the fake one)
            spec["quantization"] = "gguf-i8"
            model_cfg = msgspec.structs.replace(model_cfg, draft_source=model_cfg.source)
        config = config.replace(model=model_cfg, speculative=SpeculativeConfig.from_dict(spec))
        self.kv = KVCacheManager(num_blocks, 4, config.cache.enable_prefix_caching)
        self.s = Scheduler(config, self.kv)
        self.worker = SpecWorker(num_blocks, 4, propose, target, draft_model=method != "ngram")
        self.hash_tokens = {}

    def run_all(self, max_steps: int = 200) -> dict[str, Tokens]:
        """Step until nothing is left; each request's emitted tokens and finish reason."""
        out: dict[str, Tokens] = {}
        self.finish: dict[str, str] = {}
        for _ in range(max_steps):
            if not self.s.has_work():
                return out
            _, outs = self.step()
            check_cached_contents(self)
            for o in outs:
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason:
                    self.finish[o.request_id] = o.finish_reason
        raise AssertionError("requests still running")


def plain_run(prompts: dict[str, Tokens], num_blocks: int = 64, **params) -> dict[str, Tokens]:
    """The same requests with no drafts at all: the reference tokens."""
    h = SpecHarness(lambda tokens: [], num_blocks)
    for rid, prompt in prompts.items():
        h.add(rid, prompt, **params)
    return h.run_all()


def test_partially_accepted_drafts_roll_back_computed_tokens_and_give_the_plain_tokens():
    h = SpecHarness(right_then_wrong(2))
    h.add("a", [100, 101, 102, 103, 104], max_tokens=20)
    so, outs = h.step()
    assert so.scheduled_spec_decode_tokens == {} and outs[0].new_token_ids == [105]
    req = h.s.requests["a"]
    assert req.spec_token_ids == [106, 100, 9999, 9999]
    so, outs = h.step()
    assert so.num_scheduled_tokens == {"a": 1 + K}
    assert so.scheduled_spec_decode_tokens == {"a": [106, 100, 9999, 9999]}
    assert outs[0].new_token_ids == [106, 100, 101]      # two accepted, then the target's own
    assert req.num_computed_tokens == req.num_tokens - 1  # two of four drafts rolled back
    assert h.kv.num_blocks_held("a") == -(-(req.num_computed_tokens + 1 + 2) // 4)   # no block freed
    out = h.run_all()
    out["a"] = [105, 106, 100, 101] + out["a"]
    assert out == plain_run({"a": [100, 101, 102, 103, 104]}, max_tokens=20)
    stats = h.s.stats()
    assert stats.spec_num_draft_tokens == K * stats.spec_num_drafts
    assert stats.spec_num_accepted_tokens == 2 * stats.spec_num_drafts
    assert stats.spec_num_accepted_tokens_per_pos == [stats.spec_num_drafts] * 2 + [0, 0]


@pytest.mark.parametrize("num_right", [0, 1, K])
def test_every_acceptance_count_gives_the_tokens_of_decoding_without_drafts(num_right):
    prompts = {"a": [100, 101, 102, 103], "b": list(range(200, 213)), "c": [104, 105]}
    h = SpecHarness(right_then_wrong(num_right))
    for rid, prompt in prompts.items():
        h.add(rid, prompt, max_tokens=17)
    assert h.run_all() == plain_run(prompts, max_tokens=17)
    assert set(h.finish.values()) == {"length"}
    assert h.s.stats().spec_num_accepted_tokens == num_right * h.s.stats().spec_num_drafts
    assert h.kv.num_free_blocks == h.kv.pool.num_usable_blocks


def test_eos_among_accepted_drafts_ends_the_request_there_and_drops_the_rest():
    target = lambda tokens: EOS if len(tokens) == 8 else model(tokens)    # noqa: E731
    h = SpecHarness(lambda tokens: truth(tokens, K, target), target=target)
    h.add("a", [100, 101, 102, 103, 104], max_tokens=50)
    _, outs = h.step()
    assert outs[0].new_token_ids == [105]
    so, outs = h.step()
    assert so.scheduled_spec_decode_tokens["a"] == [106, 100, EOS, model([EOS])]
    assert outs[0].new_token_ids == [106, 100, EOS] and outs[0].finish_reason == "stop"
    assert "a" not in h.s.requests and not h.s.has_work()
    assert h.kv.num_free_blocks == h.kv.pool.num_usable_blocks
    assert h.s.stats().spec_num_accepted_tokens == K      # the worker accepted all four


def test_stop_token_accepted_mid_draft_ends_the_request_with_its_stop_reason():
    prompt = [100, 101, 102, 103]
    h = SpecHarness(lambda tokens: truth(tokens, K))
    h.add("a", prompt, max_tokens=50, stop_token_ids=[102])
    out = h.run_all()
    assert out["a"] == [104, 105, 106, 100, 101, 102]     # the draft after 102 is dropped
    assert h.finish == {"a": "stop"}
    assert h.s.stats().spec_num_accepted_tokens >= 4


@pytest.mark.parametrize("max_tokens", [2, 3, 6, 7])
def test_max_tokens_reached_mid_draft_emits_exactly_max_tokens(max_tokens):
    h = SpecHarness(lambda tokens: truth(tokens, K))
    h.add("a", [100, 101, 102], max_tokens=max_tokens)
    out = h.run_all()
    assert out == plain_run({"a": [100, 101, 102]}, max_tokens=max_tokens)
    assert len(out["a"]) == max_tokens and h.finish == {"a": "length"}


def test_drafts_stop_at_the_context_length():
    h = SpecHarness(lambda tokens: truth(tokens, K), num_blocks=8)     # max_model_len 28
    max_len = h.s.max_model_len
    h.add("a", list(range(100, 107)) * 3, max_tokens=100)
    out = h.run_all()
    assert len(out["a"]) == max_len - 21 and h.finish == {"a": "length"}
    assert out == plain_run({"a": list(range(100, 107)) * 3}, num_blocks=8, max_tokens=100)


def test_token_budget_trims_drafts_after_the_requests_own_tokens():
    h = SpecHarness(lambda tokens: truth(tokens, K), max_num_batched_tokens=7)
    h.add("a", [100, 101], max_tokens=30)
    h.add("b", [102, 103], max_tokens=30)
    h.step()                                 # both prompts
    so, _ = h.step()
    assert so.num_scheduled_tokens == {"a": 5, "b": 2}
    assert so.scheduled_spec_decode_tokens == {"a": truth([100, 101, 102], K), "b": truth([102, 103, 104], 1)}
    out = h.run_all()
    ref = plain_run({"a": [100, 101], "b": [102, 103]}, max_tokens=30)
    assert {rid: ref[rid][-len(toks):] for rid, toks in out.items()} == out


def test_preemption_drops_drafts_and_the_request_resumes_with_the_same_tokens():
    prompts = {"a": list(range(200, 210)), "b": list(range(300, 310))}
    h = SpecHarness(right_then_wrong(3), num_blocks=10)
    for rid, prompt in prompts.items():
        h.add(rid, prompt, max_tokens=24)
    out: dict[str, Tokens] = {}
    preempted_with_no_drafts = False
    while h.s.has_work():
        so, outs = h.step()
        check_cached_contents(h)
        for o in outs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        for req in h.s.waiting:
            if req.num_preemptions:
                assert req.spec_token_ids == []
                preempted_with_no_drafts = True
                assert req.request_id not in so.scheduled_spec_decode_tokens
    assert preempted_with_no_drafts and h.s.stats().num_preemptions >= 1
    assert out == plain_run(prompts, max_tokens=24)


def test_no_cached_block_ever_holds_a_rejected_draft():
    # every draft wrong: the slots past a request's tokens always hold 9999s when its blocks fill
    h = SpecHarness(right_then_wrong(0))
    h.add("a", [100, 101, 102, 103, 104, 105, 106], max_tokens=40)
    h.run_all()                                           # checks cached contents every step
    h2 = SpecHarness(right_then_wrong(0))
    h2.add("a", [100, 101, 102, 103, 104, 105, 106], max_tokens=40)
    h2.add("b", [100, 101, 102, 103, 104, 105, 106], max_tokens=40)
    h2.run_all()
    assert h2.s.stats().prefix_cache_hits > 0


def test_a_step_without_drafts_from_the_worker_schedules_none():
    h = SpecHarness(lambda tokens: [])
    h.add("a", [100, 101], max_tokens=5)
    while h.s.has_work():
        so, _ = h.step()
        assert so.scheduled_spec_decode_tokens == {} and all(n == 2 or n == 1 for n in so.num_scheduled_tokens.values())
    assert h.s.stats().spec_num_drafts == 0


def test_speculative_decoding_turns_async_scheduling_off_and_refuses_it_when_asked_for():
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    cfg = EngineArgs(speculative_config=json.dumps(spec)).create_engine_config()
    assert cfg.speculative == SpeculativeConfig.from_dict(spec)
    assert cfg.parallel.multiprocess and cfg.scheduler.async_scheduling is None
    assert cfg.resolve(cuda_available=False, cpu_count=2, arch=ARCH).scheduler.async_scheduling is False
    with pytest.raises(ValueError, match="async scheduling and speculative decoding cannot be combined"):
        EngineArgs(speculative_config=spec, async_scheduling=True).create_engine_config()
    with pytest.raises(ValueError, match="unknown model 'no-such-draft'"):    # fails fast, naming it
        EngineArgs(speculative_config={"method": "draft_model", "model": "no-such-draft",
                                       "num_speculative_tokens": 3}).create_engine_config()
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineArgs(speculative_config='{"method": "ngram"}').create_engine_config()


def test_a_draft_model_gets_k_lookahead_slots_for_its_drafts_kv_up_to_the_context_length():
    """With a draft model, every step's blocks reach k slots past its tokens (the worker writes the
    next drafts' keys and values there before the next schedule: the fake worker asserts it),
    except past the context length; the tokens are those of plain decoding."""
    prompts = {"a": [100, 101, 102], "b": [100, 104], "c": list(range(100, 130))}
    h = SpecHarness(lambda tokens: truth(tokens, K), num_blocks=64, method="self_draft")
    for rid, prompt in prompts.items():
        h.add(rid, prompt, max_tokens=40 if rid != "c" else 400)
    seen = []
    out: dict[str, Tokens] = {}
    while h.s.has_work():
        so, outs = h.step()
        for o in outs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        for req in h.s.running:
            held = h.kv.num_blocks_held(req.request_id) * 4
            seen.append(held >= min(req.num_computed_tokens + K, h.s.max_model_len))
    assert seen and all(seen)
    assert out == plain_run(prompts, max_tokens=40) | {"c": out["c"]}
    assert len(prompts["c"]) + len(out["c"]) == h.s.max_model_len          # c ran to the context length
    assert h.s.stats().spec_num_accepted_tokens == h.s.stats().spec_num_draft_tokens > 0
