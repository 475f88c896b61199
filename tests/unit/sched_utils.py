"""Drive a real Scheduler and KVCacheManager by hand, as the scheduler actor and a worker would."""
from __future__ import annotations

import zlib
from collections import deque
from typing import Callable

from actors.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from actors.kv_manager.manager import KVCacheManager
from actors.scheduler.scheduler import Scheduler
from models.resolve import ModelSource
from actors.engine.messages import EngineCoreOutput, EngineCoreRequest, ModelRunnerOutput, SchedulerOutput
from actors.engine.sampling_params import SamplingParams

EOS = 2


def engine_config(num_blocks: int = 64, enable_prefix_caching: bool = True, **cfg) -> EngineConfig:
    """A resolved config for a cache of ``num_blocks`` blocks of 4 tokens (no model behind it);
    ``cfg``: scheduler options."""
    return EngineConfig(
        model=ModelConfig(source=ModelSource("hf_dir", "", "fake"), max_model_len=(num_blocks - 1) * 4),
        cache=CacheConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(**{"max_num_batched_tokens": 64, **cfg}))


def make(num_blocks: int = 64, **cfg) -> tuple[Scheduler, KVCacheManager]:
    """A Scheduler on its own KVCacheManager (see ``engine_config``)."""
    config = engine_config(num_blocks, **cfg)
    kv = KVCacheManager(num_blocks, 4, config.cache.enable_prefix_caching)
    return Scheduler(config, kv), kv


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
    their hashes, and samples ``token`` (or ``token(tokens so far)``) for every request whose
    tokens are all computed. It keeps its own copy of each request's tokens, as the real worker
    does, so a step planned before the previous one's output came back computes the token sampled
    there."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}

    def run(self, so: SchedulerOutput, token: int | Callable[[list[int]], int]) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.tokens.pop(rid, None)
            self.blocks.pop(rid, None)
        for r in so.new_reqs:
            self.tokens[r.req_id] = r.prompt_token_ids + r.output_token_ids
            self.blocks[r.req_id] = list(r.block_ids[0])     # one KV cache group
        for rid, blocks in zip(so.cached_reqs.req_ids, so.cached_reqs.new_block_ids):
            self.blocks[rid].extend(blocks[0])
        sampled = []
        starts = dict(zip(so.cached_reqs.req_ids, so.cached_reqs.num_computed_tokens))
        starts |= {r.req_id: r.num_computed_tokens for r in so.new_reqs}
        for rid, n in so.num_scheduled_tokens.items():
            start = starts[rid]
            for pos in range(start, start + n):
                slot = self.blocks[rid][pos // self.bs] * self.bs + pos % self.bs
                self.slots[slot] = self.tokens[rid][pos]
            done = start + n == len(self.tokens[rid])
            tok = token(self.tokens[rid]) if callable(token) else token
            sampled.append([tok] if done else [])
            if done:
                self.tokens[rid].append(tok)
        return ModelRunnerOutput(list(so.num_scheduled_tokens), sampled)


class Harness:
    """A Scheduler, its KVCacheManager and a FakeWorker, stepped as the scheduler actor does."""

    def __init__(self, num_blocks: int = 64, **cfg) -> None:
        self.s, self.kv = make(num_blocks, **cfg)
        self.worker = FakeWorker(num_blocks, self.kv.block_size)
        self.hash_tokens: dict[bytes, tuple[int, ...]] = {}   # every block hash seen -> its tokens

    def add(self, rid: str, prompt: int | list[int], **kw) -> None:
        add(self.s, rid, prompt, **kw)

    def step(self, token: int = 7, check: bool = True) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        """One engine step: schedule, run on the fake worker, update; then the KV manager's
        integrity check."""
        so = self.schedule()
        outs = self.s.update_from_output(so, self.worker.run(so, token))
        if check:
            self.kv.check_integrity()
        return so, outs

    def schedule(self) -> SchedulerOutput:
        """The next step; every request's block hashes noted first (for check_cached_contents:
        a request may offer blocks to the cache and be preempted within one step)."""
        bs = self.kv.block_size
        for req in self.s.requests.values():
            for i, bh in enumerate(req.block_hashes):
                self.hash_tokens[bh] = tuple(req.all_token_ids[i * bs:(i + 1) * bs])
        return self.s.schedule()


class AsyncHarness(Harness):
    """As Harness, but stepped as the scheduler actor does with async scheduling: step N+1 is
    planned (and run by the in-order worker) before step N's output is handed back."""

    def __init__(self, num_blocks: int = 64, **cfg) -> None:
        super().__init__(num_blocks, **cfg)
        self.in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()

    def step(self, token=7, check: bool = True) -> tuple[SchedulerOutput | None, list[EngineCoreOutput]]:
        """Plan and run the next step; hand back the oldest output once two are in flight (or
        when nothing new was planned). Returns the planned step and the outputs handed back."""
        so, outs = None, []
        if self.s.has_work():
            planned = self.schedule()
            if planned.num_scheduled_tokens:
                so = planned
                self.in_flight.append((so, self.worker.run(so, token)))
        if self.in_flight and (len(self.in_flight) >= 2 or so is None):
            outs += self.s.update_from_output(*self.in_flight.popleft())
        if check:
            self.kv.check_integrity()
        return so, outs

    def busy(self) -> bool:
        return self.s.has_work() or bool(self.in_flight)


def held_blocks(kv: KVCacheManager) -> int:
    return sum(len(b) for b in kv.req_to_blocks.values())


def check_cached_contents(h: Harness) -> None:
    """Every block in the prefix map holds exactly the tokens its hash stands for."""
    bs = h.kv.block_size
    for (bh, _group), block in h.kv.pool.cached.items():
        held = tuple(h.worker.slots[block.block_id * bs:(block.block_id + 1) * bs])
        assert held == h.hash_tokens[bh], (block.block_id, held, h.hash_tokens[bh])
