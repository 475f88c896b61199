"""HttpFrontend actor: owns the aiohttp server for its lifetime."""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
from typing import Any, ClassVar

import msgspec
from aiohttp import web

from actors.engine import vllm_env
from actors.frontend.app import OpenAIServer
from actors.frontend.tls import TlsFiles
from actors.runtime import Actor, Msg


class ServerAddress(msgspec.Struct):
    host: str
    port: int
    scheme: str = "http"          # "https" with --ssl-certfile
    uds: str = ""                 # the Unix socket it listens on instead (--uds)

    @property
    def url(self) -> str:
        return f"unix:{self.uds}" if self.uds else f"{self.scheme}://{self.host}:{self.port}"


class GetAddress(Msg):
    reply_type: ClassVar[Any] = ServerAddress


HttpFrontendProtocol = GetAddress


class HttpFrontend(Actor):
    protocol = HttpFrontendProtocol
    on_failure = "escalate"

    def __init__(self, server: OpenAIServer, host: str, port: int, ssl_context: ssl.SSLContext | None = None,
                 refresh_from: TlsFiles | None = None, uds: str | None = None,
                 sockets: list[socket.socket] | None = None, reuse_port: bool = False) -> None:
        """``ssl_context``: serve HTTPS with it; ``refresh_from``: load these files into it again
        whenever they change (--enable-ssl-refresh); ``uds``: listen on this Unix socket instead
        of host and port (vLLM's --uds); ``sockets``: accept on these listening sockets, another
        API server's (--api-server-count), instead of listening; ``reuse_port``: listen with
        SO_REUSEPORT, on a port other API servers listen on too (the kernel spreads the
        connections over them)."""
        self.sockets = sockets
        self.reuse_port = reuse_port
        self.server = server
        self.host = host
        self.port = port
        self.uds = uds
        self.ssl_context = ssl_context
        self.refresh_from = refresh_from
        self.refreshing: asyncio.Future | None = None
        self.runner: web.AppRunner | None = None
        self.site: web.BaseSite | None = None

    async def started(self) -> None:
        # handler_cancellation: a client that disconnects cancels its handler, whose
        # ``finally`` aborts the engine requests (their KV blocks are freed)
        keep_alive = vllm_env.http_keep_alive_s()      # vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE
        self.runner = web.AppRunner(self.server.app(), access_log=None, shutdown_timeout=2.0,
                                    handler_cancellation=True,
                                    **({"keepalive_timeout": keep_alive} if keep_alive is not None else {}))
        await self.runner.setup()
        if self.sockets is not None:
            for sock in self.sockets:
                await web.SockSite(self.runner, sock, ssl_context=self.ssl_context).start()
            return
        if self.uds:
            site: web.BaseSite = web.UnixSite(self.runner, self.uds, ssl_context=self.ssl_context)
        else:
            site = web.TCPSite(self.runner, self.host, self.port, ssl_context=self.ssl_context,
                               reuse_port=self.reuse_port or None)
        await site.start()
        self.site = site
        if self.port == 0 and not self.uds:
            self.port = self.runner.addresses[0][1]
        if self.ssl_context is not None and self.refresh_from is not None:
            self.refreshing = asyncio.ensure_future(self.refresh_from.refresh(self.ssl_context))

    def listening_sockets(self) -> list[Any]:
        """The sockets this server accepts on (each a file descriptor other API servers may share)."""
        server = getattr(self.site, "_server", None)
        return list(server.sockets) if server is not None else []

    async def receive(self, msg: HttpFrontendProtocol) -> Any:
        return ServerAddress(self.host, self.port, "https" if self.ssl_context is not None else "http",
                             self.uds or "")

    async def stopped(self) -> None:
        if self.refreshing is not None:
            self.refreshing.cancel()
        if self.runner is not None:
            await self.runner.cleanup()
        if self.uds and self.sockets is None:
            with contextlib.suppress(OSError):
                os.unlink(self.uds)
