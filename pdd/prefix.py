"""Prefix block hashes: the names the gateway and the decode agents give to cached KV blocks.

A block hash covers every token from the start of the prompt to the end of that block (a
chain hash), so equal hashes mean equal prefixes. Torch-free: the gateway imports it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any


def _chain(previous: bytes, block: Sequence[int]) -> bytes:
    digest = hashlib.blake2b(previous, digest_size=8)
    digest.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in block))
    return digest.digest()


def prefix_block_hashes(token_ids: Sequence[int], block_tokens: int) -> tuple[str, ...]:
    """One hash per whole block of `block_tokens` tokens; a trailing partial block has none."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    hashes: list[str] = []
    previous = b""
    for end in range(block_tokens, len(token_ids) + 1, block_tokens):
        previous = _chain(previous, token_ids[end - block_tokens : end])
        hashes.append(previous.hex())
    return tuple(hashes)


def tree_block_hashes(root: Any, block_tokens: int, limit: int = 8192) -> list[str]:
    """Hashes of every whole block held in a radix tree (nodes with `.children` and `.key`,
    a run of whole blocks of token ids), most shallow first, at most `limit` of them.

    Read-only; the caller must own the tree (the engine thread)."""
    out: list[str] = []
    frontier: list[tuple[Any, bytes]] = [(child, b"") for child in root.children.values()]
    while frontier and len(out) < limit:
        next_frontier: list[tuple[Any, bytes]] = []
        for node, previous in frontier:
            key = node.key
            for start in range(0, len(key) - block_tokens + 1, block_tokens):
                previous = _chain(previous, key[start : start + block_tokens])
                out.append(previous.hex())
                if len(out) >= limit:
                    return out
            next_frontier.extend((child, previous) for child in node.children.values())
        frontier = next_frontier
    return out
