"""The system actor every node runs as ``_system``: readiness of child nodes, trace export,
shutdown. Its messages travel in the system lane."""
from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import msgspec

from actors.runtime.actor import Actor
from actors.runtime.messages import Msg
from actors.runtime.tracing import SpanRecord

SYSTEM_ACTOR = "_system"


class NodeReady(Msg):
    """A child node finished starting; ``info`` is what its entry function returned (msgpack)."""
    lane: ClassVar[str] = "system"
    node: str
    pid: int
    info: bytes = b""


class TraceChunk(msgspec.Struct):
    node: str
    next_seq: int
    records: list[SpanRecord]


class GetTrace(Msg):
    reply_type: ClassVar[Any] = TraceChunk
    lane: ClassVar[str] = "system"
    since: int = 0


class Shutdown(Msg):
    """Stop the whole node with exit code ``code``."""
    lane: ClassVar[str] = "system"
    code: int = 0
    reason: str = "asked to shut down"


SystemProtocol = NodeReady | GetTrace | Shutdown


class SystemActor(Actor):
    protocol = SystemProtocol

    def __init__(self) -> None:
        self.ready_waiters: dict[str, asyncio.Future[NodeReady]] = {}

    def expect_ready(self, node: str) -> asyncio.Future[NodeReady]:
        fut = asyncio.get_running_loop().create_future()
        self.ready_waiters[node] = fut
        return fut

    async def receive(self, msg: SystemProtocol) -> Any:
        match msg:
            case NodeReady():
                fut = self.ready_waiters.pop(msg.node, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            case GetTrace():
                tracer = self.ctx.node.tracer
                nxt, records = tracer.snapshot(msg.since)
                return TraceChunk(tracer.node, nxt, records)
            case Shutdown():
                node = self.ctx.node
                if msg.code:
                    node.fatal(msg.reason, msg.code)
                elif not node.closed.done():
                    node.closed.set_result(0)
        return None
