"""The one error shape, vLLM's (its ``ErrorResponse``), for every error the server writes, as an
HTTP response or as a server-sent event mid-stream::

    {"error": {"message": str, "type": str, "param": str | null, "code": int}}

``code`` is the HTTP status and ``type`` the name of the exception the openai client raises for
it ("BadRequestError", "NotFoundError", "InternalServerError"...). What OpenAI spells as a string
code (context_length_exceeded, invalid_api_key, model_not_found) is told by the message, as in
vLLM ("This model's maximum context length is ...", "The model `x` does not exist.")."""
from __future__ import annotations

from http import HTTPStatus
from typing import Any

import msgspec
from aiohttp import web

json_encoder = msgspec.json.Encoder()

MAX_MESSAGE_CHARS = 2000          # an error quotes the input it is about at most this much

# The openai client's exception class for a status; 5xx are all InternalServerError (as in
# vLLM), other statuses are named after their HTTP phrase (413: RequestEntityTooLargeError).
_CLIENT_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                       404: "NotFoundError", 409: "ConflictError", 422: "UnprocessableEntityError",
                       429: "RateLimitError"}


def error_type(status: int) -> str:
    if status >= 500:
        return "InternalServerError"
    if status in _CLIENT_ERROR_TYPES:
        return _CLIENT_ERROR_TYPES[status]
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "BadRequestError"
    return "".join(word.capitalize() for word in phrase.replace("-", " ").split()) + "Error"


def clip(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[:MAX_MESSAGE_CHARS]}... ({len(message)} characters in all)"


def error_body(message: str, param: str | None = None, code: int = 500) -> dict[str, Any]:
    """The error object; ``code`` is the HTTP status (the type follows from it)."""
    return {"error": {"message": clip(message), "type": error_type(code), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None) -> web.Response:
    """An error response of HTTP ``status``."""
    return web.Response(status=status, body=json_encoder.encode(error_body(message, param, status)),
                        content_type="application/json")


class ApiError(Exception):
    """Ends a handler with ``response`` (an error the client caused, or an engine failure)."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(error_response(400, message, param))


def not_found(message: str, param: str | None = None) -> ApiError:
    return ApiError(error_response(404, message, param))


def server_error(status: int, message: str) -> ApiError:
    return ApiError(error_response(status, message))
