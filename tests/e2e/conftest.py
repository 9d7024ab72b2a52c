"""One real local fleet per test session of this folder (slow to start, so shared)."""

from __future__ import annotations

import pytest

from bench.testbed import start_cluster


@pytest.fixture(scope="package")
def cluster():
    fleet = start_cluster()
    try:
        yield fleet
    finally:
        fleet.stop()
