"""One HTTP request, several engine requests: n choices per prompt, several prompts per
completion request. Choice ``index = prompt_index * n + i`` runs as engine request
``{rid}-{index}`` (just ``rid`` when there is one choice); siblings share the prompt's token
ids, so the prefix cache serves all but the first. With n > 1, a prompt's choices form a group
(``{rid}-p{prompt_index}``) the metrics count as one request with n choices, as vLLM does."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from actors.frontend.client import RequestHandle
from actors.frontend.params import PromptInput, for_choice
from actors.frontend.streams import RequestOutput, StreamTimeout
from actors.engine.messages import Logprobs
from actors.engine.sampling_params import SamplingParams

Submit = Callable[..., Awaitable[RequestHandle]]


@dataclass(slots=True)
class Choice:
    index: int
    prompt_index: int
    handle: RequestHandle
    text: list[str] = field(default_factory=list)
    last: RequestOutput | None = None
    state: Any = None                  # the endpoint's per-choice bookkeeping
    token_ids: list[int] = field(default_factory=list)     # generated so far
    prompt_logprobs: Logprobs | None = None                 # the prompt's, as far as computed
    prompt_scores: list = field(default_factory=list)       # prompt_logprob_token_ids' rows, by chunk
    unsent_ids: list[int] = field(default_factory=list)    # a stream's token ids no chunk carried yet
    sampling_mask: list[list[int]] | None = None            # --return-sampling-mask: per token, its support

    def take(self, out: RequestOutput) -> None:
        """Count ``out`` in: the last output, the token ids, the prompt's log-probs."""
        self.last = out
        self.token_ids.extend(out.token_ids)
        lp = out.prompt_logprobs
        if lp is not None:
            if self.prompt_logprobs is None:
                self.prompt_logprobs = Logprobs([], [], [])
            self.prompt_logprobs.extend(lp)
        if out.prompt_token_id_logprobs is not None:
            self.prompt_scores.append(out.prompt_token_id_logprobs)
        if out.sampling_mask is not None:
            self.sampling_mask = (self.sampling_mask or []) + out.sampling_mask

    @property
    def num_output_tokens(self) -> int:
        return self.last.num_output_tokens if self.last is not None else 0


async def submit_choices(submit: Submit, request_id: str, params: SamplingParams, n: int,
                         prompts: list[PromptInput] | None = None, **kwargs: Any) -> list[Choice]:
    """Admit every choice; if one is refused, the ones already admitted are aborted. With
    ``prompts`` None, ``kwargs`` say what the single prompt is (chat messages)."""
    choices: list[Choice] = []
    single = n == 1 and (prompts is None or len(prompts) == 1)
    group, p = "", 0
    try:
        for p, prompt in enumerate(prompts if prompts is not None else [None]):
            ids: list[int] | None = None
            group = f"{request_id}-p{p}" if n > 1 else ""
            for i in range(n):
                index = p * n + i
                rid = request_id if single else f"{request_id}-{index}"
                what = dict(kwargs, parent_id=group, n=n) if group else dict(kwargs)
                embeds = prompt.embeds if prompt is not None else kwargs.get("prompt_embeds")
                if embeds is not None:         # every choice: the same rows
                    what.update(prompt_embeds=embeds)
                elif ids is not None:          # a sibling: the first choice's token ids
                    what.update(messages=None, prompt=None, prompt_token_ids=ids)
                elif prompt is not None:
                    what.update(prompt=prompt.text, prompt_token_ids=prompt.token_ids)
                handle = await submit(for_choice(params, i), request_id=rid, **what)
                ids = handle.prompt_token_ids
                choices.append(Choice(index, p, handle))
    except BaseException:
        close_all(choices)
        admitted = [c for c in choices if c.prompt_index == p] if group else []
        if admitted:               # the group's other choices never came: it ends with these
            admitted[0].handle.client.end_group(group, len(admitted))
        raise
    return choices


def close_all(choices: list[Choice]) -> None:
    """Close every choice's request (aborting those that did not finish)."""
    for c in choices:
        c.handle.close()


async def merged_outputs(choices: list[Choice]) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """Outputs of all choices as they come, until every choice finished. StreamTimeout from
    any choice ends the iteration with that error."""
    if len(choices) == 1:
        c = choices[0]
        async for out in c.handle:
            yield c, out
        return
    queue: asyncio.Queue[tuple[Choice, RequestOutput | BaseException]] = asyncio.Queue()

    async def pump(c: Choice) -> None:
        try:
            async for out in c.handle:
                queue.put_nowait((c, out))
        except StreamTimeout as exc:
            queue.put_nowait((c, exc))

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        remaining = len(choices)
        while remaining:
            c, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield c, item
            remaining -= item.finished
    finally:
        for t in tasks:
            t.cancel()
