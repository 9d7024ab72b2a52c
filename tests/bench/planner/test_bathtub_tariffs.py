"""Re-pricing a committed hit-rate sweep at other tariffs (bench/planner/bathtub_tariffs.py)."""

from __future__ import annotations

import json

import pytest

from bench.planner.bathtub_tariffs import main, price, shape
from planner.metrics import Tariff


def point(goodput: float, uncached: float, cached: float, output: float) -> dict:
    billed = {"uncached_input": uncached, "cached_input": cached, "output": output}
    return {"goodput_rps": goodput, "cost_per_hour": 80.0, "at": {"billed_tokens": billed}}


SWEEP = [
    {"value": 0.0, "pdd": point(6.0, 64_000, 0, 500)},
    {"value": 0.5, "pdd": point(10.0, 32_000, 32_000, 500)},
    {"value": 0.9, "pdd": point(40.0, 6_400, 57_600, 500)},
]


def test_repricing_matches_the_tariff_applied_to_each_point() -> None:
    [block] = price(SWEEP, [0.25], [4.0])
    ys = block["cases"]["pdd"]["per_cost"]
    tariff = Tariff(1.0, 0.25, 4.0)
    for row, y in zip(SWEEP, ys, strict=True):
        billed = row["pdd"]["at"]["billed_tokens"]
        expected = row["pdd"]["goodput_rps"] * 3600 * tariff.billed(**billed) / 80.0
        assert y == pytest.approx(expected)
    assert block["hits"] == [0.0, 0.5, 0.9]


def test_shape_finds_the_valley_between_the_ends() -> None:
    s = shape([5.0, 3.0, 4.0, 2.0, 8.0])
    assert s["valley"] == 2.0 and s["valley_at_index"] == 3
    assert s["low_over_valley"] == 2.5 and s["high_over_valley"] == 4.0


def test_cli_prints_a_table_per_tariff_and_writes_json(tmp_path, capsys) -> None:
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"sweep": SWEEP}))
    out = tmp_path / "priced.json"
    assert main([str(path), "--cached", "0.1", "--output", "1.5", "5", "--json", str(out)]) == 0
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
    assert main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
