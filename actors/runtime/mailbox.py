"""A single-consumer mailbox with two lanes: system (always taken first) and user (bounded: a
full user lane refuses at once with MailboxFull, so memory stays bounded)."""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any

from actors.runtime.errors import MailboxFull

MAILBOX_CAPACITY = 65536          # user messages waiting in one mailbox


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
    sender: str = ""      # "node/actor" that sent it, for tracing


class Mailbox:
    def __init__(self, capacity: int = MAILBOX_CAPACITY) -> None:
        self.capacity = capacity
        self._system: deque[Delivery] = deque()
        self._user: deque[Delivery] = deque()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._system) + len(self._user)

    def put(self, d: Delivery, system: bool = False) -> None:
        if system:
            self._system.append(d)
        else:
            if len(self._user) >= self.capacity:
                raise MailboxFull(f"mailbox full ({self.capacity} messages) for {type(d.msg).__name__}")
            self._user.append(d)
        self._ready.set()

    async def get(self) -> Delivery:
        while not (self._system or self._user):
            self._ready.clear()
            await self._ready.wait()
        if self._system:
            return self._system.popleft()
        return self._user.popleft()

    def clear(self) -> list[Delivery]:
        items = list(self._system) + list(self._user)
        self._system.clear()
        self._user.clear()
        return items
