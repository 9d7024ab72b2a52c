"""The REST API's JSON parser: DRF's, with the depth and Unicode checks of jsonsafety."""

from __future__ import annotations

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

from base import jsonsafety


class SafeJSONParser(JSONParser):
    """400 ``{"detail": ...}`` for JSON nested too deep or holding lone surrogates."""

    def parse(self, stream, media_type=None, parser_context=None):
        parser_context = parser_context or {}
        encoding = parser_context.get("encoding", settings.DEFAULT_CHARSET)
        raw = stream.read() if stream is not None else b""
        if not raw:
            raise ParseError("JSON parse error - the body is empty.")
        try:
            return jsonsafety.loads(raw.decode(encoding))
        except UnicodeDecodeError as exc:
            raise ParseError(
                f"JSON parse error - the body is not valid {encoding}: {exc}"
            ) from None
        except jsonsafety.UnsafeJSON as exc:
            raise ParseError(f"JSON parse error - {exc.message}") from None
