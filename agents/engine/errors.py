"""Errors the engine raises that callers are expected to handle (the HTTP layer maps EngineFull
to 503/429)."""

from __future__ import annotations


class EngineFull(RuntimeError):
    """The engine cannot take this request now (queue full or KV exhausted); retry later."""


class PrefixMissing(ValueError):
    """A decode engine was sent KV that starts after the prefix it actually holds."""
