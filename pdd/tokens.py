"""Bearer secrets shown once and stored as a public prefix plus a digest: tenants' API keys
(``sk-baton-<prefix>-<secret>``) and node agents' tokens (``bnt_<prefix>_<secret>``).

The secret part carries 256 random bits, so a fast hash is enough (no dictionary to guess
from); lookups go by the prefix and compare digests in constant time."""

from __future__ import annotations

import hashlib
import hmac
import secrets


def digest(raw: str) -> str:
    """What is stored of a secret: its SHA-256, hex."""
    return hashlib.sha256(raw.encode()).hexdigest()


def matches(raw: str, stored_digest: str) -> bool:
    return hmac.compare_digest(stored_digest, digest(raw))


def new_token(scheme: str, sep: str, prefix_bytes: int) -> tuple[str, str, str]:
    """A fresh ``<scheme><sep><prefix><sep><secret>`` as (token, prefix, digest)."""
    prefix = secrets.token_hex(prefix_bytes)
    token = f"{scheme}{sep}{prefix}{sep}{secrets.token_urlsafe(32)}"
    return token, prefix, digest(token)


def token_prefix(raw: str, scheme: str, sep: str) -> str | None:
    """The public prefix of a token of this scheme, or None when it is not one."""
    head = f"{scheme}{sep}"
    if not raw.startswith(head):
        return None
    parts = raw[len(head) :].split(sep, 1)
    if len(parts) != 2 or not parts[0] or not parts[1]:
        return None
    return parts[0]
