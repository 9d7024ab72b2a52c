"""KV-cache transfer fabrics of the node agent: intra-DC (unshaped loopback TCP, an RDMA
stand-in) and WAN (TCP shaped to a link's bandwidth, RTT and connection pool)."""

from __future__ import annotations

from agents.transfer.client import FabricClient
from agents.transfer.counters import CounterValues, Direction, FabricCounters, FabricName
from agents.transfer.errors import (
    BadMagicError,
    ChecksumError,
    FrameError,
    MalformedFrameError,
    OversizeFrameError,
    PartialTransferError,
    RemoteAbortError,
    StreamClosedError,
    TransferError,
    TransferProtocolError,
    TruncatedFrameError,
    UnsupportedVersionError,
)
from agents.transfer.frames import Frame, FrameKind, encode_frame, read_frame
from agents.transfer.pool import LinkPool, PoolStats
from agents.transfer.records import KVChunk, TokenIds, Transfer, TransferStats
from agents.transfer.server import FabricServer, ReceiveLimits
from agents.transfer.shaping import LinkLease, LinkSettings, LinkShaper, ShaperStats
from agents.transfer.threadsafe import send_from_thread, update_link_from_thread

__all__ = [
    "BadMagicError",
    "ChecksumError",
    "CounterValues",
    "Direction",
    "FabricClient",
    "FabricCounters",
    "FabricName",
    "FabricServer",
    "Frame",
    "FrameError",
    "FrameKind",
    "KVChunk",
    "LinkLease",
    "LinkPool",
    "LinkSettings",
    "LinkShaper",
    "MalformedFrameError",
    "OversizeFrameError",
    "PartialTransferError",
    "PoolStats",
    "ReceiveLimits",
    "RemoteAbortError",
    "ShaperStats",
    "StreamClosedError",
    "TokenIds",
    "Transfer",
    "TransferError",
    "TransferProtocolError",
    "TransferStats",
    "TruncatedFrameError",
    "UnsupportedVersionError",
    "encode_frame",
    "read_frame",
    "send_from_thread",
    "update_link_from_thread",
]
