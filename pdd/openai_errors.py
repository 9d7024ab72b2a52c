"""OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``, with no Django:
what every OpenAI-shaped endpoint (the gateway's /v1, a tenant's /v1/organization/...) answers
on a refused request. Callers render ``body()`` with ``status`` (and ``headers``)."""

from __future__ import annotations

from typing import Any


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value" if param else None)


def unauthorized(message: str = "Invalid API key.") -> OpenAIError:
    return OpenAIError(401, message, type_="authentication_error", code="invalid_api_key")
