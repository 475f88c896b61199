"""The base of every message: a tagged msgspec struct that may declare its reply and lane.

  * ``reply_type``: what an ``ask`` of it returns (decoded with a typed decoder);
  * ``lane = "system"``: it jumps ahead of user messages in the target's mailbox.
"""
from __future__ import annotations

from typing import Any, ClassVar

import msgspec


class Msg(msgspec.Struct, tag=True):
    reply_type: ClassVar[Any] = Any
    lane: ClassVar[str] = "user"
