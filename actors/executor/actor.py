"""Executor actor: sends each SchedulerOutput to the worker and returns its ModelRunnerOutput.
While the worker is being restarted it holds steps until the replacement is up (its KV cache
allocated), so no step reaches a worker that cannot run it."""
from __future__ import annotations

import asyncio
from typing import Any

from actors.engine.messages import ModelRunnerOutput, SchedulerOutput
from actors.runtime import Actor, ActorDied, ActorRef, Msg


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
        return await self.worker.ask(so, timeout=STEP_TIMEOUT_S)
