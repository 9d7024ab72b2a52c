"""The shaped (WAN) FabricClient over real loopback TCP: bandwidth is a ceiling, RTT is charged,
the link is shared fairly and the connection pool bounds what is in flight."""

from __future__ import annotations

import asyncio
import contextlib
import time

from agents.transfer import (
    FabricClient,
    FabricName,
    FabricServer,
    KVChunk,
    LinkSettings,
    LinkShaper,
    PartialTransferError,
)

MBIT = 1e-3  # in Gbit/s


def _wan(bandwidth_mbit: float, *, rtt_ms: float = 0.0, pool_size: int = 4) -> LinkShaper:
    return LinkShaper(
        LinkSettings(bandwidth_gbps=bandwidth_mbit * MBIT, rtt_ms=rtt_ms, pool_size=pool_size)
    )


def _blob(size: int, tag: int = 0) -> list[KVChunk]:
    """`size` bytes as 64 KiB chunks (the last one shorter)."""
    step = 64 * 1024
    return [
        KVChunk(i, i + 1, i * 16, i * 16 + 16, bytes([tag]) * min(step, size - i * step))
        for i in range((size + step - 1) // step)
    ]


def _min_seconds(wire_bytes: int, settings: LinkSettings) -> float:
    """Shortest time the link may take for `wire_bytes` (see LinkSettings.burst_allowance)."""
    return (wire_bytes - settings.burst_allowance_bytes) / settings.bytes_per_s


def test_one_wan_transfer_cannot_beat_the_links_bandwidth(run, collector) -> None:
    shaper = _wan(80)
    chunks = _blob(2_000_000)

    async def scenario():
        async with FabricServer(collector.on_transfer, fabric=FabricName.WAN) as server:
            client = FabricClient(FabricName.WAN, shaper)
            started = time.monotonic()
            stats = await client.send(server.host, server.port, "big", chunks)
            elapsed = time.monotonic() - started
            return stats, elapsed, await collector.next_transfer()

    stats, elapsed, transfer = run(scenario())

    assert transfer.chunks == tuple(chunks)  # the bytes really crossed the socket
    assert elapsed >= stats.total_s >= _min_seconds(stats.bytes_sent, shaper.settings)
    assert stats.total_s >= 0.19  # 2 MB at 80 Mbit/s is 0.2 s, less one burst allowance


def test_concurrent_wan_transfers_share_one_bandwidth_budget(run, collector) -> None:
    shaper = _wan(80, pool_size=4)

    async def scenario():
        async with FabricServer(collector.on_transfer, fabric=FabricName.WAN) as server:
            client = FabricClient(FabricName.WAN, shaper)
            started = time.monotonic()
            results = await asyncio.gather(
                *(
                    client.send(server.host, server.port, f"r{i}", _blob(600_000, i))
                    for i in range(3)
                )
            )
            return results, time.monotonic() - started

    results, elapsed = run(scenario())

    total_wire = sum(stats.bytes_sent for stats in results)
    settings = shaper.settings
    # Total throughput <= bandwidth + allowance, i.e. the elapsed time has a floor.
    assert total_wire * 8 / elapsed <= settings.bandwidth_gbps * 1e9 + (
        settings.burst_allowance_bytes * 8 / elapsed
    )
    assert elapsed >= _min_seconds(total_wire, settings)
    assert shaper.bytes_granted == total_wire


def test_a_small_transfer_started_during_a_large_one_finishes_first(run, collector) -> None:
    shaper = _wan(40, pool_size=2)
    finished: list[str] = []

    async def scenario():
        async with FabricServer(collector.on_transfer, fabric=FabricName.WAN) as server:
            client = FabricClient(FabricName.WAN, shaper)

            async def send(rid: str, size: int):
                stats = await client.send(server.host, server.port, rid, _blob(size))
                finished.append(rid)
                return stats

            large = asyncio.create_task(send("large", 2_000_000))
            while shaper.bytes_granted < 200_000:  # the large transfer is well under way
                await asyncio.sleep(0.005)
            small = await send("small", 100_000)
            return small, await large

    small, large = run(scenario())

    assert finished == ["small", "large"]
    # Sharing the link half-and-half, 100 KB takes far less than the large transfer's 0.4 s.
    assert small.transfer_s < large.transfer_s / 2


def test_the_pool_bounds_transfers_in_flight_and_the_rest_wait(run, collector) -> None:
    shaper = _wan(80, pool_size=2)
    in_flight = {"now": 0, "peak": 0}
    real_lease = shaper.lease

    @contextlib.asynccontextmanager
    async def counted_lease(**kwargs):
        async with real_lease(**kwargs) as lease:
            in_flight["now"] += 1
            in_flight["peak"] = max(in_flight["peak"], in_flight["now"])
            try:
                yield lease
            finally:
                in_flight["now"] -= 1

    shaper.lease = counted_lease  # type: ignore[method-assign]

    async def scenario():
        async with FabricServer(collector.on_transfer, fabric=FabricName.WAN) as server:
            client = FabricClient(FabricName.WAN, shaper)
            return await asyncio.gather(
                *(client.send(server.host, server.port, f"r{i}", _blob(200_000)) for i in range(4))
            )

    results = run(scenario())

    waits = sorted(stats.wait_for_connection_s for stats in results)
    assert in_flight["peak"] == 2
    assert shaper.pool.stats().peak_in_use == 2
    assert waits[:2] == [0.0, 0.0]
    assert waits[2] > 0 and waits[3] > 0
    # Whoever waited, waited at least for one 200 KB transfer at 80 Mbit/s to finish.
    assert waits[3] >= _min_seconds(results[0].bytes_sent, shaper.settings)


def test_a_tiny_transfer_pays_the_links_rtt(run, collector) -> None:
    shaper = _wan(1000, rtt_ms=200)

    async def scenario():
        async with FabricServer(collector.on_transfer, fabric=FabricName.WAN) as server:
            started = time.monotonic()
            stats = await FabricClient(FabricName.WAN, shaper).send(
                server.host, server.port, "tiny", [KVChunk(0, 1, 0, 1, b"k")]
            )
            return stats, time.monotonic() - started

    stats, elapsed = run(scenario())

    # One RTT of connection setup, then rtt / 2 until the END lands.
    assert elapsed >= stats.total_s >= 0.3
    assert stats.transfer_s >= 0.3


def test_rtt_changes_apply_to_the_next_transfer(run, collector) -> None:
    shaper = _wan(1000, rtt_ms=0)

    async def scenario():
        async with FabricServer(collector.on_transfer, fabric=FabricName.WAN) as server:
            client = FabricClient(FabricName.WAN, shaper)
            shaper.update(rtt_ms=100)
            return await client.send(server.host, server.port, "r", [KVChunk(0, 1, 0, 1, b"k")])

    assert run(scenario()).total_s >= 0.15


def test_lowering_bandwidth_mid_transfer_slows_what_is_left(run, collector) -> None:
    shaper = _wan(80)
    slow = LinkSettings(bandwidth_gbps=16 * MBIT, rtt_ms=0, pool_size=4)

    async def scenario():
        async with FabricServer(collector.on_transfer, fabric=FabricName.WAN) as server:
            client = FabricClient(FabricName.WAN, shaper)
            task = asyncio.create_task(client.send(server.host, server.port, "r", _blob(1_000_000)))
            await asyncio.sleep(0.03)
            granted_before = shaper.bytes_granted
            shaper.update(bandwidth_gbps=slow.bandwidth_gbps)
            changed = time.monotonic()
            stats = await task
            return stats, granted_before, time.monotonic() - changed

    stats, granted_before, after_change = run(scenario())

    assert granted_before < stats.bytes_sent
    assert after_change >= _min_seconds(stats.bytes_sent - granted_before, slow)


def test_growing_the_pool_lets_waiting_transfers_start_at_once(run, collector) -> None:
    shaper = _wan(16, pool_size=1)

    async def scenario():
        async with FabricServer(collector.on_transfer, fabric=FabricName.WAN) as server:
            client = FabricClient(FabricName.WAN, shaper)
            sends = [
                asyncio.create_task(client.send(server.host, server.port, f"r{i}", _blob(size)))
                for i, size in enumerate((1_000_000, 1000, 1000))
            ]
            while shaper.pool.waiting < 2:
                await asyncio.sleep(0.002)
            shaper.update(pool_size=3)
            in_use = shaper.pool.in_use
            return in_use, await asyncio.gather(*sends)

    in_use, (large, *small) = run(scenario())

    assert in_use == 3
    assert all(stats.wait_for_connection_s < large.transfer_s for stats in small)


def test_cancelling_a_send_frees_its_pool_slot_and_link_share(run, collector) -> None:
    shaper = _wan(16, pool_size=1)

    async def scenario():
        async with FabricServer(
            collector.on_transfer, collector.on_error, fabric=FabricName.WAN
        ) as server:
            client = FabricClient(FabricName.WAN, shaper)
            doomed = asyncio.create_task(
                client.send(server.host, server.port, "doomed", _blob(10_000_000))
            )
            while shaper.bytes_granted < 100_000:
                await asyncio.sleep(0.005)
            doomed.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await doomed
            stats = await client.send(server.host, server.port, "next", _blob(10_000))
            return stats, await collector.next_error(), await collector.next_transfer(), client

    stats, (request_id, exc), transfer, client = run(scenario())

    assert stats.wait_for_connection_s == 0.0
    assert shaper.pool.in_use == 0
    assert shaper.stats().waiting_for_quantum == 0
    assert (request_id, type(exc)) == ("doomed", PartialTransferError)
    assert transfer.request_id == "next"
    assert client.counters.totals(FabricName.WAN).failures == 1


def test_a_background_transfer_yields_the_pool_to_an_urgent_one(run, collector) -> None:
    shaper = _wan(200, pool_size=1)

    async def scenario():
        async with FabricServer(collector.on_transfer, fabric=FabricName.WAN) as server:
            client = FabricClient(FabricName.WAN, shaper)
            finished: list[str] = []

            async def send(name: str, size: int, background: bool) -> None:
                await client.send(
                    server.host, server.port, name, _blob(size), background=background
                )
                finished.append(name)

            first = asyncio.create_task(send("holder", 500_000, False))
            while shaper.pool.in_use < 1:
                await asyncio.sleep(0.001)
            relayed = asyncio.create_task(send("relayed", 200_000, True))
            while shaper.pool.waiting < 1:
                await asyncio.sleep(0.001)
            urgent = asyncio.create_task(send("urgent", 200_000, False))
            await asyncio.gather(first, relayed, urgent)
            return finished, shaper.pool.stats()

    finished, stats = run(scenario())

    # The relayed transfer queued first but waited behind the urgent one for the connection.
    assert finished == ["holder", "urgent", "relayed"]
    assert stats.background_acquisitions == 1


def test_a_streamed_source_overlaps_its_transfer_with_the_work_that_makes_it(
    run, collector
) -> None:
    """Chunks from an asynchronous source go out as they come: a transfer whose chunks are
    made over 1 s (by a producer of its own, as P's engine thread is) ends soon after the
    last one, not a whole transfer's time later."""
    shaper = _wan(8)  # 1 MB: 1 s on the link
    chunks = _blob(1_000_000)
    per_chunk_s = 1.0 / len(chunks)

    async def scenario():
        made: asyncio.Queue = asyncio.Queue()

        async def produce():
            for chunk in chunks:
                await asyncio.sleep(per_chunk_s)  # prefill computing the next chunk
                made.put_nowait(chunk)
            made.put_nowait(None)

        async def source():
            while (chunk := await made.get()) is not None:
                yield chunk

        async with FabricServer(collector.on_transfer, fabric=FabricName.WAN) as server:
            client = FabricClient(FabricName.WAN, shaper)
            started = time.monotonic()
            producer = asyncio.create_task(produce())
            stats = await client.send(server.host, server.port, "streamed", source())
            elapsed = time.monotonic() - started
            await producer
            return stats, elapsed, await collector.next_transfer()

    stats, elapsed, transfer = run(scenario())
    assert transfer.chunks == tuple(chunks)
    assert stats.payload_bytes == 1_000_000 and stats.frames == len(chunks) + 1
    assert elapsed >= 1.0
    # Made, then sent: >= 2 s less one burst allowance. Streamed: the last chunk's share of
    # the link (64 KiB: 66 ms) after the last is made, plus scheduling slack.
    assert elapsed < 1.6


def test_a_failing_source_aborts_the_transfer_under_way(run, collector) -> None:
    shaper = _wan(80)
    chunks = _blob(300_000)

    async def broken():
        yield chunks[0]
        raise RuntimeError("prefill failed")

    async def scenario():
        async with FabricServer(
            collector.on_transfer, collector.on_error, fabric=FabricName.WAN
        ) as server:
            client = FabricClient(FabricName.WAN, shaper)
            with contextlib.suppress(RuntimeError):
                await client.send(server.host, server.port, "broken", broken())
            return await collector.next_error()

    request_id, error = run(scenario())
    assert request_id == "broken" and isinstance(error, PartialTransferError)
