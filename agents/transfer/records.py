"""The values that cross the fabric API: KV chunks in, received transfers and send stats out."""

from __future__ import annotations

from typing import NamedTuple

from agents.transfer.frames import Payload


class KVChunk(NamedTuple):
    """Opaque KV-cache bytes for blocks [block_start, block_end) covering tokens
    [token_start, token_end). The fabric never looks inside `payload`."""

    block_start: int
    block_end: int
    token_start: int
    token_end: int
    payload: Payload


class TokenIds(NamedTuple):
    """Token ids for positions [token_start, token_start + len(ids)), e.g. the tokens RelayDecode
    generated, which MainDecode recomputes the KV of at handoff."""

    token_start: int
    ids: tuple[int, ...]

    @property
    def token_end(self) -> int:
        return self.token_start + len(self.ids)


class Transfer(NamedTuple):
    """A complete, verified transfer as handed to `FabricServer`'s on_transfer callback.

    Times are `time.monotonic()` on the receiver.
    """

    request_id: str
    chunks: tuple[KVChunk, ...]  # in the order they were sent; payloads are `bytes`
    tokens: TokenIds | None
    payload_bytes: int
    wire_bytes: int  # every frame of the transfer as it crossed the socket, END included
    frames: int  # data frames (KV_BLOCKS and TOKENS), END not included
    connected_at: float
    first_frame_at: float
    completed_at: float

    @property
    def receive_s(self) -> float:
        """From the first frame to the verified END."""
        return self.completed_at - self.first_frame_at


class TransferStats(NamedTuple):
    """What `FabricClient.send` measured for one transfer."""

    bytes_sent: int  # wire bytes: headers, request ids, payloads and the END frame
    frames: int  # every frame written, END included
    wait_for_connection_s: float  # queued for a pooled connection (0 when unshaped)
    transfer_s: float  # from holding a connection to the END being delivered (RTT included)
    total_s: float  # wait_for_connection_s + transfer_s, i.e. the whole send() call
    payload_bytes: int  # the KV bytes the caller handed over
