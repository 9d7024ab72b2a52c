"""KV in flight to MD, counted in its prefix match (PROTOCOL.md, `reserve`).

In agentic traffic turn k+1's prompt extends turn k's. When turn k+1 reaches MD while turn k's
KV is still crossing the WAN, MD's radix cache does not hold that KV yet, but it is committed
to MD (reserved and on its way). MD counts it: the reservation answers the longest whole-block
prefix shared with any request whose KV is incoming on that instance, and the import waits for
that request's KV to land first. These helpers are the prompt comparison."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# The first comparison window is small so that unrelated prompts are rejected at once; later
# windows grow so a long shared prefix (~100K tokens) costs a few vectorised compares.
FIRST_WINDOW = 64
MAX_WINDOW = 1 << 16


def as_tokens(prompt: Sequence[int] | np.ndarray) -> np.ndarray:
    """A prompt as a flat int64 array (the form the comparisons take)."""
    return np.asarray(prompt, dtype=np.int64).reshape(-1)


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Number of leading tokens `a` and `b` share; compares window by window and stops at the
    first window holding a mismatch."""
    n = min(len(a), len(b))
    lo, window = 0, FIRST_WINDOW
    while lo < n:
        hi = min(n, lo + window)
        mismatch = np.flatnonzero(a[lo:hi] != b[lo:hi])
        if mismatch.size:
            return lo + int(mismatch[0])
        lo, window = hi, min(window * 4, MAX_WINDOW)
    return n


def block_prefix_len(a: np.ndarray, b: np.ndarray, block_size: int) -> int:
    """The shared prefix of `a` and `b` rounded down to whole blocks: the part of one prompt
    whose KV the other's import puts in the radix cache."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    common = common_prefix_len(a, b)
    return common - common % block_size
