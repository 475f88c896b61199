"""The request log's output lines (vLLM's --enable-log-outputs, bounded by --max-log-len): one
INFO line per request when it finishes, its text and finish reason, and its token ids at DEBUG;
for a streamed request also one line per delta (--enable-log-deltas)."""
from __future__ import annotations

import logging
from typing import Sequence, TypeVar

from actors.frontend.streams import RequestOutput

log = logging.getLogger("troupe.http")

T = TypeVar("T", str, list)


def clip(value: T, max_len: int | None) -> T:
    """The first ``max_len`` characters (or items) of ``value``; all of it for None."""
    return value if max_len is None else value[:max_len]


class OutputLog:
    """Collects one request's outputs as they reach its handle and logs them once it finishes;
    a streamed one (``streaming``) also logs each delta as it comes, unless ``deltas`` is off
    (vLLM's --enable-log-deltas, on by default)."""

    __slots__ = ("request_id", "max_len", "deltas", "streaming", "text", "token_ids")

    def __init__(self, request_id: str, max_len: int | None, deltas: bool = True) -> None:
        self.request_id = request_id
        self.max_len = max_len
        self.deltas = deltas
        self.streaming = False
        self.text: list[str] = []
        self.token_ids: list[int] = []

    def take(self, out: RequestOutput) -> None:
        self.text.append(out.text)
        self.token_ids.extend(out.token_ids)
        if self.streaming and self.deltas and out.text:
            log.info("response %s (streaming delta): output: %r, finish_reason: %s", self.request_id,
                     clip(out.text, self.max_len), out.finish_reason)
        if out.finished:
            self.write(out.finish_reason if out.error is None else f"error ({out.error})")

    def write(self, finish_reason: str | None) -> None:
        how = " (streaming complete)" if self.streaming else ""
        if log.isEnabledFor(logging.DEBUG):
            log.debug("response %s%s: output_token_ids: %s", self.request_id, how, clip(self.token_ids, self.max_len))
        log.info("response %s%s: output: %r, finish_reason: %s", self.request_id, how,
                 clip("".join(self.text), self.max_len), finish_reason)


def prompt_line(request_id: str, prompt: str, token_ids: Sequence[int], max_len: int | None) -> None:
    """The DEBUG line of an admitted request's prompt."""
    log.debug("request %s: prompt: %r, prompt_token_ids: %s", request_id, clip(prompt, max_len),
              clip(list(token_ids), max_len))
