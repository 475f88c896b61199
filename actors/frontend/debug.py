"""POST /debug/fault: arm a fault in one of the server's processes (the runtime's fault injection,
``actors/runtime/faults.py``), for the tests that check nothing is lost and nothing hangs. The
route exists only in a server started with TROUPE_FAULT_INJECTION=1."""
from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from actors.frontend.errors import error_response, json_encoder
from actors.runtime import ActorError
from actors.runtime.faults import InjectFault

if TYPE_CHECKING:
    from actors.frontend.app import OpenAIServer


async def inject_fault(server: OpenAIServer, request: web.Request) -> web.Response:
    """The body is InjectFault's fields as JSON (``kind``, ``node``, ``actor``, ...)."""
    try:
        fault = msgspec.json.decode(await request.read(), type=InjectFault)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return error_response(400, f"not a fault: {exc}")
    try:
        armed = await server.inject(fault)
    except ActorError as exc:
        return error_response(500, f"the fault could not be armed: {exc}")
    return web.Response(body=json_encoder.encode({"armed": armed}), content_type="application/json")
