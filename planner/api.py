"""The planner's public API: ``simulate(scenario)`` and ``plan(...)``, plain dicts in and out;
``planner.size.size(scenario, rps)`` (the cheapest fleet meeting the SLA, and the best-BCR
fleet) builds on it.

The Django command, REST endpoint and UI page call these; so does ``python -m planner``.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import time
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdd.hardware import EngineSpec
from pdd.policy import Role
from pdd.spec import build, integer, number
from planner.fleet import FleetSpec, fleet_from_dict
from planner.metrics import Sla, Tariff, revenue, summarise
from planner.microbench import simulate_transfers
from planner.scenario import case_configs, load_scenario, set_path
from planner.sim import RunRecord, Simulator
from planner.wan import WanLinkSpec
from planner.workload import Trace, WorkloadSpec, generate, read_trace


@dataclass(slots=True)
class CaseResult:
    name: str
    summary: dict[str, Any]
    series: dict[str, list[float]] = field(default_factory=dict)
    goodput: dict[str, Any] | None = None
    wall_s: float = 0.0


@dataclass(slots=True)
class SimResult:
    scenario: str
    kind: str
    cases: dict[str, CaseResult]
    sweep: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "kind": self.kind,
            "cases": {
                name: {
                    "summary": c.summary,
                    "goodput": c.goodput,
                    "wall_s": c.wall_s,
                    "series": c.series,
                }
                for name, c in self.cases.items()
            },
            "sweep": self.sweep,
            "warnings": warnings_of(self),
        }


@dataclass(slots=True)
class PlanResult:
    counts: dict[str, int]  # "role@datacenter:gpu" -> units
    goodput_rps: float
    cost_per_hour: float
    bcr: float
    summary: dict[str, Any]
    # The goodput's band: the drawn rates between which the search stopped (the SLA held at
    # the first, failed at the second), and whether it still held at the search's ceiling.
    bracket: list[float] = field(default_factory=list)
    at_ceiling: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "counts": self.counts,
            "goodput_rps": self.goodput_rps,
            "goodput_bracket_rps": self.bracket,
            "at_ceiling": self.at_ceiling,
            "cost_per_hour": self.cost_per_hour,
            "bcr": self.bcr,
            "summary": self.summary,
        }


# --- building blocks -------------------------------------------------------------------------


def make_trace(config: Mapping[str, Any], rps: float | None = None, settle: bool = True) -> Trace:
    """The case's trace: replayed from ``trace_file`` or generated from ``workload``.

    A replay is open loop unless ``trace_closed_loop`` is true (each session's turn then waits
    for its previous turn's response, as ``workload.closed_loop`` does for generated traces).
    ``settle=False`` drops ``workload.settle_s`` (a transfer-only run has no fleet to settle).
    """
    source = _trace_source(config, rps, settle)
    if isinstance(source, WorkloadSpec):
        return generate(source)
    path, closed = source
    return read_trace(path, closed_loop=closed)


def _trace_source(
    config: Mapping[str, Any], rps: float | None = None, settle: bool = True
) -> WorkloadSpec | tuple[Path, bool]:
    """What ``make_trace`` reads or generates, checked without doing either: the trace file
    and whether its replay is closed loop, or the workload to generate."""
    if config.get("trace_file"):
        closed = config.get("trace_closed_loop", False)
        if not isinstance(closed, bool):
            raise ValueError(f"trace_closed_loop: must be true or false, got {closed!r}")
        path = Path(config["trace_file"])
        if not path.is_file():
            raise ValueError(f"{path}: no such trace file")
        return path, closed
    workload = dict(config.get("workload", {}))
    if rps is not None:
        workload["rps"] = rps
    if not settle:
        workload["settle_s"] = 0.0
    return build(WorkloadSpec, workload, "workload")


def run_fleet(
    fleet: FleetSpec,
    trace: Trace,
    sla: Sla,
    warmup_s: float,
    tariff: Tariff | None = None,
    stop_on_miss: bool = False,
) -> tuple[dict[str, Any], RunRecord]:
    """Simulate ``trace`` on ``fleet``; figures count from ``warmup_s`` after its settle span.

    ``stop_on_miss``: stop the run once the SLA is certain to fail (``Simulator.run``); its
    summary then has ``stopped_at_s`` and TTFT figures that are lower bounds. A run that meets
    the SLA is never stopped, so its figures are those of a full run.
    """
    warmup = trace.settle_s + warmup_s
    stop = (warmup, sla.ttft_p90_s, sla.ttft_p99_s) if stop_on_miss else None
    record = Simulator(fleet).run(trace, stop_on_miss=stop)
    summary = summarise(record, sla, warmup, fleet.cost_per_hour(), tariff)
    summary["links"] = link_report(fleet)
    if fleet.host is not None:
        summary["host"] = host_report(fleet, record)
    return summary, record


def host_report(fleet: FleetSpec, record: RunRecord) -> dict[str, Any]:
    """A shared host's cores and the CPU seconds each task used, and the span from the start to
    the last answer (the window the live benchmark takes its processes' CPU over)."""
    assert fleet.host is not None
    span = max((t for t in record.finish_s.tolist() if t == t), default=0.0)
    return {
        "cores": fleet.host.cores,
        "request_cpu_s": fleet.host.request_cpu_s,
        "cpu_s": dict(record.host_cpu_s),
        "span_s": span,
    }


def link_report(fleet: FleetSpec) -> dict[str, Any]:
    """Each WAN link's limits (line, pool ceiling, which binds) for a fleet that uses one."""
    if fleet.system == "idc-pd":
        return {}
    return {dc: spec.describe() for dc, spec in fleet.links.items()}


def warnings_of(result: SimResult) -> list[str]:
    """One line per distinct warning in a result's cases (a pool ceiling below its line),
    naming the link and the cases it applies to."""
    seen: dict[tuple[str, str], list[str]] = {}
    for name, case in result.cases.items():
        links = case.summary.get("links") or {}
        if "link" in case.summary:
            links = {"": case.summary["link"]}
        for dc, info in links.items():
            if info and info.get("warning"):
                seen.setdefault((dc, info["warning"]), []).append(name)
    return [
        f"link{' ' + dc if dc else ''} ({', '.join(names)}): {warning}"
        for (dc, warning), names in seen.items()
    ]


def goodput_search(
    fleet: FleetSpec,
    config: Mapping[str, Any],
    sla: Sla,
    warmup_s: float,
    lo_rps: float,
    hi_rps: float,
    iters: int = 6,
    rel_tol: float | None = None,
    tariff: Tariff | None = None,
) -> dict[str, Any]:
    """Highest offered RPS at which the TTFT SLA still holds: the goodput.

    Plain bisection on [lo_rps, hi_rps] for ``iters`` steps, or, with ``rel_tol``, a bracket
    found by doubling from ``lo_rps`` (up to ``hi_rps``) and then bisection until the bracket
    is narrower than ``rel_tol`` of its lower end (same relative resolution at 10 or 200 RPS).
    ``at_ceiling`` says the SLA still held at ``hi_rps`` (the goodput is only a lower bound).
    With a ``tariff``, ``revenue`` is what the goodput earns (per request, per hour, per
    unit-hour of hardware) with the requests billed as at the goodput's run.
    """
    runs = 0

    def met(rps: float, stop: bool = True) -> tuple[bool, dict[str, Any]]:
        # A run past the first is stopped once its SLA is certain to fail: only a run that
        # meets it gives figures (``best``), and those are a full run's.
        nonlocal runs
        runs += 1
        summary, _ = run_fleet(
            fleet, make_trace(config, rps), sla, warmup_s, tariff, stop_on_miss=stop
        )
        return summary["sla"]["met"], summary

    ok, summary = met(lo_rps, stop=False)  # reported as is when even it fails
    cost = fleet.cost_per_hour()

    def found(goodput: float, at: dict[str, Any], **rest: Any) -> dict[str, Any]:
        out = {"goodput_rps": goodput, **rest, "bcr": goodput / cost, "cost_per_hour": cost,
               "at": at, "runs": runs}  # fmt: skip
        if tariff is not None:
            out["revenue"] = revenue(tariff, at["billed_tokens"], goodput, cost)
        return out

    if not ok:
        return found(0.0, summary, bracket=[0.0, lo_rps], at_ceiling=False)
    best = summary
    lo, hi = lo_rps, hi_rps
    at_ceiling = False
    if rel_tol is not None:
        hi = lo
        while True:
            nxt = min(hi * 2, hi_rps)
            ok, summary = met(nxt)
            if not ok:
                hi = nxt
                break
            lo, best = nxt, summary
            if nxt >= hi_rps:
                hi, at_ceiling = nxt, True
                break
            hi = nxt
        while not at_ceiling and (hi - lo) > rel_tol * lo:
            mid = (lo + hi) / 2
            ok, summary = met(mid)
            if ok:
                lo, best = mid, summary
            else:
                hi = mid
    else:
        for _ in range(iters):
            mid = (lo + hi) / 2
            ok, summary = met(mid)
            if ok:
                lo, best = mid, summary
            else:
                hi = mid
        at_ceiling = lo >= hi_rps - 1e-9
    # The search steps the drawn rate; the goodput is the rate the fleet actually received
    # there (equal for open-loop traffic, lower where closed-loop sessions waited on it).
    return found(best["offered_rps"], best, drawn_rps=lo, bracket=[lo, hi], at_ceiling=at_ceiling)


def case_sla(config: Mapping[str, Any]) -> Sla:
    return build(Sla, config.get("sla", {}), "sla")


def case_tariff(config: Mapping[str, Any]) -> Tariff | None:
    """The case's ``tariff`` (absent or null: no revenue figures)."""
    data = config.get("tariff")
    return None if data is None else build(Tariff, data, "tariff")


_SEARCH_KEYS = ("lo_rps", "hi_rps", "iters", "rel_tol")


def search_bounds(
    search: Any, where: str, defaults: Mapping[str, Any] | None = None, extra: tuple = ()
) -> dict[str, Any]:
    """The checked ``lo_rps`` / ``hi_rps`` / ``iters`` / ``rel_tol`` of a goodput search.

    ``defaults`` fills missing keys (without, ``lo_rps`` and ``hi_rps`` are required);
    ``extra`` names other keys the mapping may hold.
    """
    if not isinstance(search, Mapping):
        raise ValueError(f"{where}: must be an object")
    unknown = sorted(
        str(k) for k in search if not str(k).startswith("_") and k not in _SEARCH_KEYS + extra
    )
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: unknown field")
    search = {**(defaults or {}), **search}
    for key in ("lo_rps", "hi_rps"):
        if key not in search:
            raise ValueError(f"{where}.{key}: required")
    lo = number(search["lo_rps"], f"{where}.lo_rps", positive=True)
    hi = number(search["hi_rps"], f"{where}.hi_rps", positive=True)
    if hi < lo:
        raise ValueError(f"{where}.hi_rps: must be >= lo_rps ({hi:g} < {lo:g})")
    iters = search.get("iters", 6)
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"{where}.iters: must be an integer >= 1, got {iters!r}")
    rel_tol = search.get("rel_tol")
    if rel_tol is not None:
        rel_tol = number(rel_tol, f"{where}.rel_tol", positive=True)
    return {"lo_rps": lo, "hi_rps": hi, "iters": iters, "rel_tol": rel_tol}


@dataclass(slots=True)
class _Case:
    """A fleet case's parsed settings: everything ``run_case`` needs besides the trace."""

    fleet: FleetSpec
    sla: Sla
    tariff: Tariff | None
    warmup_s: float
    search: dict[str, Any] | None


# What a case (base merged with its override) may hold; a transfer case ignores the fleet keys
# the shared defaults bring in.
CASE_KEYS = frozenset(
    {"description", "fleet", "workload", "sla", "tariff", "warmup_s", "goodput_search",
     "trace_file", "trace_closed_loop", "link", "kv_bytes_per_token"}
)  # fmt: skip


def parse_case(name: str, config: Mapping[str, Any], kind: str) -> _Case | WanLinkSpec:
    """Check a case's settings: a fleet case's parsed form, or a transfer case's link.

    Errors name the case and the field.
    """
    try:
        unknown = sorted(
            str(k) for k in config if not str(k).startswith("_") and k not in CASE_KEYS
        )
        if unknown:
            raise ValueError(
                f"{unknown[0]}: unknown field (a case holds {', '.join(sorted(CASE_KEYS))})"
            )
        if kind == "transfer":
            link = build(WanLinkSpec, config.get("link", {}), "link")
            kv = config.get("kv_bytes_per_token")
            if isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0:
                raise ValueError(f"kv_bytes_per_token: must be a positive integer, got {kv!r}")
            _trace_source(config, settle=False)
            return link
        if "fleet" not in config:
            raise ValueError("fleet: required")
        fleet = fleet_from_dict(config["fleet"])
        case = _Case(
            fleet,
            case_sla(config),
            case_tariff(config),
            number(config.get("warmup_s", 60.0), "warmup_s"),
            None,
        )
        search = config.get("goodput_search")
        if search:
            case.search = search_bounds(search, "goodput_search")
        _trace_source(config)
        return case
    except ValueError as exc:
        raise ValueError(f"case {name!r}: {exc}") from exc


def run_case(name: str, config: Mapping[str, Any], kind: str) -> CaseResult:
    start = time.perf_counter()
    case = parse_case(name, config, kind)
    if isinstance(case, WanLinkSpec):  # a transfer case
        trace = make_trace(config, settle=False)
        summary = simulate_transfers(case, trace, config["kv_bytes_per_token"])
        return CaseResult(name, summary, wall_s=time.perf_counter() - start)
    goodput = None
    if case.search:
        s = case.search
        goodput = goodput_search(
            case.fleet, config, case.sla, case.warmup_s, s["lo_rps"], s["hi_rps"],
            s["iters"], s["rel_tol"], case.tariff,
        )  # fmt: skip
        summary = goodput["at"]
        series: dict[str, list[float]] = {}
    else:
        summary, record = run_fleet(
            case.fleet, make_trace(config), case.sla, case.warmup_s, case.tariff
        )
        series = record.series
    return CaseResult(name, summary, series, goodput, time.perf_counter() - start)


# --- public API ----------------------------------------------------------------------------


def _run_job(job: tuple[str, dict[str, Any], str]) -> CaseResult:
    return run_case(*job)


def _run_all(jobs: list[tuple[str, dict[str, Any], str]], workers: int) -> list[CaseResult]:
    """``run_case`` on every job, in order; on ``workers`` processes when more than one."""
    if workers <= 1 or len(jobs) <= 1:
        return list(map(_run_job, jobs))
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
        return list(pool.map(_run_job, jobs))


# --- one point of a sizing search or a band (in a worker process) ---------------------------


def fleet_with_counts(fleet: Mapping[str, Any], counts: tuple[int, ...]) -> dict[str, Any]:
    out = copy.deepcopy(dict(fleet))
    out["pools"] = [{**p, "count": c} for p, c in zip(fleet["pools"], counts, strict=True)]
    return out


def _scaled(fleet: dict[str, Any], constants: Mapping[str, float]) -> dict[str, Any]:
    """``fleet`` with engine constants multiplied (``{"prefill_efficiency": 1.05}``)."""
    if not constants:
        return fleet
    engine = dict(fleet.get("engine", {}))
    for name, factor in constants.items():
        base = engine.get(name, getattr(EngineSpec(), name))
        engine[name] = min(base * factor, 1.0) if name.endswith("efficiency") else base * factor
    return {**fleet, "engine": engine}


def evaluate(job: tuple[Any, ...]) -> dict[str, Any]:
    """Simulate one (fleet counts, rate, constants) point; the figures sizing (planner/size.py)
    and the bands need."""
    fleet, config, counts, rps, constants = job
    mods = dict(constants)
    # "rate_factor": the same requests, arriving f times faster (times and gaps divided by f):
    # the rate changes but the sample does not (common random numbers), so the figure moves
    # by what the rate does, not by a new draw. "seed": another draw at the same rate.
    factor = float(mods.pop("rate_factor", 1.0))
    # "stop_on_miss": only whether the SLA holds matters (a search's probe), so a run is
    # stopped once it is certain to fail; its TTFT figures are then lower bounds ("stopped").
    stop = bool(mods.pop("stop_on_miss", False))
    seed = mods.pop("seed", None)
    if seed is not None:
        config = {**config, "workload": {**config.get("workload", {}), "seed": int(seed)}}
    spec = fleet_from_dict(_scaled(fleet_with_counts(fleet, counts), mods))
    trace = _trace_for(config, rps)
    if factor != 1.0:
        trace = dataclasses.replace(
            trace, arrival_s=trace.arrival_s / factor, settle_s=trace.settle_s / factor
        )
    summary, _ = run_fleet(
        spec,
        trace,
        case_sla(config),
        number(config.get("warmup_s", 60.0), "warmup_s"),
        case_tariff(config),
        stop_on_miss=stop,
    )
    tokens = summary.get("tokens", {})
    return {
        "met": bool(summary["sla"]["met"]),
        "stopped": "stopped_at_s" in summary,
        "ttft_p50_s": summary["ttft_s"]["p50"],
        "ttft_p90_s": summary["ttft_s"]["p90"],
        "ttft_p99_s": summary["ttft_s"]["p99"],
        "offered_rps": summary["offered_rps"],
        "relay_share": tokens.get("relay_share"),
        "cost_per_hour": spec.cost_per_hour(),
    }


_TRACES: dict[str, Trace] = {}


def _trace_for(config: Mapping[str, Any], rps: float) -> Trace:
    """``make_trace(config, rps)``, kept for the next point of a search in this process (its
    points share the workload and rate; generating takes ~5% of a run). Not mutated: the
    simulator copies what it changes."""
    if config.get("trace_file"):
        return make_trace(config, rps)
    key = json.dumps([config.get("workload", {}), rps], sort_keys=True, default=repr)
    trace = _TRACES.get(key)
    if trace is None:
        if len(_TRACES) >= 4:
            _TRACES.pop(next(iter(_TRACES)))
        trace = _TRACES[key] = make_trace(config, rps)
    return trace


def seed_list(config: Mapping[str, Any], seeds: int) -> tuple[int, ...]:
    """The ``seeds`` seeds after the case's own, for its seed spread."""
    seed = int(config.get("workload", {}).get("seed", 0))
    return tuple(seed + 1 + i for i in range(seeds))


def add_bands(
    result: SimResult,
    configs: Mapping[str, Mapping[str, Any]],
    band_pct: float,
    constants_pct: float,
    jobs: int = 1,
    seeds: int = 0,
) -> None:
    """Attach ``summary["band"]`` (planner/bands.py) to every case run at one rate: a fleet
    case with a generated workload and no goodput search (a goodput's band is its bracket)."""
    from planner.bands import band_of, band_points

    planned: dict[str, tuple[float, list[tuple[Any, ...]]]] = {}
    for name, config in configs.items():
        case = result.cases.get(name)
        if case is None or case.goodput or config.get("trace_file") or "fleet" not in config:
            continue
        rps = float(config.get("workload", {}).get("rps", WorkloadSpec().rps))
        counts = tuple(int(p.get("count", 0)) for p in config["fleet"]["pools"])
        planned[name] = (
            rps,
            [
                (config["fleet"], dict(config), counts, r, k)
                for r, k in band_points(rps, band_pct, constants_pct, seed_list(config, seeds))
            ],
        )
    flat = [job for _, js in planned.values() for job in js]
    if not flat:
        return
    if jobs <= 1:
        outs = list(map(evaluate, flat))
    else:
        with ProcessPoolExecutor(max_workers=min(jobs, len(flat))) as pool:
            outs = list(pool.map(evaluate, flat))
    it = iter(outs)
    for name, (rps, js) in planned.items():
        results = [next(it) for _ in js]
        result.cases[name].summary["band"] = band_of(
            results, rps, band_pct, constants_pct, seed_list(configs[name], seeds)
        )


def simulate(
    scenario: str | Mapping[str, Any],
    jobs: int = 1,
    band_pct: float = 0.0,
    constants_pct: float = 0.0,
    seeds: int = 0,
) -> SimResult:
    """Run every case of a scenario (a bundled name, a path, or a parsed dict).

    ``jobs`` > 1 runs cases (and a sweep's points) on that many processes; the results are
    the same as one after another (every run is seeded). ``band_pct`` > 0 (and
    ``constants_pct``) also runs each single-rate case at nearby rates (and engine constants)
    and attaches its band and cliff flag (planner/bands.py) as ``summary["band"]``; a sweep
    gets none (its points are the band).
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs: must be an integer >= 1, got {jobs!r}")
    band_pct = number(band_pct, "band_pct")
    constants_pct = number(constants_pct, "constants_pct")
    seeds = integer(seeds, "seeds", 0, 16)
    if band_pct >= 50 or constants_pct >= 50:
        raise ValueError("band_pct, constants_pct: must be below 50 (percent)")
    data = load_scenario(scenario)
    kind = data["kind"]
    configs = case_configs(data)
    sweep = data.get("sweep")
    if not sweep:
        for name, cfg in configs.items():
            parse_case(name, cfg, kind)  # every case's settings checked before any run
        results = _run_all([(name, cfg, kind) for name, cfg in configs.items()], jobs)
        out = SimResult(str(data.get("name", "scenario")), kind, {r.name: r for r in results})
        if kind == "fleet" and (band_pct or constants_pct or seeds):
            add_bands(out, configs, band_pct, constants_pct, jobs, seeds)
        return out
    # A sweep runs every case at every value of one parameter (e.g. the mean hit rate).
    path, values = sweep.get("path"), sweep.get("values")
    if not isinstance(path, str) or not isinstance(values, list) or not values:
        raise ValueError("sweep: needs a dotted 'path' and a non-empty 'values' list")
    points = []
    for i, value in enumerate(values):
        for name, base in configs.items():
            cfg = copy.deepcopy(base)
            set_path(cfg, path, value)
            parse_case(f"{name}@{value}", cfg, kind)
            points.append((i, name, (f"{name}@{value}", cfg, kind)))
    results = _run_all([job for _, _, job in points], jobs)
    rows: list[dict[str, Any]] = [{"value": value} for value in values]
    cases: dict[str, CaseResult] = {}
    for (i, name, _), result in zip(points, results, strict=True):
        cases[result.name] = result
        rows[i][name] = result.goodput if result.goodput else result.summary
    return SimResult(str(data.get("name", "scenario")), kind, cases, rows)


def plan(
    fleet_spec: Mapping[str, Any],
    workload_spec: Mapping[str, Any],
    sla: Mapping[str, Any],
    search_space: Mapping[str, Any],
    top: int = 5,
    tariff: Mapping[str, Any] | None = None,
) -> list[PlanResult]:
    """Search P / RLD / MD counts per datacenter for the best BCR under the SLA.

    ``search_space``: ``{"pools": [{"role", "gpu", "datacenter", "counts": [..]}, ...],
    "lo_rps", "hi_rps", "iters"}``. Each combination replaces ``fleet_spec["pools"]``; its
    goodput is found by bisection on offered RPS; results are sorted by BCR, best first.
    With a ``tariff`` each result's summary also says what its goodput earns (``revenue``).
    """
    pools = search_space.get("pools")
    if not isinstance(pools, list) or not pools:
        raise ValueError("search_space.pools: needs a non-empty list")
    gpu_types = fleet_spec.get("gpu_types", {}) if isinstance(fleet_spec, Mapping) else {}
    for i, p in enumerate(pools):
        where = f"search_space.pools[{i}]"
        counts = p.get("counts") if isinstance(p, Mapping) else None
        if not isinstance(counts, list) or not counts:
            raise ValueError(f"{where}.counts: needs a non-empty list")
        # Checked here: a bad pool would otherwise make every combination unservable, and
        # those are skipped silently (an empty plan instead of an error).
        unknown = sorted(str(k) for k in p if not str(k).startswith("_") and k not in
                         ("role", "gpu", "datacenter", "counts"))  # fmt: skip
        if unknown:
            raise ValueError(f"{where}.{unknown[0]}: unknown field")
        for j, c in enumerate(counts):
            integer(c, f"{where}.counts[{j}]", 0)
        if p.get("role") not in Role.CHOICES:
            raise ValueError(
                f"{where}.role: must be one of {', '.join(Role.CHOICES)}, got {p.get('role')!r}"
            )
        if p.get("gpu") not in gpu_types:
            raise ValueError(f"{where}.gpu: unknown GPU type {p.get('gpu')!r}")
        if not isinstance(p.get("datacenter"), str) or not p.get("datacenter"):
            raise ValueError(f"{where}.datacenter: must be a non-empty string")
    bounds = search_bounds(
        search_space, "search_space", {"lo_rps": 1.0, "hi_rps": 100.0, "iters": 5},
        extra=("pools", "warmup_s"),
    )  # fmt: skip
    sla_obj = build(Sla, sla, "sla")
    tariff_obj = None if tariff is None else build(Tariff, tariff, "tariff")
    config = {"workload": dict(workload_spec)}
    _trace_source(config)
    warmup = number(search_space.get("warmup_s", 60.0), "search_space.warmup_s")
    results = []
    for combo in itertools.product(*(p["counts"] for p in pools)):
        chosen = [
            {"role": p["role"], "gpu": p["gpu"], "datacenter": p["datacenter"], "count": c}
            for p, c in zip(pools, combo, strict=True)
        ]
        try:
            fleet = fleet_from_dict({**fleet_spec, "pools": chosen})
        except ValueError:
            continue  # e.g. no main decode at all: not a servable fleet
        found = goodput_search(
            fleet,
            config,
            sla_obj,
            warmup,
            bounds["lo_rps"],
            bounds["hi_rps"],
            bounds["iters"],
            tariff=tariff_obj,
        )
        counts = {f"{p['role']}@{p['datacenter']}:{p['gpu']}": p["count"] for p in chosen}
        results.append(
            PlanResult(
                counts,
                found["goodput_rps"],
                fleet.cost_per_hour(),
                found["goodput_rps"] / fleet.cost_per_hour(),
                found["at"],
                list(found["bracket"]),
                bool(found.get("at_ceiling", False)),
            )
        )
    results.sort(key=lambda r: (-r.bcr, r.cost_per_hour))
    return results[:top]
