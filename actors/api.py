"""The offline API: ``AsyncLLM`` (an async iterator per request) and ``LLM`` (synchronous, with a
progress bar). By default every actor runs in one event loop in this process; pass
``multiprocess=True`` for the same process layout as the server. Engine options are
``EngineArgs``'s fields (``actors/engine/args.py``), as keywords."""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

from actors.engine.args import EngineArgs
from actors.engine.sampling_params import SamplingParams
from actors.frontend.launch import Frontend, start_frontend
from actors.frontend.streams import RequestOutput

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "GenerationResult"]


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    error: str | None = None
    prompt: Any = field(default=None, repr=False)


class AsyncLLM:
    def __init__(self, frontend: Frontend) -> None:
        self._fe = frontend
        self.client = frontend.client

    @classmethod
    async def create(cls, model: str | None = None, *, multiprocess: bool = False,
                     **engine_options: Any) -> AsyncLLM:
        return await cls.from_engine_args(
            EngineArgs.from_options(model, {**engine_options, "multiprocess": multiprocess}))

    @classmethod
    async def from_engine_args(cls, args: EngineArgs) -> AsyncLLM:
        return cls(await start_frontend(args.create_engine_config()))

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one text (or token-id) prompt, as they are produced."""
        params = params or SamplingParams()
        kw: dict[str, Any] = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": list(prompt)}
        async for out in self.client.generate(params, request_id=request_id, **kw):
            yield out

    async def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None, *,
                   request_id: str | None = None, **template: Any) -> AsyncIterator[RequestOutput]:
        """Outputs of one conversation rendered with the model's chat template."""
        params = params or SamplingParams()
        async for out in self.client.generate(params, request_id=request_id, messages=messages,
                                              **template):
            yield out

    async def shutdown(self) -> None:
        await self._fe.shutdown()


async def _collect(stream: AsyncIterator[RequestOutput], prompt: Any) -> GenerationResult:
    text, ids, last = [], [], None
    async for out in stream:
        text.append(out.text)
        ids.extend(out.token_ids)
        last = out
    if last is None:
        raise RuntimeError("the request ended without any output")
    return GenerationResult(last.request_id, "".join(text), ids, last.finish_reason,
                            last.num_prompt_tokens, last.error, prompt)


class LLM:
    """Synchronous front of AsyncLLM: its event loop runs in a background thread."""

    def __init__(self, model: str | None = None, *, multiprocess: bool = False,
                 **engine_options: Any) -> None:
        import uvloop
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="troupe-llm", daemon=True)
        self._thread.start()
        try:
            self._llm: AsyncLLM = self._run(AsyncLLM.create(model, multiprocess=multiprocess,
                                                            **engine_options))
        except BaseException:
            self._stop_loop()
            raise

    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True) -> list[GenerationResult]:
        """Generate for every prompt concurrently (they share engine steps); results in order.
        ``params``: one for all prompts, or one per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} sampling parameters for {len(prompts)} prompts")
        return self._batch([(p, lambda p=p, sp=sp: self._llm.generate(p, sp))
                            for p, sp in zip(prompts, per_prompt)], use_tqdm)

    def chat(self, conversations: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             params: SamplingParams | None = None, *, use_tqdm: bool = True,
             **template: Any) -> list[GenerationResult]:
        """Reply to one conversation (a list of messages) or to each of several."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        return self._batch([(c, lambda c=c: self._llm.chat(c, params, **template))
                            for c in conversations], use_tqdm)

    def _batch(self, jobs: list[tuple[Any, Any]], use_tqdm: bool) -> list[GenerationResult]:
        async def run_all() -> list[GenerationResult]:
            bar = None
            if use_tqdm and len(jobs) > 1:
                from tqdm import tqdm
                bar = tqdm(total=len(jobs), desc="Generating", unit="req")

            async def one(prompt: Any, make: Any) -> GenerationResult:
                result = await _collect(make(), prompt)
                if bar is not None:
                    bar.update(1)
                return result
            try:
                return list(await asyncio.gather(*(one(p, m) for p, m in jobs)))
            finally:
                if bar is not None:
                    bar.close()
        return self._run(run_all())

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self._llm.shutdown(), timeout=60)
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
