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


# Idle keep-alive connections on the data plane. A server that closes an idle connection at
# the moment its client reuses it makes the client's next call fail before any byte came back
# (httpx's and uvicorn's defaults are both 5 s: a gateway's call to an MD found its pooled
# connection reset, "ReadError", and failed a request). The agents' server keeps an idle
# connection open well past the time its callers keep one in their pools, so the side that
# closes an idle connection is always the client, which never reuses a closed one.
SERVER_IDLE_S = 75.0
"""How long an agent's HTTP server keeps an idle connection (uvicorn's ``timeout_keep_alive``)."""
CLIENT_IDLE_S = 20.0
"""How long a data-plane client keeps an idle connection in its pool (httpx's
``keepalive_expiry``): well under ``SERVER_IDLE_S``."""
