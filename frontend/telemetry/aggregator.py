"""Rolling-window aggregation of request records: what one record adds, and what a window says.

A record becomes a handful of integer increments (request counts by labels, one latency bin per
histogram, token and byte counters, SLA counters) added to its second's bucket, its minute's
bucket and the running totals. Windows are sums of buckets, so state from any number of
processes merges by addition. Latency sums are kept in microseconds to stay integer.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from dataclasses import field as dc_field
from datetime import datetime
from typing import Any

from frontend.telemetry import histogram
from frontend.telemetry.store import MINUTE, SECOND, TOTAL, Bucket, Deltas, Store, merge_into

# Request-record latencies (each the record's `<name>_s`): TTFT to the user's first token, which
# leaves with the decoding role's stream; prefill time on P; KV wait (P's token ready to the
# decoding role's first token); the largest gap between tokens (the handoff's stall); TPOT; e2e.
LATENCIES = ("ttft", "prefill", "kv_wait", "max_gap", "tpot", "e2e")
NONE_LABEL = "none"
STATUS_OK = "ok"
# Histograms kept for /metrics only (not charted): decode time (first token to last, e2e - TTFT)
# and queue time (arrival at the gateway to P admitting the request: TTFT less P's own part).
METRIC_LATENCIES = ("decode", "queue")
# Prompt / output length histograms: vLLM's 1-2-5 buckets (1, 2, 5, 10, ... 1,000,000 tokens).
TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5) if m * 10**e <= 10**6)
FINISHED_STATUSES = ("ok", "cancelled")
# Live chart points are computed over this many trailing seconds.
POINT_WINDOW_S = 10
WINDOWS_S = {"1m": 60, "5m": 300, "1h": 3600}


@dataclass(frozen=True, slots=True)
class SLA:
    """Goodput SLA of one served model: P90 TTFT < p90_ttft_s and P99 TTFT < p99_ttft_s."""

    p90_ttft_s: float = 10.0
    p99_ttft_s: float = 15.0

    def __post_init__(self) -> None:
        assert 0 < self.p90_ttft_s <= self.p99_ttft_s, "need 0 < P90 bound <= P99 bound"


def _get(record: Any, name: str, default: Any = None) -> Any:
    if isinstance(record, Mapping):
        return record.get(name, default)
    return getattr(record, name, default)


def _label(value: Any) -> str:
    text = str(value or "").replace("|", "/").strip()
    return text or NONE_LABEL


def record_timestamp(record: Any, default: float) -> float:
    created = _get(record, "created_at")
    if isinstance(created, datetime):
        return created.timestamp()
    if isinstance(created, int | float):
        return float(created)
    return default


def token_bucket(n: int) -> int:
    """Index of the smallest TOKEN_BUCKETS bound >= n (len(TOKEN_BUCKETS) past the last)."""
    for i, bound in enumerate(TOKEN_BUCKETS):
        if n <= bound:
            return i
    return len(TOKEN_BUCKETS)


def finish_label(status: str, reason: str) -> str | None:
    """vLLM's finish_reason of a finished request: stop / length for a completed one (unknown
    for records written before the gateway kept it), abort for one the client cancelled."""
    if status == STATUS_OK:
        return reason if reason in ("stop", "length") else "unknown"
    if status == "cancelled":
        return "abort"
    return None


def _metric_latencies(record: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    ttft, e2e = _get(record, "ttft_s"), _get(record, "e2e_s")
    if ttft is not None and e2e is not None:
        out["decode"] = max(0.0, float(e2e) - float(ttft))
    prefill, kv_wait = _get(record, "prefill_s"), _get(record, "kv_wait_s")
    early = bool(_get(record, "first_token_early"))
    if ttft is not None and prefill is not None and (early or kv_wait is not None):
        at_p = float(prefill) + (0.0 if early else float(kv_wait))
        out["queue"] = max(0.0, float(ttft) - at_p)
    return out


def error_deltas(status: int, code: str, tenant: str, model: str) -> dict[str, int]:
    """The counter increment of one error answer the gateway sent."""
    return {f"x|{_label(tenant)}|{_label(model)}|{int(status)}|{_label(code)}": 1}


def record_deltas(record: Any, sla: SLA) -> dict[str, int]:
    """The counter increments one request record contributes."""
    model = _label(_get(record, "model"))
    pipeline = _label(_get(record, "pipeline"))
    handoff = _label(_get(record, "handoff_mode"))
    status = _label(_get(record, "status"))
    out: dict[str, int] = {f"r|{model}|{pipeline}|{handoff}|{status}": 1}
    for name in LATENCIES:
        value = _get(record, f"{name}_s")
        if value is None:
            continue
        value = max(0.0, float(value))
        out[f"h|{name}|{model}|{pipeline}|{histogram.bin_index(value)}"] = 1
        out[f"u|{name}|{model}|{pipeline}"] = round(value * 1e6)
    for name, value in _metric_latencies(record).items():
        out[f"h|{name}|{model}|{pipeline}|{histogram.bin_index(value)}"] = 1
        out[f"u|{name}|{model}|{pipeline}"] = round(value * 1e6)
    finish = finish_label(status, str(_get(record, "finish_reason") or ""))
    if finish is not None:
        out[f"f|{model}|{finish}"] = 1
        for kind, attr in (("prompt", "prompt_tokens"), ("generation", "completion_tokens")):
            n = int(_get(record, attr) or 0)
            out[f"n|{kind}|{model}|{token_bucket(n)}"] = 1
            if n:
                out[f"ns|{kind}|{model}"] = n
    ttft = _get(record, "ttft_s")
    if status == STATUS_OK and ttft is not None:
        out[f"g|{model}|ok"] = 1
        if ttft < sla.p90_ttft_s:
            out[f"g|{model}|fast"] = 1
        elif ttft < sla.p99_ttft_s:
            out[f"g|{model}|mid"] = 1
    for key, attr in (
        ("prompt", "prompt_tokens"),
        ("cached", "cached_tokens"),
        ("completion", "completion_tokens"),
        ("rld", "tokens_by_rld"),
        ("md", "tokens_by_md"),
        ("migrations", "migrations"),
    ):
        value = int(_get(record, attr) or 0)
        if value:
            out[f"k|{key}"] = value
    wan = int(_get(record, "kv_bytes_wan") or 0)
    if wan:
        src = _label(_get(record, "prefill_instance"))
        dst = _label(_get(record, "main_instance"))
        out[f"w|{src}|{dst}"] = wan
    intra = int(_get(record, "kv_bytes_intra_dc") or 0)
    if intra:
        out["i"] = intra
    return out


def goodput_count(fast: float, mid: float, slow: float) -> float:
    """Largest number of requests that together meet a P90/P99 TTFT SLA.

    ``fast`` met the P90 bound, ``mid`` only the P99 bound, ``slow`` neither. At most 10% of
    the counted requests may miss the P90 bound and at most 1% the P99 bound, so the tail is
    counted only as far as the fast requests leave room for it.
    """
    mid_counted = min(mid, fast / 9)
    slow_counted = max(0.0, min(slow, (fast + mid_counted) / 99, fast / 9 - mid_counted))
    return fast + mid_counted + slow_counted


@dataclass(slots=True)
class Parsed:
    """A bucket (or a sum of buckets) decoded into labelled counters."""

    requests: dict[tuple[str, str, str, str], int]
    hist: dict[tuple[str, str, str], dict[int, int]]
    sums_us: dict[tuple[str, str, str], int]
    sla: dict[str, dict[str, int]]
    tokens: dict[str, int]
    wan: dict[tuple[str, str], int]
    intra_bytes: int
    cost_micro: int | None
    # (model, finish_reason) -> finished requests
    finished: dict[tuple[str, str], int] = dc_field(default_factory=dict)
    # (prompt|generation, model) -> {token bucket index: count}, and their token sums
    lengths: dict[tuple[str, str], dict[int, int]] = dc_field(default_factory=dict)
    length_sums: dict[tuple[str, str], int] = dc_field(default_factory=dict)
    # (tenant, model, HTTP status, error code) -> error answers
    errors: dict[tuple[str, str, str, str], int] = dc_field(default_factory=dict)


def parse(bucket: Mapping[str, int]) -> Parsed:
    p = Parsed({}, {}, {}, {}, {}, {}, 0, None)
    for field, value in bucket.items():
        parts = field.split("|")
        tag = parts[0]
        if tag == "r" and len(parts) == 5:
            p.requests[(parts[1], parts[2], parts[3], parts[4])] = value
        elif tag == "h" and len(parts) == 5:
            p.hist.setdefault((parts[1], parts[2], parts[3]), {})[int(parts[4])] = value
        elif tag == "u" and len(parts) == 4:
            p.sums_us[(parts[1], parts[2], parts[3])] = value
        elif tag == "g" and len(parts) == 3:
            p.sla.setdefault(parts[1], {})[parts[2]] = value
        elif tag == "k" and len(parts) == 2:
            p.tokens[parts[1]] = value
        elif tag == "w" and len(parts) == 3:
            p.wan[(parts[1], parts[2])] = value
        elif tag == "f" and len(parts) == 3:
            p.finished[(parts[1], parts[2])] = value
        elif tag == "n" and len(parts) == 4:
            p.lengths.setdefault((parts[1], parts[2]), {})[int(parts[3])] = value
        elif tag == "ns" and len(parts) == 3:
            p.length_sums[(parts[1], parts[2])] = value
        elif tag == "x" and len(parts) == 5:
            p.errors[(parts[1], parts[2], parts[3], parts[4])] = value
        elif tag == "i":
            p.intra_bytes = value
        elif tag == "cost_micro":
            p.cost_micro = value
    return p


def _percentiles(counts: Mapping[int, int], sum_us: int) -> dict[str, float | None]:
    n = sum(counts.values())
    return {
        "p50": histogram.percentile(counts, 0.50),
        "p90": histogram.percentile(counts, 0.90),
        "p99": histogram.percentile(counts, 0.99),
        "mean": (sum_us / 1e6 / n) if n else None,
        "count": n,
    }


def latency_by_pipeline(p: Parsed, name: str) -> dict[str, dict[str, float | None]]:
    """Percentiles of one latency per pipeline, and over all pipelines as ``all``."""
    merged: dict[str, dict[int, int]] = {}
    sums: dict[str, int] = {}
    for (lat, _model, pipeline), counts in p.hist.items():
        if lat != name:
            continue
        for target in (pipeline, "all"):
            merge_into(merged.setdefault(target, {}), counts)
    for (lat, _model, pipeline), value in p.sums_us.items():
        if lat == name:
            for target in (pipeline, "all"):
                sums[target] = sums.get(target, 0) + value
    return {k: _percentiles(v, sums.get(k, 0)) for k, v in sorted(merged.items())}


def summarize(
    p: Parsed,
    *,
    seconds: float,
    cost_per_hour: float | None,
    link_of: Mapping[tuple[str, str], str] | None = None,
    link_bandwidth_gbps: Mapping[str, float] | None = None,
    slas: Mapping[str, SLA] | None = None,
) -> dict[str, Any]:
    """Everything the dashboard shows for one window of ``seconds``."""
    seconds = max(seconds, 1e-9)
    total = sum(p.requests.values())
    by_pipeline: dict[str, int] = {}
    by_status: dict[str, int] = {}
    for (_m, pipeline, _h, status), n in p.requests.items():
        by_pipeline[pipeline] = by_pipeline.get(pipeline, 0) + n
        by_status[status] = by_status.get(status, 0) + n
    good = 0.0
    sla_met: dict[str, bool] = {}
    for model, c in p.sla.items():
        fast, mid, ok = c.get("fast", 0), c.get("mid", 0), c.get("ok", 0)
        good += goodput_count(fast, mid, ok - fast - mid)
        sla_met[model] = ok > 0 and (ok - fast) <= 0.1 * ok and (ok - fast - mid) <= 0.01 * ok
    goodput_rps = good / seconds
    tokens = {k: p.tokens.get(k, 0) for k in ("prompt", "cached", "completion", "rld", "md")}
    decoded = tokens["rld"] + tokens["md"]
    wan_bytes: dict[str, int] = {}
    for pair, nbytes in p.wan.items():
        link = (link_of or {}).get(pair, "unresolved")
        wan_bytes[link] = wan_bytes.get(link, 0) + nbytes
    # Per link: bytes, Gbit/s and the share of its bandwidth (None: bandwidth unknown).
    wan: dict[str, dict[str, float | None]] = {}
    for link, total_bytes in wan_bytes.items():
        gbps = total_bytes * 8 / seconds / 1e9
        bandwidth = (link_bandwidth_gbps or {}).get(link)
        utilisation = gbps / bandwidth if bandwidth else None
        wan[link] = {"bytes": total_bytes, "gbps": gbps, "utilisation": utilisation}
    bcr = goodput_rps / cost_per_hour if cost_per_hour else None
    return {
        "seconds": seconds,
        "requests": total,
        "rps": total / seconds,
        "requests_by_pipeline": by_pipeline,
        "requests_by_status": by_status,
        "goodput_rps": goodput_rps,
        "sla_met": sla_met,
        **{name: latency_by_pipeline(p, name) for name in LATENCIES},
        "tokens": tokens,
        "rld_share": tokens["rld"] / decoded if decoded else None,
        "md_share": tokens["md"] / decoded if decoded else None,
        "cache_hit_rate": tokens["cached"] / tokens["prompt"] if tokens["prompt"] else None,
        "wan": wan,
        "intra_dc_bytes": p.intra_bytes,
        "cost_per_hour": cost_per_hour,
        "bcr": bcr,
    }


class Aggregator:
    """Adds records into a Store and reads windows back. Thread-safe; one per process."""

    def __init__(self, store: Store, *, sla_for=None) -> None:
        self.store = store
        self._sla_for = sla_for or (lambda model: SLA())
        self._lock = threading.Lock()

    # -- writing -------------------------------------------------------------------------
    def observe(self, record: Any, *, now: float | None = None) -> None:
        self.observe_many([record], now=now)

    def observe_many(self, records: Iterable[Any], *, now: float | None = None) -> int:
        """Aggregate records (RequestRecord rows or mappings with the same field names)."""
        import time

        default_ts = time.time() if now is None else now
        deltas: Deltas = {}
        n = 0
        for record in records:
            ts = record_timestamp(record, default_ts)
            fields = record_deltas(record, self._sla_for(_label(_get(record, "model"))))
            sec = int(ts)
            for bucket in ((SECOND, sec), (MINUTE, sec // 60), (TOTAL, 0)):
                target = deltas.get(bucket)
                if target is None:
                    deltas[bucket] = dict(fields)
                else:
                    merge_into(target, fields)
            n += 1
        if deltas:
            self.store.apply(deltas)
        return n

    def observe_error(
        self, status: int, code: str, tenant: str, model: str, *, now: float | None = None
    ) -> None:
        """Count one error answer (4xx/5xx) of the gateway, by tenant, model, status and code."""
        import time

        sec = int(time.time() if now is None else now)
        fields = error_deltas(status, code, tenant, model)
        buckets = ((SECOND, sec), (MINUTE, sec // 60), (TOTAL, 0))
        self.store.apply({bucket: dict(fields) for bucket in buckets})

    def record_cost(self, cost_per_hour: float, *, now: float) -> None:
        """Sample the fleet's cost per hour into the current second and minute (a gauge)."""
        value = {"cost_micro": round(cost_per_hour * 1e6)}
        self.store.set_values(SECOND, int(now), value)
        self.store.set_values(MINUTE, int(now) // 60, value)

    # -- reading -------------------------------------------------------------------------
    def seconds(self, start: int, end: int, *, now: float) -> dict[int, Bucket]:
        """Second buckets start..end inclusive (missing ones are absent)."""
        return self.store.read(SECOND, range(start, end + 1), now=now)

    def minutes(self, start: int, end: int, *, now: float) -> dict[int, Bucket]:
        return self.store.read(MINUTE, range(start, end + 1), now=now)

    def window(self, name: str, *, now: float) -> tuple[Parsed, float]:
        """Counters of a named window ending now, and its length in seconds.

        1m and 5m slide by the second (the current, partial second included); 1h is the
        current minute plus the 59 before it, so it slides by the minute.
        """
        length = WINDOWS_S[name]
        now_i = int(now)
        merged: Bucket = {}
        if length <= 300:
            buckets = self.seconds(now_i - length + 1, now_i, now=now).values()
            span = float(length)
        else:
            minute = now_i // 60
            count = length // 60
            buckets = self.minutes(minute - count + 1, minute, now=now).values()
            span = (count - 1) * 60 + (now - minute * 60)
        for bucket in buckets:
            merge_into(merged, {k: v for k, v in bucket.items() if k != "cost_micro"})
        return parse(merged), span

    def series(
        self, *, now: float, points: int, step: str = SECOND
    ) -> list[tuple[int, Parsed, float]]:
        """Chart points ending at the last complete second (or minute): each is the sum of the
        trailing POINT_WINDOW_S seconds (or one minute) with that step's cost sample."""
        if step == SECOND:
            last = int(now) - 1
            first = last - points - POINT_WINDOW_S + 2
            buckets = self.seconds(first, last, now=now)
            out = []
            for t in range(last - points + 1, last + 1):
                merged: Bucket = {}
                cost = None
                for s in range(t - POINT_WINDOW_S + 1, t + 1):
                    b = buckets.get(s)
                    if b:
                        merge_into(merged, b)
                        cost = b.get("cost_micro", cost)
                if cost is not None:
                    merged["cost_micro"] = cost
                out.append((t, parse(merged), float(POINT_WINDOW_S)))
            return out
        last = int(now) // 60 - 1
        buckets = self.minutes(last - points + 1, last, now=now)
        return [
            (m * 60, parse(buckets.get(m, {})), 60.0) for m in range(last - points + 1, last + 1)
        ]

    def totals(self) -> Parsed:
        return parse(self.store.read_total())
