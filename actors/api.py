"""The offline API: ``AsyncLLM`` (an async iterator per request) and ``LLM`` (synchronous, with a
progress bar). By default every actor runs in one event loop in this process; pass
``multiprocess=True`` for the same process layout as the server (the default with
``data_parallel_size``, ``tensor_parallel_size`` or ``pipeline_parallel_size`` > 1, and with a Ray
backend: each engine core and rank needs a process, or a Ray actor, of its own). Engine options are
``EngineArgs``'s fields (``actors/engine/args.py``), as keywords."""
from __future__ import annotations

import asyncio
import itertools
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable, Iterator, Sequence, Sized, Union

from actors.engine.args import EngineArgs
from actors.engine.lora import LoRARequest
from actors.engine.sampling_params import SamplingParams
from actors.frontend.launch import Frontend, start_frontend
from actors.frontend.streams import RequestOutput

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "GenerationResult", "LoRARequest"]


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    error: str | None = None
    prompt: Any = field(default=None, repr=False)
    index: int = 0                       # the prompt's place in the list it came in
    kv_transfer_params: dict | None = None   # vLLM's: what another instance needs to read its KV


class Progress:
    """A tqdm bar on standard error: requests done, output tokens per second, time left."""

    def __init__(self, total: int, desc: str) -> None:
        from tqdm import tqdm
        self.bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True)
        self.started = time.monotonic()
        self.tokens = 0

    def update(self, output_tokens: int) -> None:
        self.tokens += output_tokens
        rate = self.tokens / max(time.monotonic() - self.started, 1e-9)
        self.bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class AsyncLLM:
    def __init__(self, frontend: Frontend) -> None:
        self._fe = frontend
        self.client = frontend.client

    @classmethod
    async def create(cls, model: str | None = None, *, multiprocess: bool | None = None,
                     **engine_options: Any) -> AsyncLLM:
        if multiprocess is None:
            multiprocess = (max(engine_options.get("data_parallel_size", 1),
                                engine_options.get("tensor_parallel_size", 1),
                                engine_options.get("pipeline_parallel_size", 1)) > 1
                            or "ray" in (engine_options.get("distributed_executor_backend"),
                                         engine_options.get("data_parallel_backend")))
        return await cls.from_engine_args(
            EngineArgs.from_options(model, {**engine_options, "multiprocess": multiprocess}))

    @classmethod
    async def from_engine_args(cls, args: EngineArgs) -> AsyncLLM:
        return cls(await start_frontend(args.create_engine_config()))

    def default_sampling_params(self) -> SamplingParams:
        """What a prompt given no SamplingParams samples with: vLLM's defaults, overridden by
        the model's generation_config.json under ``generation_config="auto"`` (as vLLM's
        ``LLM.get_default_sampling_params``)."""
        defaults = self.client.config.model.sampling_defaults
        return SamplingParams(**defaults.as_dict()) if defaults is not None else SamplingParams()

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                       request_id: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one text (or token-id) prompt, as they are produced; with
        ``lora_request``, from the base model plus that adapter (vLLM's argument)."""
        params = params or self.default_sampling_params()
        kw: dict[str, Any] = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": list(prompt)}
        lora = self.client.register_lora(lora_request) if lora_request is not None else None
        async for out in self.client.generate(params, request_id=request_id, lora_request=lora, **kw):
            yield out

    async def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None, *,
                   request_id: str | None = None, lora_request: LoRARequest | None = None,
                   **template: Any) -> AsyncIterator[RequestOutput]:
        """Outputs of one conversation rendered with the model's chat template."""
        params = params or self.default_sampling_params()
        lora = self.client.register_lora(lora_request) if lora_request is not None else None
        async for out in self.client.generate(params, request_id=request_id, messages=messages,
                                              lora_request=lora, **template):
            yield out

    async def generate_many(self, prompts: Iterable[Prompt],
                            params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                            max_pending: int = 1024, use_tqdm: bool = False,
                            **template: Any) -> AsyncIterator[GenerationResult]:
        """Results of many prompts (text, token ids, or a conversation: a list of messages), in
        the order they finish; ``result.index`` is the prompt's place. At most ``max_pending``
        requests are in the engine or finished and not yet taken, so a long (even endless)
        input runs in bounded memory. ``params``: one for all, or one per prompt."""
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        per_prompt = params if isinstance(params, Sequence) else None
        slots = asyncio.Semaphore(max_pending)
        arrived: asyncio.Queue[Any] = asyncio.Queue()     # results, errors, then the count
        tasks: set[asyncio.Future] = set()
        bar = Progress(len(prompts), "Generating") if use_tqdm and isinstance(prompts, Sized) else None

        async def one(i: int, prompt: Prompt, sp: SamplingParams | None) -> None:
            try:
                stream = (self.chat(prompt, sp, **template) if _is_conversation(prompt)  # type: ignore[arg-type]
                          else self.generate(prompt, sp))                                 # type: ignore[arg-type]
                result = await _collect(stream, prompt)
                result.index = i
                arrived.put_nowait(result)
            except Exception as exc:
                arrived.put_nowait(exc)

        async def feed() -> None:
            n, it = 0, iter(prompts)
            try:
                for i in itertools.count():
                    await slots.acquire()           # a slot first: no prompt is read ahead of one
                    try:
                        prompt = next(it)
                    except StopIteration:
                        break
                    task = asyncio.ensure_future(one(i, prompt, per_prompt[i] if per_prompt is not None else params))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    n += 1
            except Exception as exc:          # the prompts' iterator failed: the consumer sees it
                arrived.put_nowait(exc)
            arrived.put_nowait(_Total(n))

        feeder = asyncio.ensure_future(feed())
        total, taken = None, 0
        try:
            while total is None or taken < total:
                item = await arrived.get()
                if isinstance(item, _Total):
                    total = item.n
                    continue
                if isinstance(item, BaseException):
                    raise item
                taken += 1
                slots.release()
                if bar is not None:
                    bar.update(len(item.token_ids))
                yield item
        finally:
            feeder.cancel()
            for task in list(tasks):
                task.cancel()
            if bar is not None:
                bar.close()

    async def shutdown(self) -> None:
        await self._fe.shutdown()


@dataclass(slots=True)
class _Total:
    n: int                               # how many prompts there were


Prompt = Union[str, list[int], list[dict[str, Any]]]


def _is_conversation(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


async def _collect(stream: AsyncIterator[RequestOutput], prompt: Any) -> GenerationResult:
    text, ids, last = [], [], None
    async for out in stream:
        text.append(out.text)
        ids.extend(out.token_ids)
        last = out
    if last is None:
        raise RuntimeError("the request ended without any output")
    return GenerationResult(last.request_id, "".join(text), ids, last.finish_reason,
                            last.num_prompt_tokens, last.error, prompt, kv_transfer_params=last.kv_transfer_params)


CLOSED = "this LLM is closed: create another to generate"


class LLM:
    """Synchronous front of AsyncLLM: its event loop runs in a background thread."""

    def __init__(self, model: str | None = None, *, multiprocess: bool | None = None,
                 **engine_options: Any) -> None:
        import uvloop
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="troupe-llm", daemon=True)
        self._thread.start()
        try:
            self._llm: AsyncLLM | None = self._run(AsyncLLM.create(model, multiprocess=multiprocess,
                                                            **engine_options))
        except BaseException:
            self._stop_loop()
            raise

    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError(CLOSED)
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def client(self) -> Any:
        """The engine client: its ``stats`` are the engine's statistics as /metrics shows them."""
        return self._engine().client

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[GenerationResult]:
        """Generate for every prompt concurrently (they share engine steps); results in order.
        ``params``: one for all prompts, or one per prompt; ``lora_request`` likewise (vLLM's
        argument: the adapter each prompt runs with, None for the base model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} sampling parameters for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} LoRA requests for {len(prompts)} prompts")
        return self._batch([(p, lambda p=p, sp=sp, lr=lr: self._engine().generate(p, sp, lora_request=lr))
                            for p, sp, lr in zip(prompts, per_prompt, loras)], use_tqdm)

    def chat(self, conversations: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             params: SamplingParams | None = None, *, use_tqdm: bool = True,
             **template: Any) -> list[GenerationResult]:
        """Reply to one conversation (a list of messages) or to each of several."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        return self._batch([(c, lambda c=c: self._engine().chat(c, params, **template))
                            for c in conversations], use_tqdm)

    def generate_many(self, prompts: Iterable[Prompt],
                      params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                      max_pending: int = 1024, use_tqdm: bool = True,
                      **template: Any) -> Iterator[GenerationResult]:
        """``AsyncLLM.generate_many`` for a synchronous caller: results as they finish, in
        bounded memory."""
        results = self._engine().generate_many(prompts, params, max_pending=max_pending, use_tqdm=use_tqdm,
                                               **template)
        try:
            while True:
                try:
                    yield self._run(results.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if self._loop.is_running():     # not after close(): the engine is gone already
                self._run(results.aclose(), timeout=60)

    def _batch(self, jobs: list[tuple[Any, Any]], use_tqdm: bool) -> list[GenerationResult]:
        async def run_all() -> list[GenerationResult]:
            bar = Progress(len(jobs), "Generating") if use_tqdm and len(jobs) > 1 else None

            async def one(prompt: Any, make: Any) -> GenerationResult:
                result = await _collect(make(), prompt)
                if bar is not None:
                    bar.update(len(result.token_ids))
                return result
            try:
                results = list(await asyncio.gather(*(one(p, m) for p, m in jobs)))
                for i, r in enumerate(results):
                    r.index = i
                return results
            finally:
                if bar is not None:
                    bar.close()
        return self._run(run_all())

    def _engine(self) -> AsyncLLM:
        if self._llm is None:
            raise RuntimeError(CLOSED)
        return self._llm

    def close(self) -> None:
        """Stop the engine and let go of it: its weights and KV cache are freed even while this
        object is still referred to."""
        if self._llm is None:
            return
        try:
            if self._loop.is_running():
                self._run(self._llm.shutdown(), timeout=60)
        finally:
            self._llm = None
            self._stop_loop()
            if not self._loop.is_running():
                self._loop.close()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
