"""Typed readers for the environment variables that configure the control plane."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from pdd.checks import is_number

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def env_bool(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean (use true/false, 1/0, yes/no)")


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not an integer") from None


def env_float(name: str, default: float, *, minimum: float = 0.0) -> float:
    """A finite number of at least `minimum` (seconds, rates); ImproperlyConfigured otherwise."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not a number") from None
    if not is_number(value) or value < minimum:
        raise ImproperlyConfigured(f"{name}={raw!r} must be a finite number >= {minimum:g}")
    return value


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def env_int_list(name: str, default: list[int], *, count: int) -> tuple[int, ...]:
    """Up to `count` whole numbers >= 0, comma-separated; empty: none (keep the library's own);
    unset: `default`. ImproperlyConfigured otherwise."""
    raw = os.environ.get(name)
    if raw is None:
        return tuple(default)
    items = [item.strip() for item in raw.split(",") if item.strip()]
    try:
        values = tuple(int(item) for item in items)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not a list of whole numbers") from None
    if len(values) > count or any(v < 0 for v in values):
        raise ImproperlyConfigured(f"{name}={raw!r}: at most {count} whole numbers >= 0")
    return values


def generated_secret_key(path: Path) -> str:
    """The key in `path`, made once (random, 0600) if the file does not exist yet. Several
    processes starting at once agree: the first to link its file into place wins."""
    try:
        found = path.read_text().strip()
    except FileNotFoundError:
        found = ""
    if found:
        return found
    path.parent.mkdir(parents=True, exist_ok=True)
    draft = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_urlsafe(50))
    try:
        os.link(draft, path)  # fails if another process got there first
    except FileExistsError:
        pass
    finally:
        draft.unlink()
    found = path.read_text().strip()
    if not found:
        raise ImproperlyConfigured(f"{path} is empty: delete it, or set SECRET_KEY")
    return found
