"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` as HTTP responses
and as server-sent events, and the exception that carries one out of a handler."""
from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

json_encoder = msgspec.json.Encoder()


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | int | None = None) -> web.Response:
    return web.Response(status=status, body=json_encoder.encode(error_body(message, type_, param, code)),
                        content_type="application/json")


class ApiError(Exception):
    """Ends a handler with ``response`` (an error the client caused, or an engine failure)."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(error_response(400, message, param=param, code=code))


def not_found(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(error_response(404, message, param=param, code=code))


def server_error(status: int, message: str) -> ApiError:
    return ApiError(error_response(status, message, "server_error", code=status))
