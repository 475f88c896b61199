"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's endpoints and answers): an
adapter is validated against the model when it is loaded (a bad one is a 400, a path with no
adapter a 404, and changes nothing), then served as a model of its own name; the worker reads
its weights when a request first needs them. Unloading stops new requests with it (they get a
404, as for any unknown model) and the workers drop it from their slots and host cache;
requests already running with it finish. As in vLLM, the endpoints exist only when the
environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING is 1 or true (--lora-modules needs
nothing)."""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Callable

import msgspec
from aiohttp import web

from actors.frontend.errors import bad_request, not_found
from models.lora import InvalidAdapter

if TYPE_CHECKING:
    from actors.frontend.app import OpenAIServer
    from actors.frontend.client import EngineClient

log = logging.getLogger("troupe.http")

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed() -> bool:
    """vLLM's reading of VLLM_ALLOW_RUNTIME_LORA_UPDATING: "1" or "true", any case."""
    return os.environ.get(RUNTIME_UPDATING_ENV, "0").strip().lower() in ("1", "true")


def routes() -> list[tuple[str, str, Callable]]:
    if not runtime_updating_allowed():
        return []
    log.warning("LoRA dynamic loading & unloading is enabled in the API server (%s). "
                "This should ONLY be used for local development!", RUNTIME_UPDATING_ENV)
    return [("POST", "/v1/load_lora_adapter", load_lora_adapter),
            ("POST", "/v1/unload_lora_adapter", unload_lora_adapter)]


class LoadLoRAAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str = ""               # both required: a missing one gets vLLM's message
    lora_path: str = ""
    load_inplace: bool = False        # vLLM's: replace an adapter of the same name


class UnloadLoRAAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None


def _decode(body: bytes, typ: type) -> msgspec.Struct:
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.DecodeError as exc:
        raise bad_request(f"invalid request body: {exc}") from None


async def load_lora_adapter(server: OpenAIServer, request: web.Request) -> web.Response:
    return await _change(server, True, await request.read())


async def unload_lora_adapter(server: OpenAIServer, request: web.Request) -> web.Response:
    return await _change(server, False, await request.read())


async def _change(server: OpenAIServer, load: bool, body: bytes) -> web.Response:
    """Applied here, or with several API servers (--api-server-count) by API server 0, whose
    registry every API server then serves."""
    shared = server.shared
    if shared is not None and shared.remote:
        return await shared.change_lora(load, body, server)
    response = apply_lora_change(server.engine(), load, body)
    if shared is not None:
        await shared.lora_changed(server)
    return response


def apply_lora_change(client: EngineClient, load: bool, body: bytes) -> web.Response:
    """A load (``load``) or unload request's body applied to ``client``'s adapters: the success
    answer, or ApiError with vLLM's error (nothing changed then)."""
    if not load:
        unload = _decode(body, UnloadLoRAAdapterRequest)
        if not unload.lora_name:
            raise bad_request("'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
        if not client.remove_lora(unload.lora_name):
            raise not_found(f"The lora adapter '{unload.lora_name}' cannot be found.", "lora_name")
        return web.Response(text=f"Success: LoRA adapter '{unload.lora_name}' removed successfully.")
    req = _decode(body, LoadLoRAAdapterRequest)
    if not req.lora_name or not req.lora_path:
        raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
    if req.lora_name in client.lora_requests and not req.load_inplace:
        raise bad_request(f"The lora adapter '{req.lora_name}' has already been loaded.", "lora_name")
    if not os.path.exists(req.lora_path):        # vLLM's NotFoundError for a path with no adapter
        raise not_found(f"Loading lora {req.lora_name} failed: No adapter found for {req.lora_path}", "lora_path")
    previous = client.lora_requests.pop(req.lora_name, None) if req.load_inplace else None
    try:
        client.add_lora(req.lora_name, req.lora_path)
    except InvalidAdapter as exc:
        if previous is not None:
            client.lora_requests[req.lora_name] = previous
        raise bad_request(str(exc), "lora_path") from None
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' added successfully.")
