"""The scheduler's core: which requests advance by how many tokens in the next step.

There is no prefill phase and no decode phase. Each request has ``num_computed_tokens`` and a
token count (prompt + output so far); a step lets requests catch up under the token budget
``max_num_batched_tokens`` and ``max_num_seqs``. RUNNING requests are served first, then
WAITING ones. A prompt longer than the budget is prefilled in chunks over several steps.
When the KV cache cannot hold a running request's next tokens, the request at the tail of the
running list is preempted (its blocks freed, recomputed later) and its budget refunded.

Pure: no asyncio, no transport. A step is ``schedule()`` -> the KV manager commits the block
changes -> ``build_output()``; after the workers ran it, ``update_from_output()``.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from actors.kv_manager.messages import KVCommit, KVCommitResult
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


class StepPlan(NamedTuple):
    """What ``schedule`` decided; the KV commit turns block counts into block ids."""
    step: int
    scheduled: list[tuple[Request, int]]       # (request, num new tokens), in batch order
    new_req_ids: set[str]                      # requests the workers must be told in full
    kv_commit: KVCommit
    finished_req_ids: list[str]


@dataclass(slots=True)
class _Counters:
    step: int = 0
    num_preemptions: int = 0
    last_scheduled_reqs: int = 0
    last_scheduled_tokens: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_blocks: int) -> None:
        self.config = config
        self.num_usable_blocks = num_blocks - 1          # block 0 is the null block
        self.num_free_blocks = self.num_usable_blocks    # mirrors the KV manager exactly
        self.watermark_blocks = int(config.watermark * self.num_usable_blocks)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._to_free: list[str] = []             # blocks to release at the next commit
        self._finished_for_workers: list[str] = []
        self.counters = _Counters()

    # -- admission and abort -----------------------------------------------------------------
    def add_request(self, r: EngineCoreRequest) -> EngineCoreOutput | None:
        """Queue a request; returns an immediate error output if it can never be served."""
        if r.request_id in self.requests:
            return EngineCoreOutput(r.request_id, [], "error", error=f"duplicate request id {r.request_id}")
        limit = min(self.config.max_model_len, self.num_usable_blocks * self.config.block_size)
        if len(r.prompt_token_ids) >= limit:
            return EngineCoreOutput(r.request_id, [], "error", error=(
                f"prompt of {len(r.prompt_token_ids)} tokens leaves no room to generate "
                f"(limit {limit} tokens)"))
        req = Request.from_engine_request(r)
        self.requests[req.request_id] = req
        self.waiting.append(req)
        return None

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        outs = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and not req.status.finished:
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

    def release_commit(self) -> KVCommit | None:
        """Frees not yet sent to the KV manager, for when no step is coming to carry them."""
        if not self._to_free:
            return None
        commit, self._to_free = KVCommit(self._to_free, []), []
        return commit

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req in self.running:
            self.running.remove(req)
            self._finished_for_workers.append(req.request_id)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self._release_blocks(req)
        del self.requests[req.request_id]

    def _release_blocks(self, req: Request) -> None:
        if req.num_blocks:
            self.num_free_blocks += req.num_blocks
            req.num_blocks = 0
        self._to_free.append(req.request_id)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: dict[Request, int] = {}
        new_blocks: dict[Request, int] = {}
        preempted: list[Request] = []
        free = self.num_free_blocks

        # 1) running requests, in order; preempt from the tail when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new_tokens(req, budget)
            if n == 0:
                i += 1
                continue
            need = self._blocks_needed(req, n)
            while need > free:
                victim = self.running.pop()
                budget += scheduled.pop(victim, 0)
                free += new_blocks.pop(victim, 0) + victim.num_blocks
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req in preempted:
                break
            scheduled[req] = n
            new_blocks[req] = need
            free -= need
            budget -= n
            i += 1

        # 2) waiting requests, first come first served, unless this step had to preempt
        new_ids: set[str] = set()
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < cfg.max_num_seqs):
            req = self.waiting[0]
            n = self._num_new_tokens(req, budget)
            need = self._blocks_needed(req, n)
            if free - need < self.watermark_blocks:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req] = n
            new_blocks[req] = need
            new_ids.add(req.request_id)
            free -= need
            budget -= n

        # 3) account: tokens become computed once scheduled; blocks are reserved now
        for req, n in scheduled.items():
            req.num_computed_tokens += n
            req.num_blocks += new_blocks[req]
        self.num_free_blocks = free
        self.counters.step += 1
        self.counters.last_scheduled_reqs = len(scheduled)
        self.counters.last_scheduled_tokens = cfg.max_num_batched_tokens - budget
        commit = KVCommit(self._to_free, [(r.request_id, new_blocks[r]) for r in scheduled])
        self._to_free = []
        finished = self._finished_for_workers + [r.request_id for r in preempted]
        self._finished_for_workers = []
        return StepPlan(self.counters.step, list(scheduled.items()), new_ids, commit, finished)

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        n = req.num_tokens - req.num_computed_tokens
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < n and len(self.running) + len(self.waiting) > 1:
            n = threshold
        return min(n, budget)

    def _blocks_needed(self, req: Request, n: int) -> int:
        bs = self.config.block_size
        total = -(-(req.num_computed_tokens + n) // bs)
        return max(total - req.num_blocks, 0)

    def _preempt(self, req: Request) -> None:
        # schedule() already counted the victim's blocks as free in its local tally.
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.num_blocks = 0
        self._to_free.append(req.request_id)
        self.waiting.appendleft(req)
        self.counters.num_preemptions += 1

    def build_output(self, plan: StepPlan, kv: KVCommitResult) -> SchedulerOutput:
        """Turn the plan and the blocks the KV manager gave into the workers' step message."""
        if kv.num_free_blocks != self.num_free_blocks:
            raise RuntimeError(f"scheduler and KV manager disagree on free blocks: "
                               f"{self.num_free_blocks} != {kv.num_free_blocks}")
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        num_scheduled: dict[str, int] = {}
        for (req, n), blocks in zip(plan.scheduled, kv.new_block_ids):
            rid = req.request_id
            num_scheduled[rid] = n
            if rid in plan.new_req_ids:
                new_reqs.append(NewRequestData(rid, req.prompt_token_ids, list(req.output_token_ids),
                                               req.sampling_params, blocks, req.num_computed_tokens - n))
            else:
                cached.req_ids.append(rid)
                cached.new_block_ids.append(blocks)
                cached.num_computed_tokens.append(req.num_computed_tokens - n)
        return SchedulerOutput(plan.step, new_reqs, cached, num_scheduled,
                               sum(num_scheduled.values()), plan.finished_req_ids)

    def update_from_output(self, so: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, check stop conditions, and finish requests that are done."""
        outs = []
        for rid, sampled in zip(out.req_ids, out.sampled_token_ids):
            req = self.requests.get(rid)
            if req is None or not sampled or req.status.finished:
                continue   # aborted meanwhile, or a prompt chunk that sampled nothing
            new_ids: list[int] = []
            status = None
            for tok in sampled:
                req.append_output_token_ids([tok])
                new_ids.append(tok)
                status = self._check_stop(req, tok)
                if status is not None:
                    break
            outs.append(EngineCoreOutput(rid, new_ids))
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
        if n_out >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def stats(self) -> SchedulerStats:
        c = self.counters
        return SchedulerStats(c.step, len(self.running), len(self.waiting), c.last_scheduled_reqs,
                              c.last_scheduled_tokens,
                              1.0 - self.num_free_blocks / max(self.num_usable_blocks, 1),
                              c.num_preemptions)

