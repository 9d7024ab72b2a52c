"""The compiled simulator (planner/native.py): used only when current, and the same results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from planner import native

ROOT = Path(__file__).resolve().parents[2]

# A short simulation whose per-request records are hashed: paper-ttft's pdd case, 120 s after
# a 60-s settle, at 80 RPS (about 14,000 requests, both pipelines, relays, the WAN pool).
SNIPPET = r"""
import hashlib, json
import numpy as np
import planner
from planner.api import make_trace
from planner.fleet import fleet_from_dict
from planner.scenario import case_configs, deep_merge, load_scenario
from planner.sim import Simulator
config = deep_merge(case_configs(load_scenario("paper-ttft"))["pdd"],
                    {"workload": {"rps": 80, "duration_s": 120, "settle_s": 60}})
rec = Simulator(fleet_from_dict(config["fleet"])).run(make_trace(config))
h = hashlib.sha256()
for name in ("arrival_s", "ttft_s", "finish_s", "wan_s", "pipeline", "rld_tokens",
             "md_tokens", "md_hit_tokens"):
    h.update(np.ascontiguousarray(getattr(rec, name)).tobytes())
h.update(json.dumps(rec.series, sort_keys=True).encode())
import planner.sim
print(json.dumps({"state": planner._native.state, "sim": planner.sim.__file__,
                  "digest": h.hexdigest(), "relayed": int((rec.rld_tokens > 0).sum())}))
"""


def _run(native_switch: str) -> dict:
    env = dict(os.environ, BATON_PLANNER_NATIVE=native_switch, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", SNIPPET], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=240, check=True,
    ).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def _stamp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stamp: dict | None) -> Path:
    where = tmp_path / "native"
    where.mkdir()
    if stamp is not None:
        (where / native.STAMP).write_text(json.dumps(stamp))
    monkeypatch.setenv("BATON_NATIVE_DIR", str(where))
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    return where


def test_a_stale_build_is_never_used(tmp_path, monkeypatch, capsys) -> None:
    _stamp(tmp_path, monkeypatch, {"digest": "0" * 64})
    path = ["planner-sources"]
    assert native.enable(path) is False
    assert path == ["planner-sources"]
    assert native.state == "stale"
    assert "out of date" in capsys.readouterr().err


def test_no_build_and_a_failed_build_run_pure_python(tmp_path, monkeypatch) -> None:
    _stamp(tmp_path, monkeypatch, None)
    path: list[str] = []
    assert native.enable(path) is False and path == []
    assert native.state == "not built"
    (tmp_path / "native" / native.STAMP).write_text(json.dumps({"error": "gcc: not found"}))
    assert native.enable(path) is False and path == []
    assert native.state == "build failed" and "gcc" in native.reason


def test_a_current_build_goes_first_and_the_switch_turns_it_off(tmp_path, monkeypatch) -> None:
    names = native.source_names()
    where = _stamp(tmp_path, monkeypatch, {"digest": native.digest(names), "sources": names})
    path = ["planner-sources"]
    assert native.enable(path) is True
    assert path == [str(where / "planner"), "planner-sources"]
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    path = ["planner-sources"]
    assert native.enable(path) is False and path == ["planner-sources"]
    assert native.state == "disabled"


def test_the_digest_follows_every_source_the_build_depends_on() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in native._sources()}
    assert {f"planner/{m}.py" for m in native.MODULES} <= names
    # Imported by the compiled modules: their classes and constants are read at build time.
    assert {"planner/fleet.py", "pdd/spec.py", "pdd/policy.py"} <= names
    assert "planner/cli.py" not in names  # not imported by them: editing it keeps the build


@pytest.mark.slow
def test_the_compiled_simulator_gives_the_pure_python_records() -> None:
    pure = _run("0")
    assert pure["state"] == "disabled" and pure["sim"].endswith("planner/sim.py")
    compiled = _run("1")
    if compiled["state"] != "native":
        # CI builds it (make setup): there, a missing build is a failure, not a skip.
        if os.environ.get("CI"):
            pytest.fail(f"no current compiled build in CI: {compiled['state']}")
        pytest.skip(f"no current compiled build ({compiled['state']}): make setup builds it")
    assert compiled["sim"].endswith(".so")
    assert compiled["relayed"] > 0
    assert compiled["digest"] == pure["digest"]
