"""Where a request's time goes in the gateway, per stage, sent back as a ``Server-Timing``
header (the W3C format browsers' developer tools and curl -v show) and used by
bench/gateway_overhead.py to break the gateway's overhead down."""

from __future__ import annotations

import time


class Stopwatch:
    """Laps in milliseconds since the previous lap (or the start), in order."""

    __slots__ = ("_last", "laps")

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.laps[stage] = self.laps.get(stage, 0.0) + (now - self._last) * 1000.0
        self._last = now

    def header(self) -> str:
        """``stage;dur=ms`` entries, comma-separated (Server-Timing)."""
        return ", ".join(f"{stage};dur={ms:.3f}" for stage, ms in self.laps.items())
