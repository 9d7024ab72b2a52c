"""FabricCounters: per-fabric and per-request byte counts for the agent's /state."""

from __future__ import annotations

import pytest

from agents.transfer.counters import CounterValues, Direction, FabricCounters, FabricName


def test_counters_add_up_per_fabric_direction_and_request() -> None:
    counters = FabricCounters()
    counters.record_transfer(
        fabric=FabricName.WAN,
        direction=Direction.SENT,
        request_id="a",
        payload_bytes=100,
        wire_bytes=150,
    )
    counters.record_transfer(
        fabric=FabricName.WAN,
        direction=Direction.SENT,
        request_id="b",
        payload_bytes=10,
        wire_bytes=60,
    )
    counters.record_failure(fabric=FabricName.WAN, direction=Direction.SENT, request_id="a")

    assert counters.totals(FabricName.WAN) == CounterValues(2, 110, 210, 1)
    assert counters.for_request("a", FabricName.WAN) == CounterValues(1, 100, 150, 1)
    assert counters.totals(FabricName.INTRA_DC) == CounterValues()


def test_snapshot_is_plain_json_data_and_reset_clears_it() -> None:
    counters = FabricCounters()
    counters.record_transfer(
        fabric=FabricName.INTRA_DC,
        direction=Direction.RECEIVED,
        request_id="a",
        payload_bytes=1,
        wire_bytes=2,
    )

    snapshot = counters.snapshot()
    counters.reset()

    assert snapshot["fabrics"] == {
        "intra_dc": {
            "received": {"transfers": 1, "payload_bytes": 1, "wire_bytes": 2, "failures": 0}
        }
    }
    assert list(snapshot["requests"]) == ["a"]
    assert counters.snapshot() == {"fabrics": {}, "requests": {}}


def test_only_the_most_recent_requests_are_kept_but_totals_never_forget() -> None:
    counters = FabricCounters(max_requests=2)
    for rid in ("a", "b", "c"):
        counters.record_transfer(
            fabric=FabricName.WAN,
            direction=Direction.SENT,
            request_id=rid,
            payload_bytes=1,
            wire_bytes=1,
        )

    assert list(counters.snapshot()["requests"]) == ["b", "c"]
    assert counters.totals(FabricName.WAN).transfers == 3


def test_unknown_fabric_is_rejected() -> None:
    with pytest.raises(ValueError, match="fabric"):
        FabricCounters().record_failure(fabric="rdma", direction=Direction.SENT, request_id=None)
