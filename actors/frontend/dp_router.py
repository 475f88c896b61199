"""DataParallelRouter: the frontend's door to several engine cores (``--data-parallel-size N``).

It takes the scheduler's protocol, so the tokenizer, the detokenizer and the client talk to it as
they would to one engine's scheduler, and sends each request to one engine core:

  - the least loaded: waiting plus running requests in the engine's latest stats (which come
    with its outputs), plus the requests sent to it since those stats (ties: the one that was
    given fewer requests);
  - unless the engine that last served the same prompt prefix (its first blocks) is within a
    small slack of the least loaded: then that one, whose prefix cache likely holds it.

It remembers which engine holds each open request, so an abort goes to that engine only, and an
engine core that dies fails its own requests (``EngineLost`` with their ids) while the others
keep serving; until it is back (``EngineUp``) it gets no new request. A pause, its end and its
status go to every engine core that is up; the pause is complete when it is on each.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

from actors.detokenizer.actor import EngineLost
from actors.engine.messages import EngineCoreRequest
from actors.frontend.stats import EngineStats
from actors.frontend.streams import OutputStreams
from actors.runtime import Actor, ActorRef, Msg, RemoteError
from actors.runtime.errors import passed_on
from actors.scheduler.actor import (SLEEP_TIMEOUT_S, AbortRequests, AddRequest, GetPauseStatus, GrammarReady,
                                    PauseScheduler, PauseStatus, PinLoRA, ProfileEngine, RemoveLoRA, ResetEncoderCache,
                                    ResumeScheduler, SleepEngine, WakeEngine, WeightVersion)
from actors.worker.actor import WorkerRPC

AFFINITY_BLOCKS = 4            # the prompt prefix that keys affinity: its first blocks, at most this many
AFFINITY_ENTRIES = 4096        # prefixes remembered (least recently used forgotten)


class EngineDown(Msg):
    """Engine core ``dp_rank`` died (``reason``): its requests fail, it gets no new one."""
    dp_rank: int
    reason: str


class EngineUp(Msg):
    """Engine core ``dp_rank`` serves again (restarted)."""
    dp_rank: int


RouterProtocol = (AddRequest | AbortRequests | GrammarReady | RemoveLoRA | PinLoRA | EngineDown | EngineUp
                  | PauseScheduler | ResumeScheduler | GetPauseStatus | SleepEngine | WakeEngine | ProfileEngine
                  | WeightVersion | ResetEncoderCache
                  | WorkerRPC)
PAUSE_ASK_TIMEOUT_S = 30.0


class NoEngineUp(RuntimeError):
    """Every engine core is down."""


class DataParallelRouter(Actor):
    protocol = RouterProtocol

    def __init__(self, schedulers: list[ActorRef], stats: EngineStats, streams: OutputStreams,
                 detokenizer: ActorRef, block_size: int, ranks: list[int] | None = None) -> None:
        self.schedulers = schedulers
        # each scheduler's data-parallel rank (hybrid load balancing: this machine's, from its start rank)
        self.ranks = list(ranks) if ranks is not None else list(range(len(schedulers)))
        self.index = {rank: e for e, rank in enumerate(self.ranks)}
        self.stats = stats
        self.streams = streams
        self.detokenizer = detokenizer
        self.block_size = block_size
        self.up = [True] * len(schedulers)
        self.owner: dict[str, int] = {}              # open request -> its engine
        self.sent = [0] * len(schedulers)            # requests sent since the engine's latest stats
        self.seen_step = [-1] * len(schedulers)      # the step of those stats
        self.affinity: OrderedDict[int, int] = OrderedDict()   # prompt prefix -> the engine that served it
        self.routed = [0] * len(schedulers)          # requests sent to each engine, since start

    async def receive(self, msg: RouterProtocol) -> Any:
        match msg:
            case AddRequest(request=r):
                try:
                    engine = self.choose(r)
                except NoEngineUp as exc:
                    self.detokenizer.tell(EngineLost(str(exc), [r.request_id]))
                    return
                self.owner[r.request_id] = engine
                self.sent[engine] += 1
                self.routed[engine] += 1
                self._forget_closed()
                self.schedulers[engine].tell(msg)
            case AbortRequests(request_ids=ids):
                by_engine: dict[int, list[str]] = {}
                for rid in ids:
                    engines = [self.owner[rid]] if rid in self.owner else range(len(self.schedulers))
                    for e in engines:
                        by_engine.setdefault(e, []).append(rid)
                for e, rids in by_engine.items():
                    if self.up[e]:
                        self.schedulers[e].tell(AbortRequests(rids))
            case RemoveLoRA() | PinLoRA():          # every engine's workers may hold the adapter
                for e, scheduler in enumerate(self.schedulers):
                    if self.up[e]:
                        scheduler.tell(msg)
            case GrammarReady(request_id=rid):
                engine = self.owner.get(rid)
                if engine is not None and self.up[engine]:
                    self.schedulers[engine].tell(msg)
            case EngineDown(dp_rank=rank, reason=reason):
                e = self.index[rank]
                self.up[e] = False
                lost = [rid for rid, owner in self.owner.items() if owner == e]
                for rid in lost:
                    del self.owner[rid]
                self.affinity = OrderedDict((k, v) for k, v in self.affinity.items() if v != e)
                if lost:
                    self.detokenizer.tell(EngineLost(reason, lost))
            case EngineUp(dp_rank=rank):
                e = self.index[rank]
                self.up[e] = True
                self.sent[e] = 0
            case SleepEngine() | WakeEngine():          # sleep mode: every engine core alike
                up = [s for e, s in enumerate(self.schedulers) if self.up[e]]
                each = await asyncio.gather(*(s.ask(msg, timeout=SLEEP_TIMEOUT_S) for s in up))
                return all(each) if isinstance(msg, WakeEngine) else msg.level
            case WorkerRPC(timeout=timeout):            # collective_rpc: every engine core's workers, in order
                up = [s for e, s in enumerate(self.schedulers) if self.up[e]]
                try:
                    each = await asyncio.gather(*(s.ask(msg, timeout=(timeout or SLEEP_TIMEOUT_S) + 10) for s in up))
                except RemoteError as exc:
                    raise passed_on(exc) from None
                return [r for results in each for r in results]
            case ResetEncoderCache():                   # every engine core's encoder cache
                up = [s for e, s in enumerate(self.schedulers) if self.up[e]]
                await asyncio.gather(*(s.ask(msg, timeout=PAUSE_ASK_TIMEOUT_S) for s in up))
            case ProfileEngine():                       # profiling: every engine core's workers
                up = [s for e, s in enumerate(self.schedulers) if self.up[e]]
                await asyncio.gather(*(s.ask(msg, timeout=SLEEP_TIMEOUT_S) for s in up))
            case WeightVersion():                       # every engine core's, set alike
                up = [s for e, s in enumerate(self.schedulers) if self.up[e]]
                each = await asyncio.gather(*(s.ask(msg, timeout=PAUSE_ASK_TIMEOUT_S) for s in up))
                return each[0] if each else (msg.new or "default")
            case PauseScheduler() | ResumeScheduler() | GetPauseStatus():
                up = [s for e, s in enumerate(self.schedulers) if self.up[e]]
                each = await asyncio.gather(*(s.ask(msg, timeout=PAUSE_ASK_TIMEOUT_S) for s in up))
                return PauseStatus(any(p.paused for p in each), bool(each) and all(p.drained for p in each))

    def choose(self, r: EngineCoreRequest) -> int:
        """The engine core for request ``r``: see the module docstring."""
        loads = {e: self._load(e) for e in range(len(self.schedulers)) if self.up[e]}
        if not loads:
            raise NoEngineUp("no engine core is serving")
        least = min(loads, key=lambda e: (loads[e], self.routed[e], e))    # ties: the one given fewer
        key = self._prefix_key(r.prompt_token_ids)
        if key is None:
            return least
        engine = self.affinity.get(key)
        slack = max(2, loads[least] // 4)
        if engine is None or engine not in loads or loads[engine] > loads[least] + slack:
            engine = least
        self.affinity[key] = engine
        self.affinity.move_to_end(key)
        if len(self.affinity) > AFFINITY_ENTRIES:
            self.affinity.popitem(last=False)
        return engine

    def _load(self, e: int) -> int:
        s = self.stats.engines.get(self.ranks[e])     # its latest stats, by its rank
        if s is None:
            return self.sent[e]
        if s.step != self.seen_step[e]:             # newer stats count the requests sent before them
            self.seen_step[e] = s.step
            self.sent[e] = 0
        return s.num_running + s.num_waiting + self.sent[e]

    def _prefix_key(self, prompt: list[int]) -> int | None:
        n = min(len(prompt) // self.block_size, AFFINITY_BLOCKS) * self.block_size
        return hash(tuple(prompt[:n])) if n else None

    def _forget_closed(self) -> None:
        """Drop the owners of requests no longer open, once they outnumber the open ones."""
        if len(self.owner) > 2 * len(self.streams) + 1024:
            self.owner = {rid: e for rid, e in self.owner.items() if self.streams.get(rid) is not None}
