"""Tokenizers for served models on the gateway (torch-free): bytes for baton-tiny, a Hugging
Face tokenizer.json for checkpoints the gateway can read."""

from __future__ import annotations

import threading
from pathlib import Path

from pdd.profiles import is_profile_source
from pdd.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, apply_chat_template
from routing.gateway.errors import GatewayError

_cache: dict[tuple[str, str], Tokenizer] = {}
_lock = threading.Lock()

__all__ = ["apply_chat_template", "tokenizer_for"]


def tokenizer_for(*, name: str, source: str, tokenizer: str) -> Tokenizer:
    key = (source, tokenizer)
    with _lock:
        found = _cache.get(key)
    if found is not None:
        return found
    if not tokenizer and (source == "baton-tiny" or is_profile_source(source)):
        # baton-tiny and the emulated engine's model profiles speak the byte tokenizer's ids.
        found = ByteTokenizer()
    else:
        path = Path(tokenizer or source)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise GatewayError(
                503,
                f"The tokenizer of model '{name}' ({path}) is not available on this gateway.",
                type_="server_error",
                code="tokenizer_unavailable",
            )
        try:
            found = HFTokenizer(path)
        except Exception as exc:  # a file that is not a tokenizer: any parser error
            raise GatewayError(
                503,
                f"The tokenizer of model '{name}' ({path}) could not be loaded: "
                f"{type(exc).__name__}: {str(exc)[:200]}",
                type_="server_error",
                param="model",
                code="tokenizer_unavailable",
            ) from exc
    with _lock:
        _cache[key] = found
    return found
