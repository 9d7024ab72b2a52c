"""Stopping a run once its SLA is certain to fail (the sizing search's probes): a run that
meets the SLA is the same run, a stopped one fails as the full run does, and its TTFT figures
are lower bounds of the full run's."""

from __future__ import annotations

from planner.api import evaluate, make_trace, run_fleet
from planner.fleet import fleet_from_dict
from planner.metrics import Sla
from planner.scenario import case_configs, load_scenario
from planner.size import PROBE
from tests.planner.test_sim_speed_identical import record_digest

CONFIG = next(iter(case_configs(load_scenario("tiny-size")).values()))
MEETS = (3, 1, 1)  # tiny-size's cheapest fleet at 5 RPS (tests/planner/test_size.py)
FAILS = (2, 1, 1)  # one prefill fewer: P90 ~17 s


def _point(counts: tuple[int, ...], mods: tuple = ()) -> dict:
    return evaluate((CONFIG["fleet"], CONFIG, counts, 5.0, mods))


def _run(counts: tuple[int, ...], stop: bool):
    fleet = dict(CONFIG["fleet"])
    fleet["pools"] = [dict(p, count=c) for p, c in zip(fleet["pools"], counts, strict=True)]
    spec = fleet_from_dict(fleet)
    return run_fleet(spec, make_trace(CONFIG), Sla(), CONFIG.get("warmup_s", 60.0),
                     stop_on_miss=stop)  # fmt: skip


def test_a_run_that_meets_the_sla_is_never_stopped_and_is_the_same_run() -> None:
    full, full_rec = _run(MEETS, stop=False)
    probe, probe_rec = _run(MEETS, stop=True)
    assert full["sla"]["met"] and "stopped_at_s" not in probe
    assert record_digest(probe_rec) == record_digest(full_rec)
    assert _point(MEETS, PROBE) == _point(MEETS)


def test_a_stopped_run_fails_as_the_full_run_does_with_lower_bound_figures() -> None:
    full, full_rec = _run(FAILS, stop=False)
    probe, probe_rec = _run(FAILS, stop=True)
    assert not full["sla"]["met"] and not probe["sla"]["met"]
    assert probe["stopped_at_s"] < full_rec.sim_end_s and probe["ttft_lower_bounds"]
    for q in ("p50", "p90", "p99"):
        assert probe["ttft_s"][q] <= full["ttft_s"][q]
    point = _point(FAILS, PROBE)
    assert point["stopped"] and not point["met"]
    assert not _point(FAILS)["stopped"]
