"""Message base class and the runtime's own system messages.

Every message is a tagged ``msgspec.Struct``. A message class may declare:
  * ``reply_type``: the type an ``ask`` of it returns (decoded with a typed decoder);
  * ``lane = "system"``: it jumps ahead of user messages in the target's mailbox.
"""
from __future__ import annotations

from typing import Any, ClassVar

import msgspec


class Msg(msgspec.Struct, tag=True):
    reply_type: ClassVar[Any] = Any
    lane: ClassVar[str] = "user"


# -- replies -----------------------------------------------------------------------------------

class ErrorReply(msgspec.Struct, tag=True):
    """Sent back instead of a reply when a handler raised or a message was rejected."""
    actor: str
    message_type: str
    error_type: str
    message: str
    traceback: str = ""
    rejected: bool = False


# -- runtime system messages (handled by the runtime for every actor) -------------------------

class Pong(msgspec.Struct, tag=True):
    actor: str
    mailbox_depth: int
    handled: int


class Ping(Msg):
    reply_type: ClassVar[Any] = Pong
    lane: ClassVar[str] = "system"


class Stop(Msg):
    """Stop the actor after the message being handled; pending user messages are dropped."""
    lane: ClassVar[str] = "system"


SystemMessage = Ping | Stop
