"""Executor actor: fans one SchedulerOutput out to every worker rank, returns the driver's
(rank 0) ModelRunnerOutput."""
from __future__ import annotations

import asyncio
from typing import Any

from actors.runtime import Actor, ActorDied, ActorRef, Msg
from actors.engine.messages import ModelRunnerOutput, SchedulerOutput


class WorkersUp(Msg):
    """New worker refs after a (re)start."""
    generation: int
    node: str
    names: list[str]


ExecutorProtocol = SchedulerOutput | WorkersUp

STEP_TIMEOUT_S = 600.0


class Executor(Actor):
    protocol = ExecutorProtocol

    def __init__(self, workers: list[ActorRef]) -> None:
        self.workers = workers

    async def receive(self, msg: ExecutorProtocol) -> Any:
        match msg:
            case SchedulerOutput():
                return await self._execute(msg)
            case WorkersUp(node=node, names=names):
                self.workers = [self.ctx.node.ref(n, node) for n in names]
        return None

    async def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if not self.workers:
            raise ActorDied("no worker is running")
        results = await asyncio.gather(*(w.ask(so, timeout=STEP_TIMEOUT_S) for w in self.workers))
        return results[0]
