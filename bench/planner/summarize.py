"""Condense the planner's regenerated results (var/planner/, untracked) into the small
summaries committed here.

    .venv/bin/python bench/planner/summarize.py [--var var/planner] [--out bench/planner]

Writes ``summaries.json`` (every headline scenario's cases: summary, goodput, wall time; the
per-second series are dropped), ``bathtub/sweep.json`` (the hit-rate sweep, what
``bathtub_tariffs.py`` reads) and ``ttft-seeds.json`` (``make ttft-seeds``' rate scan, keyed by
rate) from whichever of ``<var>/<scenario>/result.json`` and ``<var>/ttft-seeds/<r>rps.json``
exist; a scenario or rate not regenerated keeps its committed entry.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ["paper-microbench", "paper-ttft", "paper-token-share", "paper-bcr", "p-rld-collapse"]
KEEP = ("summary", "goodput", "wall_s")


def condense(result: dict[str, Any]) -> dict[str, Any]:
    cases = {
        name: {k: case[k] for k in KEEP if k in case} for name, case in result["cases"].items()
    }
    return {"scenario": result.get("scenario"), "kind": result.get("kind"), "cases": cases}


def _load(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else {}


def _dump(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--var", type=Path, default=ROOT / "var" / "planner")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "planner")
    args = ap.parse_args(argv)

    summaries = _load(args.out / "summaries.json")
    for name in SCENARIOS:
        path = args.var / name / "result.json"
        if path.exists():
            summaries[name] = condense(json.loads(path.read_text()))
            print(f"summaries.json: {name}")
    _dump(args.out / "summaries.json", summaries)

    bathtub = args.var / "bathtub" / "result.json"
    if bathtub.exists():
        data = json.loads(bathtub.read_text())
        keep = {k: data.get(k) for k in ("scenario", "kind", "sweep")}
        _dump(args.out / "bathtub" / "sweep.json", keep)
        print("bathtub/sweep.json")

    seeds = _load(args.out / "ttft-seeds.json")
    for path in sorted((args.var / "ttft-seeds").glob("*rps.json")):
        seeds[path.stem.removesuffix("rps")] = json.loads(path.read_text())
        print(f"ttft-seeds.json: {path.stem}")
    _dump(args.out / "ttft-seeds.json", seeds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
