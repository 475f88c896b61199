"""The system actor every node runs as ``_system``: readiness of child nodes, telemetry (its
node's trace records and actor counters, and its children's), the flight recorder of its
children, shutdown. Its messages travel in the system lane."""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, ClassVar

import msgspec

from actors.runtime.actor import Actor
from actors.runtime import faults
from actors.runtime.errors import ActorError, ChildStartError
from actors.runtime.faults import InjectFault
from actors.runtime.messages import Msg
from actors.runtime.tracing import (ActorStats, RecentRecords, SpanRecord, StepRecord, default_flight_dir,
                                    write_flight_record)

SYSTEM_ACTOR = "_system"
log = logging.getLogger("troupe.system")


class NodeReady(Msg):
    """A child node finished starting; ``info`` is what its entry function returned (msgpack);
    ``address``: where it receives (a child on another machine is reached there). ``error``: it
    failed to start, and why (the parent's start fails with that)."""
    lane: ClassVar[str] = "system"
    node: str
    pid: int
    info: bytes = b""
    address: str = ""
    error: str = ""


class Cursor(msgspec.Struct, array_like=True):
    """Where a node's last telemetry read ended, in its span and step rings."""
    spans: int = 0
    steps: int = 0


class TelemetryChunk(msgspec.Struct):
    """A node's records since a cursor, its actors' counters now, and its children's chunks."""
    node: str
    pid: int
    spans: list[SpanRecord]
    steps: list[StepRecord]
    actors: list[ActorStats]
    cursor: Cursor                       # where the next read starts
    missed: int = 0                      # records overwritten before they could be read
    children: list[TelemetryChunk] = []
    down: dict[str, str] = {}            # child nodes that did not answer, and why

    def walk(self) -> list[TelemetryChunk]:
        out = [self]
        for child in self.children:
            out.extend(child.walk())
        return out


class GetTelemetry(Msg):
    """This node's telemetry from its cursor in ``cursors`` (at most ``limit`` span records,
    the newest); with ``recursive``, its child nodes' too."""
    reply_type: ClassVar[Any] = TelemetryChunk
    lane: ClassVar[str] = "system"
    cursors: dict[str, Cursor] = {}
    limit: int = 20000
    recursive: bool = True


class Shutdown(Msg):
    """Stop the whole node with exit code ``code``."""
    lane: ClassVar[str] = "system"
    code: int = 0
    reason: str = "asked to shut down"


SystemProtocol = NodeReady | GetTelemetry | Shutdown | InjectFault


class SystemActor(Actor):
    protocol = SystemProtocol
    concurrent = True          # a trace collection waiting on children blocks nothing else

    def __init__(self) -> None:
        self.ready_waiters: dict[str, asyncio.Future[NodeReady]] = {}
        self.children: set[str] = set()     # child nodes, for recursive telemetry
        self.flight_dir = default_flight_dir()
        self.recent: dict[str, RecentRecords] = {}   # each child's last seconds, for the flight recorder

    def expect_ready(self, node: str) -> asyncio.Future[NodeReady]:
        fut = asyncio.get_running_loop().create_future()
        self.ready_waiters[node] = fut
        return fut

    async def receive(self, msg: SystemProtocol) -> Any:
        match msg:
            case NodeReady():
                fut = self.ready_waiters.pop(msg.node, None)
                if fut is not None and not fut.done():
                    if msg.error:
                        fut.set_exception(ChildStartError(f"process '{msg.node}' (pid {msg.pid}) failed to start: "
                                                          f"{msg.error}"))
                    else:
                        fut.set_result(msg)
            case GetTelemetry():
                return await self._telemetry(msg)
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

    async def _telemetry(self, msg: GetTelemetry) -> TelemetryChunk:
        node = self.ctx.node
        tracer = node.tracer
        cursor = msg.cursors.get(node.name, Cursor())
        spans, missed = tracer.spans.since(cursor.spans, msg.limit)
        steps, _ = tracer.steps.since(cursor.steps)
        chunk = TelemetryChunk(node.name, os.getpid(), spans, steps, node.actor_stats(),
                               Cursor(tracer.spans.next, tracer.steps.next), missed)
        if msg.recursive and self.children:
            names = sorted(self.children)
            answers = await asyncio.gather(*(node.ref(SYSTEM_ACTOR, child).ask(msg, timeout=5.0) for child in names),
                                           return_exceptions=True)
            for child, answer in zip(names, answers):
                if isinstance(answer, TelemetryChunk):
                    chunk.children.append(answer)
                    self._keep_recent(child, answer)
                else:
                    chunk.down[child] = str(answer)
        return chunk

    def _keep_recent(self, child: str, chunk: TelemetryChunk) -> None:
        recent = self.recent.setdefault(child, RecentRecords())
        for c in chunk.walk():
            recent.pids[c.node] = c.pid
            recent.add(c.spans, [(c.node, s) for s in c.steps])

    def child_exited(self, child: str, pid: int, reason: str) -> None:
        """Flight recorder: write what a dead child's last seconds were, as far as they reached
        this node, and say where."""
        self.children.discard(child)
        recent = self.recent.pop(child, None)
        if recent is None or not recent.spans:
            return
        path = write_flight_record(self.flight_dir, child, pid, reason, list(recent.spans),
                                   list(recent.steps), recent.pids)
        if path:
            log.error("flight recorder: the last %g s of node '%s' (pid %d) are in %s",
                      recent.seconds, child, pid, path)
