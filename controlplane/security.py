"""Response headers that Django's SecurityMiddleware does not set: a Content-Security-Policy on
every HTML page (the UI, the admin, the API docs)."""

from __future__ import annotations

from django.conf import settings


class ContentSecurityPolicyMiddleware:
    """``Content-Security-Policy: <BATON_CSP>`` on HTML responses that set none themselves."""

    def __init__(self, get_response) -> None:
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        policy = getattr(settings, "BATON_CSP", "")
        if (
            policy
            and "Content-Security-Policy" not in response
            and response.get("Content-Type", "").startswith("text/html")
        ):
            response["Content-Security-Policy"] = policy
        return response
