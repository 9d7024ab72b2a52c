"""The fleet's data-plane token: its rule, where it comes from and how it is sent.

Torch-free, so the control plane and the gateway use the same rule and header as the agents.
"""

from __future__ import annotations

import os

ENV = "BATON_DATA_TOKEN"
MIN_LENGTH = 16


def check_data_token(value: object, name: str) -> str:
    """`value` if it is a usable token, else ValueError naming `name`."""
    if not isinstance(value, str) or len(value) < MIN_LENGTH or any(c.isspace() for c in value):
        raise ValueError(f"{name} must be at least {MIN_LENGTH} characters without spaces")
    return value


def env_data_token() -> str | None:
    """$BATON_DATA_TOKEN, or None when unset or empty."""
    return os.environ.get(ENV) or None


def bearer_headers(token: str | None) -> dict[str, str]:
    """The Authorization header carrying `token`; none without one."""
    return {"Authorization": f"Bearer {token}"} if token else {}
