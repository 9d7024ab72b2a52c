"""FabricServer and the unshaped FabricClient over real loopback TCP: delivery, counters, and
how corrupt, partial or malformed streams fail one request without stopping the server."""

from __future__ import annotations

import asyncio
import threading

import pytest

from agents.transfer import (
    ChecksumError,
    FabricClient,
    FabricCounters,
    FabricName,
    FabricServer,
    KVChunk,
    LinkSettings,
    LinkShaper,
    OversizeFrameError,
    PartialTransferError,
    ReceiveLimits,
    RemoteAbortError,
    TokenIds,
    TransferProtocolError,
    TruncatedFrameError,
    send_from_thread,
    update_link_from_thread,
)
from agents.transfer.counters import CounterValues, Direction
from agents.transfer.frames import FrameKind, encode_end, encode_error, encode_frame


def _kv(request_id: str, payload: bytes, block: int = 0) -> bytes:
    return encode_frame(
        FrameKind.KV_BLOCKS,
        request_id,
        payload,
        block_start=block,
        block_end=block + 1,
        token_start=block * 16,
        token_end=block * 16 + 16,
    )


async def _write_raw(port: int, data: bytes) -> None:
    """A hand-built stream, written by a plain socket and then closed."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    writer.close()
    await writer.wait_closed()


async def _expect_error(collector, port: int, data: bytes) -> tuple[str | None, Exception]:
    await _write_raw(port, data)
    return await collector.next_error()


def test_loopback_transfer_delivers_every_chunk_byte_identical(run, collector, make_chunks) -> None:
    chunks = make_chunks(12, 100_000) + make_chunks(1, 0, first_block=12)
    counters = FabricCounters()

    async def scenario():
        async with FabricServer(
            collector.on_transfer, collector.on_error, counters=counters
        ) as server:
            client = FabricClient(FabricName.INTRA_DC, counters=counters)
            stats = await client.send(server.host, server.port, "req-1", chunks)
            return stats, await collector.next_transfer()

    stats, transfer = run(scenario())

    assert transfer.request_id == "req-1"
    assert transfer.chunks == tuple(chunks)
    assert transfer.tokens is None
    assert transfer.payload_bytes == stats.payload_bytes == 1_200_000
    assert transfer.frames == 13
    assert stats.frames == 14  # END included
    assert stats.wait_for_connection_s == 0.0
    assert stats.total_s >= stats.transfer_s > 0
    sent = counters.for_request("req-1", FabricName.INTRA_DC, Direction.SENT)
    received = counters.for_request("req-1", FabricName.INTRA_DC, Direction.RECEIVED)
    assert sent == CounterValues(1, 1_200_000, stats.bytes_sent, 0)
    assert received == CounterValues(1, 1_200_000, stats.bytes_sent, 0)
    assert transfer.wire_bytes == stats.bytes_sent  # both sides count the END frame
    assert counters.totals(FabricName.INTRA_DC, Direction.SENT) == sent


def test_a_transfer_without_chunks_is_delivered_empty(run, collector) -> None:
    async def scenario():
        async with FabricServer(collector.on_transfer, collector.on_error) as server:
            await FabricClient().send(server.host, server.port, "full-hit", [])
            return await collector.next_transfer()

    transfer = run(scenario())

    assert (transfer.request_id, transfer.chunks, transfer.frames) == ("full-hit", (), 0)


def test_token_ids_arrive_with_the_transfer(run, collector, make_chunks) -> None:
    tokens = TokenIds(token_start=640, ids=(11, 22, 33))

    async def scenario():
        async with FabricServer(collector.on_transfer, collector.on_error) as server:
            await FabricClient().send(
                server.host, server.port, "handoff", make_chunks(1, 10), tokens=tokens
            )
            return await collector.next_transfer()

    transfer = run(scenario())

    assert transfer.tokens == tokens
    assert transfer.frames == 2


def test_a_corrupt_frame_fails_that_request_and_the_server_serves_the_next(
    run, collector, make_chunks
) -> None:
    good = _kv("bad-req", b"A" * 5000)
    corrupt = bytearray(good)
    corrupt[-100] ^= 0xFF  # one payload byte flipped in flight
    stream = bytes(corrupt) + encode_end("bad-req", payload_bytes=5000, frames=1)

    async def scenario():
        async with FabricServer(collector.on_transfer, collector.on_error) as server:
            failure = await _expect_error(collector, server.port, stream)
            await FabricClient().send(server.host, server.port, "next", make_chunks(2, 10))
            return failure, await collector.next_transfer(), server.counters

    (request_id, exc), transfer, counters = run(scenario())

    assert request_id == "bad-req"
    assert isinstance(exc, ChecksumError)
    assert transfer.request_id == "next"
    assert counters.for_request("bad-req", FabricName.INTRA_DC, Direction.RECEIVED).failures == 1


def test_a_connection_closed_before_end_is_a_partial_transfer(run, collector) -> None:
    stream = _kv("cut", b"x" * 100, 0) + _kv("cut", b"y" * 100, 1)

    async def scenario():
        async with FabricServer(collector.on_transfer, collector.on_error) as server:
            return await _expect_error(collector, server.port, stream)

    request_id, exc = run(scenario())

    assert request_id == "cut"
    assert isinstance(exc, PartialTransferError)
    assert "2 frames" in str(exc)


def test_a_connection_closed_inside_a_frame_names_the_request(run, collector) -> None:
    stream = _kv("cut", b"x" * 100) + _kv("cut", b"y" * 100, 1)[:-30]

    async def scenario():
        async with FabricServer(collector.on_transfer, collector.on_error) as server:
            return await _expect_error(collector, server.port, stream)

    request_id, exc = run(scenario())

    assert request_id == "cut"
    assert isinstance(exc, PartialTransferError)
    assert isinstance(exc.__cause__, TruncatedFrameError)


def test_an_end_that_disagrees_with_what_arrived_is_a_partial_transfer(run, collector) -> None:
    # A frame lost in between: END promises two frames, one arrived.
    stream = _kv("lossy", b"x" * 100) + encode_end("lossy", payload_bytes=200, frames=2)

    async def scenario():
        async with FabricServer(collector.on_transfer, collector.on_error) as server:
            return await _expect_error(collector, server.port, stream)

    request_id, exc = run(scenario())

    assert request_id == "lossy"
    assert isinstance(exc, PartialTransferError)


def test_interleaving_two_requests_on_one_connection_is_a_protocol_error(run, collector) -> None:
    stream = _kv("first", b"x") + _kv("second", b"y")

    async def scenario():
        async with FabricServer(collector.on_transfer, collector.on_error) as server:
            return await _expect_error(collector, server.port, stream)

    request_id, exc = run(scenario())

    assert request_id == "first"
    assert isinstance(exc, TransferProtocolError)


def test_an_error_frame_aborts_the_request_with_the_senders_reason(run, collector) -> None:
    stream = _kv("aborted", b"x") + encode_error("aborted", "engine evicted the blocks")

    async def scenario():
        async with FabricServer(collector.on_transfer, collector.on_error) as server:
            return await _expect_error(collector, server.port, stream)

    request_id, exc = run(scenario())

    assert request_id == "aborted"
    assert isinstance(exc, RemoteAbortError)
    assert "engine evicted the blocks" in str(exc)


def test_a_frame_above_the_servers_limit_fails_and_the_server_keeps_serving(run, collector) -> None:
    limits = ReceiveLimits(max_payload_bytes=1000)

    async def scenario():
        async with FabricServer(collector.on_transfer, collector.on_error, limits=limits) as srv:
            failure = await _expect_error(collector, srv.port, _kv("big", b"x" * 1001))
            await FabricClient().send(srv.host, srv.port, "fits", [KVChunk(0, 1, 0, 16, b"x")])
            return failure, await collector.next_transfer()

    (request_id, exc), transfer = run(scenario())

    assert request_id == "big"
    assert isinstance(exc, OversizeFrameError)
    assert transfer.request_id == "fits"


def test_one_connection_may_carry_several_transfers_back_to_back(run, collector) -> None:
    stream = b"".join(
        _kv(rid, rid.encode()) + encode_end(rid, payload_bytes=len(rid), frames=1)
        for rid in ("one", "two", "three")
    )

    async def scenario():
        async with FabricServer(collector.on_transfer, collector.on_error) as server:
            await _write_raw(server.port, stream)
            return [(await collector.next_transfer()).request_id for _ in range(3)]

    assert run(scenario()) == ["one", "two", "three"]
    assert collector.errors.empty()


def test_garbage_before_any_frame_is_reported_without_a_request_id(run, collector) -> None:
    async def scenario():
        async with FabricServer(collector.on_transfer, collector.on_error) as server:
            return await _expect_error(collector, server.port, b"GET / HTTP/1.1\r\n" * 4)

    request_id, exc = run(scenario())

    assert request_id is None
    assert type(exc).__name__ == "BadMagicError"


def test_a_failing_on_transfer_callback_does_not_stop_the_server(run, collector) -> None:
    delivered: list[str] = []

    async def flaky(transfer) -> None:
        delivered.append(transfer.request_id)
        if transfer.request_id == "boom":
            raise RuntimeError("consumer bug")

    async def scenario():
        async with FabricServer(flaky, collector.on_error) as server:
            client = FabricClient()
            for rid in ("boom", "after"):
                await client.send(server.host, server.port, rid, [KVChunk(0, 1, 0, 1, b"k")])
            while len(delivered) < 2:
                await asyncio.sleep(0.01)

    run(scenario())

    assert delivered == ["boom", "after"]
    assert collector.errors.empty()


def test_invalid_chunks_are_rejected_before_connecting(run) -> None:
    client = FabricClient()

    with pytest.raises(ValueError, match="block range"):
        run(client.send("127.0.0.1", 9, "r", [KVChunk(5, 4, 0, 0, b"")]))
    assert client.counters.snapshot() == {"fabrics": {}, "requests": {}}


def test_send_to_a_closed_port_raises_and_counts_a_failure(run) -> None:
    client = FabricClient(FabricName.WAN)

    async def scenario() -> int:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        return port

    port = run(scenario())

    with pytest.raises(OSError):
        run(client.send("127.0.0.1", port, "r", [KVChunk(0, 1, 0, 1, b"k")]))
    assert client.counters.totals(FabricName.WAN).failures == 1


def test_send_from_thread_blocks_until_the_transfer_is_sent(make_chunks) -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        received: list[str] = []

        async def on_transfer(transfer) -> None:
            received.append(transfer.request_id)

        server = FabricServer(on_transfer)
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
        stats = send_from_thread(
            loop,
            FabricClient(),
            server.host,
            server.port,
            "from-engine",
            make_chunks(3, 1000),
            timeout_s=10,
        )
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()

    assert stats.payload_bytes == 3000
    assert received == ["from-engine"]


def test_update_link_from_thread_changes_the_running_shaper() -> None:
    shaper = LinkShaper(LinkSettings(bandwidth_gbps=1.0, rtt_ms=10, pool_size=2))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        settings = update_link_from_thread(loop, shaper, bandwidth_gbps=0.5, pool_size=5)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()

    assert (settings.bandwidth_gbps, settings.rtt_ms, settings.pool_size) == (0.5, 10, 5)
    assert shaper.pool.capacity == 5


def test_a_server_with_a_token_takes_only_connections_that_open_with_it(
    run, collector, make_chunks
) -> None:
    chunks = make_chunks(2, 1_000)

    async def scenario():
        async with FabricServer(collector.on_transfer, collector.on_error) as server:
            server.token = "fabric-token-0123456789"
            client = FabricClient()
            # No HELLO: refused before any transfer is read.
            await client.send(server.host, server.port, "no-hello", chunks)
            missing = await collector.next_error()
            client.token = "wrong-token-0123456789"
            await client.send(server.host, server.port, "wrong", chunks)
            wrong = await collector.next_error()
            client.token = "fabric-token-0123456789"
            await client.send(server.host, server.port, "right", chunks)
            delivered = await collector.next_transfer()
            # A server without a token accepts a client that sends one (rolling a token out).
            server.token = None
            await client.send(server.host, server.port, "open", chunks)
            return missing, wrong, delivered, await collector.next_transfer()

    missing, wrong, delivered, opened = run(scenario())

    assert missing[0] == "no-hello" and isinstance(missing[1], TransferProtocolError)
    assert "did not open with a HELLO" in str(missing[1])
    assert wrong[0] is None and "wrong fabric token" in str(wrong[1])
    assert delivered.request_id == "right" and delivered.chunks == tuple(chunks)
    assert opened.request_id == "open"


def test_closing_the_server_mid_transfer_logs_no_asyncio_error(run, collector, caplog) -> None:
    async def scenario():
        server = FabricServer(collector.on_transfer, collector.on_error)
        await server.start()
        _, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(_kv("half", b"x" * 1000)[:60])  # a frame cut short: the server waits
        await writer.drain()
        while server.open_connections == 0:
            await asyncio.sleep(0.01)
        await server.close()
        writer.close()
        await asyncio.sleep(0.05)  # let asyncio run the connection's done-callback

    with caplog.at_level("ERROR", logger="asyncio"):
        run(scenario())
    assert "Exception in callback" not in caplog.text
