"""The OpenAI-compatible HTTP API (aiohttp): chat and text completions, plain and streamed
(server-sent events), models, health, metrics. Errors are OpenAI-shaped:
``{"error": {"message", "type", "param", "code"}}``, 4xx for bad input, never a 500 for it."""
from __future__ import annotations

import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
from aiohttp import web

from actors.frontend.client import EngineClient, EngineDeadError, RequestHandle
from actors.frontend.protocol import (BadRequest, ChatCompletionRequest, CompletionRequest,
                                      chat_messages, decode_body, sampling_params)
from actors.frontend.streams import RequestOutput, StreamTimeout
from actors.runtime.tracing import to_chrome_trace
from actors.tokenizer.actor import InvalidPrompt, PromptTooLong

log = logging.getLogger("troupe.http")

MAX_BODY_BYTES = 8 << 20
_json = msgspec.json.Encoder()


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | int | None = None) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return web.Response(status=status, body=_json.encode(body), content_type="application/json")


class ApiError(Exception):
    def __init__(self, response: web.Response) -> None:
        self.response = response


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


class OpenAIServer:
    def __init__(self, client: EngineClient, api_key: str | None = None,
                 trace: Callable[[int], Awaitable[list]] | None = None) -> None:
        self.client = client
        self.api_key = api_key
        self.trace = trace

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._middleware])
        app.router.add_get("/health", self.health)
        app.router.add_get("/ping", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/debug/engine", self.debug_engine)
        app.router.add_get("/debug/trace", self.debug_trace)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        if self.api_key and request.path.startswith("/v1/"):
            if request.headers.get("Authorization", "") != f"Bearer {self.api_key}":
                return error_response(401, "invalid or missing API key", "authentication_error")
        try:
            response = await handler(request)
        except ApiError as exc:
            response = exc.response
        except web.HTTPRequestEntityTooLarge:
            response = error_response(413, f"request body larger than {MAX_BODY_BYTES} bytes")
        except web.HTTPException as exc:
            response = error_response(exc.status, exc.reason)
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            response = error_response(500, "internal error (see the server log)", "server_error", code=500)
        rid = request.headers.get("X-Request-Id")
        if rid and not response.prepared:
            response.headers["X-Request-Id"] = rid
        return response

    # -- probes ------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.client.dead is not None:
            return error_response(503, self.client.dead, "server_error")
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.client.stats.prometheus(), content_type="text/plain")

    async def debug_engine(self, request: web.Request) -> web.Response:
        return web.json_response(self.client.stats.as_dict())

    async def debug_trace(self, request: web.Request) -> web.Response:
        """The actors' recent message spans in every process, as Chrome-trace / Perfetto JSON."""
        if self.trace is None:
            return error_response(404, "tracing is not available here")
        try:
            limit = int(request.query.get("limit", "20000"))
        except ValueError:
            return error_response(400, "limit must be an integer", param="limit")
        if limit < 1:
            return error_response(400, "limit must be at least 1", param="limit")
        records = await self.trace(limit)
        return web.Response(body=_json.encode(to_chrome_trace(records)), content_type="application/json")

    async def models(self, request: web.Request) -> web.Response:
        c = self.client
        card = {"id": c.model_name, "object": "model", "created": int(c.stats.started_at),
                "owned_by": "troupe", "root": c.model_name, "max_model_len": c.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    # -- generation --------------------------------------------------------------------------
    async def _read(self, request: web.Request, typ: type) -> Any:
        body = await request.read()
        try:
            req = decode_body(body, typ)
        except BadRequest as exc:
            raise ApiError(error_response(400, str(exc), param=exc.param)) from None
        if req.model is not None and req.model != self.client.model_name:
            raise ApiError(error_response(404, f"The model `{req.model}` does not exist.",
                                          param="model", code="model_not_found"))
        return req

    async def _submit(self, params_of: Callable[[], Any], **kwargs: Any) -> RequestHandle:
        try:
            return await self.client.submit(params_of(), **kwargs)
        except BadRequest as exc:
            raise ApiError(error_response(400, str(exc), param=exc.param, code=exc.code)) from None
        except PromptTooLong as exc:
            raise ApiError(error_response(400, str(exc), param="messages" if "messages" in kwargs
                                          else "prompt", code="context_length_exceeded")) from None
        except InvalidPrompt as exc:
            raise ApiError(error_response(400, str(exc))) from None
        except EngineDeadError as exc:
            raise ApiError(error_response(503, f"the engine is not running: {exc}", "server_error")) from None

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req: ChatCompletionRequest = await self._read(request, ChatCompletionRequest)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        try:
            messages = chat_messages(req)
        except BadRequest as exc:
            raise ApiError(error_response(400, str(exc), param=exc.param)) from None
        handle = await self._submit(
            lambda: sampling_params(req, max_tokens), max_tokens=max_tokens, messages=messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template_kwargs=req.chat_template_kwargs, priority=req.priority)
        return await self._respond(request, req, handle, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req: CompletionRequest = await self._read(request, CompletionRequest)
        prompt, token_ids = _single_prompt(req.prompt)
        handle = await self._submit(lambda: sampling_params(req, req.max_tokens),
                                    max_tokens=req.max_tokens if req.max_tokens is not None else 16,
                                    prompt=prompt, prompt_token_ids=token_ids, priority=req.priority)
        return await self._respond(request, req, handle, chat=False)

    async def _respond(self, request: web.Request, req: Any, handle: RequestHandle,
                       chat: bool) -> web.StreamResponse:
        try:
            if req.stream:
                return await self._stream(request, req, handle, chat)
            return await self._complete(handle, chat)
        finally:
            handle.close()   # aborts the request if it did not finish (e.g. the client left)

    async def _complete(self, handle: RequestHandle, chat: bool) -> web.Response:
        text, last = [], None
        try:
            async for out in handle:
                text.append(out.text)
                last = out
        except StreamTimeout as exc:
            return error_response(504, str(exc), "server_error")
        if last is None or last.error is not None:
            return error_response(500, _failure(last), "server_error", code=500)
        rid, created, model = handle.request_id, int(time.time()), self.client.model_name
        content = "".join(text)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": content},
                      "logprobs": None, "finish_reason": last.finish_reason,
                      "stop_reason": last.stop_reason}
            body = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created,
                    "model": model, "choices": [choice]}
        else:
            choice = {"index": 0, "text": content, "logprobs": None,
                      "finish_reason": last.finish_reason, "stop_reason": last.stop_reason}
            body = {"id": f"cmpl-{rid}", "object": "text_completion", "created": created,
                    "model": model, "choices": [choice]}
        body["usage"] = _usage(handle.num_prompt_tokens, last.num_output_tokens)
        return web.Response(body=_json.encode(body), content_type="application/json")

    async def _stream(self, request: web.Request, req: Any, handle: RequestHandle,
                      chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        rid = request.headers.get("X-Request-Id")
        if rid:
            resp.headers["X-Request-Id"] = rid
        await resp.prepare(request)
        async for event in self._events(req, handle, chat):
            await resp.write(b"data: " + _json.encode(event) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _events(self, req: Any, handle: RequestHandle, chat: bool) -> AsyncIterator[dict]:
        rid, created, model = handle.request_id, int(time.time()), self.client.model_name
        obj, prefix = ("chat.completion.chunk", "chatcmpl-") if chat else ("text_completion", "cmpl-")

        def chunk(delta_text: str | None, finish: str | None = None, role: bool = False,
                  stop_reason: Any = None) -> dict:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                    {"content": delta_text} if delta_text else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_text or "", "logprobs": None,
                          "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = stop_reason
            return {"id": prefix + rid, "object": obj, "created": created, "model": model,
                    "choices": [choice]}

        if chat:
            yield chunk(None, role=True)
        last: RequestOutput | None = None
        try:
            async for out in handle:
                last = out
                if out.error is not None:
                    yield {"error": {"message": _failure(out), "type": "server_error",
                                     "param": None, "code": 500}}
                    return
                if out.text:
                    yield chunk(out.text)
                if out.finished:
                    yield chunk(None, out.finish_reason, stop_reason=out.stop_reason)
        except StreamTimeout as exc:
            yield {"error": {"message": str(exc), "type": "server_error", "param": None, "code": 504}}
            return
        opts = req.stream_options
        if opts is not None and opts.include_usage and last is not None:
            yield {"id": prefix + rid, "object": obj, "created": created, "model": model,
                   "choices": [], "usage": _usage(handle.num_prompt_tokens, last.num_output_tokens)}


def _failure(out: RequestOutput | None) -> str:
    if out is None:
        return "the request ended without output"
    return f"the request failed: {out.error}"


def _single_prompt(prompt: Any) -> tuple[str | None, list[int] | None]:
    """One prompt as text or token ids; several prompts per request are refused for now."""
    if isinstance(prompt, str):
        return prompt, None
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, list(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return _single_prompt(prompt[0])
    raise ApiError(error_response(400, "prompt must be one string or one list of token ids "
                                  "(several prompts per request are not supported yet)", param="prompt"))
