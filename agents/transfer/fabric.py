"""The KV-transfer fabric in one import: FabricServer receives, FabricClient sends.

Server and client live in server.py and client.py; this module gathers the public names callers
need (see README.md for an example).
"""

from __future__ import annotations

from agents.transfer.client import FabricClient
from agents.transfer.counters import CounterValues, Direction, FabricCounters, FabricName
from agents.transfer.records import KVChunk, TokenIds, Transfer, TransferStats
from agents.transfer.server import FabricServer, OnError, OnTransfer, ReceiveLimits

__all__ = [
    "CounterValues",
    "Direction",
    "FabricClient",
    "FabricCounters",
    "FabricName",
    "FabricServer",
    "KVChunk",
    "OnError",
    "OnTransfer",
    "ReceiveLimits",
    "TokenIds",
    "Transfer",
    "TransferStats",
]
