"""Waiting queues: first come first served, or by priority (lower value first, then arrival)."""
from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from typing import Iterator

from actors.scheduler.request import Request


class RequestQueue(ABC):
    @abstractmethod
    def add(self, req: Request) -> None: ...

    @abstractmethod
    def prepend(self, req: Request) -> None:
        """Put back a preempted request so that it is served before newer ones."""

    @abstractmethod
    def readmit(self, req: Request) -> None:
        """Put back a request that was held aside (its grammar compiling) where its arrival
        places it: ahead of the requests that came after it (vLLM's skipped waiting requests
        keep their place the same way)."""

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, req: Request) -> bool: ...

    @abstractmethod
    def first(self, n: int) -> list[Request]:
        """The next ``n`` requests in the order they would be popped."""

    @abstractmethod
    def __len__(self) -> int: ...

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def prepend(self, req: Request) -> None:
        self._q.appendleft(req)

    def readmit(self, req: Request) -> None:
        # from the back: a request held aside is usually among the newest
        i = len(self._q)
        while i > 0 and self._q[i - 1].arrival_time > req.arrival_time:
            i -= 1
        self._q.insert(i, req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> bool:
        try:
            self._q.remove(req)
            return True
        except ValueError:
            return False

    def first(self, n: int) -> list[Request]:
        return list(itertools.islice(self._q, n))

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue(RequestQueue):
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._seq), req))

    prepend = add   # a preempted request sorts by its own priority and arrival
    readmit = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, req: Request) -> bool:
        for i, entry in enumerate(self._heap):
            if entry[3] is req:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False

    def first(self, n: int) -> list[Request]:
        return [e[3] for e in heapq.nsmallest(n, self._heap)]

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap))


def create_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}; accepted: fcfs, priority")
