"""``python -m bench.autopilot``: the autopilot on a live emulated fleet whose rate doubles.

Writes var/bench-autopilot/ (raw results, agents' logs, summary.json, REPORT.md); a full run
(the default --run-s) also writes bench/autopilot/REPORT.md and summary.json. About 15 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.autopilot import report
from bench.autopilot import run as r
from bench.harness.control_plane import start_control_plane
from bench.harness.host import port_in_use
from bench.harness.testbed import ROOT, stop_on_signals

HERE = Path(__file__).resolve().parent
BASE_PORT = 24000
COMMAND = ".venv/bin/python -m bench.autopilot"


class Progress:
    """One line every 15 s: phase, time into the replay, requests answered."""

    def __init__(self) -> None:
        self.phase, self.planned, self.firsts, self.done, self.failed = "start", 0, 0, 0, 0
        self.elapsed = 0.0
        self._stop = threading.Event()
        threading.Thread(target=self._loop, daemon=True).start()

    def first(self) -> None:
        self.firsts += 1

    def _loop(self) -> None:
        while not self._stop.wait(15.0):
            print(f"[autopilot] {self.phase}: {self.elapsed:.0f} s, "
                  f"{self.firsts} first tokens, {self.done} done, {self.failed} failed "
                  f"of {self.planned}", flush=True)  # fmt: skip

    def close(self) -> None:
        self._stop.set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.autopilot")
    parser.add_argument("--out", default=str(ROOT / "var" / "bench-autopilot"))
    parser.add_argument(
        "--run-s",
        type=float,
        default=r.RUN_S,
        help="seconds of arrivals (shorter: a smoke run, not published)",
    )
    parser.add_argument(
        "--late-ramp",
        action="store_true",
        help=f"the ramp at {r.LATE_RAMP_AT_S:g} s, arrivals until {r.LATE_RUN_S:g} s "
        "(written to REPORT-late-ramp.md)",
    )
    args = parser.parse_args(argv)
    full_run_s = r.RUN_S
    if args.late_ramp:
        r.RAMP_AT_S, r.RUN_S = r.LATE_RAMP_AT_S, r.LATE_RUN_S
        full_run_s = r.LATE_RUN_S
        if args.run_s == parser.get_default("run_s"):
            args.run_s = r.LATE_RUN_S
        if args.out == parser.get_default("out"):
            args.out = str(ROOT / "var" / "bench-autopilot-late")
    if args.run_s <= r.RAMP_AT_S + r.RAMP_S:
        print(f"--run-s must be > {r.RAMP_AT_S + r.RAMP_S:g} (the ramp's end)", file=sys.stderr)
        return 2
    stop_on_signals()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    began = time.monotonic()
    started = datetime.now(UTC).isoformat(timespec="seconds")
    print("[autopilot] starting the control plane", flush=True)
    cp = start_control_plane(out)
    progress = Progress()
    try:
        ports = (p for p in range(BASE_PORT, BASE_PORT + 2000) if not port_in_use("127.0.0.1", p))
        live = r.run(cp, ports, out, progress, run_s=args.run_s)
    finally:
        progress.close()
        cp.stop()
    (out / "live.json").write_text(json.dumps(live, default=float) + "\n")
    node_ids = {int(k): v for k, v in live["nodes"].items()}
    summary = report.summarise(live, node_ids, args.run_s)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()  # fmt: skip
    meta = {"started": started, "commit": commit, "wall_s": time.monotonic() - began,
            "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}",
            "run_s": args.run_s}  # fmt: skip
    summary["meta"] = meta
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
    command = COMMAND + (" --late-ramp" if args.late_ramp else "")
    text = report.render(summary, command, meta)
    (out / "REPORT.md").write_text(text)
    if args.run_s == full_run_s:
        name = "-late-ramp" if args.late_ramp else ""
        (HERE / f"summary{name}.json").write_text(
            json.dumps(summary, indent=2, default=float) + "\n"
        )
        (HERE / f"REPORT{name}.md").write_text(text)
    print(f"[autopilot] done in {meta['wall_s'] / 60:.1f} min; goals: "
          f"{json.dumps(summary['goals'])}; report {out / 'REPORT.md'}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
