"""Drive a real Scheduler and KVCacheManager by hand, as the scheduler actor and a worker would."""
from __future__ import annotations

import zlib

from actors.kv_manager.manager import KVCacheManager
from actors.scheduler.scheduler import Scheduler, SchedulerConfig, StepPlan
from transport.messages import (EngineCoreOutput, EngineCoreRequest, ModelRunnerOutput,
                                SamplingParams, SchedulerOutput)

EOS = 2


def make(num_blocks: int = 64, **cfg) -> tuple[Scheduler, KVCacheManager]:
    config = SchedulerConfig(**{"block_size": 4, "max_num_batched_tokens": 64, **cfg})
    return Scheduler(config, num_blocks), KVCacheManager(num_blocks, config.block_size,
                                                         config.enable_prefix_caching)


def add(s: Scheduler, rid: str, prompt: int | list[int], max_tokens: int = 8, priority: int = 0,
        arrival: float = 0.0, **params) -> None:
    # an int: that many tokens no other request shares (no accidental prefix hits)
    base = 1000 + (zlib.crc32(rid.encode()) % 40_000)
    ids = list(range(base, base + prompt)) if isinstance(prompt, int) else list(prompt)
    err = s.add_request(EngineCoreRequest(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0, **params),
                                          arrival, [EOS], priority))
    if err is not None:
        raise AssertionError(err)


class FakeWorker:
    """Writes each scheduled token id into its slot, so cached blocks can be checked against
    their hashes, and samples ``token`` for every request whose prompt is complete."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}

    def run(self, s: Scheduler, plan: StepPlan, so: SchedulerOutput, token: int) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.tokens.pop(rid, None)
            self.blocks.pop(rid, None)
        for r in so.new_reqs:
            self.tokens[r.req_id] = r.prompt_token_ids + r.output_token_ids
            self.blocks[r.req_id] = list(r.block_ids)
        for rid, blocks in zip(so.cached_reqs.req_ids, so.cached_reqs.new_block_ids):
            self.blocks[rid].extend(blocks)
        sampled = []
        for (req, n) in plan.scheduled:
            rid = req.request_id
            start = req.num_computed_tokens - n
            for pos in range(start, start + n):
                slot = self.blocks[rid][pos // self.bs] * self.bs + pos % self.bs
                self.slots[slot] = self.tokens[rid][pos]
            done = start + n == len(self.tokens[rid])
            sampled.append([token] if done else [])
            if done:
                self.tokens[rid].append(token)
        return ModelRunnerOutput(list(so.num_scheduled_tokens), sampled)


class Harness:
    """A Scheduler, its KVCacheManager and a FakeWorker, stepped as the scheduler actor does."""

    def __init__(self, num_blocks: int = 64, **cfg) -> None:
        self.s, self.kv = make(num_blocks, **cfg)
        self.worker = FakeWorker(num_blocks, self.kv.block_size)
        self.round_trips: list[int] = []
        self.hash_tokens: dict[bytes, tuple[int, ...]] = {}   # every block hash seen -> its tokens

    def add(self, rid: str, prompt: int | list[int], **kw) -> None:
        add(self.s, rid, prompt, **kw)

    def step(self, token: int = 7, check: bool = True) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        """One engine step with its (at most two) KV round trips; then the idle release."""
        s, kv = self.s, self.kv
        trips = 0
        prepare = s.begin_step()
        if prepare is not None:
            s.apply_prepare(kv.prepare(prepare))
            trips += 1
        plan = s.schedule()
        bs = kv.block_size
        for req, _ in plan.scheduled:
            for i, bh in enumerate(req.block_hashes):
                self.hash_tokens[bh] = tuple(req.all_token_ids[i * bs:(i + 1) * bs])
        so = s.build_output(plan, kv.commit(plan.kv_commit))
        self.round_trips.append(trips + 1)
        outs = s.update_from_output(so, self.worker.run(s, plan, so, token))
        self.idle_release()
        if check:
            check_accounting(s, kv)
        return so, outs

    def idle_release(self) -> None:
        if not self.s.has_work():
            release = self.s.release()
            if release is not None:
                self.s.apply_prepare(self.kv.prepare(release))


def check_accounting(s: Scheduler, kv: KVCacheManager) -> None:
    kv.check_integrity()
    assert s.num_free_blocks == kv.pool.num_free_blocks or s.has_pending_frees()
    for rid, req in s.requests.items():
        held = len(kv.req_to_blocks.get(rid, ()))
        if not s.has_pending_frees():
            assert req.num_blocks == held, (rid, req.num_blocks, held)
            assert req.num_exclusive_blocks == kv.exclusive_blocks(rid), rid


def held_blocks(kv: KVCacheManager) -> int:
    return sum(len(b) for b in kv.req_to_blocks.values())


def check_cached_contents(h: Harness) -> None:
    """Every block in the prefix map holds exactly the tokens its hash stands for."""
    bs = h.kv.block_size
    for bh, block in h.kv.pool.cached.items():
        held = tuple(h.worker.slots[block.block_id * bs:(block.block_id + 1) * bs])
        assert held == h.hash_tokens[bh], (block.block_id, held, h.hash_tokens[bh])
