"""How operators and viewers authenticate to the REST API: hashed API tokens.

``Authorization: Token <key>`` (or ``Bearer <key>``) on ``/api/...``. The key's first characters
find the token's row (controlplane.models.ApiToken), and the SHA-256 of the whole key must match
the stored digest; the key itself is never stored. Node agents use their own scheme
(``AgentToken``, fleet.api.agent), and an agent token is no operator credential: it has no
ApiToken row, so it gets 401 here.
"""

from __future__ import annotations

from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header

KEYWORDS = (b"token", b"bearer")


class ApiTokenAuthentication(BaseAuthentication):
    """``Authorization: Token <key>`` or ``Authorization: Bearer <key>``."""

    keyword = "Token"

    def authenticate(self, request):
        parts = get_authorization_header(request).split()
        if not parts or parts[0].lower() not in KEYWORDS:
            return None  # another scheme (session, AgentToken...) or none at all
        if len(parts) != 2:
            raise exceptions.AuthenticationFailed(
                "Malformed token header: use 'Token <key>' (or 'Bearer <key>')."
            )
        try:
            key = parts[1].decode()
        except UnicodeError:
            raise exceptions.AuthenticationFailed("Invalid token.") from None
        return self.authenticate_credentials(key)

    def authenticate_credentials(self, key: str):
        from controlplane.models import ApiToken

        token = ApiToken.find(key, ApiToken.objects.select_related("user"))
        if token is None:
            raise exceptions.AuthenticationFailed("Invalid token.")
        now = timezone.now()
        if token.revoked_at is not None:
            raise exceptions.AuthenticationFailed(f"API token revoked ({token.prefix}).")
        if token.is_expired(now):
            raise exceptions.AuthenticationFailed(
                f"API token expired ({token.prefix}, at {token.expires_at:%Y-%m-%d %H:%M} UTC)."
            )
        if not token.user.is_active:
            raise exceptions.AuthenticationFailed("User inactive or deleted.")
        # Inside the request's transaction (ATOMIC_REQUESTS): a request that fails with an
        # error rolls this back too, so last_used_at follows requests that went through.
        token.touch(now)
        return (token.user, token)

    def authenticate_header(self, request) -> str:
        # Makes a missing or refused credential a 401 (with this challenge), not a 403.
        return self.keyword


class ApiTokenScheme(OpenApiAuthenticationExtension):
    """Documents the API token header in the OpenAPI schema."""

    target_class = "controlplane.authentication.ApiTokenAuthentication"
    name = "apiToken"

    def get_security_definition(self, auto_schema):
        return {
            "type": "apiKey",
            "in": "header",
            "name": "Authorization",
            "description": (
                "'Token <key>' (or 'Bearer <key>'): an operator's or viewer's API token, "
                "e.g. from 'manage.py baton_user'. Keys are shown once and stored hashed."
            ),
        }
