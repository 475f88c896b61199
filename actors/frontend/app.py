"""The OpenAI-compatible HTTP API on aiohttp: routes, authentication, and the mapping of every
failure to an OpenAI-shaped error (``errors.py``): 4xx for bad input, never a 500 for it; 500
when the engine failed a request; 503 while the model loads or once the engine is gone.

Endpoints live beside it: ``chat.py``, ``completions.py`` and ``misc.py``; installed packages add
their own through ``troupe.endpoints`` entry points (actors/runtime/plugins.py), given the app's
router (the middleware, API key and error mapping included)."""
from __future__ import annotations

import functools
import hmac
import logging
import math
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import msgspec
from aiohttp import web

from actors.frontend import (anthropic, chat, chat_batch, cohere_embed, completions, control, dashboard, debug,
                             embeddings, generative_scoring, lora, misc, observe, request_log, responses, scale_out,
                             scoring, speech_to_text, sse)
from actors.engine.sampling_params import SamplingParams, StructuredOutputsParams
from actors.frontend.admission import Overloaded
from actors.frontend.client import EngineClient, EngineDeadError, RequestHandle
from actors.frontend.cors import CorsPolicy
from actors.frontend.errors import ApiError, bad_request, error_response, not_found, server_error
from actors.frontend.generation import OPEN_ANSWERS, Answer
from actors.frontend.http_trace import HttpSpan
from actors.frontend.logprobs import TokenText
from actors.frontend.telemetry import Telemetry
from actors.runtime import otel
from actors.frontend.protocol import BadRequest, GenerationRequest, ServerDefaults, decode_body
from actors.frontend.reasoning import REASONING_PARSERS
from actors.frontend.stats import EngineStats
from actors.grammar.actor import InvalidGrammar
from actors.runtime import RemoteError, faults
from actors.runtime.faults import InjectFault
from actors.runtime.plugins import ENDPOINTS, call_plugins
from actors.runtime.tracing import Tracer
from actors.tokenizer.actor import NO_REASONING_CONFIG, InvalidPrompt

log = logging.getLogger("troupe.http")

MAX_BODY_BYTES = 8 << 20
PROTECTED_PATHS = ("/v1/", "/v2/", "/inference/", "/debug/", "/dashboard", "/invocations",   # need the API key when set
                   "/generative_scoring", "/pause", "/resume", "/is_paused", "/abort_requests", "/sleep",
                   "/wake_up", "/is_sleeping", "/start_profile", "/stop_profile", "/server_info", "/get_world_size", "/collective_rpc",
                   "/reset_mm_cache", "/reset_encoder_cache", "/release_kv_cache_memory", "/init_weight_transfer_engine",
                   "/shutdown_weight_transfer_engine", "/start_weight_update", "/start_draft_weight_update",
                   "/update_weights", "/finish_weight_update", "/update_weight_version", "/weight_info",
                   "/weight_checker")
KEY_COOKIE = "troupe_api_key"                          # the key, for the dashboard's own requests


def _same(given: str, key: str) -> bool:
    """A key check in constant time (bytes: any text a client sends compares, none raises)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), key.encode())


@dataclass(frozen=True, slots=True)
class ServerOptions:
    api_key: str | tuple[str, ...] | None = None   # Bearer tokens (any of them) on /v1/*, /debug/*, /dashboard
    lenient: bool = False                  # drop (and log) unknown request fields instead of a 400
    request_timeout: float = 0.0           # seconds a request may take before it is aborted; 0: none
    max_body_bytes: int = MAX_BODY_BYTES
    enable_auto_tool_choice: bool = False  # tool_choice "auto" read with tool_call_parser
    tool_call_parser: str | None = None    # a name in tool_parsers.TOOL_PARSERS
    tool_strict_level: str = "auto"        # --tool-strict-level: how "auto" tool calls are held to the format
    log_requests: bool = False             # one INFO line per admitted request (--enable-log-requests)
    metrics_prefixes: tuple[str, ...] = ("vllm", "troupe")   # /metrics names (--metrics-prefix)
    return_tokens_as_token_ids: bool = False   # log-prob tokens as "token_id:N" unless a request says
    trust_request_chat_template: bool = False  # a chat request may bring its own template
    enable_tokenizer_info_endpoint: bool = False   # GET /tokenizer_info (it shows the chat template)
    enable_scale_out: bool = False         # render, token-in-token-out generate (403 without, as vLLM)
    tokens_only: bool = False              # vLLM's --tokens-only: also POST /abort_requests (scale_out's)
    default_chat_template_kwargs: dict[str, Any] | None = None   # under every chat request's own
    stream_interval: int = 1               # new tokens per streamed chunk after the first (--stream-interval)
    sse_keep_alive_interval: float = 0.0   # seconds of silence before a stream sends a comment line; 0: never
    reasoning_parser: str | None = None    # a name in reasoning.REASONING_PARSERS (--reasoning-parser)
    cors: CorsPolicy = CorsPolicy()        # --allowed-origins and the rest: none allowed by default
    response_role: str = "assistant"       # a chat answer's role when the generation prompt was added
    force_include_usage: bool = False      # every stream sends its usage (--enable-force-include-usage)
    log_outputs: bool = False              # with log_requests, each request's output when it finishes
    max_log_len: int | None = None         # characters and token ids the request log shows; None: all
    log_deltas: bool = True                # with log_outputs, a streamed request's deltas too
    log_error_stack: bool = False          # every error response's stack trace in the log
    exclude_tools_when_tool_choice_none: bool = False   # tool_choice "none": the template gets no tools
    root_path: str = ""                    # every endpoint also answers under this path (--root-path)
    profiling: bool = False                # --profiler-config names a profiler: /start_profile, /stop_profile
    middleware: tuple[Callable, ...] = ()  # vLLM's --middleware: aiohttp middlewares, inside the server's own
    per_request_metrics: bool = False      # vLLM's --enable-per-request-metrics: a one-choice answer's timings
    fingerprint_mode: str = "full"         # vLLM's --fingerprint-mode: what system_fingerprint says
    fingerprint_value: str | None = None   # with fingerprint_mode "custom": the fingerprint


class OpenAIServer:
    """The HTTP API over one EngineClient. ``client`` is None while the model loads
    (``attach`` sets it): probes answer 503 and every other endpoint 503 too."""

    def __init__(self, client: EngineClient | None = None, options: ServerOptions = ServerOptions(),
                 telemetry: Callable[[], Telemetry | None] | None = None,
                 inject: Callable[[InjectFault], Awaitable[bool]] | None = None,
                 tracer: Tracer | None = None) -> None:
        self.options = options
        self.telemetry = telemetry           # the dashboard's data, once the model is loaded
        self.tracer = tracer                 # records a span per HTTP request
        self.inject = inject
        self.client: EngineClient | None = None
        self.token_text: TokenText | None = None
        self.vocab_size = 0
        self.request_defaults = ServerDefaults()
        self.responses = responses.ResponseStore()     # for GET /v1/responses/{id} and previous_response_id
        self.shared: Any = None       # with several API servers (api_servers.SharedState): what they share
        self.open_answers: dict[str, list[str]] = {}   # an answer's id -> its engine requests' ids
        self.server_load = 0             # generation requests being answered (GET /load)
        self.anthropic_merge_system: bool | None = None   # the template takes one leading system message only
        self.has_text = True             # False: --skip-tokenizer-init (token ids in and out, no text)
        self.pooling = False             # --runner pooling: the model embeds, generation is refused
        self.system_fingerprint: str | None = None   # every answer's (--fingerprint-mode), once serving
        self._otel_warned = False        # a request with trace context came while tracing is off
        self.reasoning_parser = REASONING_PARSERS[options.reasoning_parser] if options.reasoning_parser else None
        if client is not None:
            self.attach(client)

    # -- stored responses (with several API servers, API server 0's store) ----------------------
    async def keep_response(self, rid: str, stored: responses.Stored) -> None:
        if self.shared is not None and self.shared.remote:
            await self.shared.keep_response(rid, stored)
        else:
            self.responses.put(rid, stored)

    async def stored_response(self, rid: str) -> responses.Stored | None:
        if self.shared is not None and self.shared.remote:
            return await self.shared.fetch_response(rid)
        return self.responses.get(rid)

    async def forget_response(self, rid: str) -> bool:
        if self.shared is not None and self.shared.remote:
            return await self.shared.forget_response(rid)
        return self.responses.delete(rid)

    async def control_changed(self) -> None:
        """Generation was paused or resumed, or the engine put to sleep or woken, through this
        server: with several API servers, every one has taken the new state once this returns."""
        if self.shared is not None:
            client = self.engine()
            await self.shared.control_state(client.pause_mode, client.sleep_level)

    def abort_here(self, ids: list[str] | None) -> int:
        """Abort this server's open requests named by ``ids`` (an answer's or a request's id; None:
        all of them); how many."""
        client = self.engine()
        if ids is None:
            return len(client.abort_open())
        return len(client.abort_open([e for rid in ids for e in self.open_answers.get(rid, [rid])]))

    async def abort_everywhere(self, ids: list[str] | None) -> int:
        """``abort_here`` on this server and, with several API servers, on every one."""
        aborted = self.abort_here(ids)
        if self.shared is not None:
            aborted += await self.shared.abort_open(ids)
        return aborted

    async def metrics_stats(self) -> EngineStats:
        """The stats /metrics shows: with several API servers, every one's requests added up."""
        client = self.engine()
        if self.shared is None:
            return client.stats
        return client.stats.with_requests_of(await self.shared.others_request_stats(), client.num_open)

    def attach(self, client: EngineClient) -> None:
        """Serve with ``client``; ValueError when --reasoning-parser does not fit its model."""
        if self.reasoning_parser is not None:
            if not client.tokenizer.has_text:
                raise ValueError("--reasoning-parser reads text, and --skip-tokenizer-init loads no tokenizer")
            self.reasoning_parser.check(client.tokenizer)
        self.token_text = TokenText(client.tokenizer)
        self.has_text = client.tokenizer.has_text
        self.pooling = client.config.model.pooling is not None
        self.vocab_size = min(client.tokenizer.vocab_size, client.vocab_size)
        model = client.config.model
        self.request_defaults = ServerDefaults(model.max_logprobs, model.sampling_defaults)
        self.anthropic_merge_system = None
        self.system_fingerprint = misc.system_fingerprint(client.config, self.options.fingerprint_mode,
                                                          self.options.fingerprint_value)
        self.client = client

    def template_kwargs(self, own: dict[str, Any] | None) -> dict[str, Any] | None:
        """A chat request's template variables over the server's --default-chat-template-kwargs."""
        default = self.options.default_chat_template_kwargs
        return {**default, **(own or {})} if default else own

    def answer_of(self, req: GenerationRequest) -> Answer:
        """What ``req`` asks its answer to show besides the text."""
        return Answer.of(req, self.token_text, self.options.return_tokens_as_token_ids,
                         self.options.force_include_usage, self.options.per_request_metrics,
                         self.system_fingerprint)

    def app(self) -> web.Application:
        """The server's endpoints; with a root path (vLLM's --root-path, for a proxy that serves
        this server under a path) each answers under that path too, as vLLM's does (the path
        taken off before anything looks at it: the API key, tracing, the routes)."""
        app = web.Application(client_max_size=self.options.max_body_bytes,
                              middlewares=[self._middleware, *self.options.middleware])
        app.on_response_prepare.append(self.options.cors.on_prepare)
        self._add_routes(app, self.open_answers)
        if self.options.root_path:
            under = web.Application(client_max_size=self.options.max_body_bytes)
            self._add_routes(under, self.open_answers)
            app.add_subapp(self.options.root_path, under)
        return app

    def _add_routes(self, app: web.Application, answers: dict[str, list[str]]) -> None:
        app[sse.KEEP_ALIVE_S] = self.options.sse_keep_alive_interval
        app[OPEN_ANSWERS] = answers
        routes: list[tuple[str, str, Callable]] = [
            ("GET", "/health", misc.health), ("GET", "/ping", misc.health), ("POST", "/ping", misc.health),
            ("GET", "/version", misc.get_version), ("GET", "/metrics", misc.metrics),
            ("GET", "/debug/engine", misc.debug_engine), *observe.ROUTES,
            ("GET", "/v1/models", misc.models), ("GET", "/v1/models/{model:.+}", misc.model),
            ("POST", "/tokenize", misc.tokenize), ("POST", "/detokenize", misc.detokenize),
            ("POST", "/reset_prefix_cache", misc.reset_prefix_cache),
            ("GET", "/load", misc.load), ("GET", "/kv_event_sources", misc.kv_event_sources),
            ("POST", "/v1/chat/completions", self._loading(chat.chat_completions)),
            ("POST", chat_batch.PATH, self._loading(chat_batch.batch_chat_completions)),
            ("POST", generative_scoring.PATH, self._loading(generative_scoring.generative_scoring)),
            ("POST", "/v1/completions", self._loading(completions.completions)),
            ("POST", "/v1/embeddings", self._loading(embeddings.create_embedding)),
            ("POST", cohere_embed.PATH, self._loading(cohere_embed.create_cohere_embedding)),
            ("POST", "/pooling", self._loading(embeddings.create_pooling)),
            ("POST", "/classify", self._loading(embeddings.create_classification)),
            *(("POST", path, self._loading(scoring.create_score)) for path in scoring.SCORE_PATHS),
            *(("POST", path, self._loading(scoring.create_rerank)) for path in scoring.RERANK_PATHS),
            ("POST", "/v1/responses", self._loading(responses.create_response)),
            ("POST", anthropic.MESSAGES, self._loading(anthropic.create_message)),
            ("POST", anthropic.COUNT_TOKENS, anthropic.count_tokens),
            ("POST", "/invocations", self._loading(misc.invocations)),
            ("POST", speech_to_text.TRANSCRIPTIONS, self._loading(speech_to_text.transcriptions)),
            ("POST", speech_to_text.TRANSLATIONS, self._loading(speech_to_text.translations)),
            ("GET", "/v1/responses/{response_id}", responses.retrieve_response),
            ("DELETE", "/v1/responses/{response_id}", responses.delete_response),
            ("POST", "/v1/responses/{response_id}/cancel", responses.cancel_response),
        ]
        if self.options.enable_tokenizer_info_endpoint:
            routes.append(("GET", "/tokenizer_info", misc.tokenizer_info))
        routes += lora.routes()          # only with VLLM_ALLOW_RUNTIME_LORA_UPDATING, as in vLLM
        routes += [(method, path, self._loading(handler) if path == scale_out.GENERATE else handler)
                   for method, path, handler in scale_out.routes(self.options.enable_scale_out)]
        if control.enabled():            # only with VLLM_SERVER_DEV_MODE, as in vLLM
            routes += control.ROUTES
        elif self.options.tokens_only:    # vLLM's legacy path of a token-in-token-out server
            routes.append(("POST", "/abort_requests", scale_out.abort_requests))
        if self.options.profiling:       # only with --profiler-config, as in vLLM
            routes += control.PROFILE_ROUTES
        if self.inject is not None and faults.enabled():
            routes.append(("POST", "/debug/fault", debug.inject_fault))
        for method, path, handler in routes:
            app.router.add_route(method, path, functools.partial(handler, self))
        dashboard.add_routes(app)
        call_plugins(ENDPOINTS, app.router)     # troupe.endpoints plugins add their routes

    def _loading(self, handler: Callable) -> Callable:
        """``handler``, counted in ``server_load`` (vLLM's GET /load) while it answers."""
        @functools.wraps(handler)
        async def counted(server: OpenAIServer, request: web.Request) -> web.StreamResponse:
            self.server_load += 1
            try:
                return await handler(server, request)
            finally:
                self.server_load -= 1
        return counted

    def route_path(self, request: web.Request) -> str:
        """The path the endpoints answer for: under --root-path, without it."""
        root = self.options.root_path
        if root and len(request.match_info.apps) > 1 and request.path.startswith(root):
            return request.path[len(root):] or "/"
        return request.path

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        if self.options.cors.is_preflight(request):      # no key comes with it (vLLM's order)
            return self.options.cors.preflight(request)
        login: str | None = None
        path = self.route_path(request)
        if self.options.api_key and path.startswith(PROTECTED_PATHS):
            login = self._login(request, path)
            if not (login or self._authorized(request, path)):
                return error_response(401, "invalid or missing API key")
        span = HttpSpan.start(self.tracer, request, path)
        context = otel.trace_headers(request.headers)       # the caller's W3C trace context, if any
        if context is not None and not self._otel_warned and self.client is not None \
                and self.client.config.observability.otlp_traces_endpoint is None:
            self._otel_warned = True
            log.warning("Received a request with trace context but tracing is disabled "
                        "(--otlp-traces-endpoint)")
        token = otel.request_trace_headers.set(context)
        try:
            response = await self._handle(request, handler)
        finally:
            otel.request_trace_headers.reset(token)
            span.end()
        if not response.prepared and "X-Request-Id" not in response.headers:
            response.headers["X-Request-Id"] = request.headers.get("X-Request-Id") or span.request_id()
        if login and not response.prepared:
            response.set_cookie(KEY_COOKIE, login, httponly=True, samesite="Strict", path="/")
        return response

    def _keys(self) -> tuple[str, ...]:
        key = self.options.api_key
        return (key,) if isinstance(key, str) else tuple(key or ())

    def _is_key(self, given: str) -> bool:
        return any([_same(given, key) for key in self._keys()])     # every key compared

    def _authorized(self, request: web.Request, path: str) -> bool:
        """A key as a Bearer token (any of --api-key's); for the dashboard and /debug/* also as
        the cookie that ``_login`` set, since a browser sends no header of its own (EventSource
        included)."""
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and self._is_key(token):
            return True
        if "X-Api-Key" in request.headers:          # how the Anthropic SDK sends its key (/v1/messages)
            return self._is_key(request.headers["X-Api-Key"])
        return not path.startswith("/v1/") and self._is_key(request.cookies.get(KEY_COOKIE, ""))

    def _login(self, request: web.Request, path: str) -> str | None:
        """``GET /dashboard?api_key=KEY``: the page opened from a browser with a key once; the
        answer sets it as an HttpOnly cookie for the page's own requests. The key, when it is one."""
        given = request.query.get("api_key")
        if path == "/dashboard" and given is not None and self._is_key(given):
            return given
        return None

    async def _handle(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        return await self.answer(lambda: handler(request), f"{request.method} {request.path}")

    async def answer(self, call: Callable[[], Awaitable[web.StreamResponse]], what: str) -> web.StreamResponse:
        """``call``'s response, or the OpenAI error response its failure maps to."""
        try:
            return await call()
        except ApiError as exc:
            response, failure = exc.response, exc
        except BadRequest as exc:
            response, failure = error_response(400, str(exc), param=exc.param), exc
        except web.HTTPRequestEntityTooLarge as exc:
            response = error_response(413, f"the request body is larger than {self.options.max_body_bytes} bytes")
            failure = exc
        except web.HTTPException as exc:
            response, failure = error_response(exc.status, exc.reason), exc
        except EngineDeadError as exc:
            response, failure = unavailable(f"the engine is not running: {exc}", exc.retry_after).response, exc
        except Exception:
            log.exception("%s failed", what)
            return error_response(500, "internal error (see the server log)")
        if self.options.log_error_stack:        # vLLM's --log-error-stack: where the error came from
            log.error("%s answered %d", what, response.status, exc_info=failure)
        return response

    # -- what the endpoints share --------------------------------------------------------------
    def engine(self) -> EngineClient:
        """The engine client; 503 while the model is still loading."""
        if self.client is None:
            raise server_error(503, "the model is loading; try again shortly")
        return self.client

    async def read(self, request: web.Request, typ: type) -> Any:
        """Decode and type-check the JSON body; 404 for a model this server does not serve (by
        none of its --served-model-name names). A generation request gets the server's
        defaults (--max-logprobs, --generation-config) attached."""
        return self.decode(await request.read(), typ)

    def decode(self, body: bytes, typ: type) -> Any:
        """``read`` for a body already in hand (the batch runner's)."""
        client = self.engine()
        req = decode_body(body, typ, self.options.lenient)
        if req.model is not None and req.model not in client.model_names and req.model not in client.lora_requests:
            raise not_found(f"The model `{req.model}` does not exist.", "model")
        if isinstance(req, GenerationRequest):
            req.with_server_defaults(self.request_defaults)
        return req

    async def check_grammar(self, req: GenerationRequest, params: SamplingParams) -> None:
        """A request with structured outputs: its grammar compiled before it is admitted; 400
        naming the request field that asked when it cannot be."""
        if params.structured_outputs is not None:
            await self.check_grammar_spec(params.structured_outputs, req.constraint().param)

    async def check_grammar_spec(self, spec: StructuredOutputsParams, param: str) -> None:
        """``spec``'s grammar compiled; 400 naming ``param`` when it cannot be."""
        if not self.has_text:
            raise bad_request("Structured outputs requires a tokenizer so it can't be used with "
                              "'skip_tokenizer_init'", param)
        try:
            await self.engine().check_grammar(spec)
        except InvalidGrammar as exc:
            raise bad_request(f"invalid {param}: {exc}", param) from None

    async def submit(self, params: Any, **kwargs: Any) -> RequestHandle:
        """Admit one engine request, mapping refusals to OpenAI errors. Without a timeout of
        its own, a request gets the server's (``--request-timeout``)."""
        if kwargs.get("timeout_s") is None:
            kwargs["timeout_s"] = self.options.request_timeout or None
        kwargs["stream_interval"] = max(kwargs.get("stream_interval") or 1, self.options.stream_interval)
        if self.pooling and params.pooling is None:
            raise not_found("The model does not support generation: it is a pooling model (--runner pooling), "
                            "served at /pooling and, as its tasks allow, /v1/embeddings, /classify, /score and "
                            "/rerank")
        if params.thinking_token_budget is not None and not self.engine().thinking_budgets:
            raise bad_request(NO_REASONING_CONFIG, "thinking_token_budget")
        if not self.has_text:            # --skip-tokenizer-init: the field named
            for name, given in (("stop", params.stop), ("bad_words", params.bad_words)):
                if given:
                    raise bad_request(f"{name} is not supported with --skip-tokenizer-init (there is no text to "
                                      f"read it in){': use stop_token_ids' if name == 'stop' else ''}", name)
        try:
            handle = await self.engine().submit(params, **kwargs)
            if self.options.log_requests:
                self._log_request(handle, params, kwargs.get("prompt"))
            return handle
        except InvalidPrompt as exc:
            raise bad_request(str(exc), "messages" if kwargs.get("messages") is not None else "prompt") from None
        except Overloaded as exc:
            raise unavailable(str(exc), exc.retry_after) from None
        except EngineDeadError as exc:
            raise unavailable(f"the engine is not running: {exc}", exc.retry_after) from None
        except RemoteError as exc:
            if exc.error_type == "ActorDied":        # the engine died while admitting it
                raise unavailable(f"the engine is not running: {exc.message}", None) from None
            log.error("admitting a request failed: %s", exc)
            raise server_error(500, f"the request could not be admitted: {exc.message}") from None


    def _log_request(self, handle: RequestHandle, params: SamplingParams, prompt: Any) -> None:
        """--enable-log-requests: its INFO line; at DEBUG its prompt; with --enable-log-outputs
        its output once it finishes."""
        log.info("request %s: %d prompt tokens, %s", handle.request_id, handle.num_prompt_tokens,
                 params_summary(params))
        max_len = self.options.max_log_len
        if log.isEnabledFor(logging.DEBUG):
            text = prompt if isinstance(prompt, str) else self.engine().tokenizer.decode(handle.prompt_token_ids)
            request_log.prompt_line(handle.request_id, text, handle.prompt_token_ids, max_len)
        if self.options.log_outputs:
            handle.output_log = request_log.OutputLog(handle.request_id, max_len, self.options.log_deltas)


def params_summary(params: SamplingParams) -> str:
    """The sampling parameters a request set (those not at their defaults), for the request log."""
    fields = msgspec.structs.asdict(params)
    default = SamplingParams()
    shown = {k: v for k, v in fields.items() if v != getattr(default, k) and k != "bad_words_token_ids"}
    if "structured_outputs" in shown:
        shown["structured_outputs"] = params.structured_outputs.kind()
    return "params: " + ", ".join(f"{k}={v!r}" for k, v in shown.items()) if shown else "default params"


def unavailable(message: str, retry_after: float | None) -> ApiError:
    """503, with ``Retry-After`` (whole seconds) when the engine should be back by then."""
    err = server_error(503, message)
    if retry_after is not None:
        err.response.headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    return err
