"""OpenAI-style errors: ``{"error": {"message", "type", "code"}}`` with an HTTP status."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse


class ApiError(Exception):
    """An error answered to the client. ``message`` names the fix."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}


def unavailable(message: str, code: str, retry_after_s: int = 1) -> ApiError:
    """A 503 that tells the client when to come back."""
    return ApiError(503, message, "server_error", code, {"Retry-After": str(retry_after_s)})


def json_error(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)
