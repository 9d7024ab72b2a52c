"""One real local fleet per test session of this folder (slow to start, so shared)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.harness.testbed import start_cluster

LOG_TAIL_CHARS = 4000


@pytest.fixture(scope="package")
def cluster():
    fleet = start_cluster()
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test shows the tail of the control plane's (and workers') logs: the fleet's
    temporary folder is gone once the session ends, and a 500 explains itself only there."""
    outcome = yield
    report = outcome.get_result()
    fleet = item.funcargs.get("cluster") if hasattr(item, "funcargs") else None
    if not report.failed or fleet is None or not fleet.tmp:
        return
    for log in sorted(Path(fleet.tmp).glob("*.log")):
        text = log.read_text(errors="replace")
        report.sections.append((f"fleet log {log.name} (tail)", text[-LOG_TAIL_CHARS:]))
