"""bench/pdd/live_check.py: the simulator's prediction of the committed live run, on a
tiny slice (one system, one rate)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.pdd.live_check import (
    cores_of,
    engine_from_report,
    live_extras_from_report,
    main,
)

ROOT = Path(__file__).resolve().parents[2]
SUMMARY = ROOT / "bench/pdd/summary.json"
REPORT = ROOT / "bench/pdd/REPORT.md"


def test_it_reproduces_the_committed_sim_and_adds_the_host_arms(tmp_path, capsys):
    out = tmp_path / "check.json"
    args = ["--systems", "idc-pd", "--rates", "u50", "--arms", "dedicated", "host+gateway"]
    assert main([*args, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert (row["system"], row["rate"], result["cores"]) == ("idc-pd", "u50", 2)
    summary = json.loads(SUMMARY.read_text())
    alone = "sim_dedicated" if summary.get("sim_dedicated") else "sim"
    committed = summary[alone]["idc-pd"]["u50"]["ttft_s"]["p90"]
    dedicated = row["sim"]["dedicated"]
    # The engine fit comes from summary.json, or rounded from REPORT.md when the summary lacks
    # it: the same figures to within that rounding.
    assert dedicated["ttft_s"]["p90"] == pytest.approx(committed, rel=0.01)
    assert dedicated["host"] is None
    shared = row["sim"]["host+gateway"]
    assert shared["host"] == {"cores": 2, "request_cpu_s": 0.0183}
    assert shared["ttft_s"]["p90"] >= dedicated["ttft_s"]["p90"]
    assert set(shared["cpu"]) == {"prefill", "main_decode", "gateway"}
    live = row["live"]
    measured = summary["live"]["idc-pd"]["u50"]  # REPORT.md prints these rounded
    for name in ("prefill_s", "kv_wait_s"):
        assert live["record_means"][name] == pytest.approx(measured["record_means"][name], abs=6e-4)
    for name in ("gateway", "load_avg"):
        assert live["cpu"][name] == pytest.approx(measured["cpu"][name], abs=6e-3)
    err = (shared["ttft_s"]["p90"] - live["ttft_s"]["p90"]) / live["ttft_s"]["p90"]
    assert shared["p90_error"] == pytest.approx(err, rel=1e-4)  # written to 6 digits
    assert set(result["verdict"]) == {"dedicated", "host+gateway"}
    printed = capsys.readouterr().out
    assert "idc-pd  u50" in printed and "dedicated vs the committed sim P90" in printed


def test_the_engine_and_cores_come_from_the_summary_when_it_has_them(tmp_path):
    summary = json.loads(SUMMARY.read_text())
    summary["engine"] = engine_from_report(REPORT.read_text())
    summary["meta"]["machine"] = "4 cores, x86_64"
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    out = tmp_path / "check.json"
    args = ["--summary", str(path), "--report", str(tmp_path / "none.md"), "--arms", "host"]
    assert main([*args, "--systems", "idc-pd", "--rates", "u50", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["sim"]["host"]["host"] == {"cores": 4}
    carried = summary["live"]["idc-pd"]["u50"].get("cpu")  # no report: only what summary.json has
    if carried is None:
        assert row["live"]["cpu"] is None
    else:
        assert row["live"]["cpu"] == pytest.approx(carried, rel=1e-5)


def test_the_report_parsers():
    text = REPORT.read_text()
    summary = json.loads(SUMMARY.read_text())
    engine = engine_from_report(text)
    fit = summary["engine"]  # the run's own fit; REPORT.md prints it to 2-3 digits
    assert engine["prefill"]["per_token_s"] == pytest.approx(
        fit["prefill"]["per_token_s"], rel=0.02
    )
    assert engine["decode"]["per_ctx_token_s"] == pytest.approx(
        fit["decode"]["per_ctx_token_s"], rel=0.02
    )
    extras = live_extras_from_report(text, summary)
    measured = summary["live"]["pdd"]["u90"]
    assert extras["pdd"]["u90"]["record_means"]["prefill_s"] == pytest.approx(
        measured["record_means"]["prefill_s"], abs=6e-4
    )
    assert extras["pdd"]["u90"]["cpu"]["relay_decode"] == pytest.approx(
        measured["cpu"]["relay_decode"], abs=6e-3
    )
    assert "relay_decode" not in extras["cdc-pd"]["u70"]["cpu"]  # "-": no such process
    assert cores_of({"machine": "2 cores, x86_64, Python 3.11.7"}) == 2
    with pytest.raises(ValueError, match="meta.machine"):
        cores_of({"machine": "a laptop"})


def _without_gateway_view(tmp_path: Path) -> Path:
    """The committed summary as a run that simulated neither rule (the earlier arms then keep
    the instantaneous link use and the landed-only prefix, whatever the committed run did)."""
    summary = json.loads(SUMMARY.read_text())
    for key in ("sim_link_reports_s", "sim_decision_in_flight"):
        summary["meta"].pop(key, None)
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    return path


def _pdd_arms(tmp_path: Path, *arms: str) -> list[dict]:
    """The simulated figures of ``arms`` for PDD at 70%, on the committed run without the
    gateway-view rules (``_without_gateway_view``)."""
    out = tmp_path / "check.json"
    args = ["--systems", "pdd", "--rates", "u70", "--arms", *arms, "--out", str(out)]
    assert main([*args, "--summary", str(_without_gateway_view(tmp_path))]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    return [row["sim"][arm] for arm in arms]


def test_the_reported_link_use_arm_relays_fewer_requests(tmp_path):
    """The live gateway sees the WAN link's use from the P agent's heartbeat (the bytes of the
    last 2-s interval), not at the moment of each decision: a transfer in flight no longer
    reads as a full link, so fewer requests relay than with the instantaneous use."""
    instant, reported = _pdd_arms(tmp_path, "host+gateway+handoffs", "host+gateway+reports")
    assert instant["host"] == reported["host"]
    assert reported["requests"] == instant["requests"]
    assert reported["relayed"] < instant["relayed"]
    assert reported["rld_share"] < instant["rld_share"]


def test_the_in_flight_arm_counts_kv_on_its_way_to_md(tmp_path):
    """As the live gateway counts an MD agent's incoming blocks, a turn whose context is
    still crossing to MD is no longer low-hit: fewer requests relay than without it."""
    landed, in_flight = _pdd_arms(tmp_path, "host+gateway+reports", "host+gateway+in-flight")
    assert in_flight["relayed"] < landed["relayed"]


def test_the_all_cpu_arm_charges_the_measured_cpu_the_simulation_leaves_out(tmp_path):
    """``all-cpu`` runs with its base arm's rules; its gateway task carries, per request, the
    gateway's 18.3 ms plus the cores the run measured for all its processes beyond the cores
    the base arm simulated, over the rate. Asked for alone, the base arm is simulated too."""
    out = tmp_path / "check.json"
    args = ["--systems", "pdd", "--rates", "u70", "--arms", "all-cpu", "--out", str(out)]
    assert main([*args, "--summary", str(SUMMARY)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    base, arm = row["sim"]["host+gateway+in-flight"], row["sim"]["all-cpu"]
    measured = sum(v for k, v in row["live"]["cpu"].items() if k != "load_avg")
    extra = (measured - sum(base["cpu"].values())) / row["rps"]
    assert extra > 0
    assert arm["host"]["request_cpu_s"] == pytest.approx(0.0183 + extra, rel=1e-4)
    assert arm["host"]["cores"] == base["host"]["cores"]
    assert arm["requests"] == base["requests"]


def test_runs_side_by_side_give_the_spread_and_the_median_error(tmp_path, capsys):
    """--runs: each run's live and simulated P90 per row, the live run-to-run spread and the
    median simulated P90's error against the median live one."""
    summary = json.loads(SUMMARY.read_text())
    slower = json.loads(SUMMARY.read_text())
    for system in slower["live"]:
        for row in slower["live"][system].values():
            row["ttft_s"]["p90"] *= 1.2
    other = tmp_path / "other.json"
    other.write_text(json.dumps(slower))
    out = tmp_path / "runs.json"
    assert main(["--runs", str(SUMMARY), str(other), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["runs"]) == 2
    assert len(result["rows"]) == sum(len(v) for v in summary["live"].values())
    for row in result["rows"]:
        live = summary["live"][row["system"]][row["rate"]]["ttft_s"]["p90"]
        sim = summary["sim"][row["system"]][row["rate"]]["ttft_s"]["p90"]
        assert row["live_p90_s"] == pytest.approx([live, 1.2 * live], rel=1e-5)
        assert row["sim_p90_s"] == pytest.approx([sim, sim], rel=1e-5)
        assert row["live_spread"] == pytest.approx(0.2, rel=1e-4)
        assert row["median_error"] == pytest.approx(sim / (1.1 * live) - 1, rel=1e-4, abs=1e-6)
    assert "median simulated P90 within 15%" in capsys.readouterr().out


def test_runs_with_a_missing_summary_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--runs", str(tmp_path / "nope.json")])
    assert exc.value.code == 2
    assert "--runs" in capsys.readouterr().err


def test_the_measured_engines_arm_scales_the_fit_by_the_runs_engine_busy_time(tmp_path):
    """``measured-engines``: the prefill fit times (live P busy / simulated P busy), the decode
    fit times the same ratio for RLD and MD together, the base arm's simulated busy time the
    denominator. A run without the agents' busy time has no such arm."""
    from bench.pdd.live_check import engine_factors, scaled_engine

    assert engine_factors(None, {"prefill": 0.1}) is None
    assert engine_factors({"prefill": 0.3, "main_decode": 0.2}, {"prefill": 0.2}) == pytest.approx(
        (1.5, 1.0)
    )
    assert engine_factors(
        {"prefill": 0.3, "relay_decode": 0.1, "main_decode": 0.2},
        {"prefill": 0.2, "relay_decode": 0.05, "main_decode": 0.15},
    ) == pytest.approx((1.5, 1.5))
    fit = {
        "prefill": {"overhead_s": 1.0, "per_token_s": 2.0, "per_pair_s": 3.0, "max_error": 0.1},
        "decode": {"overhead_s": 4.0, "per_ctx_token_s": 5.0},
        "fabric": {"gbps": 1.0},
    }
    scaled = scaled_engine(fit, 2.0, 0.5)
    assert scaled["prefill"] == {"overhead_s": 2.0, "per_token_s": 4.0, "per_pair_s": 6.0,
                                 "max_error": 0.1}  # fmt: skip
    assert scaled["decode"] == {"overhead_s": 2.0, "per_ctx_token_s": 2.5}
    assert scaled["fabric"] == {"gbps": 1.0}

    summary = json.loads(SUMMARY.read_text())
    row_busy = summary["live"]["pdd"]["u70"].get("engine_busy")
    out = tmp_path / "check.json"
    args = ["--systems", "pdd", "--rates", "u70", "--arms", "measured-engines", "--out", str(out)]
    assert main([*args, "--summary", str(SUMMARY)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    if row_busy:  # the committed run measured it
        base, arm = row["sim"]["host+gateway+in-flight"], row["sim"]["measured-engines"]
        expect = row_busy["prefill"] / base["cpu"]["prefill"]
        assert arm["engine_factors"]["prefill"] == pytest.approx(expect, rel=1e-4)
        assert arm["host"] == base["host"] and arm["requests"] == base["requests"]
    summary["live"]["pdd"]["u70"].pop("engine_busy", None)
    older = tmp_path / "older.json"
    older.write_text(json.dumps(summary))
    assert main([*args, "--summary", str(older)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert "measured-engines" not in row["sim"]


def test_the_prior_engines_arm_takes_another_runs_factors(tmp_path, capsys):
    """``prior-engines`` applies the engine factors another run measured (its live busy time
    over its own simulated busy time) to this run's fit; from the same run it is
    ``measured-engines``. Without --factors-from there is no such arm; a bad file is a usage
    error."""
    summary = json.loads(SUMMARY.read_text())
    if not summary["live"]["pdd"]["u70"].get("engine_busy"):
        pytest.skip("the committed run did not measure its engines' busy time")
    out = tmp_path / "check.json"
    args = ["--systems", "pdd", "--rates", "u70", "--out", str(out)]
    arms = ["--arms", "measured-engines", "prior-engines"]
    assert main([*args, *arms, "--factors-from", str(SUMMARY)]) == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    measured, prior = row["sim"]["measured-engines"], row["sim"]["prior-engines"]
    for k in ("prefill", "decode"):
        assert prior["engine_factors"][k] == pytest.approx(measured["engine_factors"][k], rel=1e-3)
    assert result["factors_from"] == summary["meta"]["started"]
    assert main([*args, *arms]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert "prior-engines" not in row["sim"] and "measured-engines" in row["sim"]
    with pytest.raises(SystemExit) as exc:
        main([*args, "--factors-from", str(tmp_path / "nope.json")])
    assert exc.value.code == 2 and "--factors-from" in capsys.readouterr().err
