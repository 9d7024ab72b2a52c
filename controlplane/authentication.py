"""How operators and viewers authenticate to the REST API with an API token.

For now DRF's token scheme (``Authorization: Token <key>``); hashed tokens replace it.
"""

from __future__ import annotations

from rest_framework.authentication import TokenAuthentication


class ApiTokenAuthentication(TokenAuthentication):
    """``Authorization: Token <key>``."""
