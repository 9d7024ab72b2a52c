"""bench/planner/summarize.py: var/planner results condensed into the committed summaries."""

import json

from bench.planner.summarize import main


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

    assert main(["--var", str(var), "--out", str(out)]) == 0
    summaries = json.loads((out / "summaries.json").read_text())
    assert summaries["paper-bcr"] == {"kept": True}
    assert summaries["paper-ttft"]["cases"]["pdd"] == {
        k: case[k] for k in ("summary", "goodput", "wall_s")
    }
    sweep = json.loads((out / "bathtub" / "sweep.json").read_text())
    assert sweep == {"scenario": "bathtub", "kind": "fleet", "sweep": [{"value": 0}]}
    assert json.loads((out / "ttft-seeds.json").read_text()) == {"78": {"rps": 78.0}}
