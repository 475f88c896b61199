"""A single-consumer mailbox with two lanes: system (always drained first) and user (bounded)."""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

from actors.runtime.errors import MailboxFull

Overflow = Literal["fail", "drop_oldest"]


@dataclass(slots=True)
class Delivery:
    """One message in a mailbox, with where its reply goes and its trace context."""
    msg: Any
    reply: Any            # asyncio.Future (local ask), ReplyTo (remote ask) or None (tell)
    trace_id: int
    parent_span: int
    msg_id: int
    enqueue_ns: int
    size: int = 0


class Mailbox:
    def __init__(self, capacity: int = 65536, overflow: Overflow = "fail") -> None:
        self.capacity = capacity
        self.overflow = overflow
        self._system: deque[Delivery] = deque()
        self._user: deque[Delivery] = deque()
        self._ready = asyncio.Event()
        self._space = asyncio.Event()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._system) + len(self._user)

    def put(self, d: Delivery, system: bool = False) -> None:
        if system:
            self._system.append(d)
        else:
            if len(self._user) >= self.capacity:
                if self.overflow == "fail":
                    raise MailboxFull(f"mailbox full ({self.capacity} messages) for {type(d.msg).__name__}")
                self._user.popleft()
                self.dropped += 1
            self._user.append(d)
        self._ready.set()

    async def wait_space(self) -> None:
        while len(self._user) >= self.capacity:
            self._space.clear()
            await self._space.wait()

    async def get(self) -> Delivery:
        while not (self._system or self._user):
            self._ready.clear()
            await self._ready.wait()
        if self._system:
            return self._system.popleft()
        d = self._user.popleft()
        self._space.set()
        return d

    def drain(self) -> list[Delivery]:
        """Everything pending in the user lane, at once (system messages stay for the loop)."""
        items = list(self._user)
        self._user.clear()
        self._space.set()
        return items

    def clear(self) -> list[Delivery]:
        items = list(self._system) + list(self._user)
        self._system.clear()
        self._user.clear()
        self._space.set()
        return items
