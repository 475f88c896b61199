"""Executor actor: sends each SchedulerOutput to the worker (with tensor and pipeline
parallelism, to every rank at once) and returns its ModelRunnerOutput (the output rank's: rank 0,
or the last pipeline stage's first rank, with the KV connector's reports of every rank combined:
a transfer is finished once each rank finished its share).
While the worker is being restarted it holds steps until the replacement is up (its KV cache
allocated), so no step reaches a worker that cannot run it; a step held across a restart fails
as the worker's death (its requests are recomputed on the new one). A step whose reply is late is
asked about (StepStatus): a lost reply is recovered, a lost step sent again, so a dropped frame
costs seconds, not the step timeout.

Steps may be in flight two at a time (async scheduling), or one per pipeline stage: each carries the number of the step
sent before it, and the worker refuses one that overtook its predecessor (StepOutOfOrder: the
predecessor was lost and is being sent again); it is sent again once its predecessor settled,
then without a predecessor to wait for (one that failed before the worker took it leaves nothing
to order against)."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec

from actors.engine.messages import ModelRunnerOutput, SchedulerOutput
from actors.kv_transfer.base import KVOutputAggregator
from actors.runtime import Actor, ActorDied, ActorRef, Msg, RemoteError
from actors.runtime.errors import TimedOut, passed_on
from actors.worker.actor import ProfileWorker, SleepWorker, StepStatus, WakeWorker, WorkerRPC

log = logging.getLogger("troupe.executor")


class WorkersDown(Msg):
    """The worker died; hold steps until WorkersUp."""
    generation: int


class WorkersUp(Msg):
    """The workers of ``generation`` are up (their KV caches allocated): actor ``name`` on each
    of ``nodes`` (one per rank, in rank order)."""
    generation: int
    nodes: list[str]
    name: str


ExecutorProtocol = SchedulerOutput | WorkersDown | WorkersUp | SleepWorker | WakeWorker | ProfileWorker | WorkerRPC

STEP_TIMEOUT_S = 600.0
SLEEP_TIMEOUT_S = 600.0         # a wake-up after level 2 reads the weights again
RESTART_WAIT_S = 600.0          # a held step fails if no worker is up by then
REPLY_CHECK_S = 2.0             # a step's reply later than this is asked about
PEER_DEATH_WAIT_S = 10.0        # a rank's failed step waits this long for a peer's death to show


class Executor(Actor):
    protocol = ExecutorProtocol
    concurrent = True            # a held step waits while WorkersUp is handled

    def __init__(self, workers: list[ActorRef], output_rank: int = 0) -> None:
        self.workers = workers                    # one per rank (tensor-parallel ranks x pipeline stages)
        self.output_rank = output_rank            # whose output is the step's: the last stage's first rank
        self._up = asyncio.Event()
        self._up.set()
        self._generation = 0
        self._last_sent = -1                      # the step sent last to this generation's worker
        self._executing: dict[int, asyncio.Future[None]] = {}   # step -> done when it is settled
        self._kv_reports = KVOutputAggregator(len(workers))

    async def receive(self, msg: ExecutorProtocol) -> Any:
        match msg:
            case SchedulerOutput():
                self.ctx.link(list(msg.num_scheduled_tokens))
                msg.prev_step, self._last_sent = self._last_sent, msg.step     # in arrival order
                done = asyncio.get_running_loop().create_future()
                self._executing[msg.step] = done
                try:
                    return await self._execute(msg, self._generation)
                finally:
                    del self._executing[msg.step]
                    done.set_result(None)
            case SleepWorker() | WakeWorker() | ProfileWorker():     # sleep mode, profiling: every rank alike
                done = await asyncio.gather(*(w.ask(msg, timeout=SLEEP_TIMEOUT_S) for w in self.workers))
                return all(done) if isinstance(msg, WakeWorker) else None
            case WorkerRPC(timeout=timeout):            # collective_rpc: every rank's result, in rank order
                try:
                    return list(await asyncio.gather(*(w.ask(msg, timeout=timeout or SLEEP_TIMEOUT_S)
                                                       for w in self.workers)))
                except RemoteError as exc:
                    raise passed_on(exc) from None
                except TimeoutError as exc:
                    raise TimedOut(f"a worker did not answer {msg.method} in time ({exc})") from None
            case WorkersDown():
                self._up.clear()
            case WorkersUp(generation=generation, nodes=nodes, name=name):
                self.workers = [self.ctx.node.ref(name, node) for node in nodes]
                self._generation, self._last_sent = generation, -1
                self._kv_reports = KVOutputAggregator(len(self.workers))   # the old ranks' transfers died with them
                self._up.set()
        return None

    async def _execute(self, so: SchedulerOutput, generation: int) -> ModelRunnerOutput:
        try:
            await asyncio.wait_for(self._up.wait(), RESTART_WAIT_S)
        except TimeoutError:
            raise ActorDied(f"no worker came back within {RESTART_WAIT_S:g} s") from None
        if generation != self._generation:
            raise ActorDied("the worker was restarted while the step waited: it holds none of its requests")
        try:
            return await self._send(so)
        except RemoteError as exc:
            if exc.error_type != "StepOutOfOrder":
                raise
            predecessor = self._executing.get(so.prev_step)
            log.warning("step %d overtook step %d, which was sent again; sending it after", so.step, so.prev_step)
            if predecessor is not None:
                await predecessor
            so.prev_step = -1
            return await self._send(so)

    async def _send(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """The step on every rank at once (their collectives meet); the output rank's."""
        if len(self.workers) == 1:
            return await self._send_to(self.workers[0], so)
        sends = [asyncio.ensure_future(self._send_to(w, so)) for w in self.workers]
        try:
            done, pending = await asyncio.wait(sends, return_when=asyncio.FIRST_EXCEPTION)
            failed = [f for f in done if f.exception() is not None]
            if failed and pending and all(isinstance(f.exception(), RemoteError) for f in failed):
                # a rank whose peer died fails its collective (gloo: "Connection reset by peer")
                # before the peer's death is seen: give the death a moment to arrive, so the
                # step fails as the worker's death (its requests recomputed), not as an error
                done, _ = await asyncio.wait(pending, timeout=PEER_DEATH_WAIT_S, return_when=asyncio.FIRST_EXCEPTION)
                failed += [f for f in done if f.exception() is not None]
            for f in failed:
                if isinstance(f.exception(), ActorDied):
                    raise f.exception()
            if failed:
                raise failed[0].exception()
            out = sends[self.output_rank].result()
            reports = [f.result().kv_connector_output for f in sends]
            if any(r is not None for r in reports):
                out = msgspec.structs.replace(out, kv_connector_output=self._kv_reports.aggregate(reports))
            # a request failed on any rank fails (an image the first pipeline stage could not encode)
            errors = {rid: why for f in sends for rid, why in f.result().errors.items()}
            if errors.keys() != out.errors.keys():
                out = msgspec.structs.replace(out, errors={**errors, **out.errors})
            return out
        finally:
            for f in sends:
                f.cancel()

    async def _send_to(self, worker: ActorRef, so: SchedulerOutput) -> ModelRunnerOutput:
        reply = asyncio.ensure_future(worker.ask(so, timeout=STEP_TIMEOUT_S))
        try:
            while True:
                done, _ = await asyncio.wait({reply}, timeout=REPLY_CHECK_S)
                if done:
                    return reply.result()
                status = await worker.ask(StepStatus(so.step), timeout=STEP_TIMEOUT_S)
                if reply.done():
                    return reply.result()
                if status.ran:                      # its reply was lost on the way
                    log.warning("step %d: the worker's reply was lost; using its output again", so.step)
                    return status.output
                log.warning("step %d never reached the worker; sending it again", so.step)
                reply.cancel()
                reply = asyncio.ensure_future(worker.ask(so, timeout=STEP_TIMEOUT_S))
        finally:
            reply.cancel()
