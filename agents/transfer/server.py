"""Receiving side of a fabric: a TCP server that reassembles, verifies and hands over transfers.

Each connection carries one or more transfers back to back. A transfer that is corrupt, partial
or aborted is reported to `on_error` and its connection is closed; every other connection keeps
being served, and no error escapes into the event loop.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from agents.transfer.counters import Direction, FabricCounters, FabricName
from agents.transfer.errors import (
    FrameError,
    OversizeFrameError,
    PartialTransferError,
    RemoteAbortError,
    StreamClosedError,
    TransferProtocolError,
    TruncatedFrameError,
)
from agents.transfer.frames import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    Frame,
    FrameKind,
    decode_end,
    decode_token_ids,
    read_frame,
)
from agents.transfer.records import KVChunk, TokenIds, Transfer
from pdd.checks import check_number

logger = logging.getLogger(__name__)

# StreamReader buffer: large enough that multi-MiB payloads are not read in 64 KiB steps.
STREAM_LIMIT_BYTES = 4 * 1024 * 1024

OnTransfer = Callable[[Transfer], Awaitable[None] | None]
OnError = Callable[[str | None, Exception], Awaitable[None] | None]


@dataclass(slots=True)
class ReceiveLimits:
    """What a server accepts before it fails a transfer."""

    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES  # per frame
    max_transfer_bytes: int = 16 * 1024**3  # per transfer, all payloads together
    frame_timeout_s: float | None = 120.0  # a stalled sender fails after this; None waits forever

    def __post_init__(self) -> None:
        if self.max_payload_bytes < 0:
            raise ValueError(f"max_payload_bytes must be >= 0, got {self.max_payload_bytes}")
        if self.max_transfer_bytes < self.max_payload_bytes:
            raise ValueError(
                f"max_transfer_bytes ({self.max_transfer_bytes}) must be >= "
                f"max_payload_bytes ({self.max_payload_bytes})"
            )
        if self.frame_timeout_s is not None:
            check_number(self.frame_timeout_s, "frame_timeout_s", gt=0)


class _Assembly:
    """The transfer being received on one connection."""

    __slots__ = ("request_id", "first_frame_at", "chunks", "tokens", "payload_bytes", "wire_bytes")

    def __init__(self, request_id: str, first_frame_at: float) -> None:
        self.request_id = request_id
        self.first_frame_at = first_frame_at
        self.chunks: list[KVChunk] = []
        self.tokens: TokenIds | None = None
        self.payload_bytes = 0
        self.wire_bytes = 0

    @property
    def frames(self) -> int:
        return len(self.chunks) + (self.tokens is not None)


class FabricServer:
    """Listens on host:port (port 0 picks a free one; read `port` after `start`).

    `on_transfer(transfer)` is called, and awaited if it returns an awaitable, for each verified
    transfer; the connection reads nothing more until it returns. `on_error(request_id, exc)`
    is called for each failed one; request_id is None when the stream failed before naming a
    request. Exceptions raised by either callback are logged and swallowed.
    """

    def __init__(
        self,
        on_transfer: OnTransfer,
        on_error: OnError | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        fabric: str = FabricName.INTRA_DC,
        limits: ReceiveLimits | None = None,
        counters: FabricCounters | None = None,
    ) -> None:
        if fabric not in FabricName.ALL:
            raise ValueError(f"fabric must be one of {FabricName.ALL}, got {fabric!r}")
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        self._on_transfer = on_transfer
        self._on_error = on_error
        self._host = host
        self._requested_port = port
        self.fabric = fabric
        self.limits = limits or ReceiveLimits()
        self.counters = counters or FabricCounters()
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._connections: set[asyncio.Task[None]] = set()
        # The fleet's data-plane token: when set, a connection must open with a HELLO frame
        # carrying it, or it is closed before any transfer is read.
        self.token: str | None = None

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        """The bound port (known once `start` has returned)."""
        if self._port is None:
            raise RuntimeError("FabricServer.port is only known after start()")
        return self._port

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("FabricServer already started")
        self._server = await asyncio.start_server(
            self._serve_connection, self._host, self._requested_port, limit=STREAM_LIMIT_BYTES
        )
        self._port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening and drop open connections (their transfers are not reported)."""
        if self._server is None:
            return
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    async def __aenter__(self) -> FabricServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None, "connection handlers run as tasks"
        self._connections.add(task)
        connected_at = time.monotonic()
        assembly: _Assembly | None = None
        greeted = self.token is None
        try:
            while True:
                try:
                    frame = await self._read(reader, assembly)
                except StreamClosedError:
                    if assembly is None:
                        return  # clean close between transfers
                    raise PartialTransferError(
                        f"connection closed after {assembly.frames} frames, before END",
                        request_id=assembly.request_id,
                    ) from None
                if frame.kind is FrameKind.HELLO:
                    if assembly is not None:
                        raise TransferProtocolError(
                            "HELLO inside a transfer", request_id=assembly.request_id
                        )
                    if self.token is not None and not hmac.compare_digest(
                        frame.payload, self.token.encode("utf-8")
                    ):
                        raise TransferProtocolError("wrong fabric token in HELLO")
                    greeted = True
                    continue
                if not greeted:
                    raise TransferProtocolError(
                        "connection did not open with a HELLO carrying the fabric token",
                        request_id=frame.request_id,
                    )
                if assembly is None:
                    assembly = _Assembly(frame.request_id, time.monotonic())
                assembly.wire_bytes += frame.wire_bytes
                transfer = self._apply(assembly, frame, connected_at)
                if transfer is not None:
                    assembly = None
                    self.counters.record_transfer(
                        fabric=self.fabric,
                        direction=Direction.RECEIVED,
                        request_id=transfer.request_id,
                        payload_bytes=transfer.payload_bytes,
                        wire_bytes=transfer.wire_bytes,
                    )
                    await self._call("on_transfer", self._on_transfer, transfer)
        except asyncio.CancelledError:
            # `close()` cancels open connections. End the handler normally: on Python 3.11
            # asyncio's stream callback calls task.exception() on a cancelled handler and logs
            # the CancelledError as an "Exception in callback" error at every shutdown with a
            # transfer in flight.
            return
        except Exception as exc:  # noqa: BLE001 - one connection must never take the server down
            request_id = getattr(exc, "request_id", None) or (
                assembly.request_id if assembly is not None else None
            )
            self.counters.record_failure(
                fabric=self.fabric,
                direction=Direction.RECEIVED,
                request_id=request_id,
                wire_bytes=assembly.wire_bytes if assembly is not None else 0,
            )
            if self._on_error is None:
                logger.warning("transfer %s failed: %r", request_id, exc)
            else:
                await self._call("on_error", self._on_error, request_id, exc)
        finally:
            self._connections.discard(task)
            writer.close()

    async def _read(self, reader: asyncio.StreamReader, assembly: _Assembly | None) -> Frame:
        request_id = assembly.request_id if assembly is not None else None
        try:
            async with asyncio.timeout(self.limits.frame_timeout_s):
                return await read_frame(reader, max_payload_bytes=self.limits.max_payload_bytes)
        except TruncatedFrameError as exc:
            # To the consumer a frame cut short is the same failure as a missing END.
            raise PartialTransferError(
                f"connection closed inside a frame: {exc}",
                request_id=exc.request_id or request_id,
            ) from exc
        except FrameError:
            raise
        except TimeoutError:
            raise PartialTransferError(
                f"no complete frame within {self.limits.frame_timeout_s} s",
                request_id=request_id,
            ) from None
        except OSError as exc:  # reset, broken pipe: the sender went away mid-transfer
            raise PartialTransferError(f"connection lost: {exc!r}", request_id=request_id) from exc

    def _apply(self, assembly: _Assembly, frame: Frame, connected_at: float) -> Transfer | None:
        """Add one frame to the transfer; returns the finished Transfer on a valid END."""
        request_id = assembly.request_id
        if frame.request_id != request_id:
            raise TransferProtocolError(
                f"frame for {frame.request_id!r} inside the transfer of {request_id!r}",
                request_id=request_id,
            )
        if frame.kind is FrameKind.ERROR:
            reason = frame.payload.decode("utf-8", errors="replace")
            raise RemoteAbortError(f"sender aborted: {reason}", request_id=request_id)
        if frame.kind is FrameKind.END:
            summary = decode_end(frame)
            if (summary.payload_bytes, summary.frames) != (
                assembly.payload_bytes,
                assembly.frames,
            ):
                raise PartialTransferError(
                    f"END promises {summary.payload_bytes} bytes in {summary.frames} frames, "
                    f"received {assembly.payload_bytes} bytes in {assembly.frames} frames",
                    request_id=request_id,
                )
            return Transfer(
                request_id=request_id,
                chunks=tuple(assembly.chunks),
                tokens=assembly.tokens,
                payload_bytes=assembly.payload_bytes,
                wire_bytes=assembly.wire_bytes,
                frames=assembly.frames,
                connected_at=connected_at,
                first_frame_at=assembly.first_frame_at,
                completed_at=time.monotonic(),
            )
        assembly.payload_bytes += len(frame.payload)
        if assembly.payload_bytes > self.limits.max_transfer_bytes:
            raise OversizeFrameError(
                f"transfer exceeds {self.limits.max_transfer_bytes} bytes",
                request_id=request_id,
            )
        if frame.kind is FrameKind.TOKENS:
            if assembly.tokens is not None:
                raise TransferProtocolError("second TOKENS frame", request_id=request_id)
            ids = decode_token_ids(frame.payload)
            if len(ids) != frame.token_end - frame.token_start:
                raise TransferProtocolError(
                    f"TOKENS frame has {len(ids)} ids for range "
                    f"[{frame.token_start}, {frame.token_end})",
                    request_id=request_id,
                )
            assembly.tokens = TokenIds(frame.token_start, ids)
        else:
            assembly.chunks.append(
                KVChunk(
                    frame.block_start,
                    frame.block_end,
                    frame.token_start,
                    frame.token_end,
                    frame.payload,
                )
            )
        return None

    async def _call(self, what: str, callback: Callable[..., object], *args: object) -> None:
        try:
            result = callback(*args)
            if inspect.isawaitable(result):
                await result
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a failing callback must not kill the connection loop
            logger.exception("FabricServer %s callback failed", what)
