"""Sending side of a fabric: frames a request's KV chunks and writes them to a FabricServer.

Unshaped (intra-DC, the RDMA stand-in) it writes as fast as loopback TCP allows; with a
LinkShaper (WAN) every byte, headers included, waits for the link's bandwidth budget, a pooled
connection and the link's RTT.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Iterable

from agents.transfer.counters import Direction, FabricCounters, FabricName
from agents.transfer.frames import (
    FrameKind,
    Payload,
    encode_end,
    encode_frame_header,
    encode_hello,
    encode_token_ids,
)
from agents.transfer.records import KVChunk, TokenIds, TransferStats
from agents.transfer.shaping import LinkLease, LinkShaper


class Wire:
    """A transfer serialised as frames, each a list of buffers (no payload is copied): built
    at once from a list of chunks (every range checked before connecting), or as the chunks
    of an asynchronous source come (a streamed export: P sends each chunk as prefill
    completes it; a bad chunk then aborts the transfer under way)."""

    def __init__(
        self,
        request_id: str,
        chunks: Iterable[KVChunk] | AsyncIterable[KVChunk],
        tokens: TokenIds | None,
    ) -> None:
        self.request_id = request_id
        self.payload_bytes = 0
        self.frames = 0
        self.data_bytes = 0
        self._tokens = tokens
        self._source: AsyncIterable[KVChunk] | None = None
        self._ready: list[list[Payload]] | None = None
        if isinstance(chunks, AsyncIterable):
            self._source = chunks
        else:
            self._ready = [self._chunk_frame(chunk) for chunk in chunks]
            self._ready.extend(self._tokens_frame())

    def _chunk_frame(self, chunk: KVChunk) -> list[Payload]:
        chunk = KVChunk(*chunk)
        header = encode_frame_header(
            FrameKind.KV_BLOCKS,
            self.request_id,
            chunk.payload,
            block_start=chunk.block_start,
            block_end=chunk.block_end,
            token_start=chunk.token_start,
            token_end=chunk.token_end,
        )
        return self._count(header, chunk.payload)

    def _tokens_frame(self) -> list[list[Payload]]:
        tokens = self._tokens
        if tokens is None:
            return []
        payload = encode_token_ids(tokens.ids)
        header = encode_frame_header(
            FrameKind.TOKENS,
            self.request_id,
            payload,
            token_start=tokens.token_start,
            token_end=tokens.token_end,
        )
        return [self._count(header, payload)]

    def _count(self, header: bytes, payload: Payload) -> list[Payload]:
        self.payload_bytes += len(payload)
        self.frames += 1
        self.data_bytes += len(header) + len(payload)
        return [header, payload] if len(payload) else [header]

    async def frames_out(self) -> AsyncIterator[list[Payload]]:
        """Each frame's buffers, in order (a streamed source's as its chunks come)."""
        if self._ready is not None:
            for frame in self._ready:
                yield frame
            return
        assert self._source is not None
        async for chunk in self._source:
            yield self._chunk_frame(chunk)
        for frame in self._tokens_frame():
            yield frame

    def end(self) -> bytes:
        """The END frame: what came before it (call after every frame went out)."""
        return encode_end(self.request_id, payload_bytes=self.payload_bytes, frames=self.frames)


class FabricClient:
    """Sends transfers over one fabric; safe to share between concurrent tasks of one loop.

    Every `send` opens its own TCP connection and closes it after END. On a shaped link that
    connection's setup is charged one RTT, and the pool slot is held from setup until the END
    is delivered.
    """

    def __init__(
        self,
        name: str = FabricName.INTRA_DC,
        shaper: LinkShaper | None = None,
        *,
        counters: FabricCounters | None = None,
        connect_timeout_s: float = 10.0,
    ) -> None:
        if name not in FabricName.ALL:
            raise ValueError(f"name must be one of {FabricName.ALL}, got {name!r}")
        if connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {connect_timeout_s}")
        self.name = name
        self.shaper = shaper
        self.counters = counters or FabricCounters()
        self.connect_timeout_s = connect_timeout_s
        # The fleet's data-plane token: sent in a HELLO frame first on every connection.
        self.token: str | None = None

    async def send(
        self,
        host: str,
        port: int,
        request_id: str,
        chunks: Iterable[KVChunk] | AsyncIterable[KVChunk],
        *,
        tokens: TokenIds | None = None,
        background: bool = False,
    ) -> TransferStats:
        """Send one transfer: every chunk as a KV_BLOCKS frame (in order), then `tokens` as one
        TOKENS frame if given, then END. Returns once END has been handed to the socket (and,
        when shaped, rtt / 2 later). ``background``: on a shaped link, wait for a pooled
        connection behind every urgent transfer (nobody's first token waits on this one).

        ``chunks`` may be an asynchronous iterable (a streamed export): the connection opens
        at once and each chunk goes out as it comes, so the transfer overlaps the work that
        makes the chunks; the connection (and its pool slot) is held meanwhile. An exception
        from the source aborts the transfer like a failed connection.

        Raises ValueError for an invalid request id or chunk range (before connecting, for a
        list) and OSError / TimeoutError when the connection fails. Cancelling the call drops
        the connection, so the receiver reports a partial transfer, and frees the pool slot
        and the link share at once.
        """
        wire = Wire(request_id, chunks, tokens)
        started = time.monotonic()
        try:
            if self.shaper is None:
                wait_s, connected = 0.0, started
                await self._send_unshaped(host, port, wire)
            else:
                async with self.shaper.lease(background=background) as lease:
                    wait_s, connected = lease.wait_for_connection_s, time.monotonic()
                    await self._send_shaped(host, port, wire, lease)
        except BaseException:
            self.counters.record_failure(
                fabric=self.name, direction=Direction.SENT, request_id=request_id
            )
            raise
        finished = time.monotonic()
        bytes_sent = wire.data_bytes + len(wire.end())
        self.counters.record_transfer(
            fabric=self.name,
            direction=Direction.SENT,
            request_id=request_id,
            payload_bytes=wire.payload_bytes,
            wire_bytes=bytes_sent,
        )
        return TransferStats(
            bytes_sent=bytes_sent,
            frames=wire.frames + 1,
            wait_for_connection_s=wait_s,
            transfer_s=finished - connected,
            total_s=finished - started,
            payload_bytes=wire.payload_bytes,
        )

    async def _connect(self, host: str, port: int) -> asyncio.StreamWriter:
        async with asyncio.timeout(self.connect_timeout_s):
            _, writer = await asyncio.open_connection(host, port)
        if self.token:
            writer.write(encode_hello(self.token))
        return writer

    async def _send_unshaped(self, host: str, port: int, wire: Wire) -> None:
        writer = await self._connect(host, port)
        async with _closing(writer):
            async for frame in wire.frames_out():
                for segment in frame:
                    writer.write(segment)
                    # Drain per segment so a large transfer is not buffered twice in user space.
                    await writer.drain()
            writer.write(wire.end())
            await writer.drain()

    async def _send_shaped(self, host: str, port: int, wire: Wire, lease: LinkLease) -> None:
        await lease.handshake()
        writer = await self._connect(host, port)
        async with _closing(writer):
            async for frame in wire.frames_out():
                pending = deque(memoryview(segment).cast("B") for segment in frame)
                remaining = sum(len(segment) for segment in pending)
                while remaining:
                    allowed = await lease.grant(remaining)
                    remaining -= allowed
                    while allowed:
                        head = pending[0]
                        if len(head) <= allowed:
                            writer.write(head)
                            allowed -= len(head)
                            pending.popleft()
                        else:
                            writer.write(head[:allowed])
                            pending[0] = head[allowed:]
                            allowed = 0
                    await writer.drain()
            end = wire.end()
            end_left = len(end)
            while end_left:
                end_left -= await lease.grant(end_left)
            # The END is the transfer's last byte: the receiver sees it one-way latency later.
            await lease.propagate()
            writer.write(end)
            await writer.drain()


@contextlib.asynccontextmanager
async def _closing(writer: asyncio.StreamWriter) -> AsyncIterator[asyncio.StreamWriter]:
    """Close the connection; wait for a clean close only when the send succeeded."""
    try:
        yield writer
    except BaseException:
        writer.transport.abort()
        raise
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
