"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
from collections.abc import Mapping

from starlette.responses import Response

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    409: "ConflictError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class ApiError(Exception):
    """An error answered to the client with ``status`` and an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param)

    def response(self) -> Response:
        return Response(
            self.body(), status_code=self.status, headers=self.headers, media_type="application/json"
        )


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    return json.dumps(
        {
            "error": {
                "message": message,
                "type": _TYPES.get(status, "Error"),
                "param": param,
                "code": status,
            }
        }
    ).encode()


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)
