"""The WAN transfer microbenchmark: every request's KV delta over one link, nothing else.

Mirrors PDD's measurement (one 20 Gbps line, 80 RPS, 90% mean hit): transfer time includes
the wait for a pooled connection, fair sharing of the line and one RTT.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from planner.events import EventLoop
from planner.metrics import percentiles
from planner.wan import WanLink, WanLinkSpec
from planner.workload import Trace


def simulate_transfers(
    link_spec: WanLinkSpec, trace: Trace, kv_bytes_per_token: int
) -> dict[str, Any]:
    loop = EventLoop()
    link = WanLink(link_spec, loop)
    n = len(trace)
    total = np.full(n, np.nan)
    wait = np.full(n, np.nan)
    delta = (trace.input_tokens - trace.cached_tokens) * kv_bytes_per_token

    def done(i: int, seconds: float, waited: float) -> None:
        total[i], wait[i] = seconds, waited

    for i, (t, nbytes) in enumerate(zip(trace.arrival_s.tolist(), delta.tolist(), strict=True)):
        loop.at(t, functools.partial(link.send, nbytes, functools.partial(done, i)))
    end = float(trace.arrival_s[-1]) if n else 0.0
    loop.run(until=end)  # figures over the offered window; transfers still open count as NaN
    hit = trace.hit_rate
    return {
        "requests": n,
        "mean_hit_rate": float(hit.mean()),
        "share_hit_above_95": float((hit > 0.95).mean()),
        "offered_gbps": float(delta.sum() * 8 / max(end, 1e-9) / 1e9),
        "transfer_s": percentiles(total, (50, 90, 99)) | {"max": float(np.nanmax(total))},
        "pool_wait_s": percentiles(wait, (50, 90, 99)),
        "pool_utilisation": link.pool_busy_integral / max(end, 1e-9),
        "link_utilisation": link.bytes_sent / (link.capacity * max(end, 1e-9)),
        "unfinished_at_end": int(np.isnan(total).sum()),
        "link": link_spec.describe(),
    }
