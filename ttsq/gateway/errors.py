"""Errors of the HTTP gateway, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``,
with the field named in ``param``, so that OpenAI's client libraries raise their own typed errors
(``openai.BadRequestError`` for a 400, and so on)."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from ttsq.errors import InvalidRequest


class ApiError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        cause: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}
        self.cause = cause

    def response(self) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}},
            status_code=self.status,
            headers=self.headers,
        )


def invalid(exc: InvalidRequest) -> ApiError:
    """A request field that failed validation: 400 naming it."""
    return ApiError(400, str(exc), param=exc.field, code="invalid_value", cause="invalid")


class Interrupted(Exception):
    """A speech response broken off after its audio began: its error, in OpenAI's shape."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message, self.code = message, code

    def event(self) -> dict[str, Any]:
        """The SSE event that ends the stream."""
        error = {"message": self.message, "type": "server_error", "param": None, "code": self.code}
        return {"type": "speech.audio.error", "error": error}
