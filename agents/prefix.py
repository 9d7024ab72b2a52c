"""Prefix block hashes: the names the gateway and the decode agents give to cached KV blocks.

A block hash covers every token from the start of the prompt to the end of that block (a
chain hash), so equal hashes mean equal prefixes. Torch-free: the gateway imports it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

HASH_HEX_CHARS = 16


def prefix_block_hashes(token_ids: Sequence[int], block_tokens: int) -> tuple[str, ...]:
    """One hash per whole block of `block_tokens` tokens; a trailing partial block has none."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    hashes: list[str] = []
    previous = b""
    for end in range(block_tokens, len(token_ids) + 1, block_tokens):
        block = token_ids[end - block_tokens : end]
        digest = hashlib.blake2b(previous, digest_size=8)
        digest.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in block))
        previous = digest.digest()
        hashes.append(previous.hex())
    return tuple(hashes)
