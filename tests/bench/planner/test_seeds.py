"""bench/planner/seeds.py: a scenario's cases over several seeds, cut against a reference."""

from __future__ import annotations

import json

import pytest

from bench.planner.seeds import main
from tests.planner.test_sim import SMALL_POOLS


@pytest.fixture
def scenario(tmp_path):
    path = tmp_path / "tiny-ttft.json"
    path.write_text(
        json.dumps(
            {
                "description": "two cases on a small fleet",
                "include": "_common.json",
                "base": {
                    "fleet": {"pools": SMALL_POOLS},
                    "workload": {"rps": 6, "duration_s": 90, "settle_s": 0},
                    "warmup_s": 20,
                },
                "cases": {"cdc-pd": {"fleet": {"system": "cdc-pd"}}, "pdd": {}},
            }
        )
    )
    return path


def test_seeds_cut_each_case_against_the_reference_seed_by_seed(scenario, tmp_path, capsys):
    out = tmp_path / "seeds.json"
    args = [str(scenario), "--reference", "cdc-pd", "--seeds", "1", "2", "--jobs", "1"]
    assert main([*args, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    runs = {(r["case"], r["seed"]): r for r in data["runs"]}
    assert set(runs) == {(c, s) for c in ("cdc-pd", "pdd") for s in (1, 2)}
    for seed in (1, 2):
        pdd, ref = runs["pdd", seed], runs["cdc-pd", seed]
        assert pdd["cut_p90"] == pytest.approx(pdd["p90"] / ref["p90"] - 1)
        assert ref["cut_p90"] == 0.0
        assert set(pdd["ttft_parts"]) == {"all", "tail"}
        assert 0 < pdd["offered_rps"] <= 6.5 and 0 <= pdd["wan_pool_utilisation"] <= 1
    printed = capsys.readouterr().out
    assert "where the tail's first tokens" in printed and "pdd" in printed


def test_an_unknown_reference_is_a_one_line_error(scenario, capsys):
    assert main([str(scenario), "--reference", "nope", "--seeds", "1"]) == 2
    assert "--reference 'nope' is not a case" in capsys.readouterr().err


def test_rps_sets_every_cases_drawn_rate(scenario, tmp_path, capsys):
    out = tmp_path / "seeds.json"
    args = [str(scenario), "--reference", "cdc-pd", "--seeds", "1", "--jobs", "1"]
    assert main([*args, "--rps", "3", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["rps"] == 3.0
    for run in data["runs"]:
        assert 0 < run["offered_rps"] <= 3.5  # the scenario draws 6 RPS
    assert main([*args, "--rps", "0"]) == 2
    assert "--rps must be a positive number" in capsys.readouterr().err
