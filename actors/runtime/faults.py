"""Fault injection, for the tests that check nothing is lost and nothing hangs: a handler that
raises, an event loop that stalls (busy, as in a long step, or idle, as in a hang), frames that
are dropped, a process killed outright. Enabled only in processes started with
``TROUPE_FAULT_INJECTION=1`` (children inherit it); otherwise every request is refused.

A fault is asked of the ``_system`` actor of any node (``InjectFault``, forwarded down to the
node it names), which arms it in that node's ``Faults``; the runtime consults them where the
fault strikes (before a handler runs, before a frame is sent)."""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from actors.runtime.messages import Msg

ENV = "TROUPE_FAULT_INJECTION"
FaultKind = Literal["raise", "stall", "drop", "kill"]


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


class InjectedFault(RuntimeError):
    """The exception a "raise" fault makes a handler raise."""


class InjectFault(Msg):
    """Arm a fault on ``node`` ("" = the node that receives it). ``raise``: the next ``count``
    handlings of ``message_type`` by ``actor`` raise InjectedFault; ``stall``: block that node's
    event loop for ``seconds`` (``busy``: computing, like a long step; else sleeping, like a
    hang); ``drop``: the next ``count`` frames the node sends are lost (only frames carrying a
    ``message_type`` when one is given: a step's reply, not a trace record sent meanwhile);
    ``kill``: SIGKILL it.
    The reply: whether some node took it."""
    reply_type: ClassVar[Any] = bool
    lane: ClassVar[str] = "system"
    kind: FaultKind
    node: str = ""
    actor: str = ""
    message_type: str = ""
    seconds: float = 0.0
    busy: bool = True
    count: int = 1


@dataclass(slots=True)
class Faults:
    """The faults armed in one node."""
    raises: dict[tuple[str, str], int] = field(default_factory=dict)  # (actor, message type) -> times
    drops: dict[str, int] = field(default_factory=dict)               # message type ("": any) -> frames

    def arm(self, f: InjectFault) -> None:
        """Arm ``f`` here; a stall or a kill strikes at once."""
        if f.kind == "raise":
            key = (f.actor, f.message_type)
            self.raises[key] = self.raises.get(key, 0) + f.count
        elif f.kind == "drop":
            self.drops[f.message_type] = self.drops.get(f.message_type, 0) + f.count
        elif f.kind == "stall":
            stall(f.seconds, f.busy)
        elif f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            raise ValueError(f"unknown fault kind {f.kind!r}; accepted: raise, stall, drop, kill")

    def check_handler(self, actor: str, message_type: str) -> None:
        """Raise InjectedFault if a "raise" fault is armed for this handling."""
        key = (actor, message_type)
        left = self.raises.get(key, 0)
        if left:
            self.raises[key] = left - 1
            raise InjectedFault(f"injected fault: {actor} handling {message_type}")

    def take_drop(self, message_type: str) -> bool:
        """Whether the frame about to be sent, carrying a ``message_type``, is lost."""
        for key in (message_type, ""):
            left = self.drops.get(key, 0)
            if left:
                if left == 1:
                    del self.drops[key]
                else:
                    self.drops[key] = left - 1
                return True
        return False


def stall(seconds: float, busy: bool) -> None:
    """Block the calling thread (the event loop's) for ``seconds``."""
    end = time.monotonic() + seconds
    if not busy:
        time.sleep(seconds)
        return
    x = 0
    while time.monotonic() < end:
        x += 1
