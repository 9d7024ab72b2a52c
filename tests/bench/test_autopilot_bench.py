"""The autopilot benchmark's fixed scenario (bench/autopilot/run.py) and its figures
(bench/autopilot/report.py), checked without starting a process."""

from __future__ import annotations

import pytest

from bench.autopilot import report
from bench.autopilot import run as r


def test_the_rate_doubles_within_one_minute():
    assert r.RATE_HIGH == 2 * r.RATE_LOW and r.RAMP_S <= 60
    assert r.rate_at(0) == r.rate_at(r.RAMP_AT_S - 1) == r.RATE_LOW
    assert r.rate_at(r.RAMP_AT_S + r.RAMP_S / 2) == pytest.approx(1.5 * r.RATE_LOW)
    assert r.rate_at(r.RAMP_AT_S + r.RAMP_S) == r.rate_at(r.RUN_S - 1) == r.RATE_HIGH
    times = r.arrivals()
    assert times == sorted(times) and times == r.arrivals()  # seeded
    before = sum(t < r.RAMP_AT_S for t in times) / r.RAMP_AT_S
    after = sum(t >= r.RAMP_AT_S + r.RAMP_S for t in times) / (r.RUN_S - r.RAMP_AT_S - r.RAMP_S)
    assert before == pytest.approx(r.RATE_LOW, rel=0.2)
    assert after == pytest.approx(r.RATE_HIGH, rel=0.15)


def test_lengths_come_from_the_scenarios_workload():
    prompts, answers = r.lengths(400)
    assert 14_000 < sorted(prompts)[200] < 18_000
    assert 25 < sorted(answers)[200] < 40
    assert min(prompts) > r.SHARED_TOKENS


def _result(i, arrival, ttft, completed=True, exact=True):
    return {"i": i, "id": f"r{i}", "arrival_s": arrival, "ttft_s": ttft, "completed": completed,
            "exact": exact}  # fmt: skip


def test_the_sla_is_judged_per_minute_and_recovery_is_the_first_lasting_minute():
    results = [_result(i, 60 * m + 1, 2.0 if m not in (3, 4) else 30.0)
               for m in range(10) for i in (m * 10, m * 10 + 1)]  # fmt: skip
    minutes = r.per_minute(results)
    assert [m["met"] for m in minutes] == [True] * 3 + [False] * 2 + [True] * 5
    assert r.recovered_at(minutes) == 300.0
    minutes[-1]["met"] = False
    assert r.recovered_at(minutes) is None  # the last minute misses it: not recovered
    unanswered = r.per_minute([_result(0, 5, None, completed=False)])
    assert unanswered[0]["met"] is False and unanswered[0]["unanswered"] == 1


def test_the_summary_checks_every_goal():
    results = [_result(i, 60 * m + 1, 2.0) for m in range(10) for i in (2 * m, 2 * m + 1)]
    live = {
        "results": results,
        "records": [{"request_id": x["id"]} for x in results],
        "instances": [
            {"role": "prefill", "node": 1, "desired_state": "running"},
            {"role": "prefill", "node": 2, "desired_state": "running"},
            {"role": "main_decode", "node": 5, "desired_state": "running"},
            {"role": "main_decode", "node": 6, "desired_state": "drained"},
        ],
        "offline": {"cheapest": {"found": True, "counts": {"p": 2, "md": 1},
                                 "cost_per_hour": 52.0}},
        "proposals": [{"id": 3, "status": "applied", "applied_at": "2026-12-05T10:03:00Z",
                       "predicted": {"after": {"ttft_p90_s": 5.0}},
                       "target": {"cost_per_hour": 52.0},
                       "realised": [{"ttft_p90_s": 5.5, "cost_per_hour": 52.0}], "steps": []}],
    }  # fmt: skip
    nodes = {1: "auto-a-1", 2: "auto-a-2", 5: "auto-b-1", 6: "auto-b-2"}
    s = report.summarise(live, nodes)
    assert s["end_fleet"] == {"roles": {"prefill": 2, "main_decode": 1},
                              "cost_per_hour": 16 + 16 + 20}  # fmt: skip
    assert all(s["goals"].values()), s["goals"]
    live["results"][3]["completed"] = False
    live["proposals"][0]["realised"][0]["ttft_p90_s"] = 9.0
    s = report.summarise(live, nodes)
    assert s["goals"]["no_request_lost_or_failed"] is False
    assert s["goals"]["predicted_p90_within_15pct"] is False
    text = report.render(s, "python -m bench.autopilot", {"started": "x", "commit": "abc"})
    assert "| 0 requests lost or failed | **no** |" in text


def test_the_run_waits_for_the_first_applied_proposals_realised_window():
    from plans import autopilot

    assert r.REALISED_WINDOW_S == autopilot.REALISED_WINDOW_S
    assert r.REALISED_SETTLE_S == autopilot.REALISED_SETTLE_S
    applied = {"applied_at": "2026-12-05T12:00:00+00:00", "realised": []}
    later = {"applied_at": "2026-12-05T12:05:00+00:00", "realised": []}
    proposed = {"applied_at": None}
    due = r.realised_due([later, proposed, applied], 0.0)
    at = 1_796_472_000.0  # 2026-12-05T12:00:00Z
    assert due == at + 300 + 60 + r.TICK_S  # the first applied one's window
    assert r.realised_due([{**applied, "realised": [{"ttft_p90_s": 3.0}]}, later], 0.0) is None
    assert r.realised_due([proposed], 0.0) is None
