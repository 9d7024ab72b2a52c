"""LinkSettings, the virtual-clock budget and LinkShaper's fair sharing, without sockets."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from agents.transfer.shaping import LinkBudget, LinkSettings, LinkShaper

MBIT = 1e-3  # in Gbit/s


@pytest.mark.parametrize(
    "fields",
    [
        {"bandwidth_gbps": 0.0},
        {"bandwidth_gbps": float("inf")},
        {"rtt_ms": -1.0},
        {"rtt_ms": float("nan")},
        {"pool_size": 0},
        {"pool_size": 2.5},
        {"pool_size": True},
        {"quantum_bytes": 100},
        {"catch_up_ms": -0.1},
    ],
)
def test_link_settings_reject_invalid_values(fields: dict[str, float]) -> None:
    values = {"bandwidth_gbps": 1.0, "rtt_ms": 10.0, "pool_size": 4} | fields

    with pytest.raises(ValueError, match=next(iter(fields))):
        LinkSettings(**values)


def test_burst_allowance_is_one_quantum_plus_the_catch_up_window() -> None:
    settings = LinkSettings(
        bandwidth_gbps=0.08, rtt_ms=0, pool_size=1, quantum_bytes=32768, catch_up_ms=5
    )

    assert settings.bytes_per_s == 10_000_000
    assert settings.burst_allowance_bytes == 32768 + 50_000


def _simulate_grants(budget: LinkBudget, rng: random.Random, quanta: int, quantum: int):
    """Drive the budget like the dispatcher does, with late wake-ups and idle gaps."""
    now, grants = 0.0, []
    while len(grants) < quanta:
        start = budget.start_time(now)
        if start > now:
            now = start + rng.uniform(0, 0.003)  # timers fire late, never early
            continue
        size = rng.choice([quantum, quantum, rng.randint(1, quantum)])
        budget.commit(start, size)
        grants.append((now, size))
        if rng.random() < 0.05:
            now += rng.uniform(0, 0.05)  # the link goes idle for a while
    return grants


def test_budget_never_grants_more_than_rate_times_window_plus_allowance() -> None:
    settings = LinkSettings(bandwidth_gbps=0.08, rtt_ms=0, pool_size=1, quantum_bytes=16384)
    budget = LinkBudget(settings.bytes_per_s, settings.catch_up_ms / 1000)
    grants = _simulate_grants(budget, random.Random(7), 400, settings.quantum_bytes)

    worst = 0.0
    for first in range(len(grants)):
        granted = 0
        for last in range(first, len(grants)):
            granted += grants[last][1]
            window = grants[last][0] - grants[first][0]
            worst = max(worst, granted - settings.bytes_per_s * window)

    assert worst <= settings.burst_allowance_bytes


def test_budget_makes_up_for_late_wakeups_while_backlogged() -> None:
    budget = LinkBudget(10_000_000, catch_up_s=0.005)
    now, sent = 0.0, 0
    rng = random.Random(3)
    while now < 1.0:
        start = budget.start_time(now)
        if start > now:
            now = start + rng.uniform(0, 0.003)
            continue
        budget.commit(start, 16384)
        sent += 16384

    # 3 ms of lateness per wake-up would cost ~50% of the rate without catching up.
    assert sent >= 0.97 * 10_000_000


def test_budget_does_not_bank_idle_time_beyond_the_catch_up_window() -> None:
    budget = LinkBudget(1_000_000, catch_up_s=0.005)
    budget.commit(0.0, 1000)  # busy until 1 ms

    assert budget.start_time(10.0) == 10.0


def test_budget_rate_change_retimes_the_quantum_in_flight() -> None:
    budget = LinkBudget(1_000_000, catch_up_s=0.0)
    budget.commit(0.0, 10_000)  # 10 ms at 1 MB/s

    budget.set_rate(100_000)

    assert budget.start_time(0.0) == pytest.approx(0.1)


async def _pull(shaper: LinkShaper, name: str, total: int, log: list[str]) -> None:
    async with shaper.lease() as lease:
        remaining = total
        while remaining:
            remaining -= await lease.grant(remaining)
            log.append(name)


def test_waiting_transfers_get_quanta_round_robin(run) -> None:
    shaper = LinkShaper(LinkSettings(bandwidth_gbps=0.1, rtt_ms=0, pool_size=3, quantum_bytes=1024))
    log: list[str] = []

    async def scenario() -> None:
        await asyncio.gather(*(_pull(shaper, name, 8 * 1024, log) for name in "abc"))

    run(scenario())

    assert log == list("abc") * 8


def test_small_transfer_passes_a_large_one_already_in_flight(run) -> None:
    shaper = LinkShaper(LinkSettings(bandwidth_gbps=0.1, rtt_ms=0, pool_size=2, quantum_bytes=1024))
    log: list[str] = []

    async def scenario() -> None:
        large = asyncio.create_task(_pull(shaper, "large", 200 * 1024, log))
        while log.count("large") < 10:
            await asyncio.sleep(0.001)
        await _pull(shaper, "small", 3 * 1024, log)
        large.cancel()

    run(scenario())

    first_small = log.index("small")
    last_small = len(log) - 1 - log[::-1].index("small")
    # Round robin: the large transfer gets one quantum between each of the small one's.
    assert log.count("small") == 3
    assert log[first_small:last_small].count("large") <= 3


def test_shaper_cannot_grant_faster_than_its_bandwidth(run) -> None:
    settings = LinkSettings(bandwidth_gbps=80 * MBIT, rtt_ms=0, pool_size=1)
    shaper = LinkShaper(settings)
    total = 2_000_000

    async def scenario() -> float:
        started = time.monotonic()
        await _pull(shaper, "x", total, [])
        return time.monotonic() - started

    elapsed = run(scenario())

    assert shaper.bytes_granted == total
    assert elapsed >= (total - settings.burst_allowance_bytes) / settings.bytes_per_s


def test_lowering_bandwidth_slows_the_quanta_still_to_come(run) -> None:
    shaper = LinkShaper(LinkSettings(bandwidth_gbps=80 * MBIT, rtt_ms=0, pool_size=1))
    total = 1_000_000
    slow = LinkSettings(bandwidth_gbps=16 * MBIT, rtt_ms=0, pool_size=1)

    async def scenario() -> tuple[int, float]:
        task = asyncio.create_task(_pull(shaper, "x", total, []))
        await asyncio.sleep(0.02)
        granted_before = shaper.bytes_granted
        shaper.update(bandwidth_gbps=slow.bandwidth_gbps)
        changed = time.monotonic()
        await task
        return granted_before, time.monotonic() - changed

    granted_before, after_change = run(scenario())

    assert granted_before < total
    remaining = total - granted_before
    assert after_change >= (remaining - slow.burst_allowance_bytes) / slow.bytes_per_s


def test_raising_bandwidth_wakes_a_sleeping_link_early(run) -> None:
    # 1 MB at 8 Mbit/s would take 1 s; at 8 Gbit/s it is a few milliseconds.
    shaper = LinkShaper(
        LinkSettings(bandwidth_gbps=8 * MBIT, rtt_ms=0, pool_size=1, quantum_bytes=512 * 1024)
    )

    async def scenario() -> float:
        task = asyncio.create_task(_pull(shaper, "x", 1_048_576, []))
        await asyncio.sleep(0.05)
        shaper.update(bandwidth_gbps=8.0)
        changed = time.monotonic()
        await task
        return time.monotonic() - changed

    # Without the re-timing the first 512 KiB quantum alone would hold the link for 0.5 s.
    assert run(scenario()) < 0.4


def test_pool_size_update_reaches_the_running_pool(run) -> None:
    shaper = LinkShaper(LinkSettings(bandwidth_gbps=1.0, rtt_ms=0, pool_size=1))

    async def scenario() -> tuple[int, int]:
        holder = shaper.lease()
        await holder.__aenter__()
        waiters = [asyncio.create_task(shaper.lease().__aenter__()) for _ in range(2)]
        while shaper.pool.waiting < 2:
            await asyncio.sleep(0.001)
        shaper.update(pool_size=3)
        in_use = shaper.pool.in_use
        await asyncio.gather(*waiters)
        shaper.update(pool_size=1)
        return in_use, shaper.pool.capacity

    assert run(scenario()) == (3, 1)


def test_cancelling_a_transfer_gives_its_turn_to_the_others(run) -> None:
    shaper = LinkShaper(LinkSettings(bandwidth_gbps=0.1, rtt_ms=0, pool_size=2, quantum_bytes=1024))
    log: list[str] = []

    async def scenario() -> None:
        doomed = asyncio.create_task(_pull(shaper, "doomed", 10**9, log))
        survivor = asyncio.create_task(_pull(shaper, "survivor", 64 * 1024, log))
        while log.count("doomed") < 5:
            await asyncio.sleep(0.001)
        doomed.cancel()
        await survivor

    run(scenario())

    assert shaper.stats().waiting_for_quantum == 0
    assert shaper.pool.in_use == 0
    assert log.count("doomed") < 64
