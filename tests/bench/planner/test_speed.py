"""bench/planner/speed.py: A (a revision, exported) and B (this tree) interleaved on one core,
with the two sides' records compared."""

from __future__ import annotations

import json

from bench.planner.speed import main


def test_before_and_after_run_interleaved_and_agree(tmp_path, capsys) -> None:
    out = tmp_path / "speed.json"
    # A tiny run: 30 s of paper-ttft's pdd case at 10 RPS, no settle, one run a side.
    rc = main(["--reps", "1", "--rps", "10", "--duration", "30", "--settle", "0",
               "--out", str(out)])  # fmt: skip
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["identical_records"]
    assert len(result["runs"]["A"]) == len(result["runs"]["B"]) == 1
    assert result["A"]["req_per_wall_s"]["median"] > 0 < result["B"]["req_per_cpu_s"]["median"]
    # B is this tree as pure Python; C, where a current compiled build exists, the same tree
    # compiled (planner/native.py); every side's records are the same.
    assert [r["native"] for r in result["runs"]["B"]] == ["disabled"]
    if "C" in result["runs"]:
        assert [r["native"] for r in result["runs"]["C"]] == ["native"]
        assert result["runs"]["C"][0]["digest"] == result["runs"]["A"][0]["digest"]
    assert "pinned to core" in result["order"]
    assert "rep 1 A" in capsys.readouterr().err
