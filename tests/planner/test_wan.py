"""Specification of the simulated WAN link: fair sharing, per-connection cap, bounded pool."""

from __future__ import annotations

import pytest

from planner.events import EventLoop
from planner.wan import WanLink, WanLinkSpec

GB = 1e9


def run(spec: WanLinkSpec, transfers: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Send (start_s, bytes) transfers; return (transfer_s, wait_s) of each."""
    loop = EventLoop()
    link = WanLink(spec, loop)
    out: list[tuple[float, float]] = [(0.0, 0.0)] * len(transfers)

    def record(k: int, seconds: float, wait: float) -> None:
        out[k] = (seconds, wait)

    for k, (start, nbytes) in enumerate(transfers):
        loop.at(start, lambda k=k, n=nbytes: link.send(n, lambda s, w, k=k: record(k, s, w)))
    loop.run()
    return out


def spec(**kw) -> WanLinkSpec:
    # 8 Gbit/s = 1 GB/s line, no per-connection limit below it, zero-ish RTT.
    return WanLinkSpec(**{"bandwidth_gbps": 8, "rtt_ms": 1e-6, "per_connection_gbps": 8, **kw})


def test_a_lone_transfer_gets_the_whole_line_plus_one_rtt() -> None:
    [(seconds, wait)] = run(spec(rtt_ms=20), [(0.0, 1 * GB)])
    assert seconds == pytest.approx(1.02)
    assert wait == 0.0


def test_concurrent_transfers_share_the_line_fairly() -> None:
    out = run(spec(), [(0.0, 1 * GB), (0.0, 1 * GB)])
    assert [s for s, _ in out] == pytest.approx([2.0, 2.0])


def test_a_light_transfer_passes_a_heavy_one() -> None:
    heavy, light = run(spec(), [(0.0, 10 * GB), (1.0, 0.5 * GB)])
    # The light one gets half the line from t=1: 0.5 GB at 0.5 GB/s.
    assert light[0] == pytest.approx(1.0)
    assert heavy[0] == pytest.approx(10.5)


def test_a_connection_is_capped_below_the_line() -> None:
    [(seconds, _)] = run(spec(per_connection_gbps=2), [(0.0, 1 * GB)])
    assert seconds == pytest.approx(4.0)


def test_a_full_pool_makes_transfers_wait_for_a_connection() -> None:
    out = run(spec(pool_size=1), [(0.0, 1 * GB), (0.0, 1 * GB)])
    assert out[0] == pytest.approx((1.0, 0.0))
    assert out[1] == pytest.approx((2.0, 1.0))


def test_bad_link_spec_names_the_field() -> None:
    with pytest.raises(ValueError, match="pool_size"):
        WanLinkSpec(pool_size=0)
