"""What tracing costs per message: an actor handles a stream of local messages with the tracer on
and off (``--no-trace``), in alternation, and the difference of the medians is the cost of one
span record (its mailbox wait, handling time, sender and request ids). Whole-engine throughput
with and without tracing is ``offline`` run twice, with and without ``--no-trace``."""
from __future__ import annotations

import json
import statistics
import time
from typing import Any, ClassVar

from actors.runtime import Actor, Msg
from actors.runtime.node import Node
from actors.runtime.tracing import Tracer


class Tick(Msg):
    request_id: str = ""


class Flush(Msg):
    reply_type: ClassVar[Any] = int


class Counter(Actor):
    protocol = Tick | Flush

    def __init__(self) -> None:
        self.count = 0

    async def receive(self, msg: Tick | Flush) -> Any:
        if isinstance(msg, Flush):
            return self.count
        self.count += 1
        return None


async def per_message_us(trace: bool, n: int) -> float:
    node = Node("bench", tracer=Tracer("bench", enabled=trace))
    ref = node.spawn("counter", Counter)
    await ref.ask(Flush(), timeout=10)
    t0 = time.perf_counter()
    for i in range(n):
        ref.tell(Tick(f"req-{i % 64}"))
        if i % 512 == 511:                       # stay inside the bounded mailbox
            await ref.ask(Flush(), timeout=10)
    await ref.ask(Flush(), timeout=10)
    seconds = time.perf_counter() - t0
    await node.stop()
    return seconds / n * 1e6


def main(args: Any) -> None:
    import uvloop
    on, off = [], []
    for _ in range(args.repeats):
        on.append(uvloop.run(per_message_us(True, args.messages)))
        off.append(uvloop.run(per_message_us(False, args.messages)))
    on_us, off_us = statistics.median(on), statistics.median(off)
    print(json.dumps({"bench": "tracing", "messages": args.messages, "repeats": args.repeats,
                      "per_message_us_trace_on": round(on_us, 3),
                      "per_message_us_trace_off": round(off_us, 3),
                      "tracing_us_per_message": round(on_us - off_us, 3)}), flush=True)
