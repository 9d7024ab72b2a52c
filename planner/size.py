"""Sizing: the cheapest fleet that meets the SLA at a target rate, and the best-BCR fleet.

``size(scenario, rps)`` searches pool counts without running the full grid. It assumes each
role is *monotone*: one more unit of any pool never makes the SLA harder to meet. Then:

1. From the starting fleet (the scenario's, or the one in the database), every count is
   doubled until the SLA holds at the target rate (an upper bound that meets it).
2. Each pool in turn, most expensive unit first, is cut to the fewest units that still meet
   the SLA with the other pools where they are: a bisection on that count, run as a
   multi-section search so that ``workers`` counts of the bracket are simulated at once.
   Cutting a later pool only makes an earlier pool's one-fewer fail harder (monotonicity),
   so one pass leaves every pool at a count where one unit fewer breaks the SLA.
3. The result is checked: the found fleet is simulated again with one unit fewer of each pool
   (``one_fewer``); the pools whose cut breaks the SLA are the binding ones. Where a finite
   run's noise breaks monotonicity and a cut still meets the SLA, it is taken and the check
   repeats.

This is a local minimum of cost (a cheaper fleet trading one role for another may exist);
the output says so. The best-BCR fleet is the best of the cheapest fleets found at a few
multiples of the rate (``bcr_scan``): the cheapest fleet meeting rate r maximises r / cost
among fleets meeting r, so the best over r approximates the best BCR; each candidate's
goodput is then searched for (its BCR = goodput / cost).

Simulations run on ``workers`` processes (default: the cores this process may use); every run
is seeded, so a point's figures do not depend on the number of workers. The bracket's probes
do (``workers`` counts at a time), so where a finite run's noise breaks monotonicity (a P99 at
its bound) another worker count can end at another local minimum: paper-ttft at 100 RPS (300 s
after a 900-s settle) gives 58 / 6 / 41 units on one worker and 67 / 6 / 35 on two, 1.3% apart
in cost.

A probe only needs whether the SLA holds: it runs with ``PROBE`` (stop once the SLA is certain
to fail, ``Simulator.run``'s ``stop_on_miss``); one that meets it runs to its end, so the found
fleet's figures are a full run's, and the band's points run in full.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor, ProcessPoolExecutor, as_completed
from typing import Any, TextIO

from pdd.spec import integer, number
from planner.api import evaluate, fleet_with_counts
from planner.fleet import fleet_from_dict
from planner.scenario import case_configs, load_scenario

MAX_COUNT = 4096
# The search's runs need only whether the SLA holds: each stops once it is certain to fail
# (planner.api.evaluate's "stop_on_miss"); a run that meets the SLA runs to its end.
PROBE = (("stop_on_miss", True),)
MIN_COUNT = {"prefill": 1, "main_decode": 1, "relay_decode": 0}


def available_cores() -> int:
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not on Linux
        return max(os.cpu_count() or 1, 1)


class Progress:
    """A one-line progress bar on a stream (stderr); silent when the stream is not a TTY."""

    def __init__(self, stream: TextIO | None = None, enabled: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.done = 0
        self.total = 0
        self.note = ""
        self.start = time.perf_counter()

    def add(self, n: int) -> None:
        self.total += n
        self._draw()

    def step(self, note: str | None = None) -> None:
        self.done += 1
        if note is not None:
            self.note = note
        self._draw()

    def phase(self, note: str) -> None:
        self.note = note
        self._draw()

    def _draw(self) -> None:
        if not self.enabled:
            return
        width = 24
        filled = int(width * self.done / self.total) if self.total else 0
        bar = "#" * filled + "." * (width - filled)
        elapsed = time.perf_counter() - self.start
        line = f"\r[{bar}] {self.done}/{self.total} runs {elapsed:5.1f}s {self.note}"[:120]
        self.stream.write(line.ljust(100))
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


# --- one simulation (in a worker process) ----------------------------------------------------


def _goodput_job(job: tuple[Any, ...]) -> dict[str, Any]:
    from planner.api import case_sla, case_tariff, goodput_search

    fleet, config, counts, lo, hi, rel_tol = job
    spec = fleet_from_dict(fleet_with_counts(fleet, counts))
    found = goodput_search(
        spec, config, case_sla(config), number(config.get("warmup_s", 60.0), "warmup_s"),
        lo, hi, rel_tol=rel_tol, tariff=case_tariff(config),
    )  # fmt: skip
    return {k: found[k] for k in ("goodput_rps", "bcr", "cost_per_hour", "bracket", "runs")} | {
        "at_ceiling": found.get("at_ceiling", False)
    }


class Runner:
    """Runs jobs on a process pool (or here, with one worker), caching every point."""

    def __init__(
        self,
        fleet: Mapping[str, Any],
        config: Mapping[str, Any],
        workers: int,
        progress: Progress,
    ) -> None:
        self.fleet = dict(fleet)
        self.config = dict(config)
        self.workers = workers
        self.progress = progress
        self.cache: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.pool: Executor | None = ProcessPoolExecutor(workers) if workers > 1 else None
        self.runs = 0

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()

    def _map(self, fn: Callable[[Any], Any], jobs: list[Any], note: str) -> list[Any]:
        self.progress.add(len(jobs))
        self.runs += len(jobs)
        if self.pool is None or len(jobs) == 1:
            out = []
            for job in jobs:
                out.append(fn(job))
                self.progress.step(note)
            return out
        futures = {self.pool.submit(fn, job): i for i, job in enumerate(jobs)}
        results: list[Any] = [None] * len(jobs)
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            self.progress.step(note)
        return results

    def points(
        self,
        points: Iterable[tuple[tuple[int, ...], float, tuple[tuple[str, float], ...]]],
        note: str = "",
    ) -> list[dict[str, Any]]:
        points = list(points)
        todo = [p for p in dict.fromkeys(points) if p not in self.cache]
        jobs = [(self.fleet, self.config, c, r, k) for c, r, k in todo]
        for point, result in zip(todo, self._map(evaluate, jobs, note), strict=True):
            self.cache[point] = result
        return [self.cache[p] for p in points]

    def at(self, counts: tuple[int, ...], rps: float, note: str = "") -> dict[str, Any]:
        return self.points([(counts, rps, ())], note)[0]

    def goodputs(self, jobs: list[tuple[tuple[int, ...], float, float]]) -> list[dict[str, Any]]:
        full = [(self.fleet, self.config, c, lo, hi, 0.05) for c, lo, hi in jobs]
        return self._map(_goodput_job, full, "goodput of the best-BCR candidates")


def _simulator_kind() -> str:
    """The kind of simulator that ran: compiled (planner/native.py) or pure Python, and why."""
    from planner import native

    return "compiled" if native.state == "native" else f"pure Python ({native.state})"


# --- the search --------------------------------------------------------------------------------


def _keys(fleet: Mapping[str, Any]) -> list[str]:
    return [f"{p['role']}@{p['datacenter']}:{p['gpu']}" for p in fleet["pools"]]


def _prices(fleet: Mapping[str, Any]) -> list[float]:
    return [float(fleet["gpu_types"][p["gpu"]]["unit_price"]) for p in fleet["pools"]]


def _cost(prices: list[float], counts: tuple[int, ...]) -> float:
    return sum(p * c for p, c in zip(prices, counts, strict=True))


def cheapest(
    runner: Runner, start: tuple[int, ...], rps: float, max_count: int = MAX_COUNT
) -> dict[str, Any]:
    """The cheapest fleet (a local minimum, see the module docstring) meeting the SLA at ``rps``."""
    fleet = runner.fleet
    keys, prices = _keys(fleet), _prices(fleet)
    lows = [MIN_COUNT.get(p["role"], 0) for p in fleet["pools"]]
    start = tuple(max(c, lo) for c, lo in zip(start, lows, strict=True))
    # 1. An upper bound: double every count until the SLA holds (workers factors at a time;
    # a start that meets it is kept).
    upper: tuple[int, ...] | None = None
    factor = 1
    while upper is None:
        factors = [factor * 2**i for i in range(max(runner.workers, 1))]
        # A pool at 0 (e.g. no relay yet) grows too: 1, 2, 4, ... as the factor doubles.
        cands = [tuple(max(c * f, f // 2, lo) for c, lo in zip(start, lows, strict=True))
                 for f in factors]  # fmt: skip
        cands = [c for c in cands if max(c) <= max_count] or []
        if not cands:
            return {"rps": rps, "found": False,
                    "reason": f"the SLA is not met at {rps:g} RPS with up to {max_count} "
                              "units of every pool"}  # fmt: skip
        results = runner.points([(c, rps, PROBE) for c in cands], f"upper bound at {rps:g} RPS")
        for c, r in zip(cands, results, strict=True):
            if r["met"]:
                upper = c
                break
        else:
            factor = factors[-1] * 2
    # 2. Per pool, most expensive unit first: the fewest units that keep the SLA.
    counts = list(upper)
    order = sorted(range(len(counts)), key=lambda i: (-prices[i], i))
    for i in order:
        good, bad = counts[i], lows[i] - 1  # good meets; bad fails (lows[i]-1: no such fleet)
        while good - bad > 1:
            n = min(runner.workers, good - bad - 1)
            step = (good - bad) / (n + 1)
            trial = sorted({bad + max(1, round(step * (k + 1))) for k in range(n)})
            trial = [t for t in trial if bad < t < good]
            pts = []
            for t in trial:
                probe = list(counts)
                probe[i] = t
                pts.append((tuple(probe), rps, PROBE))
            results = runner.points(pts, f"{keys[i]} in [{bad + 1}, {good}]")
            passed = [t for t, r in zip(trial, results, strict=True) if r["met"]]
            good = min(passed, default=good)
            # Failures above the smallest success would break monotonicity; ignore them.
            failed = [t for t, r in zip(trial, results, strict=True) if not r["met"] and t < good]
            bad = max(failed, default=bad)
        counts[i] = good
    found = tuple(counts)
    at = runner.points([(found, rps, PROBE)])[0]
    # 3. The check: one unit fewer of each pool, all at once. Where the rates are not quite
    # monotone (a finite run's noise), a cut that still meets the SLA is taken, dearest unit
    # first, and the check repeats, so the answer is always a checked local minimum.
    for _ in range(16):
        fewer = []
        for i, count in enumerate(found):
            if count - 1 >= lows[i]:
                less = list(found)
                less[i] -= 1
                fewer.append((i, tuple(less)))
        checks = runner.points([(c, rps, PROBE) for _, c in fewer], "one fewer of each pool")
        cuts = [(prices[i], c, r) for (i, c), r in zip(fewer, checks, strict=True) if r["met"]]
        if not cuts:
            break
        _, found, at = max(cuts, key=lambda t: t[0])
    one_fewer = {
        keys[i]: {"count": c[i], "met": r["met"], "ttft_p90_s": r["ttft_p90_s"],
                  "ttft_p99_s": r["ttft_p99_s"], "stopped": r.get("stopped", False)}
        for (i, c), r in zip(fewer, checks, strict=True)
    }  # fmt: skip
    binding = [k for k, v in one_fewer.items() if not v["met"]]
    return {
        "rps": rps,
        "found": True,
        "counts": dict(zip(keys, found, strict=True)),
        "cost_per_hour": _cost(prices, found),
        "at": at,
        "one_fewer": one_fewer,
        "binding": binding,
        "local_minimum": all(not v["met"] for v in one_fewer.values()),
    }


def _pick_case(data: Mapping[str, Any], case: str | None) -> tuple[str, dict[str, Any]]:
    configs = case_configs(data)
    if case is not None:
        if case not in configs:
            raise ValueError(f"case: {case!r} is not one of {', '.join(configs)}")
        return case, configs[case]
    for name, cfg in configs.items():
        if cfg.get("fleet", {}).get("system") == "pdd":
            return name, cfg
    return next(iter(configs.items()))


def _sized_config(
    scenario: str | Mapping[str, Any],
    rps: float | None,
    case: str | None,
    fleet: Mapping[str, Any] | None,
    sla: Mapping[str, Any] | None,
    workload: Mapping[str, Any] | None,
) -> tuple[dict[str, Any], str, dict[str, Any], float]:
    """The scenario, its case's name, the case's config with the overrides, and the rate;
    every field checked before any run."""
    from planner.api import parse_case

    data = load_scenario(scenario)
    if data["kind"] != "fleet":
        raise ValueError("size: needs a fleet scenario")
    name, config = _pick_case(data, case)
    config.pop("goodput_search", None)
    if fleet is not None:
        config["fleet"] = copy.deepcopy(dict(fleet))
    if sla:
        config["sla"] = {**config.get("sla", {}), **sla}
    if workload:
        config["workload"] = {**config.get("workload", {}), **workload}
    if rps is None:
        rps = config.get("workload", {}).get("rps", 80.0)
    rps = number(rps, "rps", positive=True)
    config.setdefault("workload", {})["rps"] = rps
    if config.get("trace_file"):
        raise ValueError("size: needs a generated workload (a trace file has its own rate)")
    parse_case(name, config, "fleet")
    return data, name, config, rps


def figures(
    scenario: str | Mapping[str, Any],
    rps: float,
    points: Iterable[Mapping[str, Any]],
    *,
    fleet: Mapping[str, Any] | None = None,
    sla: Mapping[str, Any] | None = None,
    workload: Mapping[str, Any] | None = None,
    goodput: bool = True,
    progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """Each point's figures at ``rps`` on one worker: a point is ``{"counts": {pool key: n},
    "policy": {...}?}`` (the policy's settings over the fleet's). Gives the full run's
    P50/P90/P99 TTFT, whether the SLA holds, the relay share and the cost per hour, and with
    ``goodput`` the highest rate meeting the SLA (a search from rps / 4 up to 4 x rps) and
    BCR = goodput / cost. What the autopilot compares: the running fleet, the proposed one,
    and the proposed one under other routing thresholds."""
    _, _, config, rps = _sized_config(scenario, rps, None, fleet, sla, workload)
    progress = progress or Progress(enabled=False)
    out = []
    try:
        for point in points:
            spec = copy.deepcopy(config["fleet"])
            if point.get("policy"):
                spec["policy"] = {**spec.get("policy", {}), **point["policy"]}
            keys = _keys(spec)
            counts = tuple(int(point["counts"][k]) for k in keys)
            runner = Runner(spec, config, 1, progress)
            row: dict[str, Any] = {"counts": dict(zip(keys, counts, strict=True))}
            row.update(runner.at(counts, rps, "figures"))
            if goodput:
                found = runner.goodputs([(counts, max(rps / 4, 0.05), 4 * rps)])[0]
                row.update(goodput_rps=found["goodput_rps"], bcr=found["bcr"],
                           goodput_at_ceiling=found["at_ceiling"])  # fmt: skip
            if point.get("policy"):
                row["policy"] = dict(point["policy"])
            out.append(row)
    finally:
        progress.close()
    return out


def size(
    scenario: str | Mapping[str, Any],
    rps: float | None = None,
    *,
    case: str | None = None,
    fleet: Mapping[str, Any] | None = None,
    sla: Mapping[str, Any] | None = None,
    workload: Mapping[str, Any] | None = None,
    workers: int | None = None,
    bcr_scan: Iterable[float] = (0.5, 1.0, 2.0),
    band_pct: float = 5.0,
    constants_pct: float = 5.0,
    seeds: int = 2,
    max_count: int = MAX_COUNT,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Size a fleet for ``rps`` (default: the case's ``workload.rps``); see the module docstring.

    ``fleet`` replaces the case's fleet (e.g. the one built from the database); its pools'
    counts are the starting point. ``sla`` / ``workload`` override the case's SLA / workload
    fields (e.g. ``{"duration_s": 300, "settle_s": 600}`` for a quicker, rougher answer).
    ``bcr_scan``: multiples of ``rps`` at which a cheapest fleet is a best-BCR candidate
    (empty: none).
    ``band_pct`` / ``constants_pct``: the band around the found fleet's figures (0: none);
    ``seeds``: how many other seeds show the sampling spread at the rate.
    """
    from planner.bands import band

    data, name, config, rps = _sized_config(scenario, rps, case, fleet, sla, workload)
    workers = available_cores() if workers is None else integer(workers, "workers", 1)
    max_count = integer(max_count, "max_count", 1)
    seeds = integer(seeds, "seeds", 0, 16)
    seed = int(config.get("workload", {}).get("seed", 0))
    scan = sorted({number(m, "bcr_scan", positive=True) for m in bcr_scan})
    fleet_spec = config["fleet"]
    start = tuple(int(p.get("count", 0)) for p in fleet_spec["pools"])
    progress = progress or Progress()
    runner = Runner(fleet_spec, config, workers, progress)
    began = time.perf_counter()
    try:
        progress.phase(f"cheapest at {rps:g} RPS")
        best = cheapest(runner, start, rps, max_count)
        out: dict[str, Any] = {
            "scenario": str(data.get("name", "scenario")),
            "case": name,
            "rps": rps,
            "sla": config.get("sla", {}),
            "start": dict(zip(_keys(fleet_spec), start, strict=True)),
            "unit_prices": {
                p["gpu"]: float(fleet_spec["gpu_types"][p["gpu"]]["unit_price"])
                for p in fleet_spec["pools"]
            },
            "workers": workers,
            "cheapest": best,
        }
        if best["found"] and (band_pct or constants_pct or seeds):
            counts = tuple(best["counts"].values())
            out["cheapest"]["band"] = band(
                # The centre is the found fleet's own run (it meets the SLA: never stopped).
                lambda pts, note="": runner.points(
                    [(counts, r, k or PROBE) for r, k in pts], note or "band"
                ),
                rps,
                band_pct,
                constants_pct,
                tuple(seed + 1 + i for i in range(seeds)),
            )
        cands = []
        for m in scan:
            r = rps * m
            c = best if m == 1.0 else cheapest(runner, start, r, max_count)
            if c["found"]:
                cands.append(c)
        if cands:
            progress.phase("goodput of the best-BCR candidates")
            uniq = list({tuple(c["counts"].values()): c for c in cands}.items())
            goods = runner.goodputs([(k, c["rps"], 4 * c["rps"]) for k, c in uniq])
            table = [
                {"counts": c["counts"], "sized_at_rps": c["rps"], **g}
                for (_, c), g in zip(uniq, goods, strict=True)
            ]
            table.sort(key=lambda row: (-row["bcr"], row["cost_per_hour"]))
            out["max_bcr"] = {"best": table[0], "candidates": table, "scan": scan}
        out["runs"] = runner.runs
        out["simulator"] = _simulator_kind()
        out["wall_s"] = time.perf_counter() - began
        out["method"] = (
            "per-pool bisection assuming monotone pools (one more unit never hurts); the "
            "cheapest fleet is a local minimum: one fewer unit of any pool breaks the SLA "
            "(see one_fewer); max_bcr is the best measured BCR among the cheapest fleets at "
            "the scanned multiples of the rate"
        )
        return out
    finally:
        runner.close()
        progress.close()
