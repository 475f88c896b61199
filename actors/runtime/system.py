"""The system actor every node runs as ``_system``: readiness of child nodes, trace export,
shutdown. Its messages travel in the system lane."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, ClassVar

import msgspec

from actors.runtime.actor import Actor
from actors.runtime import faults
from actors.runtime.errors import ActorError
from actors.runtime.faults import InjectFault
from actors.runtime.messages import Msg
from actors.runtime.tracing import SpanRecord

SYSTEM_ACTOR = "_system"
log = logging.getLogger("troupe.system")


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
    children: list[TraceChunk] = []

    def all_records(self) -> list[SpanRecord]:
        out = list(self.records)
        for child in self.children:
            out.extend(child.all_records())
        return out


class GetTrace(Msg):
    """This node's trace records from sequence ``since`` (at most ``limit``, the newest);
    with ``recursive``, its child nodes' too."""
    reply_type: ClassVar[Any] = TraceChunk
    lane: ClassVar[str] = "system"
    since: int = 0
    limit: int = 0
    recursive: bool = False


class Shutdown(Msg):
    """Stop the whole node with exit code ``code``."""
    lane: ClassVar[str] = "system"
    code: int = 0
    reason: str = "asked to shut down"


SystemProtocol = NodeReady | GetTrace | Shutdown | InjectFault


class SystemActor(Actor):
    protocol = SystemProtocol
    concurrent = True          # a trace collection waiting on children blocks nothing else

    def __init__(self) -> None:
        self.ready_waiters: dict[str, asyncio.Future[NodeReady]] = {}
        self.children: set[str] = set()     # child nodes, for recursive trace collection

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
                return await self._trace(msg)
            case Shutdown():
                node = self.ctx.node
                if msg.code:
                    node.fatal(msg.reason, msg.code)
                elif not node.closed.done():
                    node.closed.set_result(0)
            case InjectFault():
                return await self._inject(msg)
        return None

    async def _inject(self, msg: InjectFault) -> bool:
        """Arm the fault here, or pass it down to the child node it names."""
        if not faults.enabled():
            raise ActorError(f"fault injection is off (start with {faults.ENV}=1)")
        node = self.ctx.node
        if msg.node in ("", node.name):
            log.warning("node '%s': injecting fault %s", node.name, msg)
            if msg.kind == "drop":       # armed once this reply is sent, or it would drop the reply
                asyncio.get_running_loop().call_soon(node.faults.arm, msg)
            else:
                node.faults.arm(msg)
            return True
        for child in sorted(self.children):
            if await node.ref(SYSTEM_ACTOR, child).ask(msg, timeout=msg.seconds + 30.0):
                return True
        return False

    async def _trace(self, msg: GetTrace) -> TraceChunk:
        node = self.ctx.node
        nxt, records = node.tracer.snapshot(msg.since)
        if msg.limit:
            records = records[-msg.limit:]
        chunk = TraceChunk(node.tracer.node, nxt, records)
        if msg.recursive:
            for child in sorted(self.children):
                try:
                    chunk.children.append(await node.ref(SYSTEM_ACTOR, child).ask(
                        GetTrace(0, msg.limit, True), timeout=5.0))
                except ActorError as exc:   # a child that is down has no trace to give
                    log.warning("no trace from node '%s': %s", child, exc)
        return chunk
