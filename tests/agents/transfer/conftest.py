"""Helpers for the transfer-fabric tests: run a coroutine with a hard timeout, collect what a
FabricServer reports, build KV chunks with recognisable bytes."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from agents.transfer import KVChunk, Transfer


class Collector:
    """on_transfer / on_error callbacks that queue what they receive."""

    def __init__(self) -> None:
        self.transfers: asyncio.Queue[Transfer] = asyncio.Queue()
        self.errors: asyncio.Queue[tuple[str | None, Exception]] = asyncio.Queue()

    async def on_transfer(self, transfer: Transfer) -> None:
        await self.transfers.put(transfer)

    async def on_error(self, request_id: str | None, exc: Exception) -> None:
        await self.errors.put((request_id, exc))

    async def next_transfer(self, timeout: float = 10.0) -> Transfer:
        return await asyncio.wait_for(self.transfers.get(), timeout)

    async def next_error(self, timeout: float = 10.0) -> tuple[str | None, Exception]:
        return await asyncio.wait_for(self.errors.get(), timeout)


@pytest.fixture
def run() -> Callable[..., Any]:
    """Run a coroutine in a fresh event loop; a hang fails the test instead of stalling it."""

    def _run(coro: Coroutine[Any, Any, Any], timeout: float = 20.0) -> Any:
        return asyncio.run(asyncio.wait_for(coro, timeout))

    return _run


@pytest.fixture
def collector() -> Collector:
    return Collector()


@pytest.fixture
def make_chunks() -> Callable[..., list[KVChunk]]:
    """`make_chunks(count, size)`: chunks of random bytes, 16 tokens per block."""

    def _make(count: int, size: int, *, seed: int = 0, first_block: int = 0) -> list[KVChunk]:
        rng = random.Random(seed)
        chunks = []
        for index in range(count):
            block = first_block + index
            chunks.append(
                KVChunk(block, block + 1, block * 16, (block + 1) * 16, rng.randbytes(size))
            )
        return chunks

    return _make
