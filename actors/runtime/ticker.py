"""A timer that tells an actor a message every ``period_s`` seconds, for actors that poll or
report periodically. The next tick is armed when the actor calls ``again()`` (as it handles
one), so ticks never pile up in its mailbox behind a slow handler."""
from __future__ import annotations

import asyncio
from typing import Any, Callable


class Ticker:
    def __init__(self, ref: Any, make_message: Callable[[], Any], period_s: float) -> None:
        self.ref = ref
        self.make_message = make_message
        self.period_s = period_s
        self._timer: asyncio.TimerHandle | None = None

    def again(self) -> None:
        """The next tick, ``period_s`` from now (a tick already armed is replaced)."""
        self.cancel()
        self._timer = asyncio.get_running_loop().call_later(self.period_s, self._tell)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tell(self) -> None:
        try:
            self.ref.tell(self.make_message())
        except Exception:                  # the actor is stopping: no more ticks
            pass
