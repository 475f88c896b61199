"""HttpFrontend actor: owns the aiohttp server for its lifetime."""
from __future__ import annotations

from typing import Any, ClassVar

import msgspec
from aiohttp import web

from actors.frontend.app import OpenAIServer
from actors.runtime import Actor, Msg


class ServerAddress(msgspec.Struct):
    host: str
    port: int


class GetAddress(Msg):
    reply_type: ClassVar[Any] = ServerAddress


HttpFrontendProtocol = GetAddress


class HttpFrontend(Actor):
    protocol = HttpFrontendProtocol
    on_failure = "escalate"

    def __init__(self, server: OpenAIServer, host: str, port: int) -> None:
        self.server = server
        self.host = host
        self.port = port
        self.runner: web.AppRunner | None = None

    async def started(self) -> None:
        # handler_cancellation: a client that disconnects cancels its handler, whose
        # ``finally`` aborts the engine requests (their KV blocks are freed)
        self.runner = web.AppRunner(self.server.app(), access_log=None, shutdown_timeout=2.0,
                                    handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port)
        await site.start()
        if self.port == 0:
            self.port = self.runner.addresses[0][1]

    async def receive(self, msg: HttpFrontendProtocol) -> Any:
        return ServerAddress(self.host, self.port)

    async def stopped(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
