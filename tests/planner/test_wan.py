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


def test_per_connection_rate_is_window_over_rtt_and_bounds_a_lone_transfer() -> None:
    # 562.5 KB per 20 ms round trip = 225 Mbit/s on a 20 Gbit/s line: 28.125 MB takes 1 s.
    window = WanLinkSpec(bandwidth_gbps=20, rtt_ms=20, tcp_window_kb=562.5)
    assert window.connection_gbps == pytest.approx(0.225)
    [(seconds, _)] = run(window, [(0.0, 28.125e6)])
    assert seconds == pytest.approx(1.0 + 0.02)
    # Doubling the RTT halves what one connection moves: the line rate does not help.
    [(slower, _)] = run(WanLinkSpec(bandwidth_gbps=20, rtt_ms=40, tcp_window_kb=562.5),
                        [(0.0, 28.125e6)])  # fmt: skip
    assert slower == pytest.approx(2.0 + 0.04)


def test_line_share_binds_once_enough_connections_are_active() -> None:
    # 4 transfers on a 0.8 Gbit/s line with 0.4 Gbit/s connections: the line share (0.2) binds.
    out = run(spec(bandwidth_gbps=0.8, per_connection_gbps=0.4), [(0.0, 0.1 * GB)] * 4)
    assert [s for s, _ in out] == pytest.approx([4.0] * 4)


def test_uniform_hits_hold_more_connections_than_session_skew_at_equal_mean_hit() -> None:
    from planner.microbench import simulate_transfers
    from planner.workload import ContextGrowth, HitRateDist, WorkloadSpec, generate

    def occupancy(hit: HitRateDist) -> dict:
        workload = WorkloadSpec(rps=40, duration_s=120, seed=2, mean_turns=16,
                                context=ContextGrowth(), hit_rate=hit)  # fmt: skip
        link = WanLinkSpec(bandwidth_gbps=20, rtt_ms=20, tcp_window_kb=562.5, pool_size=1000)
        return simulate_transfers(link, generate(workload), 4400)

    skewed = occupancy(HitRateDist(kind="session"))
    uniform = occupancy(HitRateDist(kind="uniform", lo=0.85, hi=0.95))
    assert abs(skewed["mean_hit_rate"] - uniform["mean_hit_rate"]) < 0.03
    # Connections held (pool 1000: never full) follow the bytes each request carries.
    assert uniform["pool_utilisation"] > 1.2 * skewed["pool_utilisation"]
    # Most skewed transfers are light and pass; the median uniform one is mid-size.
    assert uniform["transfer_s"]["p50"] > 3 * skewed["transfer_s"]["p50"]
    assert skewed["transfer_s"]["max"] > uniform["transfer_s"]["max"]


def test_expected_pool_wait_is_zero_while_a_connection_is_free() -> None:
    loop = EventLoop()
    link = WanLink(spec(pool_size=2), loop)
    assert link.expected_wait_s() == 0.0
    link.send(1 * GB, lambda s, w: None)
    assert link.expected_wait_s() == 0.0


@pytest.mark.parametrize("queued", [0, 1, 5])
def test_expected_pool_wait_is_queue_times_mean_transfer_time_over_pool(queued) -> None:
    # Pool of 2 connections, 1 GB/s each (line 4 GB/s), every transfer 1 GB (1 s): on average
    # the pool frees a connection every 0.5 s, so the new transfer's turn comes after
    # (queued + 1) x 0.5 s.
    loop = EventLoop()
    link = WanLink(spec(bandwidth_gbps=32, per_connection_gbps=8, pool_size=2), loop)
    for _ in range(2 + queued):
        link.send(1 * GB, lambda s, w: None)
    assert link.expected_wait_s() == pytest.approx((queued + 1) * 0.5)


def test_expected_pool_wait_matches_the_wait_a_transfer_gets() -> None:
    # Equal 1 s transfers on a full pool of 2: the estimate (a steady-state average, one
    # departure per 0.5 s) stays within one average inter-departure time of the wait measured
    # (these synchronised transfers leave in pairs, so the real waits are 1, 1, 2, 2 s).
    loop = EventLoop()
    link = WanLink(spec(bandwidth_gbps=32, per_connection_gbps=8, pool_size=2), loop)
    waits: list[float] = []
    estimates: list[float] = []

    def send() -> None:
        estimates.append(link.expected_wait_s())
        link.send(1 * GB, lambda s, w: waits.append(w))

    for _ in range(6):
        loop.at(0.0, send)
    loop.run()
    assert estimates[:2] == [0.0, 0.0]
    assert waits[:2] == [0.0, 0.0]
    assert waits[2:] == pytest.approx([1.0, 1.0, 2.0, 2.0])
    assert estimates[2:] == pytest.approx([0.5, 1.0, 1.5, 2.0])
    for est, wait in zip(estimates, waits, strict=True):
        assert wait - 0.5 - 1e-9 <= est <= wait + 1e-9


def _reported_at(spec_: WanLinkSpec, transfers: list[tuple[float, float]], times: list[float]):
    """The link's reported use (``reported_utilisation``) read at each of ``times``."""
    loop = EventLoop()
    link = WanLink(spec_, loop)
    seen: list[float] = []
    for start, nbytes in transfers:
        loop.at(start, lambda n=nbytes: link.send(n, lambda s, w: None))
    for t in times:
        loop.at(t, lambda: seen.append(link.reported_utilisation()))
    loop.run()
    return seen


def test_reported_use_is_the_last_whole_interval_of_carried_bytes() -> None:
    # 1 GB/s line, heartbeats every 2 s: 1 GB sent at 0 s takes 1 s of the first interval.
    seen = _reported_at(spec(report_interval_s=2.0), [(0.0, 1 * GB)], [0.5, 1.5, 2.5, 3.9, 4.5])
    # Nothing reported before the first heartbeat, although the line is full at 0.5 s.
    assert seen[:2] == [0.0, 0.0]
    # From 2 s: the first interval's bytes over what the line could carry in it.
    assert seen[2:4] == pytest.approx([0.5, 0.5])
    # The second interval carried nothing.
    assert seen[4] == 0.0


def test_reported_use_counts_shared_and_capped_flows() -> None:
    # Two transfers share a 1 GB/s line for 1 s; then a lone one capped at 0.25 GB/s.
    seen = _reported_at(
        spec(report_interval_s=1.0, per_connection_gbps=2),
        [(0.0, 0.25 * GB), (0.0, 0.25 * GB), (1.0, 0.125 * GB)],
        [1.0, 2.0],
    )
    # 0.25 GB/s each (the cap), 1 s: 0.5 GB of 1 GB; then one at 0.25 GB/s for 0.5 s.
    assert seen == pytest.approx([0.5, 0.125])


def test_instant_use_is_the_default_and_reports_stay_off() -> None:
    assert WanLinkSpec().report_interval_s == 0.0
    seen = _reported_at(spec(), [(0.0, 1 * GB)], [0.5, 2.5])
    assert seen == [0.0, 0.0]


def test_bad_report_interval_names_the_field() -> None:
    with pytest.raises(ValueError, match="report_interval_s"):
        WanLinkSpec(report_interval_s=-1.0)
