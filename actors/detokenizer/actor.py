"""Detokenizer actor: one EngineCoreOutputs batch per engine step in; text deltas out to each
request's stream. Stop strings end a request here, and the engine is told to abort it."""
from __future__ import annotations

from typing import Any

from actors.detokenizer.incremental import IncrementalDetokenizer
from actors.frontend.stats import EngineStats
from actors.frontend.streams import OutputStreams, RequestOutput
from actors.runtime import Actor, ActorRef, Msg
from actors.tokenizer.actor import TrackRequest
from transport.messages import AbortRequests, EngineCoreOutput, EngineCoreOutputs


class Untrack(Msg):
    """Forget requests the client gave up on."""
    request_ids: list[str]


DetokenizerProtocol = TrackRequest | EngineCoreOutputs | Untrack


class _State:
    __slots__ = ("detok", "num_prompt_tokens", "num_output_tokens")

    def __init__(self, detok: IncrementalDetokenizer, num_prompt_tokens: int) -> None:
        self.detok = detok
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = 0


class DetokenizerActor(Actor):
    protocol = DetokenizerProtocol

    def __init__(self, tokenizer: Any, streams: OutputStreams, stats: EngineStats,
                 engine: ActorRef) -> None:
        self.tokenizer = tokenizer
        self.streams = streams
        self.stats = stats
        self.engine = engine
        self.states: dict[str, _State] = {}

    async def receive(self, msg: DetokenizerProtocol) -> Any:
        match msg:
            case EngineCoreOutputs(outputs=outputs, stats=stats):
                if stats is not None:
                    self.stats.observe_step(stats)
                aborts = [o.request_id for o in outputs if self._process(o)]
                if aborts:
                    self.engine.tell(AbortRequests(aborts))
            case TrackRequest(request_id=rid, prompt_token_ids=ids, sampling_params=p):
                detok = IncrementalDetokenizer(
                    self.tokenizer, ids, skip_special_tokens=p.skip_special_tokens, stop=p.stop,
                    include_stop_str_in_output=p.include_stop_str_in_output, min_tokens=p.min_tokens)
                self.states[rid] = _State(detok, len(ids))
            case Untrack(request_ids=ids):
                for rid in ids:
                    self.states.pop(rid, None)

    def _process(self, o: EngineCoreOutput) -> bool:
        """Deliver one request's output; True if a stop string ended it (abort in the engine)."""
        st = self.states.get(o.request_id)
        if st is None:
            return False
        st.num_output_tokens += len(o.new_token_ids)
        self.stats.generation_tokens += len(o.new_token_ids)
        delta = st.detok.update(o.new_token_ids)
        text, finish_reason, stop_reason = delta.text, o.finish_reason, o.stop_reason
        stopped_here = delta.finished and finish_reason is None
        if delta.finished:
            finish_reason, stop_reason = "stop", delta.stop_reason
        elif finish_reason is not None:
            text += st.detok.flush().text
        finished = finish_reason is not None
        if finished:
            del self.states[o.request_id]
            self.stats.observe_finished(finish_reason)
        stream = self.streams.get(o.request_id)
        if stream is not None:
            stream.put(RequestOutput(o.request_id, text, list(o.new_token_ids), finished,
                                     finish_reason, stop_reason, st.num_prompt_tokens,
                                     st.num_output_tokens, o.error))
        return stopped_here
