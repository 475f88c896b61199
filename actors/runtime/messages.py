"""The runtime's own messages: error replies and the system messages every actor answers."""
from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from transport.msg import Msg


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
