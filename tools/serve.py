"""``python -m tools.serve``: the OpenAI-compatible server on the default (or given) model.

Three processes: this one (HTTP frontend, tokenizer, detokenizer), the engine core
(scheduler, KV manager, executor) and the worker (model runner). Ctrl-C or SIGTERM stops taking
requests, lets the running ones finish (``--shutdown-timeout``) and stops all three; a second
one stops at once."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from typing import Any

from actors import topology
from actors.engine.args import EngineArgs
from actors.frontend.tool_parsers import TOOL_PARSERS

log = logging.getLogger("troupe.serve")

SERVE_MAX_WAITING_REQUESTS = 256
SERVE_MAX_WAITING_TOKENS = 262_144      # about two minutes of prefill on a 2-core CPU


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.serve", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--lenient", action="store_true",
                   help="accept (and log) unknown request fields instead of answering 400")
    p.add_argument("--request-timeout", type=float, default=0.0, metavar="SECONDS",
                   help="abort a request (freeing its KV cache) that has not finished this long after "
                        "it arrived; 0: no limit (a request may set its own, request_timeout)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, stop taking requests and let running ones finish this long, "
                        "then abort the rest")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto" (the default when a request has tools): tool calls read out of '
                        "the model's text with --tool-call-parser")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the model's tool-call format: hermes (<tool_call>{...}</tool_call>: Hermes, "
                        "Qwen2.5), llama3_json ({\"name\": ..., \"parameters\": ...})")
    p.add_argument("--log-level", default="INFO")
    # a server bounds its queue (the offline API queues whatever it is given)
    EngineArgs.add_cli_args(p, max_waiting_requests=SERVE_MAX_WAITING_REQUESTS,
                            max_waiting_tokens=SERVE_MAX_WAITING_TOKENS)
    args = p.parse_args(argv)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        p.error("--enable-auto-tool-choice requires --tool-call-parser")
    return args


async def serve(args: argparse.Namespace) -> int:
    """Listen first (probes answer 503 while the model loads), then load and serve."""
    from actors.frontend.actor import GetAddress, HttpFrontend
    from actors.frontend.app import OpenAIServer, ServerOptions
    from actors.frontend.launch import create_frontend
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
        server = OpenAIServer(options=ServerOptions(args.api_key, args.lenient, args.request_timeout,
                                                    enable_auto_tool_choice=args.enable_auto_tool_choice,
                                                    tool_call_parser=args.tool_call_parser),
                              telemetry=lambda: fe.telemetry, inject=fe.inject_fault, tracer=fe.node.tracer)
        http = await fe.node.start(topology.HTTP, lambda: HttpFrontend(server, args.host, args.port))
        addr = await http.ask(GetAddress())
        print(f"Troupe listening on http://{addr.host}:{addr.port} (loading the model)", flush=True)
        config = EngineArgs.from_cli_args(args).create_engine_config()
        loading = asyncio.ensure_future(fe.start(config, telemetry=True))
        await asyncio.wait([loading, fe.node.closed], return_when=asyncio.FIRST_COMPLETED)
        if not loading.done():          # a signal during loading
            loading.cancel()
            return fe.node.closed.result()
        server.attach(loading.result())
        log.info("serving %s on http://%s:%d (engine pid %d)", fe.client.model_name, addr.host,
                 addr.port, fe.engine_process.pid)
        print(f"Troupe ready on http://{addr.host}:{addr.port}", flush=True)
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
    await stop_asked.wait()
    client = fe.client
    log.info("stopping: no new requests; %d running get up to %g s to finish", client.num_open, timeout)
    client.drain("the server is shutting down")
    deadline = time.monotonic() + timeout
    while client.num_open and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if client.num_open:
        log.warning("stopping: %d requests did not finish within %g s; they end with an error",
                    client.num_open, timeout)
        client.mark_dead(f"the server shut down before the request finished (--shutdown-timeout {timeout:g})")
        await asyncio.sleep(1.0)            # let their errors reach their clients
    fe.node.closed.done() or fe.node.closed.set_result(0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s [frontend] %(name)s: %(message)s")
    import uvloop
    try:
        code = uvloop.run(serve(args))
    except Exception as exc:  # start-up failures: one clear line, non-zero exit
        log.debug("start-up failed", exc_info=True)
        print(f"troupe: error: {exc}", file=sys.stderr)
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
