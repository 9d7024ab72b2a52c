"""The one definition of an agentic workload: a seeded trace generator and a trace-file reader.

Feeds the simulator, the demo traffic generator and the benchmark. Needs numpy, not matplotlib.
A trace is columns of equal length: arrival time, input tokens, cached (reusable-prefix)
tokens, output tokens and the session (prefix) id that successive turns share.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pdd.spec import (
    build,
    check_bool,
    check_int,
    check_non_negative,
    check_positive,
    check_range,
    number,
)

TRACE_COLUMNS = ("arrival_s", "input_tokens", "cached_tokens", "output_tokens", "session_id")


@dataclass(slots=True)
class HitRateDist:
    """Per-request prefix-hit distribution.

    ``skewed``: a fraction ``high_fraction`` hits uniformly in [``high_lo``, 1]; the rest follow
    a Beta on [0, ``high_lo``] whose mean makes the overall mean ``mean`` (production-like: most
    requests hit > 95%, a few low-hit requests carry most of the KV). ``uniform``: U[lo, hi].
    ``fixed``: every request hits ``mean`` (for sweeps). ``session``: no draw at all; the hit
    follows from the session's context growth (:class:`ContextGrowth`, which must then be set).
    """

    kind: str = "skewed"
    mean: float = 0.9
    high_fraction: float = 0.75
    high_lo: float = 0.95
    concentration: float = 2.0  # Beta a + b of the low part: small = spread out
    lo: float = 0.85
    hi: float = 0.95

    def __post_init__(self) -> None:
        if self.kind not in ("skewed", "uniform", "fixed", "session"):
            raise ValueError(f"kind: must be skewed, uniform, fixed or session, got {self.kind!r}")
        for name in ("mean", "high_fraction", "high_lo", "lo", "hi"):
            check_range(self, name, 0.0, 1.0)
        check_positive(self, "concentration")
        if self.lo > self.hi:
            raise ValueError("lo: must be <= hi")
        if self.kind == "skewed":
            low_mean = self._low_mean()
            if not 0.0 < low_mean < self.high_lo:
                raise ValueError(
                    f"mean: {self.mean} is unreachable with high_fraction {self.high_fraction}"
                )

    def _low_mean(self) -> float:
        high_mean = (self.high_lo + 1.0) / 2
        return (self.mean - self.high_fraction * high_mean) / (1.0 - self.high_fraction)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "session":
            raise ValueError("hit_rate.kind: 'session' needs workload.context")
        if self.kind == "fixed":
            return np.full(n, self.mean)
        if self.kind == "uniform":
            return rng.uniform(self.lo, self.hi, n)
        high = rng.random(n) < self.high_fraction
        out = rng.uniform(self.high_lo, 1.0, n)
        mu = self._low_mean() / self.high_lo
        a, b = mu * self.concentration, (1 - mu) * self.concentration
        out[~high] = rng.beta(a, b, int((~high).sum())) * self.high_lo
        return out


@dataclass(slots=True)
class LengthDist:
    """Log-normal token counts, clipped; optional mixture for short agent outputs."""

    median: float = 56_000
    sigma: float = 0.45
    min: int = 1
    max: int = 131_072
    # Extra components as [weight, median, sigma]; the main component gets the remaining weight.
    mixture: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_positive(self, "median")
        check_positive(self, "sigma")
        check_int(self, "min", 1)
        check_int(self, "max", 1)
        if self.min > self.max:
            raise ValueError("min: must be <= max")
        if not isinstance(self.mixture, list):
            raise ValueError(
                f"mixture: must be a list of [weight, median, sigma], got {self.mixture!r}"
            )
        for i, part in enumerate(self.mixture):
            if not isinstance(part, (list, tuple)) or len(part) != 3:
                raise ValueError(f"mixture[{i}]: must be [weight, median, sigma], got {part!r}")
            for j, what in enumerate(("weight", "median", "sigma")):
                number(part[j], f"mixture[{i}].{what}", positive=True)
        if sum(w for w, _, _ in self.mixture) >= 1.0:
            raise ValueError("mixture: weights must sum below 1")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        medians = np.full(n, float(self.median))
        sigmas = np.full(n, float(self.sigma))
        pick = rng.random(n)
        edge = 0.0
        for weight, median, sigma in self.mixture:
            chosen = (pick >= edge) & (pick < edge + weight)
            medians[chosen], sigmas[chosen] = median, sigma
            edge += weight
        values = np.exp(np.log(medians) + sigmas * rng.standard_normal(n))
        return np.clip(np.rint(values), self.min, self.max).astype(np.int64)


@dataclass(slots=True)
class ContextGrowth:
    """How an agent session's context grows turn by turn (couples hit rate to length).

    Turn 0 sends ``first_prompt`` tokens (system prompt, tools, task, files); only the
    ``shared_prefix_tokens`` common to every session are cached anywhere. Turn k sends the
    previous prompt, the previous output and ``append`` new tokens (tool results, user
    message); the previous prompt is the cached (reusable) prefix. When the context would exceed
    ``max_context_tokens`` the agent compacts it into a fresh ``first_prompt``-sized context,
    which again hits only the shared prefix. So high-hit requests are late turns of long
    contexts with a small delta, and the few low-hit ones are openings and compactions whose
    whole context is new KV.
    """

    first_prompt: LengthDist = field(
        default_factory=lambda: LengthDist(median=40_000, sigma=0.6, min=1_024, max=131_072)
    )
    append: LengthDist = field(
        default_factory=lambda: LengthDist(median=300, sigma=1.2, min=1, max=65_536)
    )
    shared_prefix_tokens: int = 4_000
    max_context_tokens: int = 131_072

    def __post_init__(self) -> None:
        if isinstance(self.first_prompt, Mapping):
            self.first_prompt = build(LengthDist, self.first_prompt, "first_prompt")
        if isinstance(self.append, Mapping):
            self.append = build(LengthDist, self.append, "append")
        check_int(self, "shared_prefix_tokens", 0)
        check_int(self, "max_context_tokens", 1)
        if self.shared_prefix_tokens >= self.max_context_tokens:
            raise ValueError("shared_prefix_tokens: must be below max_context_tokens")

    def grow(
        self, rng: np.random.Generator, turns: np.ndarray, outputs: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(input tokens, cached tokens) of every turn; ``turns`` sessions laid out in order."""
        n = int(turns.sum())
        first = self.first_prompt.sample(rng, n).tolist()
        append = self.append.sample(rng, n).tolist()
        out = outputs.tolist()
        inputs = [0] * n
        cached = [0] * n
        shared, cap = self.shared_prefix_tokens, self.max_context_tokens
        k = 0
        for t in turns.tolist():
            ctx = 0
            for j in range(t):
                nxt = ctx + out[k - 1] + append[k] if j else 0
                if j == 0 or nxt > cap:
                    # Opening (or compaction): a fresh context, only the shared prefix cached.
                    nxt = max(first[k], shared + 1)
                    cached[k] = shared
                else:
                    cached[k] = ctx
                inputs[k] = ctx = min(nxt, cap)
                k += 1
        return np.array(inputs, dtype=np.int64), np.array(cached, dtype=np.int64)


@dataclass(slots=True)
class WorkloadSpec:
    """An agentic workload: Poisson arrivals, multi-turn sessions reusing their prefix."""

    rps: float = 80.0
    duration_s: float = 600.0
    seed: int = 0
    mean_turns: float = 8.0  # geometric number of turns per session
    turn_gap_s: float = 60.0  # mean time between a session's turns (response + tool time)
    # Closed loop: a turn is sent at its drawn time or, if the previous turn's response has not
    # ended by then, when it ends (an agent loop waits for the answer), so a prompt never
    # includes an output that does not exist yet. Open loop (False): every turn arrives at its
    # drawn time whatever the previous turn is doing.
    closed_loop: bool = True
    # Simulated time before the measured span (the trace is shifted so the span starts here):
    # turns drawn in [-settle_s, 0) are sent too. With closed-loop sessions a fleet that answers
    # slower than the drawn turn gap holds more sessions open at once, and that population takes
    # about a session's lifetime to build up; without a settle span every run starts with the
    # population of a fleet that answers at once, and a slow fleet is measured receiving less
    # than the drawn rate. The metrics' warm-up counts from the end of this span.
    settle_s: float = 0.0
    input_tokens: LengthDist = field(default_factory=LengthDist)
    # Published: ~30% of agentic outputs < 100 tokens and ~40% <= 500 (docs/pdd.md); the rest long.
    output_tokens: LengthDist = field(
        default_factory=lambda: LengthDist(
            median=1_200, sigma=0.7, min=1, max=8_192, mixture=[[0.3, 30, 0.9], [0.1, 250, 0.4]]
        )
    )
    hit_rate: HitRateDist = field(default_factory=HitRateDist)
    # When set, input lengths come from session context growth instead of ``input_tokens``;
    # hit_rate kind "session" then takes the cached prefix from the growth as well, any other
    # kind draws the hit on top of those lengths (the same lengths, another hit distribution).
    context: ContextGrowth | None = None

    def __post_init__(self) -> None:
        check_positive(self, "rps")
        check_positive(self, "duration_s")
        check_int(self, "seed", 0)
        check_bool(self, "closed_loop")
        if number(self.mean_turns, "mean_turns") < 1:
            raise ValueError(f"mean_turns: must be >= 1, got {self.mean_turns!r}")
        check_positive(self, "turn_gap_s")
        check_non_negative(self, "settle_s")
        if isinstance(self.input_tokens, Mapping):
            self.input_tokens = build(LengthDist, self.input_tokens, "input_tokens")
        if isinstance(self.output_tokens, Mapping):
            self.output_tokens = build(LengthDist, self.output_tokens, "output_tokens")
        if isinstance(self.hit_rate, Mapping):
            self.hit_rate = build(HitRateDist, self.hit_rate, "hit_rate")
        if isinstance(self.context, Mapping):
            self.context = build(ContextGrowth, self.context, "context")
        if self.hit_rate.kind == "session" and self.context is None:
            raise ValueError("hit_rate.kind: 'session' needs workload.context")


@dataclass(slots=True)
class Trace:
    """Columns of one request each, sorted by arrival."""

    arrival_s: np.ndarray
    input_tokens: np.ndarray
    cached_tokens: np.ndarray
    output_tokens: np.ndarray
    session_id: np.ndarray
    # True: a turn with an earlier turn of its session in the trace is sent at ``arrival_s`` or
    # when that earlier turn's response ends, whichever is later (the simulator places it).
    closed_loop: bool = False
    # Seconds at the start of the trace that only settle the fleet (``WorkloadSpec.settle_s``):
    # run figures are measured from its end (plus the run's warm-up).
    settle_s: float = 0.0
    # Tokens every session shares from its first turn (the context's shared prefix): a turn
    # whose cached part is no longer opens a session, so no unit holds more of it than that.
    shared_prefix_tokens: int = 0

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def hit_rate(self) -> np.ndarray:
        return self.cached_tokens / np.maximum(self.input_tokens, 1)

    def validate(self) -> None:
        n = len(self.arrival_s)
        for name in TRACE_COLUMNS:
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name}: length differs from arrival_s")
        if n and np.any(np.diff(self.arrival_s) < 0):
            raise ValueError("arrival_s: must be sorted")
        if np.any(self.input_tokens < 1) or np.any(self.output_tokens < 1):
            raise ValueError("input_tokens/output_tokens: must be >= 1")
        if np.any(self.cached_tokens < 0) or np.any(self.cached_tokens > self.input_tokens):
            raise ValueError("cached_tokens: must be in [0, input_tokens]")

    def previous_turn(self) -> np.ndarray:
        """Index of the same session's previous request in the trace, -1 for its first."""
        prev = np.full(len(self), -1, dtype=np.int64)
        last: dict[int, int] = {}
        for i, s in enumerate(self.session_id.tolist()):
            prev[i] = last.get(s, -1)
            last[s] = i
        return prev


def generate(spec: WorkloadSpec) -> Trace:
    """Generate a reproducible agentic trace from ``spec`` (same seed, same trace).

    Sessions open as a Poisson process at ``rps / mean_turns``, run a geometric number of turns
    and space them by the agent's think/tool time, so a turn normally arrives after the previous
    one finished (as an agent loop does). Sessions also open before t=0 so the window starts in
    steady state. Lengths and hit rates are drawn per request from the spec's distributions.
    With ``settle_s`` the turns drawn in [-settle_s, 0) are kept as well and every arrival is
    shifted by ``settle_s`` (the trace starts at 0; the measured span at ``settle_s``).
    """
    rng = np.random.default_rng(spec.seed)
    settle = float(spec.settle_s)
    # long enough for the session mix to settle before the first simulated turn
    lead = spec.mean_turns * spec.turn_gap_s * 3 + settle
    n_sessions = int(rng.poisson(spec.rps / spec.mean_turns * (spec.duration_s + lead)))
    starts = rng.uniform(-lead, spec.duration_s, n_sessions)
    turns = rng.geometric(1.0 / spec.mean_turns, n_sessions)
    session = np.repeat(np.arange(n_sessions, dtype=np.int64), turns)
    gaps = rng.exponential(spec.turn_gap_s, len(session))
    first = np.concatenate(([0], np.cumsum(turns)[:-1]))
    gaps[first] = 0.0  # a session's first turn arrives at its start
    offsets = np.cumsum(gaps)
    offsets -= np.repeat(offsets[first], turns)
    arrival = np.repeat(starts, turns) + offsets
    keep = (arrival >= -settle) & (arrival < spec.duration_s)
    arrival = arrival + settle
    if spec.context is not None:
        # Lengths follow each session's growth from its first turn (before t=0 too).
        outputs = spec.output_tokens.sample(rng, len(session))
        inputs, grown = spec.context.grow(rng, turns, outputs)
        arrival, session = arrival[keep], session[keep]
        inputs, grown, outputs = inputs[keep], grown[keep], outputs[keep]
        order = np.argsort(arrival, kind="stable")
        arrival, session = arrival[order], session[order]
        inputs, grown, outputs = inputs[order], grown[order], outputs[order]
        if spec.hit_rate.kind == "session":
            cached = grown
        else:
            cached = np.floor(spec.hit_rate.sample(rng, len(inputs)) * inputs).astype(np.int64)
        return Trace(
            arrival, inputs, cached, outputs, session, spec.closed_loop, settle,
            shared_prefix_tokens=spec.context.shared_prefix_tokens,
        )  # fmt: skip
    arrival, session = arrival[keep], session[keep]
    order = np.argsort(arrival, kind="stable")
    arrival, session = arrival[order], session[order]
    n = len(arrival)
    inputs = spec.input_tokens.sample(rng, n)
    outputs = spec.output_tokens.sample(rng, n)
    cached = np.floor(spec.hit_rate.sample(rng, n) * inputs).astype(np.int64)
    return Trace(arrival, inputs, cached, outputs, session, spec.closed_loop, settle)


# --- trace files ---------------------------------------------------------------------------


def write_trace(trace: Trace, path: str | Path) -> None:
    """Write CSV (``.csv``) or JSON lines (anything else) with the TRACE_COLUMNS."""
    path = Path(path)
    rows = zip(
        trace.arrival_s.tolist(),
        trace.input_tokens.tolist(),
        trace.cached_tokens.tolist(),
        trace.output_tokens.tolist(),
        trace.session_id.tolist(),
        strict=True,
    )
    with path.open("w", newline="") as fh:
        if path.suffix == ".csv":
            writer = csv.writer(fh)
            writer.writerow(TRACE_COLUMNS)
            writer.writerows(rows)
        else:
            for row in rows:
                fh.write(json.dumps(dict(zip(TRACE_COLUMNS, row, strict=True))) + "\n")


def read_trace(path: str | Path, closed_loop: bool = False) -> Trace:
    """Read a CSV or JSONL trace.

    Required per row: ``arrival_s``, ``input_tokens``, ``output_tokens`` and one of
    ``cached_tokens`` or ``hit_rate``; optional ``session_id`` (alias ``prefix_id``, any string;
    each row is its own session when absent). Rows are sorted by arrival. ``closed_loop``: a
    session's turn waits for its previous turn's response (see ``Trace.closed_loop``); replays
    are open loop by default. Raises ValueError naming the line and field on bad input.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such trace file")
    records = _read_csv(path) if path.suffix == ".csv" else _read_jsonl(path)
    if not records:
        raise ValueError(f"{path}: trace has no requests")
    n = len(records)
    arrival = np.empty(n)
    inputs = np.empty(n, dtype=np.int64)
    cached = np.empty(n, dtype=np.int64)
    outputs = np.empty(n, dtype=np.int64)
    sessions = np.empty(n, dtype=np.int64)
    session_ids: dict[str, int] = {}
    for i, (line, rec) in enumerate(records):
        where = f"{path.name}:{line}"
        arrival[i] = _number(rec, "arrival_s", where, float)
        inputs[i] = _number(rec, "input_tokens", where, int)
        outputs[i] = _number(rec, "output_tokens", where, int)
        if rec.get("cached_tokens") not in (None, ""):
            cached[i] = _number(rec, "cached_tokens", where, int)
        elif rec.get("hit_rate") not in (None, ""):
            cached[i] = int(_number(rec, "hit_rate", where, float) * inputs[i])
        else:
            raise ValueError(f"{where}: needs cached_tokens or hit_rate")
        key = rec.get("session_id", rec.get("prefix_id"))
        key = f"row-{i}" if key in (None, "") else str(key)
        sessions[i] = session_ids.setdefault(key, len(session_ids))
        if arrival[i] < 0 or inputs[i] < 1 or outputs[i] < 1 or not 0 <= cached[i] <= inputs[i]:
            raise ValueError(f"{where}: values out of range")
    order = np.argsort(arrival, kind="stable")
    trace = Trace(
        arrival[order], inputs[order], cached[order], outputs[order], sessions[order], closed_loop
    )
    trace.validate()
    return trace


def _read_csv(path: Path) -> list[tuple[int, dict[str, Any]]]:
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        if reader.fieldnames is None or "arrival_s" not in reader.fieldnames:
            raise ValueError(f"{path.name}:1: CSV header must name arrival_s and the other fields")
        return [(i + 2, row) for i, row in enumerate(reader)]


def _read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    records = []
    with path.open() as fh:
        for i, text in enumerate(fh, start=1):
            if not text.strip():
                continue
            try:
                rec = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path.name}:{i}: not JSON ({exc.msg})") from exc
            if not isinstance(rec, dict):
                raise ValueError(f"{path.name}:{i}: each line must be a JSON object")
            records.append((i, rec))
    return records


def _number(rec: Mapping[str, Any], name: str, where: str, kind: type) -> Any:
    if name not in rec or rec[name] in (None, ""):
        raise ValueError(f"{where}: missing {name}")
    try:
        value = kind(float(rec[name]))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {name} is not a number: {rec[name]!r}") from exc
    return value
