"""Detokenizer actor: one EngineCoreOutputs batch per engine step in; text deltas out to each
request's stream. Stop strings end a request here, and the engine is told to abort it. It also
observes the request latencies (TTFT, inter-token, end-to-end, queue time) for the metrics."""
from __future__ import annotations

import time
from typing import Any, ClassVar

from actors.detokenizer.incremental import IncrementalDetokenizer
from actors.frontend.stats import EngineStats
from actors.frontend.streams import OutputStreams, RequestOutput
from actors.engine.messages import EngineCoreOutput, EngineCoreOutputs, Logprobs
from actors.engine.sampling_params import SamplingParams
from actors.frontend.admission import WaitingRequests
from actors.runtime import Actor, ActorRef, Msg
from actors.scheduler.actor import AbortRequests


class TrackRequest(Msg):
    """A request is coming (told by the Tokenizer before the engine sees it)."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0


class Untrack(Msg):
    """Forget requests the client gave up on (they count as aborted)."""
    request_ids: list[str]


class EngineLost(Msg):
    """The engine died: every request in flight ends now with ``reason`` (no output of theirs
    will come)."""
    lane: ClassVar[str] = "system"
    reason: str


DetokenizerProtocol = TrackRequest | EngineCoreOutputs | Untrack | EngineLost


class _State:
    __slots__ = ("detok", "num_prompt_tokens", "arrival_time", "last_token_time", "queued")

    def __init__(self, detok: IncrementalDetokenizer, num_prompt_tokens: int, arrival_time: float) -> None:
        self.detok = detok
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival_time = arrival_time or time.time()
        self.last_token_time = 0.0       # 0.0 until the first token
        self.queued = True               # until the engine reports its first scheduling


def _head(lp: Logprobs | None, n: int) -> Logprobs | None:
    """The first ``n`` positions (tokens after a matched stop string are dropped)."""
    if lp is None or len(lp.ranks) <= n:
        return lp
    return Logprobs(lp.token_ids[:n], lp.logprobs[:n], lp.ranks[:n])


class DetokenizerActor(Actor):
    protocol = DetokenizerProtocol

    def __init__(self, tokenizer: Any, streams: OutputStreams, stats: EngineStats,
                 engine: ActorRef, waiting: WaitingRequests) -> None:
        self.tokenizer = tokenizer
        self.waiting = waiting
        self.streams = streams
        self.stats = stats
        self.engine = engine
        self.states: dict[str, _State] = {}

    async def receive(self, msg: DetokenizerProtocol) -> Any:
        match msg:
            case EngineCoreOutputs(outputs=outputs, stats=stats):
                self.ctx.link([o.request_id for o in outputs])
                if stats is not None:
                    self.stats.observe_step(stats)
                now = time.time()
                aborts = [o.request_id for o in outputs if self._process(o, now)]
                if aborts:
                    self.engine.tell(AbortRequests(aborts))
            case TrackRequest(request_id=rid, prompt_token_ids=ids, sampling_params=p,
                              arrival_time=arrival):
                self.ctx.link((rid,))
                detok = IncrementalDetokenizer(
                    self.tokenizer, ids, skip_special_tokens=p.skip_special_tokens, stop=p.stop,
                    include_stop_str_in_output=p.include_stop_str_in_output, min_tokens=p.min_tokens)
                self.states[rid] = _State(detok, len(ids), arrival)
            case Untrack(request_ids=ids):
                for rid in ids:
                    self.waiting.release(rid)
                    if self.states.pop(rid, None) is not None:
                        self.stats.observe_finished("abort")
            case EngineLost(reason=reason):
                for _ in self.states:
                    self.stats.observe_finished("error")
                self.states.clear()
                self.waiting.release_all()
                self.streams.fail_all(reason)      # those still being admitted too

    def _process(self, o: EngineCoreOutput, now: float) -> bool:
        """Deliver one request's output; True if a stop string ended it (abort in the engine)."""
        st = self.states.get(o.request_id)
        if st is None:
            return False
        before = st.detok.num_output_tokens
        delta = st.detok.update(o.new_token_ids, stop_terminated=o.finish_reason == "stop")
        num_new = st.detok.num_output_tokens - before     # tokens past a stop string are dropped
        self._observe_timing(st, o, num_new, now)
        text, finish_reason, stop_reason = delta.text, o.finish_reason, o.stop_reason
        stopped_here = delta.finished and finish_reason is None
        if delta.finished:
            finish_reason, stop_reason = "stop", delta.stop_reason
        elif finish_reason is not None:
            text += st.detok.flush().text
        finished = finish_reason is not None
        if finished:
            del self.states[o.request_id]
            self.waiting.release(o.request_id)
            self.stats.observe_finished(finish_reason)
            self.stats.e2e_request_latency.observe(now - st.arrival_time)
        stream = self.streams.get(o.request_id)
        if stream is not None:
            stream.put(RequestOutput(
                o.request_id, text, list(o.new_token_ids[:num_new]), finished, finish_reason,
                stop_reason, st.num_prompt_tokens, st.detok.num_output_tokens, o.error,
                _head(o.logprobs, num_new), o.prompt_logprobs, o.num_cached_tokens))
        return stopped_here

    def _observe_timing(self, st: _State, o: EngineCoreOutput, num_new: int, now: float) -> None:
        if st.queued and o.first_scheduled_time > 0.0:
            st.queued = False
            self.waiting.release(o.request_id)
            self.stats.request_queue_time.observe(max(o.first_scheduled_time - st.arrival_time, 0.0))
        if num_new == 0:
            return
        self.stats.generation_tokens += num_new
        if st.last_token_time == 0.0:
            self.stats.time_to_first_token.observe(now - st.arrival_time)
        else:
            self.stats.inter_token_latency.observe(now - st.last_token_time)
        st.last_token_time = now
