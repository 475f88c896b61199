"""Detokenizer actor: one EngineCoreOutputs batch per engine step in; text deltas out to each
request's stream. Stop strings end a request here, and the engine is told to abort it. It also
observes requests for the metrics: latencies (TTFT, inter-token, end-to-end, queue, prefill,
decode), sizes, and for the n choices of one request (a group) its n and longest choice."""
from __future__ import annotations

import logging
import time
from typing import Any, ClassVar

from actors.detokenizer.incremental import IncrementalDetokenizer
from actors.frontend.stats import EngineStats
from actors.frontend.streams import OutputStreams, RequestOutput
from actors.engine.messages import EngineCoreOutput, EngineCoreOutputs, Logprobs
from actors.engine.sampling_params import SamplingParams
from actors.frontend.admission import WaitingRequests
from actors.runtime import Actor, ActorRef, Msg
from actors.runtime.otel import RequestTracer
from actors.scheduler.actor import AbortRequests
from actors.tokenizer.gguf_tokenizer import TokenIdsOnly

NO_TEXT = TokenIdsOnly(0)     # the text of a request with detokenize=False: none (its token ids are its output)
log = logging.getLogger("troupe.detokenizer")


class TrackRequest(Msg):
    """A request is coming (told by the Tokenizer before the engine sees it). ``parent_id``: it
    is one of the ``n`` choices of that request ("": a request of its own)."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    parent_id: str = ""
    n: int = 1
    trace_headers: dict[str, str] | None = None   # the caller's W3C trace context (--otlp-traces-endpoint)


class Untrack(Msg):
    """Forget requests the client gave up on (they count as aborted)."""
    request_ids: list[str]


class EndGroup(Msg):
    """Only ``num_admitted`` choices of ``parent_id`` were admitted (the rest were refused)."""
    parent_id: str
    num_admitted: int


class EngineLost(Msg):
    """The engine died: every request in flight ends now with ``reason`` (no output of theirs
    will come); with ``request_ids`` (one engine core of several died), those only."""
    lane: ClassVar[str] = "system"
    reason: str
    request_ids: list[str] | None = None


DetokenizerProtocol = TrackRequest | EngineCoreOutputs | Untrack | EndGroup | EngineLost


class _State:
    __slots__ = ("detok", "num_prompt_tokens", "arrival_time", "last_token_time", "queued",
                 "scheduled_time", "first_token_time", "max_tokens", "parent_id", "span", "spec",
                 "model_times", "watermark", "versions")

    def __init__(self, detok: IncrementalDetokenizer, num_prompt_tokens: int, arrival_time: float,
                 max_tokens: int | None, parent_id: str, span: tuple | None = None) -> None:
        self.detok = detok
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival_time = arrival_time or time.time()
        self.first_token_time = 0.0      # 0.0 until the first token
        self.last_token_time = 0.0
        self.queued = True               # until the engine reports its first scheduling
        self.scheduled_time = 0.0        # when it was first scheduled (the engine's clock)
        self.max_tokens = max_tokens
        self.parent_id = parent_id
        self.span = span                 # with a RequestTracer: (sampling params, n, trace headers)
        self.spec: SpecDecodeMetrics | None = None   # its drafts' acceptance (--per-request-spec-decode-metrics)
        self.model_times: tuple[float, float] | None = None   # (--collect-detailed-traces)
        self.watermark = ""              # with --watermark-config: its watermark_requests status
        self.versions: list[tuple[str, int]] = []    # vLLM's weight version spans: (version, first token)

    def weight_versions(self) -> list[tuple[str, int, int]] | None:
        """vLLM's: the output tokens [start, end) each weight version sampled (None: no version
        was reported for the tokens there are)."""
        n = self.detok.num_output_tokens
        if not self.versions:
            return [] if n == 0 else None
        ends = [start for _, start in self.versions[1:]] + [n]
        return [(v, start, end) for (v, start), end in zip(self.versions, ends)]

    def metrics(self) -> dict[str, Any]:
        """vLLM's per-request metrics of the finished request (--enable-per-request-metrics):
        times in milliseconds, each None when a time it needs was never reached. TTFT counts
        from its first scheduling (vLLM's), the generation time from its first token to its last."""
        n = self.detok.num_output_tokens
        sched, first, last = self.scheduled_time, self.first_token_time, self.last_token_time
        inference = (last - sched) if sched > 0.0 and last > 0.0 else 0.0
        return {"time_to_first_token_ms": (first - sched) * 1e3 if sched > 0.0 and first > 0.0 else None,
                "generation_time_ms": (last - first) * 1e3 if first > 0.0 and last > 0.0 else None,
                "queue_time_ms": (sched - self.arrival_time) * 1e3 if sched > 0.0 else None,
                "mean_itl_ms": (last - first) / (n - 1) * 1e3 if first > 0.0 and last > 0.0 and n > 1 else None,
                "tokens_per_second": n / inference if inference > 0.0 else None,
                "speculative_decoding": self.spec.as_dict() if self.spec is not None else None}


class SpecDecodeMetrics:
    """One request's speculative decoding (vLLM's RequestSpecDecodeMetrics): how many verify
    steps accepted j of their drafts (j = 0 .. k), the drafts proposed, and at the "detailed"
    level each verify step's accepted and proposed counts in order."""
    __slots__ = ("histogram", "num_draft_tokens", "per_step_accepted", "per_step_drafted")

    def __init__(self, num_spec_tokens: int, detailed: bool) -> None:
        self.histogram = [0] * (num_spec_tokens + 1)
        self.num_draft_tokens = 0
        self.per_step_accepted: list[int] | None = [] if detailed else None
        self.per_step_drafted: list[int] | None = [] if detailed else None

    def observe(self, drafted: int, accepted: int) -> None:
        self.histogram[min(accepted, len(self.histogram) - 1)] += 1
        self.num_draft_tokens += drafted
        if self.per_step_accepted is not None:
            self.per_step_accepted.append(accepted)
            self.per_step_drafted.append(drafted)

    def as_dict(self) -> dict[str, Any]:
        """vLLM's response shape: the mean acceptance length counts the bonus token."""
        steps = sum(self.histogram)
        accepted = sum(j * c for j, c in enumerate(self.histogram))
        return {"mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
                "draft_acceptance_rate": accepted / self.num_draft_tokens if self.num_draft_tokens else 0.0,
                "acceptance_histogram": list(self.histogram), "num_spec_steps": steps,
                "num_accepted_draft_tokens": accepted, "num_draft_tokens": self.num_draft_tokens,
                "num_spec_tokens": len(self.histogram) - 1,
                "per_step_accepted": self.per_step_accepted, "per_step_drafted": self.per_step_drafted}


class _Group:
    """The choices of one request with n > 1: it counts as finished once all have."""
    __slots__ = ("n", "expected", "finished", "max_generation_tokens")

    def __init__(self, n: int) -> None:
        self.n = self.expected = n
        self.finished = self.max_generation_tokens = 0


def _head(lp: Logprobs | None, n: int) -> Logprobs | None:
    """The first ``n`` positions (tokens after a matched stop string are dropped)."""
    if lp is None or len(lp.ranks) <= n:
        return lp
    return Logprobs(lp.token_ids[:n], lp.logprobs[:n], lp.ranks[:n])


class DetokenizerActor(Actor):
    protocol = DetokenizerProtocol

    def __init__(self, tokenizer: Any, streams: OutputStreams, stats: EngineStats,
                 engine: ActorRef, waiting: WaitingRequests, tracer: RequestTracer | None = None,
                 spec_metrics: tuple[int, str] | None = None) -> None:
        """``tracer``: each finished request's OpenTelemetry span goes out through it
        (--otlp-traces-endpoint). ``spec_metrics``: (k, level) where each request's draft
        acceptance is counted (--per-request-spec-decode-metrics)."""
        self.tracer = tracer
        self.spec_metrics = spec_metrics
        self.tokenizer = tokenizer
        self.waiting = waiting
        self.streams = streams
        self.stats = stats
        self.engine = engine
        self.states: dict[str, _State] = {}
        self.groups: dict[str, _Group] = {}

    async def receive(self, msg: DetokenizerProtocol) -> Any:
        match msg:
            case EngineCoreOutputs(outputs=outputs, stats=stats, engine_index=engine, weight_version=version):
                self.ctx.link([o.request_id for o in outputs])
                if stats is not None:
                    self.stats.observe_step(stats, engine)
                now = time.time()
                aborts = [o.request_id for o in outputs if self._process(o, now, version)]
                if aborts:
                    self.engine.tell(AbortRequests(aborts))
            case TrackRequest(request_id=rid, prompt_token_ids=ids, sampling_params=p,
                              arrival_time=arrival, parent_id=parent, n=n, trace_headers=headers):
                self.ctx.link((rid,))
                detok = IncrementalDetokenizer(
                    self.tokenizer if p.detokenize else NO_TEXT, ids, skip_special_tokens=p.skip_special_tokens, stop=p.stop,
                    include_stop_str_in_output=p.include_stop_str_in_output, min_tokens=p.min_tokens)
                span = (p, n, headers) if self.tracer is not None else None
                st = self.states[rid] = _State(detok, len(ids), arrival, p.max_tokens, parent, span)
                if self.stats.watermark_requests is not None:
                    st.watermark = ("not_watermarked" if p.watermarking is False
                                    else "skipped" if p.greedy else "watermarked")
                if parent and parent not in self.groups:
                    self.groups[parent] = _Group(n)
            case Untrack(request_ids=ids):
                for rid in ids:
                    self.waiting.release(rid)
                    st = self.states.pop(rid, None)
                    if st is not None:
                        self._finished(st, "abort")
                        self._trace(rid, st, time.time())
            case EndGroup(parent_id=parent, num_admitted=admitted):
                group = self.groups.get(parent)
                if group is not None:
                    group.expected = admitted
                    self._group_done(parent, group)
            case EngineLost(reason=reason, request_ids=None):
                for _ in self.states:
                    self.stats.observe_finished("error")
                self.states.clear()
                self.groups.clear()
                self.waiting.release_all()
                self.streams.fail_all(reason)      # those still being admitted too
            case EngineLost(reason=reason, request_ids=ids):
                for rid in ids:
                    if self.states.pop(rid, None) is not None:
                        self.stats.observe_finished("error")
                    self.waiting.release(rid)
                    self.streams.fail(rid, reason)

    def _process(self, o: EngineCoreOutput, now: float, version: str | None = None) -> bool:
        """Deliver one request's output; True if a stop string ended it (abort in the engine)."""
        st = self.states.get(o.request_id)
        if st is None:
            return False
        before = st.detok.num_output_tokens
        delta = st.detok.update(o.new_token_ids, stop_terminated=o.finish_reason == "stop")
        num_new = st.detok.num_output_tokens - before     # tokens past a stop string are dropped
        if num_new and version is not None and (not st.versions or st.versions[-1][0] != version):
            st.versions.append((version, before))
        self._observe_timing(st, o, num_new, now)
        if o.spec_step is not None and self.spec_metrics is not None:
            if st.spec is None:
                st.spec = SpecDecodeMetrics(self.spec_metrics[0], self.spec_metrics[1] == "detailed")
            st.spec.observe(*o.spec_step)
        if o.model_times is not None:
            st.model_times = o.model_times
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
            self.stats.observe_request(
                num_prompt_tokens=st.num_prompt_tokens, num_generation_tokens=st.detok.num_output_tokens,
                max_tokens=st.max_tokens, arrival_time=st.arrival_time, scheduled_time=st.scheduled_time,
                first_token_time=st.first_token_time, last_token_time=st.last_token_time, now=now)
            self._finished(st, finish_reason)
            self._trace(o.request_id, st, now)
        stream = self.streams.get(o.request_id)
        if stream is not None:
            stream.put(RequestOutput(
                o.request_id, text, list(o.new_token_ids[:num_new]), finished, finish_reason,
                stop_reason, st.num_prompt_tokens, st.detok.num_output_tokens, o.error,
                _head(o.logprobs, num_new), o.prompt_logprobs, o.num_cached_tokens, o.kv_transfer_params,
                o.error_status, st.metrics() if finished else None, o.prompt_token_id_logprobs,
                [m.tolist() for m in o.sampling_mask[:num_new]] if o.sampling_mask is not None else None,
                st.weight_versions() if finished else None, o.pooling_output))
        return stopped_here

    def _trace(self, rid: str, st: _State, now: float) -> None:
        """The finished request's span (vLLM's llm_request), with a tracer."""
        if st.span is None:
            return
        params, n, headers = st.span
        try:
            self.tracer.request_finished(
                request_id=rid, arrival_time=st.arrival_time, scheduled_time=st.scheduled_time,
                first_token_time=st.first_token_time, last_token_time=st.last_token_time, now=now,
                num_prompt_tokens=st.num_prompt_tokens, num_generation_tokens=st.detok.num_output_tokens,
                params=params, n=n, headers=headers, model_times=st.model_times)
        except Exception:              # a span that cannot be made must not lose the answer
            log.warning("request %s: its OpenTelemetry span could not be recorded", rid, exc_info=True)

    def _finished(self, st: _State, reason: str) -> None:
        """Count a request that ended (``reason``), and its group's end once all its choices did."""
        self.stats.observe_finished(reason)
        if st.watermark:
            self.stats.watermark_requests[st.watermark] += 1
        if not st.parent_id:
            self.stats.observe_choices(1, st.detok.num_output_tokens)
            return
        group = self.groups.get(st.parent_id)
        if group is not None:
            group.finished += 1
            group.max_generation_tokens = max(group.max_generation_tokens, st.detok.num_output_tokens)
            self._group_done(st.parent_id, group)

    def _group_done(self, parent_id: str, group: _Group) -> None:
        if group.finished >= group.expected:
            del self.groups[parent_id]
            if group.finished:
                self.stats.observe_choices(group.n, group.max_generation_tokens)

    def _observe_timing(self, st: _State, o: EngineCoreOutput, num_new: int, now: float) -> None:
        if st.queued and o.first_scheduled_time > 0.0:
            st.queued = False
            st.scheduled_time = o.first_scheduled_time
            self.waiting.release(o.request_id)
            self.stats.request_queue_time.observe(max(o.first_scheduled_time - st.arrival_time, 0.0))
        if num_new == 0:
            return
        self.stats.generation_tokens += num_new
        if st.last_token_time == 0.0:
            st.first_token_time = now
            self.stats.time_to_first_token.observe(now - st.arrival_time)
        else:
            self.stats.inter_token_latency.observe(now - st.last_token_time)
        st.last_token_time = now
