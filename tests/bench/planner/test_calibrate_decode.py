"""The decode-balance calibration's pure parts: the fleet it runs and where it reads the balance."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.planner.calibrate_decode import balance, main, side_config
from bench.planner.calibrate_load import main as load_main
from planner.scenario import case_configs, load_scenario


def _pools(config: dict) -> dict[str, int]:
    return {p["role"]: p["count"] for p in config["fleet"]["pools"]}


def test_each_side_makes_the_other_pool_and_the_wan_ample() -> None:
    base = case_configs(load_scenario("paper-bcr"))["pdd"]
    base_pools = _pools(base)
    base_link = base["fleet"]["links"]["B"]

    prefill = side_config("prefill", "decode_mem_efficiency", 0.2, 3, 4, {})
    assert _pools(prefill)["main_decode"] == 4 * base_pools["main_decode"]
    assert _pools(prefill)["prefill"] == base_pools["prefill"]
    decode = side_config("decode", "max_decode_batch", 40, 3, 4, {"prefill_efficiency": 0.3})
    assert _pools(decode)["prefill"] == 4 * base_pools["prefill"]
    assert _pools(decode)["main_decode"] == base_pools["main_decode"]
    assert _pools(decode)["relay_decode"] == base_pools["relay_decode"]
    for config in (prefill, decode):
        link = config["fleet"]["links"]["B"]
        assert link["bandwidth_gbps"] == 4 * base_link["bandwidth_gbps"]
        assert link["pool_size"] == 4 * base_link["pool_size"]
        assert config["workload"]["seed"] == 3
        # MD's own slots are balanced against P: RLD does not take MD's queue.
        assert config["fleet"]["policy"]["relay_when_main_saturated"] is False
    assert prefill["fleet"]["engine"]["decode_mem_efficiency"] == 0.2
    assert decode["fleet"]["engine"]["max_decode_batch"] == 40
    assert decode["fleet"]["engine"]["prefill_efficiency"] == 0.3
    # The scenario itself is not changed by building a side.
    assert _pools(case_configs(load_scenario("paper-bcr"))["pdd"]) == base_pools


def test_balance_interpolates_where_decode_meets_prefill() -> None:
    rows = [
        {"decode_mem_efficiency": 0.10, "prefill": 80.0, "decode": 60.0},
        {"decode_mem_efficiency": 0.20, "prefill": 80.0, "decode": 100.0},
        {"decode_mem_efficiency": 0.30, "prefill": 80.0, "decode": 140.0},
    ]
    assert balance(rows) == pytest.approx(0.15)
    # Rows may come in any order; another knob is read by name.
    cap_rows = [
        {"max_decode_batch": 48, "prefill": 78.0, "decode": 82.0},
        {"max_decode_batch": 40, "prefill": 78.0, "decode": 76.0},
    ]
    assert balance(cap_rows, "max_decode_batch") == pytest.approx(40 + 8 * 2 / 6)


def test_balance_is_none_when_the_grid_does_not_bracket_it() -> None:
    rows = [
        {"decode_mem_efficiency": 0.2, "prefill": 80.0, "decode": 90.0},
        {"decode_mem_efficiency": 0.3, "prefill": 80.0, "decode": 120.0},
    ]
    assert balance(rows) is None
    level = [
        {"decode_mem_efficiency": 0.2, "prefill": 80.0, "decode": 80.0},
        {"decode_mem_efficiency": 0.3, "prefill": 80.0, "decode": 90.0},
    ]
    assert balance(level) == 0.2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--knob", "max_decode_batch", "--values", "40.5"], "positive integers"),
        (["--values", "1.5"], "(0, 1]"),
        (["--ample", "1"], "--ample"),
        (["--engine", "decode_mem_efficiency=0.2"], "swept knob"),
        (["--engine", "foo=1"], "expected prefill_efficiency"),
        (["--engine", "prefill_order=lifo"], "prefill_order is one of fifo, srpt"),
        (["--duration", "60"], "longer than the warm-up"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--engine", "prefill_efficiency=0.2"], "swept by --eff"),
        (["--decode-ratio", "0.6", "--engine", "decode_mem_efficiency=0.2"], "not both"),
        (["--engine", "decode_mem_efficiency=1.5"], "(0, 1]"),
        (["--engine", "max_decode_batch=0"], "must be > 0"),
        (["--duration", "30"], "longer than the warm-up"),
        (["--max-drift", "0.5"], "--max-drift: must be >= 1"),
    ],
)
def test_load_calibration_takes_the_same_engine_overrides(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load_main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_prefill_order_is_an_engine_override_with_a_name_not_a_number() -> None:
    from bench.planner.calibrate_decode import engine_override

    assert engine_override("prefill_order=srpt") == ("prefill_order", "srpt")
    assert engine_override("max_decode_batch=43") == ("max_decode_batch", 43)
    config = side_config("prefill", "decode_mem_efficiency", 0.2, 1, 4, {"prefill_order": "srpt"})
    assert config["fleet"]["engine"]["prefill_order"] == "srpt"
    longer = side_config("decode", "decode_mem_efficiency", 0.2, 1, 4, {}, duration_s=900)
    assert longer["workload"]["duration_s"] == 900


def test_with_pdd_the_load_calibration_reports_the_cut_without_fitting_it() -> None:
    from bench.planner.calibrate_load import _row

    def run(system, p50, p90, p99, seed):
        return {"system": system, "rps": 92.0, "prefill_efficiency": 0.22, "seed": seed,
                "ttft_p50": p50, "ttft_p90": p90, "ttft_p99": p99}  # fmt: skip

    baselines = [
        run("idc-pd", 4.0, 12.0, 18.0, 1), run("idc-pd", 4.4, 13.0, 19.0, 2),
        run("cdc-pd", 6.5, 18.0, 30.0, 1), run("cdc-pd", 6.9, 18.6, 29.4, 2),
    ]  # fmt: skip
    row = _row(baselines, 0.22, 92.0)
    assert "pdd_cut_p90" not in row
    with_pdd = _row([*baselines, run("pdd", 4.1, 9.0, 14.0, 1), run("pdd", 4.3, 10.6, 16.0, 2)],
                    0.22, 92.0)  # fmt: skip
    assert with_pdd["pdd_cut_p90"] == pytest.approx(9.8 / 18.3 - 1)
    assert with_pdd["pdd_cut_p99"] == pytest.approx(15.0 / 29.7 - 1)
    assert with_pdd["worst_err"] == row["worst_err"]  # PDD takes no part in the fit


def test_drift_compares_the_last_quarter_with_the_second_and_rows_take_the_worse_baseline():
    from bench.planner.calibrate_load import _row, drift

    def quarters(*p50s):
        return [{"p50": v, "p90": 2 * v, "n": 10} for v in p50s]

    assert drift(quarters(1.0, 2.0, 2.2, 2.0)) == pytest.approx(1.0)
    assert drift(quarters(1.0, 2.0, 4.0, 8.0)) == pytest.approx(4.0)
    assert math.isnan(drift([]))

    def run(system, d, seed):
        return {"system": system, "rps": 88.0, "prefill_efficiency": 0.23, "seed": seed,
                "ttft_p50": 4.0, "ttft_p90": 12.0, "ttft_p99": 20.0, "drift": d}  # fmt: skip

    row = _row([run("idc-pd", 1.0, 1), run("idc-pd", 1.4, 2), run("cdc-pd", 2.0, 1),
                run("cdc-pd", 3.0, 2), run("pdd", 9.0, 1)], 0.23, 88.0)  # fmt: skip
    assert row["drift"] == pytest.approx(2.5)  # CDC-PD's seed mean; PDD takes no part


def test_max_drift_chooses_only_among_steady_points(monkeypatch, capsys, tmp_path):
    import bench.planner.calibrate_load as cl

    def fake_run(point):
        system, eff, rps, seed = point[:4]
        filling = rps > 80  # the faster rate's queues keep growing
        return {"system": system, "rps": rps, "prefill_efficiency": eff, "seed": seed,
                "ttft_p50": 4.2 if filling else 3.0, "ttft_p90": 18.3, "ttft_p99": 29.7,
                "drift": 3.0 if filling else 1.1}  # fmt: skip

    class InlinePool:
        def __init__(self, **_):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def map(self, fn, items):
            return map(fn, items)

    monkeypatch.setattr(cl, "_run", fake_run)
    monkeypatch.setattr(cl, "ProcessPoolExecutor", InlinePool)
    out = tmp_path / "c.json"
    argv = ["--rps", "78", "88", "--eff", "0.23", "--seeds", "1", "--out", str(out)]
    assert cl.main(argv) == 0
    assert "0.23, 88.0 RPS" in capsys.readouterr().out  # the best fit, though filling
    assert cl.main([*argv, "--max-drift", "1.5"]) == 0
    assert "0.23, 78.0 RPS" in capsys.readouterr().out
    assert json.loads(out.read_text())["chosen"]["rps"] == 78.0
    assert cl.main([*argv, "--max-drift", "1.05"]) == 0
    assert "chosen: none" in capsys.readouterr().out
    assert json.loads(out.read_text())["chosen"] is None


def test_the_prefill_order_probe_runs_a_named_scenario_and_refuses_a_bad_one(capsys):
    from bench.planner.probe_prefill_orders import _base_config
    from bench.planner.probe_prefill_orders import main as probe_main

    root = Path(__file__).resolve().parents[3]
    ninth = _base_config(str(root / "bench/planner/sensitivity/ninth-pass-ttft.json"))
    assert (ninth["workload"]["rps"], ninth["workload"]["duration_s"]) == (92, 600)
    assert ninth["fleet"]["engine"]["decode_mem_efficiency"] == 0.134
    assert _base_config("paper-ttft")["fleet"]["system"] == "cdc-pd"
    with pytest.raises(SystemExit) as exit_info:
        probe_main(["--scenario", "no-such-scenario.json", "--order", "fifo"])
    assert "--scenario" in str(exit_info.value.code)
    with pytest.raises(SystemExit) as exit_info:
        probe_main(["--scenario", "paper-bcr", "--order", "fifo"])
    assert "no cdc-pd case" in str(exit_info.value.code)
