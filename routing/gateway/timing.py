"""Where a request's time goes in the gateway, per stage, sent back as a ``Server-Timing``
header (the W3C format browsers' developer tools and curl -v show) and used by
bench/gateway_overhead.py to break the gateway's overhead down."""

from __future__ import annotations

import time

# The ASGI scope key the outermost ASGI layer (controlplane.limits.BodyGuard) stamps with the
# time.perf_counter() of the request's arrival, so the gateway's first lap counts from there.
RECEIVED = "baton.received"


class Stopwatch:
    """Laps in milliseconds since the previous lap (or the start), in order."""

    __slots__ = ("_last", "laps")

    def __init__(self, start: float | None = None) -> None:
        """``start``: a ``time.perf_counter()`` reading to count the first lap from (the
        moment the ASGI app got the request, ``RECEIVED``), else now."""
        self._last = time.perf_counter() if start is None else start
        self.laps: dict[str, float] = {}

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.laps[stage] = self.laps.get(stage, 0.0) + (now - self._last) * 1000.0
        self._last = now

    def header(self) -> str:
        """``stage;dur=ms`` entries, comma-separated (Server-Timing)."""
        return ", ".join(f"{stage};dur={ms:.3f}" for stage, ms in self.laps.items())
