"""``python -m tools.pd_proxy --prefill URL [URL ...] --decode URL [URL ...] --port P`` (``troupe
pd-proxy``): prefill/decode disaggregation behind one OpenAI-compatible endpoint.

Each completion or chat request goes first to a prefill instance (one started with
``--kv-transfer-config '{"kv_connector": "TroupeConnector", "kv_role": "kv_producer"}'``) with
``max_tokens`` 1 and ``kv_transfer_params`` ``{"do_remote_decode": true}``: it computes the
prompt, keeps its KV blocks and answers with the ``kv_transfer_params`` that name them. The
request then goes to a decode instance (``kv_role`` ``kv_consumer``) with those params: it loads
the blocks instead of computing the prompt and generates the answer, streamed when the client
asked for ``stream``. Instances on each side are chosen least loaded (requests in flight through
this proxy, ties in turn) or in turn (``--policy round_robin``). When no prefill instance answers,
the decode instance computes the prompt itself; a decode instance that fails gives the client its
error (502 when it cannot be reached).

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (the first decode
instance's), GET /health (200 when both sides have an instance that answers its /health).
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import json
import logging
import signal
import sys
from dataclasses import dataclass

import aiohttp
from aiohttp import web

log = logging.getLogger("troupe.pd_proxy")

HOP_HEADERS = ("Authorization", "X-Request-Id")


@dataclass
class Instance:
    url: str
    in_flight: int = 0
    requests: int = 0
    failures: int = 0


class Pool:
    """Instances of one side, picked least loaded (ties in turn) or in turn."""

    def __init__(self, urls: list[str], policy: str) -> None:
        self.instances = [Instance(u.rstrip("/")) for u in urls]
        self.policy = policy
        self._turn = itertools.count()

    def order(self) -> list[Instance]:
        """Every instance, the preferred first (the next ones are tried when it cannot be reached)."""
        n = len(self.instances)
        start = next(self._turn) % n
        rotated = self.instances[start:] + self.instances[:start]
        if self.policy == "least_loaded":
            rotated.sort(key=lambda i: i.in_flight)          # stable: ties keep their turn
        return rotated


class PDProxy:
    def __init__(self, prefill: list[str], decode: list[str], policy: str = "least_loaded",
                 timeout_s: float = 600.0) -> None:
        self.prefill = Pool(prefill, policy)
        self.decode = Pool(decode, policy)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=5)
        self.session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=self.timeout, auto_decompress=False)

    async def _stop(self, _: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    @staticmethod
    def _headers(request: web.Request) -> dict[str, str]:
        return {h: request.headers[h] for h in HOP_HEADERS if h in request.headers}

    async def _prefill(self, path: str, body: dict, headers: dict[str, str]) -> tuple[dict | None, web.Response | None]:
        """The prefill leg: (kv_transfer_params, None), or (None, the error response to give the
        client) when the instance refused the request; (None, None) when none could be reached."""
        leg = copy.deepcopy(body)
        leg["stream"] = False
        leg.pop("stream_options", None)
        if "max_completion_tokens" in leg:       # chat's newer name: set the one the client used
            leg["max_completion_tokens"] = 1
        if "max_tokens" in leg or "max_completion_tokens" not in leg:
            leg["max_tokens"] = 1
        leg["n"] = 1                              # one prompt's KV, whatever n the decode leg asks
        leg["kv_transfer_params"] = {"do_remote_decode": True}
        for inst in self.prefill.order():
            inst.in_flight += 1
            inst.requests += 1
            try:
                async with self.session.post(inst.url + path, json=leg, headers=headers) as resp:
                    raw = await resp.read()
                    if resp.status != 200:
                        return None, web.Response(body=raw, status=resp.status, content_type="application/json")
                    return json.loads(raw).get("kv_transfer_params"), None
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                inst.failures += 1
                log.warning("prefill instance %s failed (%s); trying the next", inst.url, exc)
            finally:
                inst.in_flight -= 1
        log.warning("no prefill instance answered: the decode instance computes the prompt")
        return None, None

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        headers = self._headers(request)
        prompt = body.get("prompt")
        several = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        if several:          # several prompts: the response names one prompt's blocks, so decode computes them
            params = None
        else:
            params, refused = await self._prefill(request.path, body, headers)
            if refused is not None:
                return refused
        leg = dict(body)
        if params:
            leg["kv_transfer_params"] = params
        else:
            leg.pop("kv_transfer_params", None)
        last_error = "no decode instance"
        for inst in self.decode.order():
            inst.in_flight += 1
            inst.requests += 1
            try:
                resp = await self.session.post(inst.url + request.path, json=leg, headers=headers)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                inst.in_flight -= 1
                inst.failures += 1
                last_error = f"decode instance {inst.url}: {exc}"
                log.warning("%s", last_error)
                continue
            try:
                return await self._relay(request, resp)
            finally:
                resp.release()
                inst.in_flight -= 1
        return _error(502, last_error)

    @staticmethod
    async def _relay(request: web.Request, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        """The decode instance's answer as it comes (server-sent events chunk by chunk)."""
        out = web.StreamResponse(status=resp.status)
        for h in ("Content-Type", "X-Request-Id", "Retry-After"):
            if h in resp.headers:
                out.headers[h] = resp.headers[h]
        await out.prepare(request)
        async for chunk in resp.content.iter_any():
            await out.write(chunk)
        await out.write_eof()
        return out

    async def models(self, request: web.Request) -> web.Response:
        for inst in self.decode.order():
            try:
                async with self.session.get(inst.url + "/v1/models", headers=self._headers(request)) as resp:
                    return web.Response(body=await resp.read(), status=resp.status, content_type="application/json")
            except (aiohttp.ClientError, asyncio.TimeoutError):
                continue
        return _error(502, "no decode instance answered")

    async def health(self, _: web.Request) -> web.Response:
        async def ok(inst: Instance) -> bool:
            try:
                async with self.session.get(inst.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    return r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False
        sides = {}
        for name, pool in (("prefill", self.prefill), ("decode", self.decode)):
            states = await asyncio.gather(*(ok(i) for i in pool.instances))
            sides[name] = [{"url": i.url, "healthy": s, "in_flight": i.in_flight, "requests": i.requests,
                            "failures": i.failures} for i, s in zip(pool.instances, states)]
        healthy = all(any(i["healthy"] for i in side) for side in sides.values())
        return web.json_response(sides, status=200 if healthy else 503)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "BadRequestError" if status < 500
                                        else "InternalServerError", "param": None, "code": status}}, status=status)


def main(argv: list[str] | None = None, prog: str = "python -m tools.pd_proxy") -> int:
    p = argparse.ArgumentParser(prog=prog, description="prefill/decode disaggregation proxy (OpenAI-compatible)")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances (kv_producer)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances (kv_consumer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--policy", choices=("least_loaded", "round_robin"), default="least_loaded",
                   help="how an instance of each side is chosen")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take on an instance")
    args = p.parse_args(argv)
    for url in args.prefill + args.decode:
        if not url.startswith(("http://", "https://")):
            p.error(f"{url!r} is not an http(s) URL")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    proxy = PDProxy(args.prefill, args.decode, args.policy, args.timeout)
    try:
        asyncio.run(_serve(proxy, args.host, args.port))
    except KeyboardInterrupt:
        pass
    return 0


async def _serve(proxy: PDProxy, host: str, port: int) -> None:
    runner = web.AppRunner(proxy.app())
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1] if port == 0 else port
    print(f"P/D proxy: prefill {' '.join(i.url for i in proxy.prefill.instances)}; "
          f"decode {' '.join(i.url for i in proxy.decode.instances)}", flush=True)
    print(f"Troupe ready on http://{host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    sys.exit(main())
