"""The scheduler's core: which requests advance by how many tokens in the next step.

There is no prefill phase and no decode phase. Each request has ``num_computed_tokens`` and a
token count (prompt + output so far); a step lets requests catch up under the token budget
``max_num_batched_tokens`` and ``max_num_seqs``. RUNNING requests are served first, then
WAITING ones (first come first served, or by priority). A prompt longer than the budget is
prefilled in chunks over several steps; a waiting request starts after its longest cached
prefix. When the KV cache cannot hold a running request's next tokens, a victim is preempted
(FCFS: the tail of the running list; priority: the lowest priority), its blocks freed, its
budget refunded, and it is recomputed later.

Pure: no asyncio, no transport. One step, with at most two KV-manager round trips:
    prepare = begin_step()          # frees and prefix lookups (None when there are none)
    apply_prepare(kv(prepare))
    plan = schedule()               # the decisions, and the KVCommit that realizes them
    so = build_output(plan, kv(plan.kv_commit))
    ... the workers run ``so`` ...
    update_from_output(so, runner_output)

The scheduler knows block counts, never block identities: it mirrors the number of free blocks
and each request's exclusively held blocks from the KV manager's replies, so it can decide
exactly what fits before the commit.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

from actors.kv_manager.manager import blocks_needed
from actors.kv_manager.messages import (KVAlloc, KVCommit, KVCommitResult, KVPrepare,
                                        KVPrepareResult)
from actors.scheduler.queues import create_queue
from actors.scheduler.request import Request, RequestStatus
from transport.messages import (CachedRequestData, EngineCoreOutput, EngineCoreRequest,
                                ModelRunnerOutput, NewRequestData, SchedulerOutput,
                                SchedulerStats)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    block_size: int = 16
    long_prefill_token_threshold: int = 0     # 0 = off
    watermark: float = 0.01                   # fraction of blocks kept free when admitting
    policy: str = "fcfs"                      # "fcfs" | "priority"
    enable_prefix_caching: bool = True
    full_sequence_must_fit: bool = False      # admit only if the whole prompt's blocks fit


class StepPlan(NamedTuple):
    step: int
    scheduled: list[tuple[Request, int]]       # (request, num new tokens), in batch order
    new_req_ids: set[str]                      # requests the workers must be told in full
    kv_commit: KVCommit
    finished_req_ids: list[str]
    min_free_blocks: int                       # free blocks left if no hit is shared


@dataclass(slots=True)
class _Counters:
    step: int = 0
    num_preemptions: int = 0
    last_scheduled_reqs: int = 0
    last_scheduled_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    busy_seconds: float = 0.0
    compute_seconds: float = 0.0


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_blocks: int) -> None:
        self.config = config
        self.num_usable_blocks = num_blocks - 1          # block 0 is the null block
        self.num_free_blocks = self.num_usable_blocks    # as of the KV manager's last reply
        self.watermark_blocks = int(config.watermark * self.num_usable_blocks)
        # A request alone must always fit, or preempting everything else could not save it.
        self.max_len = min(config.max_model_len, self.num_usable_blocks * config.block_size)
        self.requests: dict[str, Request] = {}
        self.waiting = create_queue(config.policy)
        self.running: list[Request] = []
        self._to_free: list[str] = []             # blocks to release at the next round trip
        self._finished_for_workers: list[str] = []
        self._hits: dict[str, tuple[int, int]] = {}
        self._lookups: list[str] = []
        self.counters = _Counters()

    # -- admission and abort -----------------------------------------------------------------
    def add_request(self, r: EngineCoreRequest) -> EngineCoreOutput | None:
        """Queue a request; returns an immediate error output if it can never be served."""
        if r.request_id in self.requests:
            return EngineCoreOutput(r.request_id, [], "error", error=f"duplicate request id {r.request_id}")
        if len(r.prompt_token_ids) >= self.max_len:
            return EngineCoreOutput(r.request_id, [], "error", error=(
                f"prompt of {len(r.prompt_token_ids)} tokens leaves no room to generate "
                f"(limit {self.max_len} tokens)"))
        bs = self.config.block_size if self.config.enable_prefix_caching else 0
        req = Request.from_engine_request(r, bs)
        self.requests[req.request_id] = req
        self.waiting.add(req)
        return None

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        outs = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, RequestStatus.FINISHED_ABORTED)
                outs.append(EngineCoreOutput(rid, [], "abort"))
        return outs

    def fail_running(self, error: str) -> list[EngineCoreOutput]:
        """The workers failed mid-step: every running request ends with ``error``."""
        outs = []
        for req in list(self.running):
            self._finish(req, RequestStatus.FINISHED_ERROR)
            outs.append(EngineCoreOutput(req.request_id, [], "error", error=error))
        return outs

    def reset_blocks(self) -> None:
        """The KV manager forgot every allocation; only requests without blocks may remain."""
        if self.running:
            raise RuntimeError("cannot reset KV blocks while requests are running")
        self.num_free_blocks = self.num_usable_blocks
        self._to_free.clear()
        self._finished_for_workers.clear()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_pending_frees(self) -> bool:
        return bool(self._to_free)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req in self.running:
            self.running.remove(req)
            self._finished_for_workers.append(req.request_id)
        else:
            self.waiting.remove(req)
        if req.num_blocks:
            self._to_free.append(req.request_id)
        req.num_blocks = req.num_exclusive_blocks = 0
        del self.requests[req.request_id]

    # -- round trip 1: frees and prefix lookups ----------------------------------------------
    def begin_step(self) -> KVPrepare | None:
        lookups = []
        if self.config.enable_prefix_caching:
            slots = self.config.max_num_seqs - len(self.running)
            for req in self.waiting.first(max(slots, 0)):
                cap = (req.num_tokens - 1) // self.config.block_size   # the last token is computed
                # prompt log-probs need the logits of every prompt position: no cache reads
                if cap > 0 and req.sampling_params.prompt_logprobs is None:
                    lookups.append((req.request_id, req.block_hashes[:cap]))
        self._hits = {}
        if not lookups and not self._to_free:
            return None
        prepare, self._to_free = KVPrepare(self._to_free, lookups), []
        self._lookups = [rid for rid, _ in lookups]
        return prepare

    def apply_prepare(self, result: KVPrepareResult) -> None:
        self.num_free_blocks = result.num_free_blocks
        self._apply_exclusive(result.exclusive)
        self._hits = dict(zip(self._lookups, result.hits))

    def release(self) -> KVPrepare | None:
        """Frees with no step to carry them (the engine is idle)."""
        if not self._to_free:
            return None
        self._lookups = []
        prepare, self._to_free = KVPrepare(self._to_free, []), []
        return prepare

    # -- the step ----------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: dict[Request, int] = {}
        new_blocks: dict[Request, int] = {}
        hit_blocks: dict[Request, int] = {}
        preempted: list[Request] = []
        free = self.num_free_blocks

        # 1) running requests, in order; preempt victims when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new_tokens(req, req.num_computed_tokens, budget)
            if n == 0:
                i += 1
                continue
            need = blocks_needed(req.num_computed_tokens + n, cfg.block_size, req.num_blocks)
            while need > free:
                victim = self._pick_victim()
                vi = self.running.index(victim)
                del self.running[vi]
                budget += scheduled.pop(victim, 0)
                free += new_blocks.pop(victim, 0) + victim.num_exclusive_blocks
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
                if vi < i:
                    i -= 1
            if req.status is RequestStatus.PREEMPTED:
                continue          # the list shifted onto the next request
            scheduled[req] = n
            new_blocks[req] = need
            free -= need
            budget -= n
            i += 1

        # 2) waiting requests, unless this step had to preempt
        new_ids: set[str] = set()
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < cfg.max_num_seqs):
            req = self.waiting.peek()
            hits, hits_free = self._hits.get(req.request_id, (0, 0))
            computed = hits * cfg.block_size
            n = self._num_new_tokens(req, computed, budget)
            need = blocks_needed(computed + n, cfg.block_size, hits)
            check = blocks_needed(req.num_tokens, cfg.block_size, hits) if cfg.full_sequence_must_fit else need
            watermark = self.watermark_blocks if (self.running or scheduled) else 0
            if free - check - hits_free < watermark:
                break
            self.waiting.pop()
            req.status = RequestStatus.RUNNING
            if not req.first_scheduled_time:
                req.first_scheduled_time = time.time()
            req.num_computed_tokens = req.num_cached_tokens = computed
            self.counters.prefix_cache_queries += req.num_tokens
            self.counters.prefix_cache_hits += computed
            self.running.append(req)
            scheduled[req] = n
            new_blocks[req] = need
            hit_blocks[req] = hits
            new_ids.add(req.request_id)
            free -= need + hits_free
            budget -= n

        # 3) account: scheduled tokens count as computed; the commit carries the blocks
        allocs = []
        for req, n in scheduled.items():
            req.num_computed_tokens += n
            allocs.append(KVAlloc(req.request_id, hit_blocks.get(req, 0), new_blocks[req],
                                  req.num_computed_tokens // cfg.block_size, req.block_hashes))
        c = self.counters
        c.step += 1
        c.last_scheduled_reqs = len(scheduled)
        c.last_scheduled_tokens = cfg.max_num_batched_tokens - budget
        commit = KVCommit(self._to_free + [r.request_id for r in preempted], allocs)
        self._to_free = []
        finished = self._finished_for_workers + [r.request_id for r in preempted]
        self._finished_for_workers = []
        return StepPlan(c.step, list(scheduled.items()), new_ids, commit, finished, free)

    def _num_new_tokens(self, req: Request, computed: int, budget: int) -> int:
        n = req.num_tokens - computed
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < n and len(self.running) + len(self.waiting) > 1:
            n = threshold
        return min(n, budget)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, req: Request) -> None:
        # schedule() counted the victim's exclusive blocks as free in its own tally
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.num_blocks = req.num_exclusive_blocks = 0
        self.waiting.prepend(req)
        self.counters.num_preemptions += 1

    def build_output(self, plan: StepPlan, kv: KVCommitResult) -> SchedulerOutput:
        """Turn the plan and the blocks the KV manager gave into the workers' step message."""
        if kv.num_free_blocks < plan.min_free_blocks:
            raise RuntimeError(f"the KV manager has {kv.num_free_blocks} free blocks, the plan "
                               f"left at least {plan.min_free_blocks}")
        self.num_free_blocks = kv.num_free_blocks
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        num_scheduled: dict[str, int] = {}
        for (req, n), blocks in zip(plan.scheduled, kv.block_ids):
            rid = req.request_id
            req.num_blocks += len(blocks)
            num_scheduled[rid] = n
            if rid in plan.new_req_ids:
                new_reqs.append(NewRequestData(rid, req.prompt_token_ids, list(req.output_token_ids),
                                               req.sampling_params, blocks, req.num_computed_tokens - n))
            else:
                cached.req_ids.append(rid)
                cached.new_block_ids.append(blocks)
                cached.num_computed_tokens.append(req.num_computed_tokens - n)
        self._apply_exclusive(kv.exclusive)
        return SchedulerOutput(plan.step, new_reqs, cached, num_scheduled,
                               sum(num_scheduled.values()), plan.finished_req_ids)

    def _apply_exclusive(self, exclusive: dict[str, int]) -> None:
        for rid, n in exclusive.items():
            req = self.requests.get(rid)
            if req is not None and req.num_blocks:
                req.num_exclusive_blocks = n

    def update_from_output(self, so: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, check stop conditions, and finish requests that are done."""
        outs = []
        for rid, sampled in zip(out.req_ids, out.sampled_token_ids):
            req = self.requests.get(rid)
            prompt_lp = out.prompt_logprobs.get(rid)
            if req is None or req.status.finished or not (sampled or prompt_lp):
                continue   # aborted meanwhile, or a prompt chunk with nothing to report
            new_ids: list[int] = []
            status = None
            for tok in sampled:
                req.append_output_token_ids([tok])
                new_ids.append(tok)
                status = self._check_stop(req, tok)
                if status is not None:
                    break
            outs.append(EngineCoreOutput(rid, new_ids, logprobs=out.logprobs.get(rid),
                                         prompt_logprobs=prompt_lp,
                                         num_cached_tokens=req.num_cached_tokens))
            if not req.first_output_sent:
                outs[-1].first_scheduled_time = req.first_scheduled_time
                req.first_output_sent = True
            if status is not None:
                outs[-1].finish_reason = status.finish_reason
                outs[-1].stop_reason = req.stop_reason
                self._finish(req, status)
        return outs

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        p = req.sampling_params
        n_out = req.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and tok in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if tok in p.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        if n_out >= p.max_tokens or req.num_tokens >= self.max_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def stats(self) -> SchedulerStats:
        c = self.counters
        return SchedulerStats(c.step, len(self.running), len(self.waiting), c.last_scheduled_reqs,
                              c.last_scheduled_tokens,
                              1.0 - self.num_free_blocks / max(self.num_usable_blocks, 1),
                              c.num_preemptions, c.prefix_cache_queries, c.prefix_cache_hits,
                              c.busy_seconds, c.compute_seconds)
