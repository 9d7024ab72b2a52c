"""OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``, with no Django:
what every OpenAI-shaped endpoint (the gateway's /v1, a tenant's /v1/organization/...) answers
on a refused request. Callers render ``body()`` with ``status`` (and ``headers``);
``OPENAPI_SCHEMA`` is the shape's OpenAPI component (``OpenAIError``) that their schemas share."""

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


OPENAPI_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "An error in OpenAI's shape.",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {
                    "type": "string",
                    "description": "invalid_request_error, authentication_error, "
                    "rate_limit_error, tokens or server_error.",
                },
                "param": {
                    "type": "string",
                    "nullable": True,
                    "description": "The request field or parameter at fault.",
                },
                "code": {
                    "type": "string",
                    "nullable": True,
                    "description": "e.g. unsupported_parameter, unknown_parameter, "
                    "invalid_value, invalid_api_key, not_found, model_not_found, "
                    "rate_limit_exceeded, no_healthy_path.",
                },
            },
        }
    },
}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value" if param else None)


def unauthorized(message: str = "Invalid API key.") -> OpenAIError:
    return OpenAIError(401, message, type_="authentication_error", code="invalid_api_key")
