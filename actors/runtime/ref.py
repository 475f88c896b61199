"""ActorRef: the same ``tell`` / ``ask`` API for an actor in this loop or in another process,
and ``colocated`` for the direct calls an actor of the same node may make. Messages outside the
target's protocol are refused at the sender when the protocol is known here, and at the
receiver's typed decoder otherwise."""
from __future__ import annotations

import asyncio
import typing
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from actors.runtime.errors import ActorDied, ActorError, AskTimeout, MessageRejected
from actors.runtime.mailbox import Delivery
from actors.runtime.messages import SystemMessage
from actors.runtime.tracing import current_context, new_trace_id, now_ns

if TYPE_CHECKING:
    from actors.runtime.actor import ActorCell
    from actors.runtime.node import Node

DEFAULT_ASK_TIMEOUT = 30.0


def protocol_names(protocol: Any) -> str:
    args = typing.get_args(protocol) or (protocol,)
    return ", ".join(sorted(a.__name__ for a in args))


def trace_parent() -> tuple[int, int, str]:
    """(trace id, parent span, sending actor as "node/actor") for a message sent from the
    current task; a task outside any actor's handler starts a new trace."""
    ctx = current_context.get()
    if ctx is None:
        return new_trace_id(), 0, ""
    return ctx.trace_id, ctx.span_id, ctx.actor


class ActorRef(ABC):
    node_name: str
    name: str

    @abstractmethod
    def tell(self, msg: Any) -> None:
        """Deliver without waiting. Raises MessageRejected, MailboxFull or ActorDied at once."""

    @abstractmethod
    async def ask(self, msg: Any, timeout: float = DEFAULT_ASK_TIMEOUT) -> Any:
        """Deliver and wait for the reply; AskTimeout after ``timeout`` seconds, RemoteError
        with the remote traceback when the handler raised."""

    def colocated(self) -> Any:
        """The co-located fast path: the synchronous interface the target offers to actors of
        its own node (``Actor.colocated``), called directly instead of asked. Raises ActorError
        for an actor on another node or one that offers none."""
        raise ActorError(f"actor '{self.name}' is on node '{self.node_name}': only an actor of "
                         "the caller's own node can be called directly")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}@{self.node_name}>"

    def _reject(self, msg: Any, protocol: Any) -> MessageRejected:
        return MessageRejected(
            f"actor '{self.name}' on node '{self.node_name}' does not accept "
            f"{type(msg).__name__}; it accepts: {protocol_names(protocol)}")


class LocalRef(ActorRef):
    def __init__(self, cell: ActorCell) -> None:
        self._cell = cell
        self.node_name = cell.node.name
        self.name = cell.name

    def _delivery(self, msg: Any, reply: Any) -> Delivery:
        cell = self._cell
        if not isinstance(msg, cell.accepts):
            raise self._reject(msg, type(cell.actor).protocol | SystemMessage)
        trace_id, parent, sender = trace_parent()
        return Delivery(msg, reply, trace_id, parent, cell.node.next_msg_id(), now_ns(), 0,
                        sender or f"{cell.node.name}/")

    def tell(self, msg: Any) -> None:
        self._cell.deliver(self._delivery(msg, None))

    async def ask(self, msg: Any, timeout: float = DEFAULT_ASK_TIMEOUT) -> Any:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._cell.deliver(self._delivery(msg, fut))
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise AskTimeout(f"ask {type(msg).__name__} to actor '{self.name}' got no reply "
                             f"within {timeout:g} s") from None

    def colocated(self) -> Any:
        actor = self._cell.actor
        if type(actor).on_failure == "restart":
            raise ActorError(f"actor '{self.name}' restarts on failure, so a direct reference to "
                             "it could outlive the instance; it cannot be called directly")
        return actor.colocated()

    @property
    def alive(self) -> bool:
        return not self._cell.stopping


class RemoteRef(ActorRef):
    def __init__(self, node: Node, node_name: str, name: str, protocol: Any = None) -> None:
        self._node = node
        self.node_name = node_name
        self.name = name
        self._protocol = protocol

    def _check(self, msg: Any) -> None:
        if self._protocol is not None and not isinstance(msg, self._protocol | SystemMessage):
            raise self._reject(msg, self._protocol)
        if self.node_name in self._node.dead_peers:
            raise ActorDied(f"actor '{self.name}' is unreachable: {self._node.dead_peers[self.node_name]}")

    def tell(self, msg: Any) -> None:
        self._check(msg)
        self._node.send_remote(self.node_name, self.name, msg)

    async def ask(self, msg: Any, timeout: float = DEFAULT_ASK_TIMEOUT) -> Any:
        self._check(msg)
        return await self._node.call_remote(self.node_name, self.name, msg, timeout)


class DeferredRef(ActorRef):
    """A reference by name to an actor of this node that may not exist yet (or was replaced):
    resolved at each use."""

    def __init__(self, node: Node, name: str) -> None:
        self._node = node
        self.node_name = node.name
        self.name = name

    def _target(self) -> LocalRef:
        cell = self._node.cells.get(self.name)
        if cell is None:
            raise ActorDied(f"no actor named '{self.name}' on node '{self.node_name}'")
        return cell.ref

    def tell(self, msg: Any) -> None:
        self._target().tell(msg)

    async def ask(self, msg: Any, timeout: float = DEFAULT_ASK_TIMEOUT) -> Any:
        return await self._target().ask(msg, timeout)

    def colocated(self) -> Any:
        return self._target().colocated()
