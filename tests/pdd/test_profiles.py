"""Model profiles (the emulated engine's served models) and the hardware model's shared
conversions: one set of numbers for the planner and the live fleet."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from pdd.hardware import unit_from_chips
from pdd.profiles import PAPER, is_profile_source, load_profile, profile_from_dict
from pdd.spec import strip_comments

ROOT = Path(__file__).resolve().parents[2]


def test_the_paper_profile_has_the_planners_numbers():
    common = strip_comments(json.loads((ROOT / "planner/scenarios/_common.json").read_text()))
    fleet = common["fleet"]
    profile = load_profile("profile:paper-dsv4")
    assert asdict(profile.model) == {**asdict(profile.model), **fleet["model"]}
    assert asdict(profile.engine) == {**asdict(profile.engine), **fleet["engine"]}
    assert profile.resident_weight_gb == fleet["resident_weight_gb"]


def test_a_profile_source_names_a_built_in_or_a_json_file(tmp_path):
    assert is_profile_source("profile:paper-dsv4") and not is_profile_source("baton-tiny")
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**PAPER, "name": "mine", "resident_weight_gb": 100}))
    assert load_profile(f"profile:{path}").name == "mine"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("baton-tiny", "does not start with"),
        ("profile:nope", "names no profile"),
        ("profile:/no/such.json", "names no profile"),
    ],
)
def test_a_bad_profile_source_gets_a_reason(source, message):
    with pytest.raises(ValueError, match=message):
        load_profile(source)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"resident_weight_gb": -1}, "resident_weight_gb"),
        ({"model": {**PAPER["model"], "kv_bytes_per_token": 0}}, "model.kv_bytes_per_token"),
        ({"engine": {**PAPER["engine"], "bogus": 1}}, "engine.bogus: unknown field"),
        ({"extra": 1}, "extra: unknown field"),
        ({"name": ""}, "name"),
    ],
)
def test_a_bad_profile_names_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        profile_from_dict({**PAPER, **change})


def test_a_unit_is_its_chips_summed_in_the_planners_units():
    unit = unit_from_chips(
        name="H200",
        count=8,
        peak_bf16_tflops=989,
        memory_gib=141,
        memory_bandwidth_gbps=4800,
        interconnect_gbps=50,
        unit_price=20,
    )
    assert unit.peak_tflops == 8 * 989
    assert unit.mem_gb == pytest.approx(8 * 141 * 1.073741824)
    assert unit.mem_bw_tbps == pytest.approx(38.4)
    assert unit.interconnect_gbps == 3200
    with pytest.raises(ValueError, match="count"):
        unit_from_chips(
            name="x",
            count=0,
            peak_bf16_tflops=1,
            memory_gib=1,
            memory_bandwidth_gbps=1,
            interconnect_gbps=1,
        )
