"""Worker actor: the shell around the worker's core (``actors/worker/worker.py``): load the model,
allocate the KV cache, then run one step per message."""
from __future__ import annotations

import time

from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from actors import topology
from actors.engine.config import EngineConfig
from actors.engine.messages import ModelRunnerOutput, SchedulerOutput
from actors.runtime import Actor, Msg, Node

if TYPE_CHECKING:
    from actors.worker.worker import Worker


class LoadModel(Msg):
    """Load the checkpoint ``config`` names; the reply is the config resolved by this worker."""
    reply_type: ClassVar[Any] = EngineConfig
    config: EngineConfig


class InitKVCache(Msg):
    """Allocate the KV cache the resolved config sizes (on CUDA, capture the decode graphs);
    the reply is its size in bytes."""
    reply_type: ClassVar[Any] = int


class StepResult(msgspec.Struct):
    ran: bool                                   # the worker ran the step asked about
    output: ModelRunnerOutput | None = None     # and this was its output


class StepStatus(Msg):
    """Did step ``step`` run, and with what output? Sent when its reply is late: queued behind
    the step (same lane), it is answered once the step ran, so it tells a lost reply (ran: the
    output again) from a lost step (not ran: send it again)."""
    reply_type: ClassVar[Any] = StepResult
    step: int


WorkerProtocol = LoadModel | InitKVCache | SchedulerOutput | StepStatus

LOAD_TIMEOUT_S = 600.0


class WorkerActor(Actor):
    protocol = WorkerProtocol

    def __init__(self) -> None:
        self.core: Worker | None = None            # until LoadModel
        self.last_step = StepResult(False)         # the output of the last step run, for StepStatus
        self.last_step_number = -1

    async def receive(self, msg: WorkerProtocol) -> Any:
        match msg:
            case SchedulerOutput():
                self.ctx.link(list(msg.num_scheduled_tokens))
                t0 = time.perf_counter()
                out = self._loaded().execute_model(msg)
                out.worker_s = time.perf_counter() - t0
                self.last_step, self.last_step_number = StepResult(True, out), msg.step
                return out
            case StepStatus(step=step):
                return self.last_step if step == self.last_step_number else StepResult(False)
            case LoadModel(config=config):
                # The core imports torch and the models: imported here, at the first load, and
                # not with this protocol, which the engine-core process imports without torch.
                from actors.worker.worker import Worker
                self.core = Worker(config)
                return self.core.config
            case InitKVCache():
                return self._loaded().init_kv_cache()

    def _loaded(self) -> Worker:
        if self.core is None:
            raise RuntimeError("no model loaded (LoadModel first)")
        return self.core


async def worker_entry(node: Node, payload: bytes) -> EngineConfig:
    """Entry of a worker process: start the Worker actor and load the model; the process's
    ready message carries the resolved config."""
    config = msgspec.msgpack.decode(payload, type=EngineConfig)
    ref = await node.start(topology.WORKER, WorkerActor)
    return await ref.ask(LoadModel(config), timeout=LOAD_TIMEOUT_S)
