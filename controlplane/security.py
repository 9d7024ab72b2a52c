"""Response headers that Django's SecurityMiddleware does not set: a Content-Security-Policy on
every HTML page (the UI, the admin, the API docs)."""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings


class ContentSecurityPolicyMiddleware:
    """``Content-Security-Policy: <BATON_CSP>`` on HTML responses that set none themselves.
    Sync and async (no thread hop under ASGI)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response) -> None:
        self.get_response = get_response
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self.async_mode:
            return self._acall(request)
        return self._add(self.get_response(request))

    async def _acall(self, request):
        return self._add(await self.get_response(request))

    @staticmethod
    def _add(response):
        policy = getattr(settings, "BATON_CSP", "")
        if (
            policy
            and "Content-Security-Policy" not in response
            and response.get("Content-Type", "").startswith("text/html")
        ):
            response["Content-Security-Policy"] = policy
        return response
