"""Per-request output streams between the Detokenizer and whoever awaits the request (an HTTP
handler or an AsyncLLM iterator). A slow reader never makes outputs pile up: deltas that
arrive before it reads are merged into one."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from actors.engine.messages import Logprobs


def _joined(a: Logprobs | None, b: Logprobs | None) -> Logprobs | None:
    if a is None or b is None:
        return a if b is None else b
    return Logprobs(a.token_ids + b.token_ids, a.logprobs + b.logprobs, a.ranks + b.ranks)


def _stacked(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    """Rows of consecutive prompt chunks as one array."""
    if a is None or b is None:
        return a if b is None else b
    return np.concatenate([a, b])


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    text: str = ""                    # new text since the previous output
    token_ids: list[int] = field(default_factory=list)   # new token ids since the previous output
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0        # cumulative
    error: str | None = None
    logprobs: Logprobs | None = None          # one position per entry of token_ids
    prompt_logprobs: Logprobs | None = None   # new prompt positions (never the first token)
    num_cached_tokens: int = 0                # prompt tokens served from the prefix cache
    kv_transfer_params: dict | None = None    # vLLM's: on the last output of a request a KV connector holds
    error_status: int = 0                     # with error: the HTTP status it answers (0: 500)
    # on a request's last output: vLLM's per-request metrics (times, its drafts' acceptance)
    metrics: dict | None = None
    # vLLM's prompt_logprob_token_ids: the scores of the prompt rows computed since the last output
    prompt_token_id_logprobs: np.ndarray | None = None
    # --return-sampling-mask: per entry of token_ids, the token ids its draw could pick
    sampling_mask: list[list[int]] | None = None
    # on a request's last output: vLLM's weight version spans, (version, start, end) over its tokens
    weight_versions: list[tuple[str, int, int]] | None = None
    # a pooling request's answer (its one, last output): float32, (dims,) or (prompt tokens, dims)
    pooling_output: np.ndarray | None = None

    def merge(self, later: RequestOutput) -> None:
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        self.finished = later.finished
        self.finish_reason = later.finish_reason
        self.stop_reason = later.stop_reason
        self.num_output_tokens = later.num_output_tokens
        self.error = later.error
        self.error_status = later.error_status
        self.logprobs = _joined(self.logprobs, later.logprobs)
        self.prompt_logprobs = _joined(self.prompt_logprobs, later.prompt_logprobs)
        self.num_cached_tokens = max(self.num_cached_tokens, later.num_cached_tokens)
        self.kv_transfer_params = later.kv_transfer_params or self.kv_transfer_params
        self.metrics = later.metrics or self.metrics
        if later.pooling_output is not None:
            self.pooling_output = later.pooling_output
        self.prompt_token_id_logprobs = _stacked(self.prompt_token_id_logprobs, later.prompt_token_id_logprobs)
        if later.sampling_mask is not None:
            self.sampling_mask = (self.sampling_mask or []) + later.sampling_mask
        self.weight_versions = later.weight_versions or self.weight_versions


class StreamTimeout(TimeoutError):
    pass


class OutputStream:
    """One request's outputs, merged while its reader is busy. ``interval`` (vLLM's
    --stream-interval): after the first token, an output is handed over once it holds that many
    new tokens, or the request finished."""

    def __init__(self, request_id: str, interval: int = 1) -> None:
        self.request_id = request_id
        self.interval = interval
        self._pending: RequestOutput | None = None
        self._waiter: asyncio.Future | None = None    # the reader's, while it waits
        self._puts = 0
        self._tokens_read = 0
        self.finished = False

    def put(self, out: RequestOutput) -> None:
        if self._pending is None:
            self._pending = out
        else:
            self._pending.merge(out)
        self._puts += 1
        self.finished = self.finished or out.finished
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _ready(self) -> bool:
        p = self._pending
        return p is not None and (self.interval <= 1 or p.finished or self._tokens_read == 0
                                  or len(p.token_ids) >= self.interval)

    async def get(self, timeout: float) -> RequestOutput:
        """The next output (possibly several merged); StreamTimeout if none comes in time (what
        has come short of the interval is handed over then)."""
        while not self._ready():
            puts = self._puts
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = loop.call_later(timeout, _expire, waiter)   # a future and a timer: no task per wait
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
            if self._puts == puts:           # nothing came within the timeout
                if self._pending is None:
                    raise StreamTimeout(f"no output for request {self.request_id} within {timeout:g} s")
                break
        out, self._pending = self._pending, None
        self._tokens_read += len(out.token_ids)
        return out


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class OutputStreams:
    """The registry of open streams, shared by the frontend's actors in one event loop."""

    def __init__(self) -> None:
        self._streams: dict[str, OutputStream] = {}

    def open(self, request_id: str, interval: int = 1) -> OutputStream:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        s = self._streams[request_id] = OutputStream(request_id, interval)
        return s

    def get(self, request_id: str) -> OutputStream | None:
        return self._streams.get(request_id)

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._streams)

    def ids(self) -> list[str]:
        """The ids of the open streams."""
        return list(self._streams)

    def fail_all(self, error: str) -> None:
        for rid in list(self._streams):
            self.fail(rid, error)

    def fail(self, request_id: str, error: str) -> None:
        """End one open request with ``error`` (its engine is gone)."""
        s = self._streams.get(request_id)
        if s is not None and not s.finished:
            s.put(RequestOutput(request_id, finished=True, finish_reason="error", error=error))
