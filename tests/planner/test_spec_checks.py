"""Every scenario field is checked: a wrong type or range is refused naming the field, and the
WAN link reports its connection pool's ceiling, with a warning when it binds below the line."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from planner.api import link_report, parse_case, simulate, warnings_of
from planner.fleet import fleet_from_dict
from planner.scenario import case_configs, load_scenario
from planner.wan import WanLinkSpec


def _config() -> dict[str, Any]:
    data = load_scenario("paper-ttft")
    return copy.deepcopy(case_configs(data)["pdd"])


def _set(config: dict[str, Any], path: str, value: Any) -> None:
    node: Any = config
    *parents, leaf = path.split(".")
    for key in parents:
        node = node[int(key)] if key.isdigit() else node.setdefault(key, {})
    if leaf.isdigit():
        node[int(leaf)] = value
    else:
        node[leaf] = value


BAD = [
    ("fleet.links.B.pool_size", 0.5, "pool_size: must be an integer >= 1"),
    ("fleet.links.B.pool_size", 0, "pool_size: must be an integer >= 1"),
    ("fleet.links.B.pool_size", True, "pool_size: must be an integer >= 1"),
    ("fleet.links.B.pool_size", "76", "pool_size: must be an integer >= 1"),
    ("fleet.links.B.bandwidth_gbps", -1, "bandwidth_gbps: must be a positive number"),
    ("fleet.links.B.rtt_ms", float("nan"), "rtt_ms: must be a positive number"),
    ("fleet.links.B.tcp_window_kb", 0, "tcp_window_kb: must be a positive number"),
    ("fleet.pools.0.count", 1.5, "count: must be an integer >= 0"),
    ("fleet.pools.0.count", True, "count: must be an integer >= 0"),
    ("fleet.pools.0.count", -1, "count: must be an integer >= 0"),
    ("fleet.engine.max_decode_batch", 12.5, "max_decode_batch: must be an integer >= 1"),
    ("fleet.engine.prefill_batch_tokens", 0.5, "prefill_batch_tokens: must be an integer"),
    ("fleet.engine.prefill_half_tokens", 4096.5, "prefill_half_tokens: must be an integer"),
    ("fleet.engine.prefill_efficiency", 1.5, "prefill_efficiency: must be a number in"),
    ("fleet.engine.decode_mem_efficiency", 0, "decode_mem_efficiency: must be a number in"),
    ("fleet.engine.prefill_overhead_s", -0.1, "prefill_overhead_s: must be a number in"),
    ("fleet.model.kv_bytes_per_token", 4400.5, "kv_bytes_per_token: must be an integer"),
    ("fleet.model.routed_experts", 256.5, "routed_experts: must be an integer"),
    ("fleet.model.experts_per_token", "8", "experts_per_token: must be an integer"),
    ("fleet.model.decode_expert_gb", "x", "decode_expert_gb: must be a number >= 0"),
    ("fleet.gpu_types.GPU-A.unit_price", 0, "unit_price: must be a positive number"),
    ("fleet.pool_wait_aware", "yes", "pool_wait_aware: must be true or false"),
    ("fleet.drc_capacity_gb", -5, "drc_capacity_gb: must be a positive number"),
    ("fleet.fabric.latency_ms", 0, "latency_ms: must be a positive number"),
    ("workload.seed", 1.5, "seed: must be an integer >= 0"),
    ("workload.seed", -1, "seed: must be an integer >= 0"),
    ("workload.closed_loop", "yes", "closed_loop: must be true or false"),
    ("workload.mean_turns", "many", "mean_turns: must be a number"),
    ("workload.mean_turns", 0.5, "mean_turns: must be >= 1"),
    ("workload.rps", 0, "rps: must be a positive number"),
    ("workload.settle_s", -1, "settle_s: must be a number >= 0"),
    ("workload.context.max_context_tokens", 1.5, "max_context_tokens: must be an integer"),
    ("workload.context.shared_prefix_tokens", 0.5, "shared_prefix_tokens: must be an integer"),
    ("workload.context.first_prompt.min", 0.5, "first_prompt.min: must be an integer >= 1"),
    ("workload.output_tokens.mixture", [[0.3, 30]], "mixture\\[0\\]: must be"),
    ("workload.output_tokens.mixture", [[0.3, -30, 1]], "mixture\\[0\\].median"),
    ("workload.hit_rate.kind", "often", "kind: must be skewed"),
    ("sla.ttft_p90_s", 0, "ttft_p90_s: must be a positive number"),
    ("tariff.cached_input_fraction", 2, "cached_input_fraction: must be a number in"),
    ("warmup_s", -1, "warmup_s: must be a number >= 0"),
    ("worklaod", {}, "worklaod: unknown field"),
    ("fleet.links.B.pool_sise", 76, "pool_sise: unknown field"),
]


@pytest.mark.parametrize(("path", "value", "message"), BAD, ids=[f"{p}={v!r}" for p, v, _ in BAD])
def test_a_bad_field_is_refused_naming_it(path: str, value: Any, message: str) -> None:
    config = _config()
    _set(config, path, value)
    with pytest.raises(ValueError, match=message) as err:
        parse_case("pdd", config, "fleet")
    assert str(err.value).startswith("case 'pdd': ")


def test_the_unchanged_case_parses() -> None:
    parse_case("pdd", _config(), "fleet")


def test_a_whole_float_counts_as_the_integer() -> None:
    config = _config()
    _set(config, "fleet.links.B.pool_size", 76.0)
    fleet = fleet_from_dict(config["fleet"])
    assert fleet.links["B"].pool_size == 76 and isinstance(fleet.links["B"].pool_size, int)


def test_a_transfer_case_checks_its_link() -> None:
    data = load_scenario("paper-microbench")
    name, config = next(iter(case_configs(data).items()))
    config["link"] = {**config.get("link", {}), "pool_size": 0.5}
    with pytest.raises(ValueError, match="link.pool_size: must be an integer >= 1"):
        parse_case(name, config, "transfer")


# --- the pool's ceiling ------------------------------------------------------------------------


def test_the_pool_ceiling_is_connections_times_the_connection_rate() -> None:
    link = WanLinkSpec(bandwidth_gbps=20, rtt_ms=20, per_connection_gbps=0.225, pool_size=76)
    assert link.pool_ceiling_gbps == pytest.approx(17.1)
    assert link.effective_gbps == pytest.approx(17.1)
    info = link.describe()
    assert info["bound_by"] == "pool" and info["pool_ceiling_gbps"] == pytest.approx(17.1)
    assert "17.1 Gbit/s is below the line's 20 Gbit/s" in info["warning"]
    assert ">= 89 connections" in info["warning"]  # 20 / 0.225 = 88.9


def test_no_warning_when_the_line_binds() -> None:
    link = WanLinkSpec(bandwidth_gbps=20, rtt_ms=20, per_connection_gbps=0.225, pool_size=89)
    assert link.ceiling_warning() is None
    assert link.describe()["bound_by"] == "line" and link.effective_gbps == 20


def test_the_window_sets_the_connection_rate_of_the_ceiling() -> None:
    # 562.5 KB per 20 ms = 225 Mbit/s; at 40 ms half that, so the same pool carries half.
    link = WanLinkSpec(rtt_ms=40, tcp_window_kb=562.5, pool_size=76)
    assert link.pool_ceiling_gbps == pytest.approx(76 * 0.1125)


def test_the_shared_defaults_link_is_reported_pool_bound() -> None:
    fleet = fleet_from_dict(_config()["fleet"])
    report = link_report(fleet)
    assert report["B"]["bound_by"] == "pool"
    assert report["B"]["pool_ceiling_gbps"] == pytest.approx(17.1)


def test_a_run_reports_the_link_and_warns() -> None:
    result = simulate(
        {
            "include": "paper-microbench.json",
            "base": {"workload": {"duration_s": 5}},
        }
    )
    case = next(iter(result.cases.values()))
    assert case.summary["link"]["bound_by"] == "pool"
    (line,) = warnings_of(result)
    assert "pool ceiling 76 connections" in line
    assert line.startswith(f"link ({', '.join(result.cases)}): pool ceiling")
    assert result.to_dict()["warnings"] == [line]
