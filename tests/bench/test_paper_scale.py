"""The paper experiment's scaling rule (bench/paper/scale.py) and its figures
(bench/paper/report.py), checked without starting a process."""

from __future__ import annotations

import math

import pytest

from bench.paper import report, scale


def test_one_factor_scales_fleet_link_and_rate():
    systems = scale.systems()
    counts = {k: {(p.role, p.gpu): p.count for p in s.pools} for k, s in systems.items()}
    assert counts["pdd"] == {
        ("prefill", "GPU-A"): 5,  # 40 / 8
        ("relay_decode", "GPU-A"): 1,  # 3 / 8, rounded up: a pool needs one
        ("main_decode", "GPU-B"): 4,  # 32 / 8
    }
    assert counts["cdc-pd"] == {("prefill", "GPU-A"): 5, ("main_decode", "GPU-B"): 4}
    assert counts["idc-pd"] == {("prefill", "GPU-A"): 4, ("main_decode", "GPU-A"): 7}
    for s in systems.values():
        assert s.config["workload"]["rps"] == 80 / scale.FACTOR
        assert s.config["workload"]["settle_s"] == 0.0
        link = scale.link(s)
        assert link["bandwidth_gbps"] == 20 / scale.FACTOR
        assert link["connection_pool_size"] == math.ceil(76 / scale.FACTOR)
        assert link["rtt_ms"] == 20  # latency is not scaled
    assert systems["pdd"].config["fleet"]["system"] == "pdd"
    assert systems["cdc-pd"].config["fleet"]["system"] == "cdc-pd"
    assert systems["idc-pd"].config["fleet"]["system"] == "idc-pd"
    # Every pool is datacenter A except PDD's and CDC-PD's main decoders.
    assert {p.datacenter for p in systems["idc-pd"].pools} == {"A"}
    assert systems["pdd"].cost_per_hour == pytest.approx(6 * 1.0 + 4 * 1.25)


def live_run(ttfts_wall: list[float | None]) -> dict:
    results = []
    for i, t in enumerate(ttfts_wall):
        r = {"i": i, "drawn_s": scale.WARMUP_S + i, "sent_wall": 1.0, "id": f"r{i}",
             "completed": t is not None, "exact": True}  # fmt: skip
        if t is not None:
            r["ttft_wall"] = t
        results.append(r)
    states = lambda rld, md: {  # noqa: E731
        "h": {"instances": [{"role": "relay_decode", "tokens_generated": rld},
                            {"role": "main_decode", "tokens_generated": md}]}
    }  # fmt: skip
    return {
        "results": results,
        "records": [{"request_id": f"r{i}", "pipeline": "p-md"} for i in range(len(results))],
        "marks": {"states_warm": states(10, 100), "states_end": states(72, 1100), "start": 0.0,
                  "t_warm": 80.0, "t_end": 400.0},
    }  # fmt: skip


def test_ttft_is_modelled_time_and_a_missing_first_token_counts_as_worst():
    system = scale.systems()["pdd"]
    # Wall seconds: 8 x the modelled ones.
    out = report.summarise(live_run([8.0, 16.0, 24.0, 32.0, None]), system)
    assert out["ttft_s"]["p50"] == pytest.approx(3.0)
    assert out["ttft_s"]["p90"] is None  # the rank falls on the request with no first token
    assert out["rld_share"] == pytest.approx(62 / (62 + 1000))
    assert out["completed"] == 4 and out["tokens_differ"] == 0
    assert out["completed_without_record"] == 0
    assert out["sla_met"] is False


def test_the_report_names_every_goal():
    system = scale.systems()["pdd"]
    live = report.summarise(live_run([8.0] * 10), system)
    results = {
        "started": "now", "machine": {"cpus": 2}, "wall_s": 60.0, "window_s": 45.0,
        "systems": {"pdd": {"live": live, "predicted": {"ttft_s": {"p50": 1, "p90": 1.1,
                    "p99": 2}, "rld_share": 0.05, "wan_utilisation": 0.2, "sla_met": True},
                    "cost_per_hour": 11.0, "pools": [p.__dict__ for p in system.pools]}},
    }  # fmt: skip
    text = report.render(results)
    for needle in ("-46%", "6.2%", "+37.5%", "within 10%", "TTFT P90 live", "RLD token share"):
        assert needle in text
    assert "| simulator vs live P90 TTFT, pdd | within 10% | 1.00 s | 1.10 s | 10.0% off" in text


def _rendered(live: dict) -> str:
    """The report of a PDD-only run whose live figures are ``live``."""
    results = {
        "started": "now", "machine": {"cpus": 2}, "wall_s": 60.0, "window_s": 40.0,
        "systems": {"pdd": {"live": live, "predicted": {"ttft_s": {"p50": 1, "p90": 1,
                    "p99": 1}, "rld_share": 0.0, "wan_utilisation": 0.0, "sla_met": True},
                    "cost_per_hour": 11.0, "pools": []}},
    }  # fmt: skip
    return report.render(results)


def test_nodes_gone_offline_are_reported():
    system = scale.systems()["pdd"]
    live = live_run([8.0] * 3)
    live["nodes_gone_offline"] = 2
    out = report.summarise(live, system)
    assert out["control_plane"]["nodes_gone_offline"] == 2
    assert "| nodes gone offline while running | 2 |" in _rendered(out)


def test_migrations_are_counted_beside_the_pipelines():
    """A migration to p-rld-md counts as relayed: the report shows how many there were."""
    system = scale.systems()["pdd"]
    live = live_run([8.0] * 4)
    live["records"][1] |= {"pipeline": "p-rld-md", "migrations": 1}
    live["records"][2]["migrations"] = 2
    out = report.summarise(live, system)
    assert out["migrations"] == 3
    assert out["pipelines"] == {"p-md": 3, "p-rld-md": 1}
    assert "| migrations (live) | 3 |" in _rendered(out)


def test_a_wan_format_variant_keeps_the_run_and_switches_only_the_link():
    pdd = scale.systems()["pdd"]
    int8 = scale.with_wan_format(pdd, "int8")
    assert int8.key == "pdd-int8" and int8.model == "paper-pdd-int8"  # its own fleet
    assert int8.pools == pdd.pools
    assert int8.config["workload"] == pdd.config["workload"]
    # The same session homes and prompts: the salt stays the base system's.
    assert int8.config["fleet"]["session_home_salt"] == "pdd"
    assert scale.link(int8) == scale.link(pdd) | {"kv_format": "int8"}
    assert (
        scale.link(pdd)["kv_format"] == "" and "kv_format" not in pdd.config["fleet"]["links"]["B"]
    )
    with pytest.raises(ValueError, match="no WAN link"):
        scale.with_wan_format(scale.systems()["idc-pd"], "int8")


def test_the_report_compares_a_switched_format_with_the_own_one():
    system = scale.systems()["pdd"]
    own = report.summarise(live_run([8.0] * 4), system)
    fast = report.summarise(live_run([4.0] * 4), system)
    own["wan_bytes"], fast["wan_bytes"] = 4e9, 2e9
    pred = {"ttft_s": {"p50": 1, "p90": 1, "p99": 1}, "rld_share": 0.0, "wan_utilisation": 0.0,
            "sla_met": True}  # fmt: skip
    entry = {"predicted": pred, "cost_per_hour": 11.0, "pools": []}
    results = {
        "started": "now", "machine": {"cpus": 2}, "wall_s": 60.0, "window_s": 40.0,
        "systems": {"pdd": entry | {"live": own, "wan_format": "own"},
                    "pdd-int8": entry | {"live": fast, "wan_format": "int8"}},
    }  # fmt: skip
    text = report.render(results)
    assert "## The WAN link's KV format switched" in text
    assert "| **pdd** | own | int8 | |" in text
    assert "| KV across the WAN (GB, live) | 4.00 | 2.00 | -50.0% |" in text
    assert "| TTFT P50 live (s) | 1.00 | 0.50 | -50.0% |" in text
    # Without a variant there is no such section.
    del results["systems"]["pdd-int8"]
    assert "format switched" not in report.render(results)


def test_the_prediction_of_an_int8_link_carries_half_the_bytes():
    from bench.paper.run import simulate

    pdd = scale.systems()["pdd"]
    own = simulate(pdd, 20.0)
    int8 = simulate(scale.with_wan_format(pdd, "int8"), 20.0)
    assert own["requests"] == int8["requests"]
    assert 0.4 < int8["wan_utilisation"] / own["wan_utilisation"] < 0.6


def test_wan_use_is_the_windows_bytes_over_the_arrival_window_as_simulated():
    system = scale.systems()["pdd"]
    live = live_run([8.0] * 5)  # drawn at 10..14 s: a 14-s window
    live["marks"]["t_end"] = 10_000.0  # a long drain changes nothing
    for record in live["records"]:
        record["kv_bytes_wan"] = 1_000_000_000
    out = report.summarise(live, system)
    link_bytes_s = system.config["fleet"]["links"]["B"]["bandwidth_gbps"] * 1e9 / 8
    assert out["wan_bytes"] == 5e9
    assert out["wan_utilisation"] == pytest.approx(5e9 / 14.0 / link_bytes_s)
    assert report.summarise(live, scale.systems()["idc-pd"])["wan_utilisation"] is None
