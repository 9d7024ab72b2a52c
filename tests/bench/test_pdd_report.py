"""REPORT.md rendered from a small canned results dict (no run, no plots)."""

from __future__ import annotations

import math

from bench.pdd import metrics, report


def live(p90: float, *, rld: float = 0.0, relayed: int = 0, missing: int = 0) -> dict:
    return {
        "ttft_s": {"p50": p90 / 3, "p90": p90, "p99": p90 * 1.5},
        "tpot_s": {"mean": 0.04, "p50": 0.04},
        "e2e_s": {"p50": 1.0, "p90": 2.0},
        "max_gap_s": {"p99": 0.3},
        "rld_share": rld,
        "pipelines": {"p-md": 90 - relayed, "p-rld-md": relayed},
        "records": 90,
        "sent": 100,
        "completed": 99,
        "failed": 1,
        "missing_records": missing,
        "relayed_cached": 2 if relayed else 0,
        "relayed_cached_known": 1 if relayed else 0,
        "relayed_cached_share": (2 / 90) if relayed else 0.0,
        "record_ttft_s": {"p50": p90 / 3, "p90": p90},
        "record_means": {"prefill_s": 0.2, "kv_wait_s": 0.5, "max_gap_s": math.nan},
        "wan_bytes": 120e6,
        "wan_wire_bytes": 125e6,
        "wan_utilisation": 0.7,
        "handoff_bytes": 2048,
        "goodput_rps": 2.5,
        "sla_met": p90 <= 1.0,
        "cost_per_hour": 36.0,
        "bcr": 2.5 / 36.0,
        "prewarm_sessions": 7,
        "cpu": {"prefill": 0.4, "main_decode": 0.5, "gateway": 0.3, "client": 0.1, "load_avg": 1.2},
        "diagnostics": {
            "all": {"n": 90, "prefill_s": 0.2, "kv_wait_s": 0.5},
            "tail": {
                "n": 9,
                "prefill_s": 0.6,
                "kv_wait_s": 2.0,
                "relayed_share": 0.3,
                "opening_share": 0.5,
            },
            "relayed": relayed,
            "relayed_rld_alone": relayed // 2,
            "mean_output_tokens": 14.0,
        },
    }


def canned() -> dict:
    results = {
        "meta": {
            "command": "make bench",
            "quick": False,
            "wall_s": 900.0,
            "started": "today",
            "machine": "2 cores",
        },
        "scaling": {
            "link": {"bandwidth_gbps": 0.06, "rtt_ms": 30.0, "connection_pool_size": 16},
            "kv_bytes_per_token": 4096,
            "workload": "a canned workload",
            "rates": [
                {
                    "key": "u50",
                    "utilisation": 0.5,
                    "rps": 2.1,
                    "requests": 137,
                    "mean_delta_tokens": 396.0,
                    "trace_utilisation": 0.49,
                }
            ],
            "sla": {
                "ttft_p90_s": 1.0,
                "ttft_p99_s": 1.5,
                "basis_s": 0.2,
                "opening_tokens": 1400,
                "factor_p90": 5.0,
                "factor_p99": 7.5,
            },
        },
        "engine": {
            "prefill": {
                "overhead_s": 0.005,
                "per_token_s": 1.5e-4,
                "per_pair_s": 9e-8,
                "max_error": 0.2,
            },
            "decode": {"overhead_s": 0.004, "per_ctx_token_s": 3.8e-6, "max_error": 0.15},
        },
        "fleets": {
            key: {
                "cost_per_hour": cost,
                "policy_note": "canned",
                "cost_rows": [
                    {
                        "role": "prefill",
                        "gpu_count": 8,
                        "gpu_type": "gpu-a",
                        "datacenter": "a",
                        "price_per_gpu_hour": 2.0,
                    }
                ],
            }
            for key, cost in (("idc-pd", 32.0), ("cdc-pd", 36.0), ("pdd", 38.0))
        },
        "live": {
            "idc-pd": {"u50": live(0.8)},
            "cdc-pd": {"u50": live(3.0, missing=3)},
            "pdd": {"u50": live(1.2, rld=0.3, relayed=40)},
        },
        "sim": {
            key: {
                "u50": {
                    "ttft_s": {"p50": 0.1, "p90": p90, "p99": 0.9},
                    "rld_share": 0.5,
                    "pipelines": {"p-rld-md": 10},
                    "requests": 137,
                    "wan_utilisation": 0.5,
                }
            }
            for key, p90 in (("idc-pd", 0.85), ("cdc-pd", 1.5), ("pdd", 0.4))
        },
        "spot": {
            "pdd": [
                {
                    "case": "open",
                    "prompt_tokens": 1212,
                    "max_tokens": 120,
                    "pipeline": "p-rld-md",
                    "gateway_tokens": 120,
                    "single_tokens": 120,
                    "same": True,
                }
            ]
        },
        "notes": ["a canned note"],
        "errors": [],
    }
    results["goals"] = metrics.goals(results["live"], results["sim"])
    return results


def test_the_report_renders_every_section_from_the_results() -> None:
    text = report.render(canned())
    assert text.startswith("# Live PDD benchmark")
    assert "QUICK RUN" not in text
    assert "Reproduce: `make bench`" in text and "15.0 min" in text
    for heading in (
        "## Goals",
        "## Scaling",
        "## Live results",
        "## Simulator beside it",
        "## Correctness spot-check",
        "## Notes",
    ):
        assert heading in text
    # PDD / CDC-PD 1.2 / 3.0 = 0.40 met; PDD / IDC-PD 1.5 missed; RLD share 30% missed.
    assert "| PDD / CDC-PD P90 TTFT <= 0.5 | 0.40 | yes |" in text
    assert "| PDD / IDC-PD P90 TTFT <= 1.1 | 1.50 | **no** |" in text
    assert "| RLD token share <= 10% | 30.0% | **no** |" in text
    assert "RLD share at 50% (2.10 req/s): 30.0%" in text  # a why line per missed goal
    assert "| CDC-PD | 50% (2.10 req/s) | 1.000 / 3.000 / 4.500 |" in text
    assert "| **3** |" in text  # completed without a record, shown
    assert "32.00 per hour" in text and "38.00 per hour" in text
    assert "| PDD | 1212 | 120 | p-rld-md | 120 / 120 | yes |" in text
    assert "SLA**: TTFT P90 <= **1.00 s** and P99 <= **1.50 s**" in text


def test_the_simulator_on_the_testbed_host_shows_the_dedicated_figures_beside_it() -> None:
    results = canned()
    text = report.render(results)
    assert "dedicated hardware (the live agents share two cores)" in text  # a run before the host
    assert "dedicated P90 (s)" not in text
    results["meta"]["sim_host"] = {"cores": 2, "request_cpu_s": 0.0183}
    results["sim_dedicated"] = {
        key: {"u50": {**m["u50"], "ttft_s": {"p50": 0.1, "p90": 0.3, "p99": 0.8}}}
        for key, m in results["sim"].items()
    }
    results["sim"]["idc-pd"]["u50"]["means"] = {"prefill_s": 0.2, "kv_wait_s": 0.03}
    text = report.render(results)
    assert "on a host of 2 cores shared" in text and "18.3 ms of CPU per request" in text
    assert "P90 error | dedicated P90 (s) | live RLD share |" in text
    # IDC-PD: live P90 0.8, simulated on the host 0.85 (+6.2%), alone 0.300.
    assert "| 0.100 / 0.850 / 0.900 | +6.2% | 0.300 | 0.0% |" in text


def test_a_measured_kv_fabric_is_named_where_the_simulator_is_explained() -> None:
    results = canned()
    results["meta"]["sim_host"] = {"cores": 2, "request_cpu_s": 0.0183}
    text = report.render(results)
    assert "KV fabric** measured" not in text
    assert "with no term for the KV handoff's CPU" in text
    fabric = {"latency_ms": 24.7, "gbps": 1.03, "max_error": 0.017, "wan_handoff": True}
    results["engine"]["fabric"] = fabric
    text = report.render(results)
    assert "24.7 ms + bytes at 1.03 Gbit/s per handoff" in text
    assert "the KV handoff as measured on the agents" in text
    assert "no term for the KV handoff's CPU" not in text
    fabric["relay"] = {"latency_ms": 32.9, "gbps": 0.97, "max_error": 0.04}
    text = report.render(results)
    assert "P to MD in its datacenter, 24.7 ms + bytes at 1.03 Gbit/s" in text
    assert "P to RLD while it ships MD's KV too, 32.9 ms + bytes at 0.97 Gbit/s" in text


def test_the_reported_link_use_is_named_when_the_run_simulated_it() -> None:
    results = canned()
    assert "The WAN link's use" not in report.render(results)
    results["meta"]["sim_link_reports_s"] = 2.0
    assert "heartbeat every 2 s (the bytes of the last interval)" in report.render(results)
    assert "KV already on its way to MD" not in report.render(results)
    results["meta"]["sim_decision_in_flight"] = True
    assert "KV already on its way to MD" in report.render(results)


def test_a_quick_run_says_so_and_skips_what_it_lacks() -> None:
    results = canned()
    results["meta"]["quick"] = True
    results["meta"]["command"] = "python -m bench.pdd --quick"
    del results["live"]["idc-pd"]
    results["sim"] = {}
    results["spot"] = {}
    results["goals"] = metrics.goals(results["live"])
    text = report.render(results)
    assert "QUICK RUN" in text.splitlines()[0]
    assert "## Simulator beside it" not in text
    assert "IDC-PD |" not in text
    assert "PDD / IDC-PD" not in text


def test_cells_format_missing_and_infinite_values() -> None:
    assert report.s(math.nan) == "-" and report.s(math.inf) == "inf" and report.s(None) == "-"
    assert report.s(1.23456) == "1.235"
    assert report.pct(0.1234) == "12.3%" and report.pct(math.inf) == "-"
    assert report.mb(2.5e6) == "2.5" and report.mb(None) == "-"


def test_the_small_summary_keeps_what_the_live_check_needs() -> None:
    from bench.pdd.run import small_summary

    results = canned()
    results["engine"] = {"prefill": {"overhead_s": 0.006}, "decode": {"overhead_s": 0.004}}
    results["engine"]["raw"] = {"prefill": [1, 2, 3]}
    results["live"]["pdd"]["u50"]["cpu"] = {"prefill": 0.4, "load_avg": 2.0}
    results["live"]["pdd"]["u50"]["record_means"] = {"prefill_s": 0.3, "kv_wait_s": 0.2}
    results["sim_dedicated"] = results["sim"]
    summary = small_summary(results)
    assert summary["engine"] == {"prefill": {"overhead_s": 0.006}, "decode": {"overhead_s": 0.004}}
    assert summary["live"]["pdd"]["u50"]["cpu"] == {"prefill": 0.4, "load_avg": 2.0}
    assert summary["live"]["pdd"]["u50"]["record_means"]["kv_wait_s"] == 0.2
    assert summary["sim_dedicated"]["pdd"]["u50"]["ttft_s"]["p90"] == 0.4


def test_the_engines_busy_time_is_shown_beside_the_simulators_engines() -> None:
    results = canned()
    text = report.render(results)
    assert "Engine threads busy" not in text  # a run before the agents reported it
    results["live"]["pdd"]["u50"]["engine_busy"] = {"prefill": 0.31, "main_decode": 0.12}
    results["sim"]["pdd"]["u50"]["host"] = {"cpu": {"prefill": 0.15, "main_decode": 0.05}}
    text = report.render(results)
    assert "Engine threads busy" in text
    assert "| PDD | 50% (2.10 req/s) | 0.310 / 0.150 | - | 0.120 / 0.050 |" in text


def test_the_small_summary_keeps_the_engines_busy_time() -> None:
    from bench.pdd.run import small_summary

    results = canned()
    results["live"]["pdd"]["u50"]["engine_busy"] = {"prefill": 0.31}
    assert small_summary(results)["live"]["pdd"]["u50"]["engine_busy"] == {"prefill": 0.31}


def test_engine_busy_sums_each_roles_instances_from_the_agents_state() -> None:
    from types import SimpleNamespace

    from bench.pdd.run import engine_busy

    docs = {
        "p1": {"instances": [{"engine": {"busy_s": 1.5}}, {"engine": {"busy_s": 0.5}}]},
        "p2": {"instances": [{"engine": {"busy_s": 2.0}}]},
        "md": {"instances": [{"load": {}}]},  # an agent before busy_s: nothing for its role
        "gone": None,  # an agent that did not answer
    }
    roles = {"p1": "prefill", "p2": "prefill", "md": "main_decode", "gone": "relay_decode"}
    fleet = SimpleNamespace(
        spec=SimpleNamespace(nodes=[SimpleNamespace(host=h, role=r) for h, r in roles.items()]),
        state=docs.get,
    )
    assert engine_busy(fleet) == {"prefill": 4.0}
