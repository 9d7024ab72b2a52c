"""Bands, not points: each single-rate figure comes with its sensitivity to the rate (the same
requests arriving faster or slower), to the fitted constants and to the seed, and a cliff flag
by a stated rule."""

from __future__ import annotations

import math

import pytest

from planner import cli
from planner.api import simulate
from planner.bands import CLIFF_PCT, RULE, band, band_of, band_points, describe


def _fake(p90_of_factor, met_below: float = math.inf):
    """A points function whose P90 TTFT is ``p90_of_factor(rate factor)``."""

    def points(jobs, note=""):
        out = []
        for _rps, mods in jobs:
            f = dict(mods).get("rate_factor", 1.0)
            p90 = p90_of_factor(f)
            out.append({"met": p90 < met_below, "ttft_p50_s": p90 / 2, "ttft_p90_s": p90,
                        "ttft_p99_s": 2 * p90, "relay_share": 0.05})  # fmt: skip
        return out

    return points


def test_the_points_are_the_rate_band_then_constants_then_seeds() -> None:
    pts = band_points(80.0, 5.0, 5.0, (2, 3))
    factors = [dict(m).get("rate_factor", 1.0) for _, m in pts[:5]]
    assert factors == [0.95, 0.99, 1.0, 1.01, 1.05]
    assert all(r == 80.0 for r, _ in pts)  # the rate moves by time scaling, not a new draw
    assert [m for _, m in pts[5:9]] == [
        (("prefill_efficiency", 0.95),), (("prefill_efficiency", 1.05),),
        (("decode_mem_efficiency", 0.95),), (("decode_mem_efficiency", 1.05),),
    ]  # fmt: skip
    assert [m for _, m in pts[9:]] == [(("seed", 2),), (("seed", 3),)]
    assert len(band_points(80.0, 0, 0)) == 3  # the point and its 1% neighbours


def test_a_flat_point_is_not_a_cliff() -> None:
    b = band(_fake(lambda f: 5.0 * f), 80.0, 5.0, 0.0)  # elasticity 1: 1% per 1%
    assert b["p90_change_pct_per_1pct_rate"] == pytest.approx(1.0)
    assert not b["cliff"] and not b["sla_flips"]
    assert b["ttft_p90_s"] == {"at": 5.0, "lo": pytest.approx(4.75), "hi": pytest.approx(5.25)}
    assert b["rule"] == RULE and f"{CLIFF_PCT:g}%" in RULE


def test_a_steep_point_is_a_cliff_and_says_so() -> None:
    # paper-ttft's knife edge: 7.42 s -> 12.0 s for +0.8% rate.
    b = band(_fake(lambda f: 7.42 if f <= 1.0 else 12.0), 80.0, 5.0, 0.0)
    assert b["cliff"] and b["p90_change_pct_per_1pct_rate"] > CLIFF_PCT
    line = describe("pdd", b)
    assert "ON A CLIFF" in line


def test_just_under_the_rule_is_not_a_cliff() -> None:
    b = band(_fake(lambda f: 10.0 * (1 + 9.9 * (f - 1))), 80.0, 5.0, 0.0)
    assert b["p90_change_pct_per_1pct_rate"] == pytest.approx(9.9)
    assert not b["cliff"]


def test_a_p99_that_jumps_is_a_cliff_too() -> None:
    def points(jobs, note=""):
        out = []
        for _rps, mods in jobs:
            f = dict(mods).get("rate_factor", 1.0)
            p99 = 14.1 if f <= 1.0 else 19.05  # paper-ttft sized for 100 RPS, at +1%
            out.append({"met": p99 < 15, "ttft_p50_s": 1.6, "ttft_p90_s": 2.9 * f,
                        "ttft_p99_s": p99, "relay_share": 0.07})  # fmt: skip
        return out

    b = band(points, 100.0, 5.0, 0.0)
    assert b["p90_change_pct_per_1pct_rate"] == pytest.approx(1.0)
    assert b["p99_change_pct_per_1pct_rate"] == pytest.approx(100 * (19.05 - 14.1) / 14.1)
    assert b["cliff"] and b["sla_flips"]


def test_an_unserved_neighbour_is_a_cliff() -> None:
    b = band(_fake(lambda f: math.inf if f > 1.0 else 5.0), 80.0, 5.0, 0.0)
    assert b["cliff"] and math.isinf(b["p90_change_pct_per_1pct_rate"])


def test_an_sla_verdict_that_flips_in_the_band_is_flagged() -> None:
    b = band(_fake(lambda f: 9.0 * f, met_below=9.2), 80.0, 5.0, 0.0)
    assert b["sla_flips"] and not b["cliff"]
    assert "SLA verdict flips" in describe("x", b)


def test_constants_and_seeds_give_their_own_spans() -> None:
    results = [{"met": True, "ttft_p90_s": v, "ttft_p99_s": 2 * v, "ttft_p50_s": 1.0,
                "relay_share": 0.0} for v in (5, 5, 5, 5, 5, 4, 6, 5.5, 4.5, 3, 7)]  # fmt: skip
    b = band_of(results, 10.0, 5.0, 5.0, (2, 3))
    assert b["ttft_p90_s_constants"] == {"at": 5, "lo": 4, "hi": 6}
    assert b["ttft_p90_s_seeds"] == {"at": 5, "lo": 3, "hi": 7}
    assert "over 3 seeds" in describe("x", b)


# --- on a real (small) run ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def banded():
    return simulate("tiny-size", band_pct=5.0, constants_pct=5.0, seeds=1)


def test_simulate_attaches_a_band_whose_centre_is_the_run(banded) -> None:
    case = banded.cases["default"]
    b = case.summary["band"]
    centre = next(row for row in b["rate"] if row["factor"] == 1.0)
    assert centre["ttft_p90_s"] == case.summary["ttft_s"]["p90"]
    assert b["ttft_p90_s"]["at"] == case.summary["ttft_s"]["p90"]
    assert [row["constant"] for row in b["constants"]] == [
        "prefill_efficiency", "prefill_efficiency", "decode_mem_efficiency",
        "decode_mem_efficiency",
    ]  # fmt: skip
    assert b["seeds"][0]["seed"] == 2  # tiny-plan's seed is 1 (from _common.json)
    # Slower prefill hurts: P90 TTFT with 5% less prefill efficiency is no better.
    slow, fast = b["constants"][0], b["constants"][1]
    assert slow["ttft_p90_s"] >= fast["ttft_p90_s"]


def test_a_faster_rate_is_the_same_requests_sooner(banded) -> None:
    b = banded.cases["default"].summary["band"]
    rows = {row["factor"]: row for row in b["rate"]}
    # Same sample, 5% more load: the tail is no shorter than at 5% less.
    assert rows[1.05]["ttft_p90_s"] >= rows[0.95]["ttft_p90_s"]


def test_no_band_unless_asked_and_none_for_a_goodput_search() -> None:
    plain = simulate("tiny-size")
    assert "band" not in plain.cases["default"].summary
    with pytest.raises(ValueError, match="band_pct"):
        simulate("tiny-size", band_pct=-1)


def test_cli_run_prints_the_band_and_the_rule(tmp_path, capsys) -> None:
    assert cli.main(["run", "tiny-size", "--no-plots", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "default: P90 TTFT" in out and "over +-5% rate" in out
    assert RULE in out
