"""bench/planner/settle_probe.py: one case at one drawn rate over several settle spans."""

from __future__ import annotations

import json

import pytest

from bench.planner.settle_probe import main
from tests.planner.test_sim import SMALL_POOLS


@pytest.fixture
def scenario(tmp_path):
    # Turns 4 s apart, responses far longer: the fleet's sessions wait on their answers.
    path = tmp_path / "slow-sessions.json"
    workload = {"duration_s": 300, "seed": 5, "mean_turns": 8, "turn_gap_s": 4.0}
    path.write_text(
        json.dumps(
            {
                "include": "_common.json",
                "base": {"fleet": {"pools": SMALL_POOLS}, "workload": workload, "warmup_s": 30},
                "cases": {"pdd": {}},
            }
        )
    )
    return path


def test_a_settled_run_receives_more_of_the_drawn_rate(scenario, tmp_path, capsys):
    out = tmp_path / "probe.json"
    args = [str(scenario), "pdd", "--rps", "4", "--settle", "0", "600", "--jobs", "1"]
    assert main([*args, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["settle_s"] for r in rows] == [0, 600]
    cold, settled = rows
    assert cold["received_share"] < 0.8 < settled["received_share"]
    assert len(settled["ttft_p90_quarters"]) == 4
    assert "settle s" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["nope", "--rps", "4", "--settle", "0"], "'nope' is not a case"),
     (["pdd", "--rps", "4", "--settle", "-1"], "--settle")],
)  # fmt: skip
def test_bad_arguments_are_refused(scenario, capsys, extra, message):
    try:
        code = main([str(scenario), *extra])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err
