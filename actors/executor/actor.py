"""Executor actor: sends each SchedulerOutput to the worker and returns its ModelRunnerOutput.
While the worker is being restarted it holds steps until the replacement is up (its KV cache
allocated), so no step reaches a worker that cannot run it. A step whose reply is late is asked
about (StepStatus): a lost reply is recovered, a lost step sent again, so a dropped frame costs
seconds, not the step timeout."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from actors.engine.messages import ModelRunnerOutput, SchedulerOutput
from actors.runtime import Actor, ActorDied, ActorRef, Msg
from actors.worker.actor import StepStatus

log = logging.getLogger("troupe.executor")


class WorkersDown(Msg):
    """The worker died; hold steps until WorkersUp."""
    generation: int


class WorkersUp(Msg):
    """The worker of ``generation`` is up (its KV cache allocated): actor ``name`` on ``node``."""
    generation: int
    node: str
    name: str


ExecutorProtocol = SchedulerOutput | WorkersDown | WorkersUp

STEP_TIMEOUT_S = 600.0
RESTART_WAIT_S = 600.0          # a held step fails if no worker is up by then
REPLY_CHECK_S = 2.0             # a step's reply later than this is asked about


class Executor(Actor):
    protocol = ExecutorProtocol
    concurrent = True            # a held step waits while WorkersUp is handled

    def __init__(self, worker: ActorRef) -> None:
        self.worker = worker
        self._up = asyncio.Event()
        self._up.set()

    async def receive(self, msg: ExecutorProtocol) -> Any:
        match msg:
            case SchedulerOutput():
                self.ctx.link(list(msg.num_scheduled_tokens))
                return await self._execute(msg)
            case WorkersDown():
                self._up.clear()
            case WorkersUp(node=node, name=name):
                self.worker = self.ctx.node.ref(name, node)
                self._up.set()
        return None

    async def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        try:
            await asyncio.wait_for(self._up.wait(), RESTART_WAIT_S)
        except TimeoutError:
            raise ActorDied(f"no worker came back within {RESTART_WAIT_S:g} s") from None
        worker = self.worker
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
