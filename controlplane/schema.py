"""The OpenAPI schema's generator (drf-spectacular's, extended here)."""

from __future__ import annotations

from drf_spectacular.openapi import AutoSchema


class BatonAutoSchema(AutoSchema):
    """drf-spectacular's AutoSchema; the one place the schema's conventions are extended."""
