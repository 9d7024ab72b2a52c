"""`planner run` writes under var/ by default, and its plots mark the published figures."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from planner import api, cli, published  # noqa: E402
from planner.api import CaseResult, SimResult  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _fake_result(name: str) -> SimResult:
    def case(p50, p90, p99, share):
        q = {"p50": p50, "p90": p90, "p99": p99}
        return CaseResult(
            "x", {"ttft_s": q, "transfer_s": q, "tokens": {"relay_share": share}}, {}, None
        )

    cases = {
        "in-dc-pd": case(3.0, 6.0, 9.0, 0.0),
        "cdc-pd": case(6.0, 19.0, 34.0, 0.0),
        "pdd": case(4.0, 8.0, 15.0, 0.05),
    }
    return SimResult(name, "fleet", cases)


def test_default_out_is_under_var(monkeypatch):
    monkeypatch.delenv("BATON_VAR_DIR", raising=False)
    assert cli.default_out("paper-ttft") == ROOT / "var" / "planner" / "paper-ttft"
    monkeypatch.setenv("BATON_VAR_DIR", "/srv/baton")
    assert cli.default_out("paper-ttft") == Path("/srv/baton/planner/paper-ttft")
    assert cli.default_out("bench/planner/x/bcr-seed2.json") == Path("/srv/baton/planner/bcr-seed2")


def test_run_without_out_writes_under_var_not_bench(monkeypatch, tmp_path, capsys):
    committed = ROOT / "bench" / "planner" / "paper-ttft" / "result.json"
    before = committed.stat().st_mtime_ns if committed.exists() else None
    monkeypatch.setenv("BATON_VAR_DIR", str(tmp_path))
    monkeypatch.setattr(api, "simulate", lambda scenario, jobs=1, **_: _fake_result("paper-ttft"))
    assert cli.main(["run", "paper-ttft"]) == 0
    out = tmp_path / "planner" / "paper-ttft"
    assert json.loads((out / "result.json").read_text())["scenario"] == "paper-ttft"
    assert (out / "ttft.png").exists()
    assert f"wrote {out / 'result.json'}" in capsys.readouterr().out
    after = committed.stat().st_mtime_ns if committed.exists() else None
    assert after == before


def test_ttft_plot_marks_the_published_figures():
    import matplotlib.pyplot as plt

    from planner import plots

    names = ["in-dc-pd", "cdc-pd", "pdd"]
    fig, ax = plt.subplots()
    plots._mark_bars(ax, "paper-ttft", "ttft", names, ("p50", "p90", "p99"), 0.25)
    plots._mark_lines(ax, "paper-ttft", "ttft")
    texts = [t.get_text() for t in ax.texts]
    assert "published PDD P90 9.8 s" in texts and "published CDC-PD P99 29.7 s" in texts
    # PDD's P90 dash sits on PDD's P90 bar (x = 2 + 0.25) at 9.8 s.
    segments = [seg for coll in ax.collections for seg in coll.get_segments()]
    assert any(abs(s[0][1] - 9.8) < 1e-9 and s[0][0] < 2.25 < s[1][0] for s in segments)
    labels = [line.get_label() for line in ax.get_lines()]
    assert "SLA P90 < 10 s" in labels and "SLA P99 < 15 s" in labels
    plt.close(fig)


def test_every_bundled_plot_with_a_published_figure_draws_it(tmp_path):
    from planner import plots

    paths = plots.plot_result(_fake_result("paper-token-share"), tmp_path)
    assert tmp_path / "token_share.png" in paths
    # Every marked case and scenario exists among the bundled scenarios.
    for scenario, marks in published.BARS.items():
        cases = json.loads((ROOT / "planner" / "scenarios" / f"{scenario}.json").read_text())
        assert {case for _, case, _ in marks} <= set(cases["cases"]), scenario
    for scenario in [*published.LINES, *published.VLINES]:
        assert (ROOT / "planner" / "scenarios" / f"{scenario}.json").exists()
