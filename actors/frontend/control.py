"""vLLM's generation-control endpoints for reinforcement-learning loops, which pause generation
while the trainer updates the weights, then resume it. As in vLLM, they exist only in a server
started with VLLM_SERVER_DEV_MODE=1:

  POST /pause?mode=abort|wait|keep&clear_cache=true   {"status": "paused"} once nothing runs
  POST /resume                                        {"status": "resumed"}
  GET  /is_paused                                     {"is_paused": bool}
  POST /abort_requests  {"request_ids": [...]}        {"status": "aborted", "aborted": n}
  POST /sleep?level=0|1|2&mode=abort                  {"status": "sleeping", "level": n}
  POST /wake_up?tags=weights&tags=kv_cache            {"status": "awake" | "sleeping", "tags": [...]}
  GET  /is_sleeping                                   {"is_sleeping": bool}
  GET  /get_world_size?include_dp=true                {"world_size": n}  (ranks: tensor x pipeline [x data])
  GET  /server_info?config_format=text|json           {"vllm_config", "vllm_env", "system_env"}
  POST /collective_rpc  {"method", "args", "kwargs", "timeout"}   {"results": [one per worker]}
  POST /reset_mm_cache, /reset_encoder_cache          200 (the processor cache, the engines' encoder caches cleared)

``abort`` (the default) aborts every request, ``wait`` lets the running ones finish, ``keep``
freezes every request where it is (they go on after /resume); requests that arrive while paused
queue. /abort_requests ends the requests it names (by the id of their answer, the X-Request-Id
they were sent with, or their engine id; none named: every open request) with finish reason
"abort", without pausing. /sleep pauses (level 0) and gives back the KV cache's memory (level 1)
or that and the weights' (level 2), with --enable-sleep-mode; /wake_up takes them back (tags:
what; none: everything) and resumes once nothing is left asleep.

With --profiler-config (and only then, as in vLLM; no VLLM_SERVER_DEV_MODE needed):

  POST /start_profile  {"profile_prefix", "delay_iterations", "max_iterations"} (each optional)   200
  POST /stop_profile                                                                             200

open and close a profiling session (actors/engine/profiler.py): 409 when one is already open."""
from __future__ import annotations

import asyncio
import functools
import json
import os
from typing import TYPE_CHECKING, Any

import msgspec

from aiohttp import web

from actors.frontend.client import ProfilerAlreadyActive
from actors.frontend.errors import ApiError, bad_request, error_response, json_encoder

if TYPE_CHECKING:
    from actors.frontend.app import OpenAIServer

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
_TRUE, _FALSE = ("1", "true", "yes", "on", "t", "y"), ("0", "false", "no", "off", "f", "n")


def enabled() -> bool:
    return os.environ.get(DEV_MODE_ENV, "0").strip().lower() in _TRUE


def _json(body: object) -> web.Response:
    return web.Response(body=json_encoder.encode(body), content_type="application/json")


def _flag(request: web.Request, name: str, default: bool) -> bool:
    value = request.query.get(name)
    if value is None:
        return default
    if value.strip().lower() in _TRUE:
        return True
    if value.strip().lower() in _FALSE:
        return False
    raise bad_request(f"{name} must be a boolean, got {value!r}", name)


async def pause(server: OpenAIServer, request: web.Request) -> web.Response:
    mode = request.query.get("mode", "abort")
    clear_cache = _flag(request, "clear_cache", True)
    try:
        await server.engine().pause_generation(mode, clear_cache)
    except ValueError as exc:
        raise bad_request(f"{exc} (one of abort, wait, keep)", "mode") from None
    finally:
        await server.control_changed()
    return _json({"status": "paused"})


async def resume(server: OpenAIServer, request: web.Request) -> web.Response:
    await server.engine().resume_generation()
    await server.control_changed()
    return _json({"status": "resumed"})


async def is_paused(server: OpenAIServer, request: web.Request) -> web.Response:
    return _json({"is_paused": await server.engine().is_paused()})


async def _object_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object ({} for an empty body); a 400 for anything else."""
    raw = await request.read()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except (ValueError, UnicodeDecodeError):
        raise bad_request("Invalid JSON format") from None
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    return body


async def abort_requests(server: OpenAIServer, request: web.Request) -> web.Response:
    body = await _object_body(request)
    ids = body.get("request_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
        raise bad_request("request_ids must be a list of strings", "request_ids")
    if not ids:
        return _json({"status": "aborted", "aborted": await server.abort_everywhere(None)})
    await server.abort_everywhere(ids)
    return _json({"status": "aborted", "aborted": len(ids)})


async def sleep(server: OpenAIServer, request: web.Request) -> web.Response:
    level_text = request.query.get("level", "1")
    if level_text not in ("0", "1", "2"):
        raise bad_request(f"level must be 0, 1 or 2, got {level_text!r}", "level")
    mode = request.query.get("mode", "abort")
    if mode not in ("abort", "wait", "keep"):
        raise bad_request(f"Invalid pause mode: {mode} (one of abort, wait, keep)", "mode")
    try:
        await server.engine().sleep(int(level_text), mode)
    except ValueError as exc:
        raise bad_request(str(exc), "level") from None
    finally:
        await server.control_changed()
    return _json({"status": "sleeping", "level": int(level_text)})


async def wake_up(server: OpenAIServer, request: web.Request) -> web.Response:
    tags = request.query.getall("tags", []) or None
    try:
        awake = await server.engine().wake_up(tags)
    except ValueError as exc:
        raise bad_request(str(exc), "tags") from None
    finally:
        await server.control_changed()
    return _json({"status": "awake" if awake else "sleeping", "tags": tags})


async def is_sleeping(server: OpenAIServer, request: web.Request) -> web.Response:
    return _json({"is_sleeping": await server.engine().is_sleeping()})


async def release_kv_cache_memory(server: OpenAIServer, request: web.Request) -> web.Response:
    """vLLM's: the KV cache's memory given back after a completed pause (the weights stay)."""
    try:
        await server.engine().release_kv_cache_memory()
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    finally:
        await server.control_changed()
    return _json({"status": "kv_cache_released"})


async def start_profile(server: OpenAIServer, request: web.Request) -> web.Response:
    body = await _object_body(request)
    options = {k: body.get(k) for k in ("profile_prefix", "delay_iterations", "max_iterations")}
    for name in ("delay_iterations", "max_iterations"):
        value = options[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise bad_request(f"{name} must be an integer", name)
    if options["profile_prefix"] is not None and not isinstance(options["profile_prefix"], str):
        raise bad_request("profile_prefix must be a string", "profile_prefix")
    try:
        await server.engine().start_profile(options["profile_prefix"], options["delay_iterations"],
                                            options["max_iterations"])
    except ProfilerAlreadyActive as exc:
        raise ApiError(error_response(409, str(exc))) from None
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return web.Response(status=200)


async def stop_profile(server: OpenAIServer, request: web.Request) -> web.Response:
    await server.engine().stop_profile()
    return web.Response(status=200)


async def reset_mm_cache(server: OpenAIServer, request: web.Request) -> web.Response:
    """vLLM's /reset_mm_cache: this API server's processor cache forgets its images (a text
    model has none: 200 all the same, as vLLM answers)."""
    images = server.engine().images
    if images is not None:
        images.clear()
    return web.Response(status=200)


async def reset_encoder_cache(server: OpenAIServer, request: web.Request) -> web.Response:
    """vLLM's /reset_encoder_cache: every engine forgets its images' embeddings (a text model
    holds none: 200 all the same)."""
    await server.engine().reset_encoder_cache()
    return web.Response(status=200)


async def get_world_size(server: OpenAIServer, request: web.Request) -> web.Response:
    """vLLM's: the ranks of one engine (tensor x pipeline), times the data-parallel engines
    unless include_dp=false."""
    parallel = server.engine().config.parallel
    size = parallel.world_size * (parallel.data_parallel_size if _flag(request, "include_dp", True) else 1)
    return _json({"world_size": size})


async def server_info(server: OpenAIServer, request: web.Request) -> web.Response:
    """vLLM's: the engine's resolved config (as text, or as JSON with config_format=json), the
    VLLM_* and TROUPE_* environment variables set (none whose name holds KEY) and the system's
    (torch's collect_env, the first call taking a few seconds)."""
    fmt = request.query.get("config_format", "text")
    if fmt not in ("text", "json"):
        raise bad_request(f"config_format must be text or json, got {fmt!r}", "config_format")
    config = server.engine().config
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("VLLM_", "TROUPE_")) and "KEY" not in k}
    shown = repr(config) if fmt == "text" else msgspec.to_builtins(config, enc_hook=str)
    if fmt == "json" and shown.get("watermark"):          # the watermark's key is a secret (its repr hides it)
        shown["watermark"]["key"] = "<redacted>"
    return _json({"vllm_config": shown,
                  "vllm_env": env, "system_env": await asyncio.to_thread(_system_env)})


@functools.lru_cache(maxsize=1)
def _system_env() -> dict[str, Any]:
    from torch.utils.collect_env import get_env_info
    from actors.frontend.misc import version
    info = {k: v if v is None or type(v) in (str, int, float, bool) else str(v)    # torch's version objects (str's kin)
            for k, v in get_env_info()._asdict().items()}
    return {**info, "troupe_version": version()}


async def collective_rpc(server: OpenAIServer, request: web.Request) -> web.Response:
    """vLLM's: a worker method by name on every worker (Troupe's: reload_weights); the results
    in rank order, each a JSON object, list, null or its text."""
    body = await _object_body(request)
    method = body.get("method")
    if method is None:
        raise bad_request("Missing 'method' in request body", "method")
    args, kwargs, timeout = body.get("args", []), body.get("kwargs", {}), body.get("timeout")
    if (not isinstance(method, str) or not isinstance(args, list) or not isinstance(kwargs, dict)
            or not (timeout is None or (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                                        and timeout > 0))):
        raise bad_request("method must be a string, args a list, kwargs an object and timeout a positive number")
    try:
        results = await server.engine().collective_rpc(method, timeout, args, kwargs)
    except ValueError as exc:
        raise bad_request(str(exc), "method") from None
    except TimeoutError as exc:
        raise ApiError(error_response(504, f"collective_rpc {method} timed out: {exc}")) from None
    except RuntimeError as exc:                   # the method raised in a worker (it serves on)
        raise ApiError(error_response(500, f"collective_rpc {method} failed: {exc}")) from None
    return _json({"results": [r if r is None or isinstance(r, (dict, list)) else str(r) for r in results]})


# -- weight transfer (vLLM's RL routes; actors/worker/weight_transfer.py) ---------------------------
async def _engine_call(what: str, call: Any) -> None:
    """A weight transfer call: refusals are the caller's (400), a timeout a 504."""
    try:
        await call
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    except TimeoutError as exc:
        raise ApiError(error_response(504, f"{what} timed out: {exc}")) from None


def _field(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], required: bool = True) -> Any:
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, kinds):
        raise bad_request(f"the body needs {name!r}" if value is None else
                          f"{name!r} has the wrong type ({type(value).__name__})", name)
    return value


async def init_weight_transfer_engine(server: OpenAIServer, request: web.Request) -> web.Response:
    init_info = _field(await _object_body(request), "init_info", dict)
    await _engine_call("init_weight_transfer_engine", server.engine().init_weight_transfer_engine(init_info))
    return _json({"message": "Weight transfer initialized"})


async def shutdown_weight_transfer_engine(server: OpenAIServer, request: web.Request) -> web.Response:
    await _engine_call("shutdown_weight_transfer_engine", server.engine().shutdown_weight_transfer_engine())
    return _json({"message": "Weight transfer shut down"})


async def start_weight_update(server: OpenAIServer, request: web.Request) -> web.Response:
    await _engine_call("start_weight_update", server.engine().start_weight_update())
    return _json({"message": "Weight update started"})


async def start_draft_weight_update(server: OpenAIServer, request: web.Request) -> web.Response:
    await _engine_call("start_draft_weight_update", server.engine().start_weight_update(draft=True))
    return _json({"message": "Draft weight update started"})


async def update_weights(server: OpenAIServer, request: web.Request) -> web.Response:
    update_info = _field(await _object_body(request), "update_info", (dict, list))
    await _engine_call("update_weights", server.engine().update_weights(update_info))
    return _json({"message": "Weights updated"})


async def finish_weight_update(server: OpenAIServer, request: web.Request) -> web.Response:
    version = _field(await _object_body(request), "weight_version", str, required=False)
    await _engine_call("finish_weight_update", server.engine().finish_weight_update(version))
    return _json({"message": "Weight update finished"})


async def update_weight_version(server: OpenAIServer, request: web.Request) -> web.Response:
    version = _field(await _object_body(request), "new_version", str)
    await _engine_call("update_weight_version", server.engine().update_weight_version(version))
    return _json({"success": True, "new_version": version})


async def weight_info(server: OpenAIServer, request: web.Request) -> web.Response:
    return _json({"weight_version": await server.engine().get_weight_version()})


async def weight_checker(server: OpenAIServer, request: web.Request) -> web.Response:
    """vLLM's: ``checksum`` (SHA-256 of every tensor of every worker's model), ``reset`` (every
    weight zeroed) or ``compare`` (the checksums against ``baseline``: match and mismatches)."""
    body = await _object_body(request)
    action = _field(body, "action", str)
    if action not in ("checksum", "reset", "compare"):
        raise bad_request(f"action must be checksum, reset or compare, got {action!r}", "action")
    engine = server.engine()
    if action == "reset":
        await _engine_call("weight_checker", engine.collective_rpc("reset_weights"))
        return _json({"status": "reset"})
    baseline = _field(body, "baseline", dict, required=action == "compare")
    checksums: dict[str, str] = {}
    for each in await engine.compute_weight_checksums():
        checksums.update(each)
    if action == "checksum":
        return _json({"checksums": checksums})
    mismatches = sorted(k for k in checksums.keys() | baseline.keys() if checksums.get(k) != baseline.get(k))
    return _json({"match": not mismatches, "mismatches": mismatches})


PROFILE_ROUTES = [("POST", "/start_profile", start_profile), ("POST", "/stop_profile", stop_profile)]

ROUTES = [("POST", "/pause", pause), ("POST", "/resume", resume), ("GET", "/is_paused", is_paused),
          ("POST", "/abort_requests", abort_requests), ("POST", "/sleep", sleep), ("POST", "/wake_up", wake_up),
          ("GET", "/is_sleeping", is_sleeping), ("POST", "/release_kv_cache_memory", release_kv_cache_memory), ("GET", "/get_world_size", get_world_size),
          ("GET", "/server_info", server_info), ("POST", "/collective_rpc", collective_rpc),
          ("POST", "/reset_mm_cache", reset_mm_cache), ("POST", "/reset_encoder_cache", reset_encoder_cache),
          ("POST", "/init_weight_transfer_engine", init_weight_transfer_engine),
          ("POST", "/shutdown_weight_transfer_engine", shutdown_weight_transfer_engine),
          ("POST", "/start_weight_update", start_weight_update),
          ("POST", "/start_draft_weight_update", start_draft_weight_update),
          ("POST", "/update_weights", update_weights), ("POST", "/finish_weight_update", finish_weight_update),
          ("POST", "/update_weight_version", update_weight_version), ("GET", "/weight_info", weight_info),
          ("POST", "/weight_checker", weight_checker)]
