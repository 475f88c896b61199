"""Actor base class and the cell that runs one actor: its mailbox, its loop, its failures."""
from __future__ import annotations

import asyncio
import logging
import traceback
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Literal

from actors.runtime.errors import Refusal, RemoteError
from actors.runtime.mailbox import Delivery, Mailbox
from actors.runtime.messages import ErrorReply, Ping, Pong, Stop, SystemMessage
from actors.runtime.tracing import ActorStats, SpanRecord, TraceContext, current_context, current_links, now_ns

if TYPE_CHECKING:
    from actors.runtime.node import Node
    from actors.runtime.ref import LocalRef

log = logging.getLogger("troupe.actors")

OnFailure = Literal["resume", "restart", "escalate"]


class Actor:
    """Subclasses declare ``protocol``, the union of message structs they accept, at the top of
    their file, and implement ``receive``. The value ``receive`` returns is the reply to an ask.

    Handlers run one message at a time (non-reentrant) unless ``concurrent`` is set.
    ``on_failure`` says what a handler exception does after it is reported and answered:
    ``resume`` keeps the actor's state, ``restart`` builds a fresh instance, ``escalate`` stops
    the process (its supervisor sees it die).
    """

    protocol: ClassVar[Any]
    concurrent: ClassVar[bool] = False
    on_failure: ClassVar[OnFailure] = "resume"

    ctx: ActorContext

    async def started(self) -> None:
        """Called once before the first message (and again after a restart)."""

    async def receive(self, msg: Any) -> Any:
        raise TypeError(f"{type(self).__name__} has no handler for {type(msg).__name__}")

    async def stopped(self) -> None:
        """Called once when the actor stops."""

    def colocated(self) -> Any:
        """The synchronous interface actors of this node may call directly instead of asking
        (``ActorRef.colocated``, the co-located fast path). Offer one only when no handler of
        this actor awaits: on one event loop a direct call then cannot interleave with a
        handler, so the actor still does one thing at a time. Actors that restart on failure
        cannot offer one (a caller would keep the old instance)."""
        raise TypeError(f"{type(self).__name__} offers no co-located interface; ask it instead")


class ActorContext:
    """What an actor knows of its surroundings."""

    def __init__(self, cell: ActorCell) -> None:
        self._cell = cell
        self.name = cell.name
        self.node = cell.node

    @property
    def self_ref(self) -> LocalRef:
        return self._cell.ref

    @property
    def mailbox(self) -> Mailbox:
        return self._cell.mailbox

    def link(self, request_ids: tuple[str, ...] | list[str]) -> None:
        """Record, in this message's trace span, the requests it served."""
        current_links.set(tuple(request_ids))


class ReplyTo:
    """Where the reply of a remote ask goes."""
    __slots__ = ("node", "call_id")

    def __init__(self, node: str, call_id: int) -> None:
        self.node = node
        self.call_id = call_id


class ActorCell:
    def __init__(self, node: Node, name: str, factory: Callable[[], Actor]) -> None:
        self.node = node
        self.name = name
        self.factory = factory
        self.actor = factory()
        cls = type(self.actor)
        self.accepts: Any = cls.protocol | SystemMessage
        self.mailbox = Mailbox()
        self.label = f"{node.name}/{name}"     # what spans name as the sender of its messages
        self.handled = 0
        self.max_depth = 0
        self.busy_ns = 0
        self.errors = 0
        self.restarts = 0
        self.last_error: str | None = None
        self.stopping = False
        self._restart_pending = False
        self.task: asyncio.Task[None] | None = None
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        from actors.runtime.ref import LocalRef
        self.ref = LocalRef(self)
        self.actor.ctx = ActorContext(self)

    def protocol_names(self) -> str:
        from actors.runtime.ref import protocol_names
        return protocol_names(type(self.actor).protocol)

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"actor:{self.name}")

    def deliver(self, d: Delivery) -> None:
        if self.stopping:
            self._fail_delivery(d, "stopped")
            return
        self.mailbox.put(d, system=type(d.msg).lane == "system")
        if len(self.mailbox) > self.max_depth:
            self.max_depth = len(self.mailbox)

    def stats(self) -> ActorStats:
        return ActorStats(self.name, len(self.mailbox), self.max_depth, self.handled, self.busy_ns,
                          self.errors, self.restarts, self.last_error)

    async def _run(self) -> None:
        try:
            await self.actor.started()
        except Exception as exc:
            self.ready.set_exception(exc)
            self.node.report_failure(self, None, exc)
            return
        self.ready.set_result(None)
        pending: set[asyncio.Task[None]] = set()
        try:
            while not self.stopping:
                d = await self.mailbox.get()
                if isinstance(d.msg, Stop):
                    self.stopping = True
                    self._reply(d, None)
                elif type(self.actor).concurrent:
                    t = asyncio.get_running_loop().create_task(self._handle(d))
                    pending.add(t)
                    t.add_done_callback(pending.discard)
                else:
                    await self._handle(d)
                if self._restart_pending:
                    await self._restart()
        finally:
            for t in pending:
                t.cancel()
            for d in self.mailbox.clear():
                self._fail_delivery(d, "stopped")
            try:
                await self.actor.stopped()
            except Exception as exc:
                self.node.report_failure(self, None, exc)
            self.node.cell_stopped(self)

    async def _handle(self, d: Delivery) -> None:
        msg = d.msg
        if isinstance(msg, Ping):
            self._reply(d, Pong(self.name, len(self.mailbox), self.handled))
            return
        tracer = self.node.tracer
        span = tracer.new_span_id()
        token = current_context.set(TraceContext(d.trace_id, span, self.label))
        links = current_links.set(())
        start = now_ns()
        depth = len(self.mailbox)
        status = "ok"
        try:
            if self.node.faults.raises:
                self.node.faults.check_handler(self.name, type(msg).__name__)
            result = await self.actor.receive(msg)
        except Refusal as exc:
            status = "refused"
            self._reply_error(d, exc)
            log.info("actor '%s' refused %s: %s", self.name, type(msg).__name__, exc)
        except Exception as exc:
            status = "error"
            self.errors += 1
            self.last_error = f"{type(msg).__name__}: {type(exc).__name__}: {exc}"[:500]
            self._reply_error(d, exc)
            if self.node.report_failure(self, msg, exc) == "restart":
                self._restart_pending = True
        else:
            self._reply(d, result)
        finally:
            served = current_links.get()
            current_links.reset(links)
            current_context.reset(token)
            self.handled += 1
            end = now_ns()
            self.busy_ns += end - start
            if tracer.enabled:
                tracer.record(SpanRecord(d.trace_id, span, d.parent_span, d.msg_id, tracer.node,
                                         self.name, type(msg).__name__, d.enqueue_ns, start,
                                         end, depth, status, d.size, served, d.sender))

    def _reply(self, d: Delivery, result: Any) -> None:
        if d.reply is None:
            return
        if isinstance(d.reply, ReplyTo):
            self.node.send_reply(d.reply, self.name, result)
        elif not d.reply.done():
            d.reply.set_result(result)
        else:
            self.node.late_replies += 1

    def _reply_error(self, d: Delivery, exc: BaseException) -> None:
        err = ErrorReply(self.name, type(d.msg).__name__, type(exc).__name__, str(exc),
                         "".join(traceback.format_exception(exc)))
        if d.reply is None:
            return
        if isinstance(d.reply, ReplyTo):
            self.node.send_reply(d.reply, self.name, err, error=True)
        elif not d.reply.done():
            d.reply.set_exception(RemoteError(err.actor, err.message_type, err.error_type,
                                              err.message, err.traceback))

    def _fail_delivery(self, d: Delivery, why: str) -> None:
        from actors.runtime.errors import ActorDied
        if d.reply is None:
            return
        if isinstance(d.reply, ReplyTo):
            self.node.send_reply(d.reply, self.name, ErrorReply(
                self.name, type(d.msg).__name__, "ActorDied", f"actor {self.name} {why}"), error=True)
        elif not d.reply.done():
            d.reply.set_exception(ActorDied(f"actor {self.name} {why} before handling "
                                            f"{type(d.msg).__name__}"))

    async def _restart(self) -> None:
        """Replace the actor with a fresh instance; its mailbox and ref stay."""
        self._restart_pending = False
        self.restarts += 1
        self.actor = self.factory()
        self.actor.ctx = ActorContext(self)
        try:
            await self.actor.started()
        except Exception as exc:
            self.node.report_failure(self, None, exc)
