"""A node: the actors of one process and event loop, their supervision, and the transport that
connects them to actors on other nodes."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import msgspec

from actors.runtime.actor import Actor, ActorCell, OnFailure, ReplyTo
from actors.runtime.errors import ActorDied, AskTimeout, MessageRejected, RemoteError
from actors.runtime.faults import Faults
from actors.runtime.mailbox import Delivery
from actors.runtime.messages import ErrorReply
from actors.runtime.ref import ActorRef, DeferredRef, LocalRef, RemoteRef, trace_parent
from actors.runtime.tracing import ActorStats, Tracer, now_ns
from transport.codec import ASK, ERROR, REPLY, TELL, Codec, Header, decode_header

log = logging.getLogger("troupe.node")


@dataclass(slots=True)
class Failure:
    """A handler (or start-up) exception, as reported to the supervisor."""
    actor: str
    message_type: str | None
    error: BaseException
    traceback: str
    at: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class _Pending:
    future: asyncio.Future[Any]
    reply_type: Any
    peer: str
    actor: str
    msg_type: str


class Node:
    """Restart intensity: an actor that fails more than ``max_restarts`` times within
    ``restart_window_s`` seconds escalates: the node stops with a non-zero exit code."""

    def __init__(self, name: str, transport: Any = None, tracer: Tracer | None = None,
                 max_restarts: int = 5, restart_window_s: float = 60.0) -> None:
        self.name = name
        self.transport = transport
        self.tracer = tracer or Tracer(name)
        self.codec = Codec()
        self.cells: dict[str, ActorCell] = {}
        self.pending: dict[int, _Pending] = {}
        self.dead_peers: dict[str, str] = {}
        self.failures: deque[Failure] = deque(maxlen=256)
        self.failure_listeners: list[Callable[[Failure], None]] = []
        self.late_replies = 0
        self.rejected = 0
        self.stopping = False            # stop() began: its actors are going away
        self.faults = Faults()                  # armed only by the tests' fault injection
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self._restarts: dict[str, deque[float]] = {}
        self._msg_ids = itertools.count(1)
        self._call_ids = itertools.count(1)
        self._recv_task: asyncio.Task[None] | None = None
        self.on_stop: list[Callable[[], Awaitable[None]]] = []   # run first by stop()
        self.closed: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        if transport is not None:
            self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop(), name="node:recv")

    def next_msg_id(self) -> int:
        return next(self._msg_ids)

    # -- local actors ------------------------------------------------------------------------
    def spawn(self, name: str, factory: Callable[[], Actor]) -> LocalRef:
        """Create and start an actor; messages sent before it finished starting wait in its mailbox."""
        if name in self.cells:
            raise ValueError(f"an actor named '{name}' already exists on node '{self.name}'")
        cell = ActorCell(self, name, factory)
        self.cells[name] = cell
        cell.start()
        return cell.ref

    async def start(self, name: str, factory: Callable[[], Actor], timeout: float = 300.0) -> LocalRef:
        """Spawn and wait until the actor's ``started`` hook returned (raises if it failed)."""
        ref = self.spawn(name, factory)
        await asyncio.wait_for(asyncio.shield(self.cells[name].ready), timeout)
        return ref

    def ref(self, name: str, node: str | None = None, protocol: Any = None) -> ActorRef:
        """A reference to actor ``name`` on ``node`` (this node when None). A local actor that
        does not exist yet is resolved when the reference is first used."""
        if node is None or node == self.name:
            cell = self.cells.get(name)
            return cell.ref if cell is not None else DeferredRef(self, name)
        return RemoteRef(self, node, name, protocol)

    def actor_stats(self) -> list[ActorStats]:
        return [cell.stats() for cell in self.cells.values()]

    def cell_stopped(self, cell: ActorCell) -> None:
        if self.cells.get(cell.name) is cell:
            del self.cells[cell.name]

    # -- supervision -------------------------------------------------------------------------
    def report_failure(self, cell: ActorCell, msg: Any, exc: BaseException) -> OnFailure:
        """Report a handler exception with its actor and message; return what happens next."""
        msg_type = type(msg).__name__ if msg is not None else None
        failure = Failure(cell.name, msg_type, exc, "".join(traceback.format_exception(exc)))
        self.failures.append(failure)
        where = f"handling {msg_type}" if msg_type else "starting"
        log.error("actor '%s' on node '%s' failed %s:\n%s", cell.name, self.name, where,
                  failure.traceback.rstrip())
        for listener in list(self.failure_listeners):
            listener(failure)
        decision = type(cell.actor).on_failure
        if msg is None:
            decision = "escalate"
        if decision == "restart":
            now = time.monotonic()
            window = self._restarts.setdefault(cell.name, deque())
            window.append(now)
            while window and now - window[0] > self.restart_window_s:
                window.popleft()
            if len(window) > self.max_restarts:
                decision = "escalate"
        if decision == "escalate":
            self.fatal(f"actor '{cell.name}' failed {where} and escalated: "
                       f"{type(exc).__name__}: {exc}")
        return decision

    def fatal(self, reason: str, code: int = 1) -> None:
        """Stop this node with a non-zero exit code."""
        log.critical("node '%s' stopping: %s", self.name, reason)
        if not self.closed.done():
            self.closed.set_result(code)

    # -- remote messaging -----------------------------------------------------------------------
    def _header(self, kind: int, dst: str, msg_type: str, call_id: int = 0) -> Header:
        trace_id, parent, sender = trace_parent()
        return Header(kind, dst, self.name, sender.partition("/")[2], self.next_msg_id(), call_id, msg_type,
                      trace_id, parent)

    def _send(self, peer: str, header: Header, msg: Any) -> None:
        if self.transport is None:
            raise ActorDied(f"node '{self.name}' has no transport to reach node '{peer}'")
        if self.faults.drops and self.faults.take_drop(header.msg_type):
            return
        frames = self.codec.encode(header, msg)
        try:
            self.transport.send(peer, frames)
        except KeyError:
            raise ActorDied(f"node '{peer}' is not connected to node '{self.name}'") from None

    def send_remote(self, peer: str, actor: str, msg: Any) -> None:
        self._send(peer, self._header(TELL, actor, type(msg).__name__), msg)

    async def call_remote(self, peer: str, actor: str, msg: Any, timeout: float) -> Any:
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        msg_type = type(msg).__name__
        self.pending[call_id] = _Pending(fut, type(msg).reply_type, peer, actor, msg_type)
        try:
            self._send(peer, self._header(ASK, actor, msg_type, call_id), msg)
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise AskTimeout(f"ask {msg_type} to actor '{actor}' on node '{peer}' got no reply "
                             f"within {timeout:g} s") from None
        finally:
            self.pending.pop(call_id, None)

    def send_reply(self, to: ReplyTo, actor: str, result: Any, error: bool = False) -> None:
        header = Header(ERROR if error else REPLY, "", self.name, actor, self.next_msg_id(),
                        to.call_id, type(result).__name__, 0, 0)
        try:
            self._send(to.node, header, result)
        except ActorDied:
            self.late_replies += 1

    # -- receiving ---------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            try:
                frames = await self.transport.recv()
            except asyncio.CancelledError:
                raise
            except Exception:  # the socket closed under us: the node is going down
                log.debug("node '%s' receive loop ended", self.name, exc_info=True)
                return
            try:
                self._dispatch(frames)
            except Exception:
                log.exception("node '%s' could not dispatch an envelope", self.name)

    def _dispatch(self, frames: list[Any]) -> None:
        header = decode_header(frames[0])
        if header.kind in (REPLY, ERROR):
            self._on_reply(header, frames[1:])
            return
        cell = self.cells.get(header.dst)
        if cell is None and self.stopping and header.kind == ASK:
            # its actor stopped with this node (a worker whose machine or parent died): the asker
            # learns it died, as it would from the process's exit, not that its message was wrong
            err = ErrorReply(header.dst, header.msg_type, "ActorDied",
                             f"actor '{header.dst}' stopped with node '{self.name}'")
            self.send_reply(ReplyTo(header.src_node, header.call_id), header.dst, err, error=True)
            return
        if cell is None:
            self._reject(header, f"no actor named '{header.dst}' on node '{self.name}'")
            return
        try:
            msg = self.codec.decode(cell.accepts, frames[1:])
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            self._reject(header, f"actor '{cell.name}' on node '{self.name}' does not accept "
                                 f"{header.msg_type} ({exc}); it accepts: {cell.protocol_names()}")
            return
        reply = ReplyTo(header.src_node, header.call_id) if header.kind == ASK else None
        size = sum(len(getattr(f, "buffer", f)) for f in frames[1:])
        cell.deliver(Delivery(msg, reply, header.trace_id, header.parent_span, header.msg_id,
                              now_ns(), size, f"{header.src_node}/{header.src}"))

    def _reject(self, header: Header, reason: str) -> None:
        self.rejected += 1
        # a message that reaches a node whose actors are stopping (another node's telemetry or
        # heartbeat question at shutdown) is expected, not an error; its sender is told either way
        log.log(logging.DEBUG if self.stopping else logging.ERROR, "rejected %s from node '%s': %s",
                header.msg_type, header.src_node, reason)
        err = ErrorReply(header.dst, header.msg_type, "MessageRejected", reason, rejected=True)
        self.send_reply(ReplyTo(header.src_node, header.call_id), header.dst, err, error=True)

    def _on_reply(self, header: Header, body: list[Any]) -> None:
        if header.kind == ERROR and header.call_id == 0:
            err = self.codec.decode(ErrorReply, body)
            log.error("a message to actor '%s' was rejected: %s", err.actor, err.message)
            return
        pending = self.pending.get(header.call_id)
        if pending is None or pending.future.done():
            self.late_replies += 1
            return
        try:
            if header.kind == ERROR:
                err = self.codec.decode(ErrorReply, body)
                cls = MessageRejected if err.rejected else RemoteError
                exc: Exception = (cls(err.message) if err.rejected else
                                  RemoteError(err.actor, err.message_type, err.error_type,
                                              err.message, err.traceback))
                if err.error_type == "ActorDied" and not err.rejected:
                    exc = ActorDied(err.message)
                pending.future.set_exception(exc)
            else:
                pending.future.set_result(self.codec.decode(pending.reply_type, body))
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            pending.future.set_exception(RemoteError(
                pending.actor, pending.msg_type, "DecodeError", f"undecodable reply: {exc}"))

    # -- peers -------------------------------------------------------------------------------
    def connect(self, peer: str, address: str) -> None:
        self.dead_peers.pop(peer, None)
        self.transport.add_peer(peer, address)

    def peer_down(self, peer: str, reason: str) -> None:
        """Fail every ask waiting on ``peer`` now; later sends to it fail fast."""
        self.dead_peers[peer] = reason
        if self.transport is not None:
            self.transport.drop_peer(peer)
        for call_id, p in list(self.pending.items()):
            if p.peer == peer and not p.future.done():
                p.future.set_exception(ActorDied(
                    f"actor '{p.actor}' died before answering {p.msg_type}: {reason}"))

    # -- shutdown ----------------------------------------------------------------------------
    async def stop_actors(self, names: list[str], timeout: float = 5.0) -> None:
        """Stop the actors ``names`` (each once the message it is handling is done) and wait for
        them; those still running after ``timeout`` are cancelled."""
        from actors.runtime.messages import Stop
        cells = [self.cells[name] for name in names if name in self.cells]
        for cell in cells:
            if not cell.stopping:
                cell.deliver(Delivery(Stop(), None, 0, 0, 0, now_ns()))
        tasks = [c.task for c in cells if c.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            for t in pending:
                t.cancel()

    async def stop(self, timeout: float = 5.0) -> None:
        self.stopping = True
        hooks, self.on_stop = self.on_stop, []
        for hook in hooks:
            try:
                await asyncio.wait_for(hook(), timeout)
            except Exception:
                log.exception("node '%s': a stop hook failed", self.name)
        await self.stop_actors(list(self.cells), timeout)
        if self._recv_task is not None:
            self._recv_task.cancel()
        if self.transport is not None:
            self.transport.close()
        if not self.closed.done():
            self.closed.set_result(0)
