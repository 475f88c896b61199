"""``troupe serve [MODEL]`` (or ``python -m tools.serve``): the OpenAI-compatible server on the
default (or given) model, with vLLM's flags (``vllm serve``'s command line runs unchanged; the
vLLM flags Troupe does not implement are refused by name: tools/vllm_flags.py).

Three processes: this one (HTTP frontend, tokenizer, detokenizer), the engine core
(scheduler, KV manager, executor) and the worker (model runner). Ctrl-C or SIGTERM stops taking
requests, ends the running ones with an error (or, with ``--shutdown-timeout N``, lets them
finish for up to N seconds first) and stops all three; a second one stops at once."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import ssl
import sys
from typing import Any

from actors import topology
from actors.engine.args import EngineArgs, at_least
from actors.frontend.cors import CorsPolicy
from actors.frontend.middleware import load_middleware
from actors.frontend.misc import FINGERPRINT_MODES
from actors.frontend.stats import PREFIXES, parse_prefixes
from actors.frontend.tls import TlsFiles
from actors.frontend.tool_parsers import TOOL_PARSERS, ToolParserManager
from actors.frontend.tools import TOOL_STRICT_LEVELS
from actors.frontend.reasoning import REASONING_PARSERS, ReasoningParserManager
from actors.grammar.config import structured_outputs_config
from actors.engine import vllm_env
from actors.engine.profiler import profiler_config
from actors.runtime import heap, logs
from actors.runtime.plugins import load_general_plugins
from tools import config_file
from tools.config_file import add_config_flag
from tools.vllm_flags import add_vllm_flags

log = logging.getLogger("troupe.serve")

SERVE_MAX_WAITING_REQUESTS = 256
SERVE_MAX_WAITING_TOKENS = 262_144      # about two minutes of prefill on a 2-core CPU


LOG_LEVELS = ("debug", "info", "warning", "error", "critical", "trace")   # vLLM's --uvicorn-log-level


def _uvicorn_level(text: str) -> str:
    """vLLM's --uvicorn-log-level as a Python logging level ("trace" is DEBUG here)."""
    level = text.lower()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(LOG_LEVELS)})")
    return "DEBUG" if level == "trace" else level.upper()


_uvicorn_level.__name__ = "level"


def parse_args(argv: list[str] | None = None, prog: str = "python -m tools.serve") -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog, description="The OpenAI-compatible server, with vLLM's flags: a `vllm serve` command "
                              "line runs as `troupe serve` unchanged.",
        epilog="vLLM's flags that Troupe does not implement (e.g. --decode-context-parallel-size) are refused, "
               "each naming itself, with exit code 2.")
    p.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                   help="the model, as --model takes it (vLLM's `vllm serve MODEL`)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--uds", default=None, metavar="PATH",
                   help="vLLM's: listen on this Unix domain socket instead of --host and --port")
    p.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (any of the keys given) on /v1/*, /invocations, "
                        "/debug/* and /dashboard (default: $VLLM_API_KEY when set, as in vLLM)")
    p.add_argument("--headless", action="store_true",
                   help="vLLM's: run engine cores only, no HTTP server: --data-parallel-size-local of them "
                        "from rank --data-parallel-start-rank, joining the server at --data-parallel-address:"
                        "--data-parallel-rpc-port; or, with --nnodes and --node-rank, this machine's share of "
                        "the worker ranks, joining the engine core at --master-addr:--master-port (started "
                        "with the same model and flags)")
    p.add_argument("--lenient", action="store_true",
                   help="accept (and log) unknown request fields instead of answering 400")
    p.add_argument("--request-timeout", type=float, default=0.0, metavar="SECONDS",
                   help="abort a request (freeing its KV cache) that has not finished this long after "
                        "it arrived; 0: no limit (a request may set its own, request_timeout)")
    p.add_argument("--api-server-count", "-asc", type=at_least(int, 1), default=1, metavar="N",
                   help="vLLM's: N API server processes accepting on the same socket, each with its own "
                        "tokenizer and detokenizer (the HTTP and text work of a busy server over N event loops); "
                        "they share the engine cores, /metrics, LoRA adapters and stored responses")
    p.add_argument("--shutdown-timeout", type=at_least(float, 0.0), default=0.0, metavar="SECONDS",
                   help="vLLM's: on SIGTERM, stop taking requests and let the running ones finish this "
                        "long, then end the rest with an error; 0 (vLLM's default): end them at once")
    p.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=False,
                   help='tool_choice "auto" (the default when a request has tools): tool calls read out of '
                        "the model's text with --tool-call-parser")
    p.add_argument("--return-tokens-as-token-ids", action=argparse.BooleanOptionalAction, default=False,
                   help="log-prob tokens read 'token_id:N' (vLLM's flag; a request's return_tokens_as_token_ids "
                        "field decides for itself)")
    p.add_argument("--trust-request-chat-template", action=argparse.BooleanOptionalAction, default=False,
                   help="a chat request may bring its own chat_template (vLLM's flag: off, such a request is refused)")
    p.add_argument("--enable-tokenizer-info-endpoint", action=argparse.BooleanOptionalAction, default=False,
                   help="serve GET /tokenizer_info: the tokenizer's configuration and chat template (vLLM's flag: off)")
    p.add_argument("--enable-scale-out", action=argparse.BooleanOptionalAction, default=False,
                   help="serve vLLM's scale-out endpoints: /v1/chat/completions/render, /v1/completions/render "
                        "(a request as token ids and sampling parameters), /inference/v1/generate (token ids in, "
                        "token ids out), /inference/v1/abort_requests and the /derender ones (token ids back to "
                        "the OpenAI answer) (vLLM's flag: off, they answer 403)")
    p.add_argument("--middleware", action="append", default=[], metavar="IMPORT_PATH",
                   help="vLLM's: an extra middleware for the HTTP server (repeatable), by import path "
                        "(package.module.name): an aiohttp middleware, async (request, handler) -> response, "
                        "or a class whose instances are one; run inside the server's own, in the order given")
    p.add_argument("--tokens-only", action=argparse.BooleanOptionalAction, default=False,
                   help="vLLM's: a token-in-token-out server: no tokenizer (--skip-tokenizer-init), the "
                        "scale-out endpoints served (/inference/v1/generate answering token ids), and "
                        "POST /abort_requests")
    p.add_argument("--default-chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                   help="vLLM's: chat template variables for every chat request, e.g. '{\"enable_thinking\": "
                        "false}'; a request's chat_template_kwargs override them")
    p.add_argument("--stream-interval", type=at_least(int, 1), default=1, metavar="N",
                   help="vLLM's: after a request's first token, its outputs go out N new tokens at a time "
                        "(fewer, larger stream chunks); a request's stream_interval may raise it")
    p.add_argument("--sse-keep-alive-interval", type=at_least(int, 0), default=0, metavar="SECONDS",
                   help="vLLM's: a streamed completion that has sent nothing for this long (queued, in "
                        "prefill, between tokens) sends an SSE comment line, so proxies with read timeouts "
                        "keep the connection; 0: never")
    p.add_argument("--tool-strict-level", default="auto", choices=TOOL_STRICT_LEVELS,
                   help="vLLM's: how tool_choice \"auto\" calls are held to the --tool-call-parser's format "
                        "(hermes, llama3_json, qwen3_coder): auto, only where a tool is \"strict\": true (its "
                        "arguments then follow its schema) or parallel_tool_calls is false; function, every "
                        "call is a well-formed call of a known function; parameter, and every call's arguments "
                        "follow the tool's schema")
    p.add_argument("--tool-call-parser", default=None, metavar="{" + ",".join(sorted(TOOL_PARSERS)) + "}",
                   help="the model's tool-call format: hermes (<tool_call>{...}</tool_call>: Hermes, "
                        "Qwen2.5, Qwen3), llama3_json ({\"name\": ..., \"parameters\": ...}), pythonic "
                        "([name(key=value), ...]: Llama 3.2 and 4), llama4_pythonic, mistral ([TOOL_CALLS]...), "
                        "qwen3_coder (<function=NAME><parameter=KEY>...: Qwen3-Coder, typed by the tools' schemas), "
                        "openai (gpt-oss's harmony messages to functions.NAME), or one a "
                        "--tool-parser-plugin registers")
    p.add_argument("--tool-parser-plugin", default="", metavar="FILE",
                   help="vLLM's: a Python file run at start-up that registers tool parsers "
                        "(ToolParserManager.register_module in actors.frontend.tool_parsers), which "
                        "--tool-call-parser may then name")
    p.add_argument("--reasoning-parser", default=None, metavar="{" + ",".join(sorted(REASONING_PARSERS)) + "}",
                   help="split a thinking model's output into the message's reasoning (between <think> and "
                        "</think>) and content: deepseek_r1 (the template opens the thinking) or qwen3 (the "
                        "model opens it), openai_gptoss (gpt-oss's harmony analysis channel), or one a "
                        "--reasoning-parser-plugin registers; the tokenizer must have both tags as tokens")
    p.add_argument("--reasoning-parser-plugin", default="", metavar="FILE",
                   help="vLLM's: a Python file run at start-up that registers reasoning parsers "
                        "(ReasoningParserManager.register_module in actors.frontend.reasoning), which "
                        "--reasoning-parser may then name")
    p.add_argument("--response-role", default="assistant", metavar="ROLE",
                   help="vLLM's: the role of a chat answer's message when the request adds the generation "
                        "prompt (add_generation_prompt, the default); otherwise the last message's role")
    p.add_argument("--enable-force-include-usage", action=argparse.BooleanOptionalAction, default=False,
                   help="vLLM's: every streamed chat or text completion sends its usage, in each chunk and "
                        "in a last chunk of its own, whatever its stream_options say")
    p.add_argument("--enable-per-request-metrics", action=argparse.BooleanOptionalAction, default=False,
                   help="vLLM's: a one-choice chat or text completion answer (or a stream's last, usage chunk) "
                        "holds metrics: its time to first token (from its first scheduling), generation time, "
                        "time in the queue, mean inter-token latency and tokens per second, in milliseconds")
    p.add_argument("--fingerprint-mode", choices=FINGERPRINT_MODES, default="full",
                   help="vLLM's: every answer's system_fingerprint: full, troupe-VERSION[-tpN-ppN-dpN-ep]-HASH8 "
                        "(HASH8 changes with what decides the outputs: the model as named, dtype, quantization, "
                        "context length, KV cache dtype, speculative decoding, compilation, LoRA, parallelism); "
                        "hash, without the parallel layout; custom, --fingerprint-value; none, no fingerprint")
    p.add_argument("--fingerprint-value", default=None, metavar="TEXT",
                   help="vLLM's: the fingerprint with --fingerprint-mode custom")
    p.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="log each request at INFO once admitted: its id, prompt tokens and the sampling "
                        "parameters it set; at DEBUG also its prompt and prompt token ids (default: off, "
                        "as in vLLM)")
    p.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                   help="vLLM's older flag: do not log each request (the default)")
    p.add_argument("--enable-log-outputs", action=argparse.BooleanOptionalAction, default=False,
                   help="vLLM's: with --enable-log-requests, log each request's output text and finish "
                        "reason at INFO when it finishes (its token ids at DEBUG)")
    p.add_argument("--root-path", type=_root_path, default="", metavar="PATH",
                   help="vLLM's: for a proxy that serves this server under PATH (\"/api\"): every endpoint also "
                        "answers under it (/api/v1/models as /v1/models), and the dashboard's page its own "
                        "requests")
    p.add_argument("--enable-log-deltas", action=argparse.BooleanOptionalAction, default=True,
                   help="vLLM's: with --enable-log-outputs, a streamed request's output is also logged delta "
                        "by delta as it is sent (default: on; --no-enable-log-deltas: only when it ends)")
    p.add_argument("--log-error-stack", action=argparse.BooleanOptionalAction, default=False,
                   help="vLLM's: log the stack trace of every error response (4xx included)")
    p.add_argument("--exclude-tools-when-tool-choice-none", action=argparse.BooleanOptionalAction, default=False,
                   help="vLLM's: a chat request with tool_choice \"none\" renders its prompt without its tools "
                        "(by default the template sees them; the model is told not to call them)")
    p.add_argument("--max-log-len", type=at_least(int, 0), default=None, metavar="N",
                   help="vLLM's: the most characters of a prompt or an output, and the most token ids, the "
                        "request log shows (default: all)")
    p.add_argument("--metrics-prefix", type=_prefixes, default=PREFIXES, metavar="PREFIXES",
                   help="the name prefixes /metrics writes, a comma list of vllm (the metrics vLLM has, "
                        "under vLLM's names) and troupe (those and Troupe's own) (default: vllm,troupe)")
    p.add_argument("--log-level", default=None,
                   help="every process's log level (default: $TROUPE_LOG_LEVEL, else INFO)")
    p.add_argument("--uvicorn-log-level", dest="log_level", type=_uvicorn_level, default=argparse.SUPPRESS,
                   metavar="{" + ",".join(LOG_LEVELS) + "}", help="vLLM's name for --log-level (trace: debug)")
    p.add_argument("--log-config-file", default=None, metavar="FILE.json",
                   help="vLLM's: a logging configuration (Python's logging.config.dictConfig schema, as JSON) "
                        "every process of the server configures itself from, instead of its log lines")
    p.add_argument("--disable-access-log-for-endpoints", default=None, metavar="PATHS",
                   help="vLLM's: accepted and changes nothing (Troupe writes no access log)")
    p.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction, default=False,
                   help="accepted for vLLM's command lines; Troupe runs no code from checkpoints")
    http = p.add_argument_group("browsers and HTTPS (vLLM's flags and defaults)")
    http.add_argument("--allowed-origins", type=_json_strings, default=[], metavar="JSON",
                      help="the origins whose pages may call the server from a browser (CORS), a JSON list, "
                          "e.g. '[\"https://app.example\"]' or '[\"*\"]' (default: none)")
    http.add_argument("--allowed-methods", type=_json_strings, default=["*"], metavar="JSON",
                      help="the methods those pages may use, a JSON list (default: [\"*\"], all)")
    http.add_argument("--allowed-headers", type=_json_strings, default=["*"], metavar="JSON",
                      help="the request headers those pages may send, a JSON list (default: [\"*\"], all)")
    http.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=False,
                      help="let those pages send cookies and HTTP authentication")
    http.add_argument("--ssl-certfile", default=None, metavar="FILE",
                      help="serve HTTPS with this certificate (PEM; the chain after it)")
    http.add_argument("--ssl-keyfile", default=None, metavar="FILE",
                      help="the certificate's private key (PEM; default: in --ssl-certfile)")
    http.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                      help="the CA certificates that clients' certificates are checked against")
    http.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE), metavar="N",
                      help="whether clients must show a certificate: 0 no, 1 optional, 2 required "
                          "(Python's ssl.CERT_*; needs --ssl-ca-certs)")
    http.add_argument("--ssl-ciphers", default=None, metavar="CIPHERS",
                      help="the cipher suites for TLS 1.2 and older (OpenSSL's cipher list format)")
    http.add_argument("--enable-ssl-refresh", action=argparse.BooleanOptionalAction, default=False,
                      help="load the certificate, key and CA files again when they change, without a "
                          "restart (new connections get them)")
    # a server bounds its queue (the offline API queues whatever it is given)
    EngineArgs.add_cli_args(p, max_waiting_requests=SERVE_MAX_WAITING_REQUESTS,
                           max_waiting_tokens=SERVE_MAX_WAITING_TOKENS)
    add_config_flag(p)
    add_vllm_flags(p)
    args = config_file.parse_args(p, argv)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            p.error(f"the model is given twice, and differently: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.tool_parser_plugin:
        try:
            ToolParserManager.import_tool_parser(args.tool_parser_plugin)
        except ValueError as exc:
            p.error(str(exc))
    if args.reasoning_parser_plugin:
        try:
            ReasoningParserManager.import_reasoning_parser(args.reasoning_parser_plugin)
        except ValueError as exc:
            p.error(str(exc))
    if args.reasoning_parser is not None and args.reasoning_parser not in REASONING_PARSERS:
        p.error(f"argument --reasoning-parser: invalid choice: {args.reasoning_parser!r} (choose from "
                f"{', '.join(sorted(REASONING_PARSERS))})")
    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_PARSERS:
        p.error(f"invalid tool call parser: {args.tool_call_parser} (choose from "
                f"{{ {','.join(sorted(TOOL_PARSERS))} }})")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        p.error("--enable-auto-tool-choice requires --tool-call-parser")
    try:
        args.middleware = tuple(load_middleware(path) for path in args.middleware)
    except ValueError as exc:
        p.error(str(exc))
    if args.tokens_only:                # vLLM's: no tokenizer, and the token-in-token-out endpoints served
        args.skip_tokenizer_init = args.enable_scale_out = True
    if args.skip_tokenizer_init:
        for flag, given in (("--reasoning-parser", args.reasoning_parser), ("--enable-auto-tool-choice",
                           args.enable_auto_tool_choice), ("--chat-template", args.chat_template)):
            if given:
                p.error(f"{flag} reads text, and --skip-tokenizer-init loads no tokenizer")
    args.api_key = tuple(args.api_key) if args.api_key else (
        (os.environ["VLLM_API_KEY"],) if os.environ.get("VLLM_API_KEY") else None)
    args.log_level = (args.log_level or os.environ.get(logs.LEVEL_ENV) or os.environ.get("VLLM_LOGGING_LEVEL")
                      or "INFO").upper()
    if args.log_config_file is None and os.environ.get("VLLM_LOGGING_CONFIG_PATH"):
        args.log_config_file = os.environ["VLLM_LOGGING_CONFIG_PATH"]           # vLLM's variable
    if args.log_config_file is not None:
        try:
            logs.load_config(args.log_config_file)
        except ValueError as exc:
            p.error(str(exc))
    if args.enable_log_outputs and not args.enable_log_requests:
        p.error("--enable-log-outputs requires --enable-log-requests")
    if args.enable_per_request_metrics and args.disable_log_stats:
        p.error("--enable-per-request-metrics requires engine statistics logging; remove --disable-log-stats "
                "to enable per-request metrics.")
    if args.fingerprint_mode == "custom" and not args.fingerprint_value:
        p.error("--fingerprint-mode custom needs --fingerprint-value")
    try:
        args.tls = TlsFiles.of(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs,
                              args.ssl_ciphers)
    except ValueError as exc:
        p.error(str(exc))
    if args.enable_ssl_refresh and args.tls is None:
        p.error("--enable-ssl-refresh needs --ssl-certfile")
    if args.nnodes > 1 and args.node_rank > 0 and not args.headless:
        p.error(f"--node-rank {args.node_rank}: the machines past node rank 0 run their share of the worker "
                "ranks for the server of node rank 0, and no server of their own: add --headless")
    if args.headless and (args.data_parallel_hybrid_lb or args.data_parallel_rank is not None):
        p.error("--headless runs engine cores for a server elsewhere; external (--data-parallel-rank) and hybrid "
                "(--data-parallel-hybrid-lb) load balancing give every machine a server of its own")
    if args.headless and args.nnodes > 1 and args.node_rank == 0:
        p.error("--headless --nnodes: give this machine's --node-rank (node rank 0 runs the server, "
                "without --headless)")
    if args.headless and args.nnodes == 1 and not args.data_parallel_size_local:
        p.error("--headless runs some of a server's data-parallel engine cores on this machine (give "
                "--data-parallel-size, --data-parallel-size-local, --data-parallel-start-rank and "
                "--data-parallel-address), or some of its worker ranks (give --nnodes, --node-rank, "
                "--master-addr and --master-port)")
    if args.data_parallel_start_rank and not (args.headless or args.data_parallel_hybrid_lb):
        p.error("--data-parallel-start-rank: with --headless, the first rank this machine runs for the server "
                "of --data-parallel-address; with --data-parallel-hybrid-lb, the first rank this machine's own "
                "server balances (vLLM's hybrid load balancing)")
    if args.kv_cache_bytes is not None and args.kv_cache_memory_bytes is not None:
        p.error("give --kv-cache-gib or --kv-cache-memory-bytes, not both")
    if args.headless and args.api_server_count > 1:
        p.error("--api-server-count: a --headless machine runs no API server")
    try:                # vLLM's structured outputs config may name the reasoning parser
        named = structured_outputs_config(args.structured_outputs_config).reasoning_parser
    except ValueError as exc:
        p.error(str(exc))
    if named:
        if named not in REASONING_PARSERS:
            p.error(f"--structured-outputs-config: reasoning_parser {named!r} is not one of "
                    f"{', '.join(sorted(REASONING_PARSERS))}")
        if args.reasoning_parser not in (None, named):
            p.error(f"--reasoning-parser {args.reasoning_parser} and --structured-outputs-config's "
                    f"reasoning_parser {named} disagree")
        args.reasoning_parser = named
    try:
        args.profiling = profiler_config(args.profiler_config).enabled
        vllm_env.check()
    except ValueError as exc:
        p.error(str(exc))
    args.argv = list(argv if argv is not None else sys.argv[1:])     # for the other API servers
    return args


def _root_path(text: str) -> str:
    """"/api" (a trailing slash dropped); "" or "/": none."""
    path = text.rstrip("/")
    if path and (not path.startswith("/") or "//" in path or any(c in path for c in "?#{}")):
        raise argparse.ArgumentTypeError(f"a root path is an absolute URL path such as /api, got {text!r}")
    return path


_root_path.__name__ = "root path"


def _prefixes(text: str) -> tuple[str, ...]:
    try:
        return parse_prefixes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_prefixes.__name__ = "prefixes"


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object is required")
    return value


_json_object.__name__ = "JSON object"


def _json_strings(text: str) -> list[str]:
    """vLLM's --allowed-origins (and methods, headers): a JSON list of strings."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError('a JSON list of strings is required, e.g. \'["*"]\'')
    return value


_json_strings.__name__ = "JSON list"



def server_options(args: argparse.Namespace) -> Any:
    """The HTTP server's options from the parsed command line."""
    from actors.frontend.app import ServerOptions
    return ServerOptions(args.api_key, args.lenient, args.request_timeout,
                         enable_auto_tool_choice=args.enable_auto_tool_choice,
                         tool_call_parser=args.tool_call_parser,
                         tool_strict_level=args.tool_strict_level,
                         log_requests=args.enable_log_requests,
                         metrics_prefixes=args.metrics_prefix,
                         return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                         trust_request_chat_template=args.trust_request_chat_template,
                         enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                         enable_scale_out=args.enable_scale_out,
                         tokens_only=args.tokens_only,
                         middleware=args.middleware,
                         default_chat_template_kwargs=args.default_chat_template_kwargs,
                         stream_interval=args.stream_interval,
                         sse_keep_alive_interval=args.sse_keep_alive_interval,
                         reasoning_parser=args.reasoning_parser,
                         cors=CorsPolicy(tuple(args.allowed_origins),
                                         tuple(args.allowed_methods),
                                         tuple(args.allowed_headers),
                                         args.allow_credentials),
                         response_role=args.response_role,
                         force_include_usage=args.enable_force_include_usage,
                         log_outputs=args.enable_log_outputs,
                         max_log_len=args.max_log_len,
                         log_deltas=args.enable_log_deltas,
                         log_error_stack=args.log_error_stack,
                         exclude_tools_when_tool_choice_none=(
                             args.exclude_tools_when_tool_choice_none),
                         root_path=args.root_path, profiling=args.profiling,
                         per_request_metrics=args.enable_per_request_metrics,
                         fingerprint_mode=args.fingerprint_mode,
                         fingerprint_value=args.fingerprint_value)


async def serve(args: argparse.Namespace) -> int:
    """Listen first (probes answer 503 while the model loads), then load and serve."""
    load_general_plugins()             # before anything else (a PluginError ends start-up, naming it)
    if args.headless:                  # engine cores or worker ranks only, for a server on another machine
        from actors.frontend.launch import READY_TIMEOUT_S
        config = EngineArgs.from_cli_args(args).create_engine_config()
        if config.parallel.nnodes > 1:
            from actors.engine.multinode import run_rank_host
            return await run_rank_host(config, READY_TIMEOUT_S)
        from actors.frontend.headless import run_headless
        return await run_headless(config, READY_TIMEOUT_S)
    from actors.frontend.actor import GetAddress, HttpFrontend
    from actors.frontend.app import OpenAIServer
    from actors.frontend.launch import READY_TIMEOUT_S, create_frontend
    fe = create_frontend(multiprocess=True)
    loop = asyncio.get_running_loop()
    stop_asked = asyncio.Event()

    def on_signal() -> None:
        """The first signal drains (once serving), the next stops at once."""
        if stop_asked.is_set() or fe.client is None:
            fe.node.closed.done() or fe.node.closed.set_result(0)
        stop_asked.set()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        server = OpenAIServer(options=server_options(args),
                             telemetry=lambda: fe.telemetry, inject=fe.inject_fault, tracer=fe.node.tracer)
        tls = args.tls
        ssl_context = tls.context() if tls is not None else None       # a file that cannot load: stop here
        http = await fe.node.start(topology.HTTP, lambda: HttpFrontend(
            server, args.host, args.port, ssl_context, tls if args.enable_ssl_refresh else None, args.uds,
            reuse_port=args.api_server_count > 1 and not args.uds))
        addr = await http.ask(GetAddress())
        print(f"Troupe listening on {addr.url} (loading the model)", flush=True)
        config = EngineArgs.from_cli_args(args).create_engine_config()
        defaults = config.model.sampling_defaults.as_dict()
        if defaults:
            log.warning("requests that leave them unset get the generation config's defaults %s "
                        "(--generation-config vllm ignores it)", defaults)
        loading = asyncio.ensure_future(fe.start(config, telemetry=True))
        await asyncio.wait([loading, fe.node.closed], return_when=asyncio.FIRST_COMPLETED)
        if not loading.done():          # a signal during loading
            loading.cancel()
            return fe.node.closed.result()
        server.attach(loading.result())
        if args.api_server_count > 1:      # the other API servers, on the same sockets
            from actors.frontend.api_servers import ApiServers
            sockets = fe.node.cells[topology.HTTP].actor.listening_sockets()
            others = ApiServers(fe, server, args.api_server_count, args.argv, sockets,
                                *(() if args.uds else (args.host, addr.port)))
            starting = asyncio.ensure_future(others.start(READY_TIMEOUT_S))
            await asyncio.wait([starting, fe.node.closed], return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                starting.cancel()
                return fe.node.closed.result()
            starting.result()
        pids = fe.engine_processes
        engines = (f"engine pid {pids[0].pid}" if list(pids) == [0] else
                   "engine pids " + ", ".join(f"{r}: {p.pid}" for r, p in sorted(pids.items())))
        log.info("serving %s as %s on %s (%s)", config.model.source.served_name,
                 ", ".join(fe.client.model_names), addr.url, engines)
        if fe.api_servers is not None:
            log.info("%d API servers (pids %s) accept on %s", args.api_server_count,
                     ", ".join(str(p) for p in [os.getpid(), *(c.pid for _, c in sorted(fe.api_servers.children.items()))]),
                     addr.url)
        heap.started()
        print(f"Troupe ready on {addr.url}", flush=True)
        draining = asyncio.ensure_future(drain(stop_asked, fe, args.shutdown_timeout))
        code = await fe.node.closed
        draining.cancel()
        if code:
            await asyncio.sleep(1.0)   # let error responses reach their clients
            log.error("shutting down with exit code %d", code)
        return code
    finally:
        await fe.shutdown()


async def drain(stop_asked: asyncio.Event, fe: Any, timeout: float) -> None:
    """Once a stop is asked: take no new request (503), let the running ones finish for up to
    ``timeout`` seconds, fail the rest with a clear error, then stop the node (exit code 0)."""
    from actors.frontend.api_servers import drain_client
    await stop_asked.wait()
    client = fe.client
    log.info("stopping: no new requests; %d running get up to %g s to finish", client.num_open, timeout)
    reason = "the server is shutting down"
    others = fe.api_servers.drain(reason, timeout) if fe.api_servers is not None else asyncio.sleep(0)
    left, _ = await asyncio.gather(drain_client(client, reason, timeout), others)
    if left:
        log.warning("stopping: %d requests did not finish within %g s; they ended with an error", left, timeout)
    fe.node.closed.done() or fe.node.closed.set_result(0)


async def api_server_entry(node: Any, payload: bytes) -> Any:
    """The entry of API server 1, 2, ... (--api-server-count), a child node of the server: its
    command line parsed again for the same HTTP options, then its side of the engine cores
    (actors/frontend/api_servers.py)."""
    import msgspec
    from actors.frontend.api_servers import ApiServerSpec, start_api_server
    from actors.frontend.app import OpenAIServer
    spec = msgspec.msgpack.decode(payload, type=ApiServerSpec)
    args = parse_args(spec.argv)
    tls = args.tls
    server = OpenAIServer(options=server_options(args), tracer=node.tracer)
    return await start_api_server(node, spec, server, tls.context() if tls is not None else None,
                                  tls if tls is not None and args.enable_ssl_refresh else None)


def main(argv: list[str] | None = None, prog: str = "python -m tools.serve") -> None:
    heap.starting()
    args = parse_args(argv, prog)
    os.environ[logs.LEVEL_ENV] = args.log_level                  # the engine's and workers' too
    if args.log_config_file is not None:
        os.environ[logs.CONFIG_ENV] = os.path.abspath(os.path.expanduser(args.log_config_file))
    # a headless machine runs no frontend: its lines are its own node's
    logs.configure(("ranks" if args.nnodes > 1 else "headless") if args.headless else "frontend", args.log_level)
    if args.trust_remote_code:
        log.warning("--trust-remote-code is accepted and changes nothing: Troupe runs no code from checkpoints")
    import uvloop
    try:
        code = uvloop.run(serve(args))
    except Exception as exc:  # start-up failures: one clear line, non-zero exit
        log.debug("start-up failed", exc_info=True)
        print(f"troupe: error: {exc}", file=sys.stderr)
        code = 1
    heap.exiting()
    sys.exit(code)


if __name__ == "__main__":
    main()
