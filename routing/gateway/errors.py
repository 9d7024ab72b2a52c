"""Errors in the OpenAI error shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging

from django.http import JsonResponse

from pdd.openai_errors import OpenAIError

log = logging.getLogger(__name__)

# Called as observer(status, code, tenant, model) for every error answer the gateway sends
# (telemetry's error counters); set by the app that aggregates. Tenant and model are "" where
# the request did not get far enough to name them.
error_observers: list = []


def notify_error(status: int, code: str | None, tenant: str = "", model: str = "") -> None:
    for observer in error_observers:
        try:
            observer(status, code or "", tenant, model)
        except Exception:  # telemetry must never fail a request
            log.warning("error observer failed", exc_info=True)


class GatewayError(OpenAIError):
    """An OpenAI-shaped refusal (``pdd.openai_errors``) the gateway answers as a JSON response."""

    def response(self) -> JsonResponse:
        response = JsonResponse(self.body(), status=self.status)
        for name, value in self.headers.items():
            response[name] = value
        return response


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code="invalid_value" if param else None)


def unauthorized(message: str = "Invalid API key.") -> GatewayError:
    return GatewayError(401, message, type_="authentication_error", code="invalid_api_key")


def rate_limited(limit: str, retry_after_s: float) -> GatewayError:
    return GatewayError(
        429,
        f"Rate limit reached for {limit} per minute; retry in {retry_after_s:.0f} s.",
        type_="rate_limit_error" if limit == "requests" else "tokens",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(max(1, int(retry_after_s + 0.999)))},
    )


def unavailable(message: str) -> GatewayError:
    return GatewayError(503, message, type_="server_error", code="no_healthy_path")
