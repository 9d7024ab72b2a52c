"""JSON from untrusted callers: a depth limit and valid Unicode, checked before anything else
reads it, so bad input is a 400 naming the field instead of a RecursionError or a
UnicodeEncodeError deep inside a tokenizer or a database driver."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from django.conf import settings

# A lone UTF-16 surrogate: JSON's "\ud800" escape decodes to one; UTF-8 cannot encode it.
_SURROGATE = re.compile("[\ud800-\udfff]")


class UnsafeJSON(ValueError):
    """The body is not JSON, nests too deep, or holds text that is not valid Unicode."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.path = path


def max_depth() -> int:
    return int(getattr(settings, "BATON_MAX_JSON_DEPTH", 64))


def _no_constant(name: str):
    raise json.JSONDecodeError(f"{name} is not valid JSON", name, 0)


def loads(raw: bytes | str, *, depth: int | None = None) -> Any:
    """``json.loads`` that refuses nesting beyond `depth` (default ``BATON_MAX_JSON_DEPTH``)
    and strings or keys with lone surrogates, naming the place (``messages[0].content``)."""
    limit = max_depth() if depth is None else depth
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise UnsafeJSON(f"JSON nested deeper than {limit} levels.") from None
    except UnicodeDecodeError as exc:
        raise UnsafeJSON(f"The body is not valid UTF-8: {exc}") from None
    except json.JSONDecodeError as exc:
        raise UnsafeJSON(f"The body is not valid JSON: {exc}") from None
    check(value, depth=limit)
    return value


def _bad_text(text: str) -> bool:
    # ASCII text (nearly all of it: hashes, ids, English) cannot hold a surrogate; the check
    # is one C call, where the regular expression scans every character.
    return not text.isascii() and _SURROGATE.search(text) is not None


def check(value: Any, *, depth: int | None = None) -> None:
    """Walk a decoded JSON value (no recursion: a deep value cannot overflow the stack).

    A container's path is spelled only when it is pushed, a scalar's only when it fails: a
    list of 4,096 block hashes (an agent's KV cache event) costs one pass of C-level checks,
    not 4,096 formatted paths."""
    limit = max_depth() if depth is None else depth
    if not isinstance(value, (dict, list)):
        if isinstance(value, str) and _bad_text(value):
            raise UnsafeJSON("'body' holds invalid Unicode (a lone surrogate).", "")
        return
    stack: list[tuple[Any, str, int]] = [(value, "", 1)]
    while stack:
        item, path, level = stack.pop()
        if level > limit:
            raise UnsafeJSON(f"JSON nested deeper than {limit} levels at '{path}'.", path)
        if isinstance(item, dict):
            for key in item:
                if isinstance(key, str) and _bad_text(key):
                    raise UnsafeJSON(
                        f"A key in '{path or 'body'}' holds invalid Unicode (a lone surrogate).",
                        path,
                    )
            children: Iterable[tuple[Any, Any]] = item.items()
            where = "{path}.{key}" if path else "{key}"
        else:
            children = enumerate(item)
            where = "{path}[{key}]"
        for key, child in children:
            if isinstance(child, str):
                if _bad_text(child):
                    here = where.format(path=path, key=key)
                    raise UnsafeJSON(f"'{here}' holds invalid Unicode (a lone surrogate).", here)
            elif isinstance(child, (dict, list)):
                stack.append((child, where.format(path=path, key=key), level + 1))
