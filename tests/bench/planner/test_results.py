"""`python -m bench.planner.results`: a scenario's cases over several seeds cut against a
reference (seeds), a committed hit-rate sweep re-priced at other tariffs (tariffs), and
var/planner results condensed into the committed summaries (publish)."""

from __future__ import annotations

import json

import pytest

from bench.planner import results
from planner.metrics import Tariff
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
    assert results.main(["seeds", *args, "--out", str(out)]) == 0
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
    assert results.main(["seeds", str(scenario), "--reference", "nope", "--seeds", "1"]) == 2
    assert "--reference 'nope' is not a case" in capsys.readouterr().err


def test_rps_sets_every_cases_drawn_rate(scenario, tmp_path, capsys):
    out = tmp_path / "seeds.json"
    args = [str(scenario), "--reference", "cdc-pd", "--seeds", "1", "--jobs", "1"]
    assert results.main(["seeds", *args, "--rps", "3", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["rps"] == 3.0
    for run in data["runs"]:
        assert 0 < run["offered_rps"] <= 3.5  # the scenario draws 6 RPS
    assert results.main(["seeds", *args, "--rps", "0"]) == 2
    assert "--rps must be a positive number" in capsys.readouterr().err


def point(goodput: float, uncached: float, cached: float, output: float) -> dict:
    billed = {"uncached_input": uncached, "cached_input": cached, "output": output}
    return {"goodput_rps": goodput, "cost_per_hour": 80.0, "at": {"billed_tokens": billed}}


SWEEP = [
    {"value": 0.0, "pdd": point(6.0, 64_000, 0, 500)},
    {"value": 0.5, "pdd": point(10.0, 32_000, 32_000, 500)},
    {"value": 0.9, "pdd": point(40.0, 6_400, 57_600, 500)},
]


def test_repricing_matches_the_tariff_applied_to_each_point() -> None:
    [block] = results.price(SWEEP, [0.25], [4.0])
    ys = block["cases"]["pdd"]["per_cost"]
    tariff = Tariff(1.0, 0.25, 4.0)
    for row, y in zip(SWEEP, ys, strict=True):
        billed = row["pdd"]["at"]["billed_tokens"]
        expected = row["pdd"]["goodput_rps"] * 3600 * tariff.billed(**billed) / 80.0
        assert y == pytest.approx(expected)
    assert block["hits"] == [0.0, 0.5, 0.9]


def test_shape_finds_the_valley_between_the_ends() -> None:
    s = results.shape([5.0, 3.0, 4.0, 2.0, 8.0])
    assert s["valley"] == 2.0 and s["valley_at_index"] == 3
    assert s["low_over_valley"] == 2.5 and s["high_over_valley"] == 4.0


def test_cli_prints_a_table_per_tariff_and_writes_json(tmp_path, capsys) -> None:
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"sweep": SWEEP}))
    out = tmp_path / "priced.json"
    assert (
        results.main(
            ["tariffs", str(path), "--cached", "0.1", "--output", "1.5", "5", "--json", str(out)]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert text.count("## cached input at 10%") == 2 and "| pdd |" in text
    assert len(json.loads(out.read_text())) == 2


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "cannot read a result"),
        (json.dumps({"cases": {}}), "not a sweep result"),
        (
            json.dumps({"sweep": [{"value": 0.1, "pdd": {"goodput_rps": 1, "at": {}}}]}),
            "no billed_tokens",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, content, message) -> None:
    path = tmp_path / "result.json"
    path.write_text(content)
    assert results.main(["tariffs", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_condenses_results_and_keeps_what_was_not_rerun(tmp_path):
    var, out = tmp_path / "var", tmp_path / "out"
    (var / "paper-ttft").mkdir(parents=True)
    case = {"summary": {"ttft_s": {"p90": 7.6}}, "goodput": None, "wall_s": 1.0, "series": [1] * 9}
    result = {"scenario": "paper-ttft", "kind": "fleet", "cases": {"pdd": case}, "sweep": []}
    (var / "paper-ttft" / "result.json").write_text(json.dumps(result))
    (var / "bathtub").mkdir()
    (var / "bathtub" / "result.json").write_text(
        json.dumps(
            {"scenario": "bathtub", "kind": "fleet", "cases": {"x": case}, "sweep": [{"value": 0}]}
        )
    )
    (var / "ttft-seeds").mkdir()
    (var / "ttft-seeds" / "78rps.json").write_text(json.dumps({"rps": 78.0}))
    out.mkdir()
    (out / "summaries.json").write_text(json.dumps({"paper-bcr": {"kept": True}}))

    assert results.main(["publish", "--var", str(var), "--out", str(out)]) == 0
    summaries = json.loads((out / "summaries.json").read_text())
    assert summaries["paper-bcr"] == {"kept": True}
    assert summaries["paper-ttft"]["cases"]["pdd"] == {
        k: case[k] for k in ("summary", "goodput", "wall_s")
    }
    sweep = json.loads((out / "bathtub" / "sweep.json").read_text())
    assert sweep == {"scenario": "bathtub", "kind": "fleet", "sweep": [{"value": 0}]}
    assert json.loads((out / "ttft-seeds.json").read_text()) == {"78": {"rps": 78.0}}


def test_an_unknown_command_is_a_usage_error(capsys) -> None:
    assert results.main(["nope"]) == 2
    assert "seeds,tariffs,publish" in capsys.readouterr().err
