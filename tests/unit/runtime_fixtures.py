"""Actors used by the runtime tests, importable by child node processes."""
from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import msgspec
import numpy as np
import torch

from actors.runtime import Actor, Msg


class Echoed(msgspec.Struct):
    text: str
    count: int


class Echo(Msg):
    reply_type: ClassVar[Any] = Echoed
    text: str


class Count(Msg):
    pass


class Crash(Msg):
    reply_type: ClassVar[Any] = int
    why: str


class Sleep(Msg):
    reply_type: ClassVar[Any] = float
    seconds: float


class Arrays(Msg):
    reply_type: ClassVar[Any] = "Arrays"
    array: np.ndarray
    tensor: torch.Tensor
    small: np.ndarray


class Unrelated(Msg):
    reply_type: ClassVar[Any] = int
    x: int


EchoProtocol = Echo | Count | Crash | Sleep | Arrays


class EchoActor(Actor):
    protocol = EchoProtocol

    def __init__(self) -> None:
        self.count = 0

    async def receive(self, msg: EchoProtocol) -> Any:
        match msg:
            case Echo(text=text):
                return Echoed(text, self.count)
            case Count():
                self.count += 1
            case Crash(why=why):
                raise ValueError(why)
            case Sleep(seconds=s):
                await asyncio.sleep(s)
                return s
            case Arrays():
                return Arrays(msg.array * 2, msg.tensor + 1, msg.small)
        return None


Arrays.reply_type = Arrays


async def echo_entry(node, config: bytes) -> dict:
    node.spawn("echo", EchoActor)
    return {"config": config.decode()}


class Restarting(EchoActor):
    on_failure = "restart"


class Escalating(EchoActor):
    on_failure = "escalate"


async def failing_entry(node, config: bytes) -> dict:
    raise ValueError(f"cannot start with {config.decode()}")


async def stuck_thread_entry(node, config: bytes) -> dict:
    """A node with a thread that never ends (a worker's step blocked in a collective whose peer
    died, say): not a daemon, so the interpreter would wait for it at exit."""
    import threading
    node.spawn("echo", EchoActor)
    threading.Thread(target=threading.Event().wait, name="stuck-step", daemon=False).start()
    return {"config": config.decode()}


async def endless_entry(node, config: bytes) -> dict:
    """An entry that never finishes (an engine core waiting for another machine that never joins)."""
    await asyncio.sleep(3600)
    return {"config": config.decode()}


_POOL = None


async def idle_pool_entry(node, config: bytes) -> dict:
    """A node with a thread pool nobody shuts down, its worker idle (torch.compile's compile
    workers are one)."""
    from concurrent.futures import ThreadPoolExecutor
    global _POOL
    _POOL = ThreadPoolExecutor(2)
    _POOL.submit(lambda: None).result()
    node.spawn("echo", EchoActor)
    return {"config": config.decode()}
