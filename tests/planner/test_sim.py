"""Specification of the fleet simulator: it routes through pdd.policy and shows the
published directions on small scenarios (seconds each)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

import pdd.policy
from planner import api
from planner.api import make_trace, run_case, simulate
from planner.cli import main
from planner.fleet import fleet_from_dict
from planner.scenario import deep_merge, load_scenario
from planner.sim import Simulator

SMALL_POOLS = [
    {"role": "prefill", "gpu": "GPU-A", "count": 4, "datacenter": "A"},
    {"role": "relay_decode", "gpu": "GPU-A", "count": 1, "datacenter": "A"},
    {"role": "main_decode", "gpu": "GPU-B", "count": 4, "datacenter": "B"},
]

# IDC-PD: P and decode in one datacenter, no WAN.
IDC_POOLS = [
    {"role": "prefill", "gpu": "GPU-A", "count": 4, "datacenter": "A"},
    {"role": "main_decode", "gpu": "GPU-A", "count": 4, "datacenter": "A"},
]


def small_config(system: str, **workload) -> dict:
    base = load_scenario({"name": "t", "include": "_common.json"})["base"]
    return deep_merge(
        base,
        {
            "fleet": {"system": system, "pools": SMALL_POOLS},
            # No settle span unless a test asks: these check behaviour on short runs.
            "workload": {"rps": 8, "duration_s": 240, "seed": 3, "settle_s": 0, **workload},
            "warmup_s": 30,
        },
    )


def test_pdd_routes_every_request_through_the_policy_module(monkeypatch) -> None:
    calls = []
    real = pdd.policy.decide

    def spy(request, snapshot, settings):
        decision = real(request, snapshot, settings)
        calls.append(decision.pipeline)
        return decision

    monkeypatch.setattr(pdd.policy, "decide", spy)
    result = run_case("pdd", small_config("pdd", duration_s=60), "fleet")
    # Every arrival (warm-up included) is decided by the policy module.
    assert len(calls) >= result.summary["requests"] > 0
    assert pdd.policy.Pipeline.P_RLD_MD in calls
    assert pdd.policy.Pipeline.P_RLD not in calls


def test_pdd_ttft_tail_is_below_cdc_pd_on_skewed_traffic() -> None:
    # 6 RPS keeps the 4 prefill units below their knee (at 8 prefill queueing, which both
    # systems share, sets the P90).
    cdc = run_case("cdc", small_config("cdc-pd", rps=6), "fleet").summary
    pdd = run_case("pdd", small_config("pdd", rps=6), "fleet").summary
    # The relay hides the few heavy transfers: the tail shrinks most, the P90 a little.
    assert pdd["ttft_s"]["p99"] < 0.5 * cdc["ttft_s"]["p99"]
    assert pdd["ttft_s"]["p90"] < cdc["ttft_s"]["p90"]
    assert 0.0 < pdd["tokens"]["relay_share"] < 0.2
    assert cdc["tokens"]["relay_share"] == 0.0
    # docs/pdd.md: with the relay, TTFT matches single-datacenter PD. The same fleet with decode in
    # datacenter A (in-DC PD) has no WAN; PDD's tail is as short, and its tail's first tokens
    # spend a small fraction of CDC-PD's time waiting for KV.
    idc = run_case("idc", small_config("idc-pd", rps=6), "fleet").summary
    assert pdd["ttft_s"]["p99"] < 1.2 * idc["ttft_s"]["p99"]
    assert pdd["ttft_parts"]["tail"]["kv"] < 0.1 * cdc["ttft_parts"]["tail"]["kv"]


def test_p_rld_relay_load_grows_while_pdd_stays_flat() -> None:
    def early_late(system: str) -> tuple[float, float, float, float]:
        series = run_case(system, small_config(system, rps=10, duration_s=900), "fleet").series
        load, hit = np.array(series["rld_load"][1:]), np.array(series["md_hit_rate"][1:])
        third = len(load) // 3
        return (
            float(load[:third].mean()),
            float(load[-third:].mean()),
            float(np.nanmean(hit[:third])),
            float(np.nanmean(hit[-third:])),
        )

    pdd_load0, pdd_load1, pdd_hit0, pdd_hit1 = early_late("pdd")
    prld_load0, prld_load1, prld_hit0, prld_hit1 = early_late("p-rld")
    # P-RLD: MD's cache falls behind, its hit rate decays and the relay takes ever more load.
    assert prld_hit1 < prld_hit0 - 0.05
    assert prld_load1 > 1.5 * prld_load0
    assert prld_load1 > 5 * pdd_load1
    # PDD: every request ends on MD, so MD's hit rate and the relay load stay level.
    assert abs(pdd_hit1 - pdd_hit0) < 0.05
    assert pdd_load1 < 0.15


def test_idc_pd_needs_no_wan() -> None:
    config = small_config("idc-pd", duration_s=60)
    config["fleet"]["pools"] = IDC_POOLS
    summary = run_case("idc", config, "fleet").summary
    assert summary["wan_transfer_s"]["n"] == 0
    assert summary["unfinished"] == 0


def test_simulate_accepts_a_parsed_scenario_dict() -> None:
    scenario = {
        "name": "tiny",
        "include": "_common.json",
        "base": small_config("pdd", duration_s=40),
        "cases": {"pdd": {}},
    }
    result = simulate(scenario)
    assert result.cases["pdd"].summary["requests"] > 30


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "no-such-scenario"], "no such scenario"),
        (["plan", "paper-ttft"], "no search_space"),
        (["run", "paper-ttft", "--jobs", "0"], "--jobs"),
    ],
)
def test_cli_bad_input_is_one_line_and_nonzero(capsys, args, message) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_cases_and_sweep_points_on_several_processes_give_the_same_results() -> None:
    scenario = {
        "name": "tiny",
        "base": small_config("pdd", duration_s=60),
        "cases": {"pdd": {}, "cdc-pd": {"fleet": {"system": "cdc-pd"}}},
        "sweep": {"path": "workload.rps", "values": [4, 8]},
    }
    one, two = simulate(scenario), simulate(scenario, jobs=2)
    assert list(two.cases) == list(one.cases) == ["pdd@4", "cdc-pd@4", "pdd@8", "cdc-pd@8"]
    for name, case in one.cases.items():
        assert two.cases[name].summary == case.summary
    assert [r["value"] for r in two.sweep] == [4, 8]
    assert two.sweep[1]["cdc-pd"] == one.sweep[1]["cdc-pd"]
    plain = {"name": "t", "base": scenario["base"], "cases": scenario["cases"]}
    parallel = simulate(plain, jobs=2).cases["cdc-pd"].summary
    assert parallel == simulate(plain).cases["cdc-pd"].summary
    with pytest.raises(ValueError, match="jobs"):
        simulate(plain, jobs=0)


def test_cli_reports_a_bad_field_in_a_scenario_file(tmp_path, capsys) -> None:
    path = tmp_path / "bad.json"
    config = small_config("pdd")
    config["fleet"]["engine"]["max_decode_batch"] = 0
    path.write_text(json.dumps({"base": config}))
    assert main(["run", str(path), "--no-plots", "--out", str(tmp_path)]) == 2
    assert "max_decode_batch" in capsys.readouterr().err


def test_every_case_and_sweep_point_is_checked_before_any_runs(monkeypatch) -> None:
    runs = []
    monkeypatch.setattr(api, "run_fleet", lambda *a, **k: runs.append(a) or ({}, None))
    good = small_config("pdd", duration_s=40)
    late = {"fleet": {"engine": {"max_decode_batch": 0}}}
    scenario = {"name": "t", "base": good, "cases": {"first": {}, "late": late}}
    with pytest.raises(ValueError, match="case 'late': .*max_decode_batch"):
        simulate(scenario)
    # a sweep value that breaks only one point is found before the first point runs
    swept = {"name": "t", "base": good, "cases": {"pdd": {}},
             "sweep": {"path": "workload.rps", "values": [4, -1]}}  # fmt: skip
    with pytest.raises(ValueError, match="case 'pdd@-1': workload.rps"):
        simulate(swept)
    assert runs == []


@pytest.mark.parametrize(
    ("search", "message"),
    [
        ({"hi_rps": 10}, "goodput_search.lo_rps: required"),
        ({"lo_rps": "1", "hi_rps": 10}, "goodput_search.lo_rps: must be a positive number"),
        ({"lo_rps": 8, "hi_rps": 4}, "goodput_search.hi_rps: must be >= lo_rps"),
        ({"lo_rps": 1, "hi_rps": 4, "iters": 0}, "goodput_search.iters"),
        ({"lo_rps": 1, "hi_rps": 4, "rel_tol": -0.1}, "goodput_search.rel_tol"),
        ({"lo_rps": 1, "hi_rps": 4, "step": 2}, "goodput_search.step: unknown field"),
    ],
)
def test_a_bad_goodput_search_is_one_line_and_exit_2(tmp_path, capsys, search, message) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"base": {**small_config("pdd"), "goodput_search": search}}))
    assert main(["run", str(path), "--no-plots", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_a_missing_trace_file_is_reported_before_any_run(tmp_path) -> None:
    config = {**small_config("pdd"), "trace_file": str(tmp_path / "none.csv")}
    with pytest.raises(ValueError, match="none.csv: no such trace file"):
        simulate({"name": "t", "base": config})


def test_goodput_search_with_a_relative_tolerance_brackets_tightly() -> None:
    from planner.api import goodput_search
    from planner.fleet import fleet_from_dict
    from planner.metrics import Sla

    config = small_config("pdd", duration_s=60)
    fleet = fleet_from_dict(config["fleet"])
    found = goodput_search(fleet, config, Sla(), 10.0, 2.0, 64.0, rel_tol=0.1)
    lo, hi = found["bracket"]
    assert found["drawn_rps"] == lo > 0
    assert found["at_ceiling"] or (hi - lo) <= 0.1 * lo
    assert found["at"]["sla"]["met"]
    # The goodput is the rate the fleet actually received at that drawn rate.
    assert found["goodput_rps"] == found["at"]["offered_rps"] > 0
    assert found["bcr"] == pytest.approx(found["goodput_rps"] / found["cost_per_hour"])


def test_offered_rate_is_what_arrived_so_a_slow_closed_loop_fleet_gets_less() -> None:
    # Open loop: every request arrives when drawn, offered = drawn. Closed loop on a fleet that
    # answers slowly (a tiny decode batch): turns wait for their previous responses and slip
    # past the measured span, so the fleet receives less than drawn, and is measured on that.
    open_loop = run_case("o", small_config("pdd", closed_loop=False), "fleet").summary
    assert open_loop["offered_rps"] == pytest.approx(open_loop["drawn_rps"])
    slow = deep_merge(small_config("pdd"), {"fleet": {"engine": {"max_decode_batch": 2}}})
    closed = run_case("c", slow, "fleet").summary
    assert closed["offered_rps"] < 0.9 * closed["drawn_rps"]


def test_the_policy_sees_the_wan_pool_queue_and_relays_more() -> None:
    # A pool of 4 connections at 8 RPS is queued most of the time: told the expected wait,
    # the policy relays requests it would otherwise send straight into the queue.
    def run(aware: bool) -> dict:
        config = deep_merge(
            small_config("pdd", duration_s=120),
            {"fleet": {"pool_wait_aware": aware, "links": {"B": {"pool_size": 4}}}},
        )
        return run_case("pdd", config, "fleet").summary

    blind, aware = run(False), run(True)
    assert blind["requests"] == aware["requests"]
    assert aware["pipelines"]["p-rld-md"] > blind["pipelines"]["p-rld-md"]
    assert aware["ttft_s"]["p90"] < blind["ttft_s"]["p90"]


def test_a_full_md_pool_hands_its_queue_to_the_relay_and_keeps_its_cache() -> None:
    # 4 MD of 48 slots at 8 RPS are full much of the time; 2 RLD have room. With the full-MD
    # rule the requests that would queue on their prefix MD for a slot decode on RLD at once
    # and are handed over when MD admits them: the slot wait leaves the tail, and since every
    # relayed request still ends on MD, its cache (the hit rate) stays where it was.
    def run(rule: bool) -> dict:
        config = deep_merge(
            small_config("pdd"),
            {
                "fleet": {
                    "engine": {"max_decode_batch": 48},
                    "policy": {"relay_when_main_saturated": rule},
                }
            },
        )
        config["fleet"]["pools"][1]["count"] = 2
        return run_case("pdd", config, "fleet").summary

    off, on = run(False), run(True)
    assert on["requests"] == off["requests"] and on["unfinished"] == off["unfinished"] == 0
    assert on["pipelines"]["p-rld-md"] > 2 * off["pipelines"]["p-rld-md"]
    assert on["ttft_parts"]["tail"]["slot"] < 0.5 * off["ttft_parts"]["tail"]["slot"]
    assert on["ttft_s"]["p90"] < 0.7 * off["ttft_s"]["p90"]
    assert on["tokens"]["relay_share"] > off["tokens"]["relay_share"]
    assert on["md_hit_rate"] == pytest.approx(off["md_hit_rate"], abs=0.02)


def test_pool_wait_aware_must_be_a_bool() -> None:
    config = deep_merge(small_config("pdd"), {"fleet": {"pool_wait_aware": "yes"}})
    with pytest.raises(ValueError, match="pool_wait_aware"):
        run_case("pdd", config, "fleet")


def test_a_decode_unit_cannot_read_more_weights_than_it_holds() -> None:
    config = deep_merge(small_config("pdd"), {"fleet": {"resident_weight_gb": 300}})
    with pytest.raises(ValueError, match="exceeds resident_weight_gb 300"):
        fleet_from_dict(config["fleet"])


def test_routing_counts_requests_still_on_their_way_so_decode_load_spreads() -> None:
    # IDC-PD has no prefix affinity: the decode instance is the least loaded one. Requests
    # routed during a prefill's seconds must count, or they would all herd onto one instance.
    config = small_config("idc-pd", duration_s=120)
    config["fleet"]["pools"] = IDC_POOLS
    sim = Simulator(fleet_from_dict(config["fleet"]))
    sim.run(make_trace(config))
    per_md = Counter(main for _, _, main in sim.route if main)
    assert len(per_md) == 4
    # Back-to-back decisions go to different instances (with 4 instances and the load counting
    # the requests just routed, far fewer than the ~all a herd would send to one).
    order = [main for _, _, main in (sim.route[i] for i in np.argsort(sim.arr)) if main]
    same = sum(a == b for a, b in zip(order, order[1:], strict=False)) / (len(order) - 1)
    assert same < 0.4
    # Every routed request arrived: nothing is left counted as on its way.
    assert all(m.assigned == 0 for m in sim.main.values())


def test_the_token_share_scenario_relays_every_stated_request_and_ends_on_md() -> None:
    # docs/pdd.md's token-share condition (64K input, 90% hit, 1K output) on a small fleet: each
    # delta needs just over the 1 s relay threshold, so every request starts on RLD and is
    # handed to MD, which makes most of the tokens.
    from planner.scenario import case_configs

    config = case_configs(load_scenario("paper-token-share"))["rps-20"]
    config = deep_merge(
        config,
        {"fleet": {"pools": SMALL_POOLS}, "workload": {"rps": 2, "duration_s": 120}},
    )
    config["warmup_s"] = 20
    s = run_case("share", config, "fleet").summary
    assert s["requests"] > 100
    assert s["pipelines"]["p-rld-md"] == s["requests"]
    assert s["pipelines"]["p-md"] == 0
    assert 0.0 < s["tokens"]["relay_share"] < 0.2
    assert s["tokens"]["relay_decode"] + s["tokens"]["main_decode"] == pytest.approx(
        1000 * s["requests"], rel=0.01
    )
    # Link utilisation is over the arrival window (not diluted by the drain after it): 2 RPS of
    # 6,400-token deltas at 4,400 B/token on a 20 Gbit/s line.
    offered = 2 * 6_400 * 4_400 * 8 / 20e9
    assert s["wan_link_utilisation"] == pytest.approx(offered, rel=0.2)
