"""P's streamed export: MD's delta sent in pieces while the prefill computes it.

Without it P sends MD's delta (the prompt past MD's cached prefix) once prefill has ended, so
the transfer (1-20 s over a WAN at 64K-token contexts) starts after the prefill (0.5-3 s a
16K-token chunk). With ``kv_stream_tokens`` > 0, once MD's reservation says where the delta
starts, the engine's worker hands over each run of whole blocks the prefill has computed (at
least that many tokens) and they go out on one transfer as they come; when prefill ends, the
rest of the prompt closes it. MD joins the pieces (kv_codec.join_payloads) and imports them
when the transfer's END lands, as for a transfer of one piece; a piece that fails fails the
transfer, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from agents.engine.core import EngineCore
from agents.engine.emulated import as_format
from agents.engine.kv_codec import encoded_size, to_format
from agents.engine.kv_pool import read_kv_header
from agents.node.agent import Agent
from agents.node.pipeline_common import transfer_id
from agents.node.wire import Peer
from agents.node.worker import EngineWorker
from agents.transfer.records import KVChunk, TransferStats
from pdd.kv_formats import wire_factor

# The float formats (what the engines store).
_FLOATS = ("float32", "bfloat16", "float16")


def send_format(link_format: str | None, own: str | None, stored: str | None) -> str | None:
    """The format P sends MD's delta in, converted once on the cheaper side: the WAN link's
    format when it names one; else MD's stored dtype when it is narrower than P's own (MD
    would narrow it on import anyway, so the values MD holds are the same and the wire
    carries fewer bytes); else None, P's own (MD widens or converts on import, if at all)."""
    if link_format:
        return link_format
    if own in _FLOATS and stored in _FLOATS and wire_factor(stored, own) < 1.0:
        return stored
    return None


def fabric_to(agent: Agent, peer: Peer) -> str:
    """The fabric P's KV reaches ``peer`` over: intra-DC in P's own datacenter, else the WAN."""
    return "intra_dc" if peer.datacenter == agent.settings.datacenter else "wan"


def delta_start(main_cached: int, length: int, block_size: int) -> int:
    """Where MD's delta starts: its cached prefix of the prompt, in whole blocks."""
    start = min(main_cached, length)
    return start - start % block_size


def for_wire(payload: bytes, kv_format: str) -> bytes:
    """A payload in ``kv_format``: a torch engine's converted (kv_codec.to_format), an emulated
    one's (no tensors) given that format's bytes per token (emulated.as_format)."""
    if read_kv_header(payload).num_layers == 0:
        return as_format(payload, kv_format)
    return to_format(payload, kv_format)


def kv_size(engine: EngineCore, payload: bytes, kv_format: str | None) -> int:
    """The KV bytes a payload stands for on the wire: its encoded size in ``kv_format``, else
    what the engine's own payload represents (an emulated one's: the profile's bytes)."""
    if kv_format:
        header = read_kv_header(payload)
        if header.num_layers:
            return encoded_size(payload, kv_format)
        own = engine.represented_bytes(payload)  # in the payload's own format
        return round(own * wire_factor(kv_format, header.dtype_name))
    return engine.represented_bytes(payload)


class StreamedDelta:
    """One request's delta to MD, streamed from P's engine while it prefills."""

    def __init__(
        self,
        agent: Agent,
        worker: EngineWorker,
        request_id: str,
        main: Peer,
        length: int,
        *,
        background: bool,
    ) -> None:
        self.agent = agent
        self.worker = worker
        self.request_id = request_id
        self.main = main
        self.length = length
        self.background = background
        self.fabric = fabric_to(agent, main)
        # The format the pieces go in (send_format, once MD said what it stores), if not P's.
        self.kv_format: str | None = None
        self.pieces = 0
        self.kv_bytes = 0  # the KV the pieces stand for (encoded size in another format)
        self.send: asyncio.Task[TransferStats] | None = None
        self._pieces: asyncio.Queue[tuple[int, int, bytes] | None] = asyncio.Queue()
        self._closed = False

    async def begin(self, start: int, kv_format: str | None) -> None:
        """MD's reservation answered: the delta starts at ``start`` (its cached prefix in whole
        blocks of MD's size); send what the prefill has computed past it, and each piece from
        now on, on one transfer, in ``kv_format`` (None: P's own)."""
        self.kv_format = kv_format
        await self.worker.watch_export(
            self.request_id,
            start,
            self.agent.settings.kv_stream_tokens,
            self._piece,
        )
        client = (
            self.agent.links.wan_client(self.main.datacenter)
            if self.fabric == "wan"
            else self.agent.links.intra_client
        )
        host, port = self.main.kv_address(self.fabric == "wan")
        self.send = asyncio.create_task(
            client.send(
                host,
                port,
                transfer_id(self.request_id, self.main.instance, "kv"),
                self._chunks(),
                background=self.background,
            )
        )

    def _piece(self, first: int, end: int, payload: bytes) -> None:
        if self._closed:
            return
        # Counted as it is committed (header only): the KV it stands for, or its encoded size.
        self.kv_bytes += kv_size(self.worker.engine, payload, self.kv_format)
        self.pieces += 1
        self._pieces.put_nowait((first, end, payload))

    def finish(self, first: int, payload: bytes) -> None:
        """Prefill ended: the rest of the prompt, from ``first``, closes the transfer (no
        piece when the pieces already cover the prompt)."""
        if first < self.length:
            self._piece(first, self.length, payload)
        self._closed = True
        self._pieces.put_nowait(None)

    def abort(self) -> None:
        """The request failed or ended before its delta was whole: stop exporting and drop
        the transfer (MD sees it partial)."""
        self._closed = True
        self.worker.take_export_watch(self.request_id)
        if self.send is not None and not self.send.done():
            self.send.cancel()

    async def _chunks(self) -> AsyncIterator[KVChunk]:
        bs = self.agent.settings.block_size
        while (item := await self._pieces.get()) is not None:
            first, end, payload = item
            if self.kv_format:
                payload = await asyncio.to_thread(for_wire, payload, self.kv_format)
            yield KVChunk(first // bs, -(-end // bs), first, end, payload)
