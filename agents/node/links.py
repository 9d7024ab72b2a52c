"""The agent's KV fabrics: the intra-DC and WAN servers it receives transfers on, the clients
it sends with, and the shaped WAN link towards each peer datacenter (its settings, its
connection pool and its recent use, for the state document)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from agents.node.settings import AgentSettings, split_host_port
from agents.transfer.client import FabricClient
from agents.transfer.counters import Direction, FabricCounters, FabricName
from agents.transfer.pool import PoolStats
from agents.transfer.records import Transfer
from agents.transfer.server import FabricServer
from agents.transfer.shaping import LinkSettings, LinkShaper

log = logging.getLogger(__name__)

OnTransfer = Callable[[Transfer], Awaitable[None]]
OnTransferError = Callable[[str | None, Exception], Awaitable[None]]


class Links:
    """The fabrics' servers and clients, and the WAN link per peer datacenter. Lives on the
    event loop's thread."""

    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.counters = FabricCounters()
        self._shapers: dict[str, LinkShaper] = {}
        self._wan_clients: dict[str, FabricClient] = {}
        self.intra_client = FabricClient(FabricName.INTRA_DC, None, counters=self.counters)
        self._unshaped_wan = FabricClient(FabricName.WAN, None, counters=self.counters)
        self.intra_server: FabricServer | None = None
        self.wan_server: FabricServer | None = None
        self._token: str | None = None
        # (monotonic time, bytes granted) per link at the last report, for its utilisation.
        self._marks: dict[str, tuple[float, int]] = {}
        for peer, link in settings.links.items():
            self.set(peer, link)

    def set_token(self, token: str | None) -> None:
        """Require `token` on both fabric servers and send it on every transfer."""
        self._token = token
        for fabric in self._fabrics():
            fabric.token = token

    def _fabrics(self) -> list[FabricClient | FabricServer]:
        clients = [self.intra_client, self._unshaped_wan, *self._wan_clients.values()]
        servers = [s for s in (self.intra_server, self.wan_server) if s is not None]
        return [*clients, *servers]

    async def start(self, on_transfer: OnTransfer, on_error: OnTransferError) -> None:
        """Listen on kv_listen (intra-DC) and wan_port (WAN); what lands goes to the callbacks."""
        host, port = split_host_port(self.settings.kv_listen, "kv_listen")
        self.intra_server = FabricServer(
            on_transfer,
            on_error,
            host=host,
            port=port,
            fabric=FabricName.INTRA_DC,
            counters=self.counters,
        )
        self.wan_server = FabricServer(
            on_transfer,
            on_error,
            host=host,
            port=self.settings.wan_port,
            fabric=FabricName.WAN,
            counters=self.counters,
        )
        self.intra_server.token = self.wan_server.token = self._token
        await self.intra_server.start()
        await self.wan_server.start()

    async def close(self) -> None:
        for server in (self.intra_server, self.wan_server):
            if server is not None:
                await server.close()

    def kv_endpoint(self) -> dict[str, Any] | None:
        """Where peers send this agent's KV (None before the servers started)."""
        if self.intra_server is None or self.wan_server is None:
            return None
        return {
            "host": self.intra_server.host,
            "port": self.intra_server.port,
            "wan_port": self.settings.advertise_wan_port or self.wan_server.port,
        }

    # -- the WAN link per peer datacenter -----------------------------------------------------

    def set(self, peer: str, link: LinkSettings) -> LinkSettings:
        """Shape the WAN link towards `peer` as declared; returns the declared settings. With
        kv_scale > 1 the shaper runs at bandwidth / kv_scale (emulated KV carries 1/kv_scale of
        the real bytes, so transfers take the declared link's time); with speedup != 1 the
        link runs at bandwidth x speedup and RTT / speedup, as the engines' modelled steps do
        (slow motion when speedup < 1)."""
        scale, speed = self.settings.kv_scale, self.settings.speedup
        shaped = dataclasses.replace(
            link,
            bandwidth_gbps=link.bandwidth_gbps * speed / scale,
            rtt_ms=link.rtt_ms / speed,
        )
        shaper = self._shapers.get(peer)
        if shaper is None:
            shaper = LinkShaper(shaped)
            self._shapers[peer] = shaper
            client = FabricClient(FabricName.WAN, shaper, counters=self.counters)
            client.token = self._token
            self._wan_clients[peer] = client
        else:
            shaper.update(
                bandwidth_gbps=shaped.bandwidth_gbps, rtt_ms=shaped.rtt_ms, pool_size=link.pool_size
            )
        return _declared(shaper, scale, speed)

    def shaper(self, peer: str) -> LinkShaper | None:
        """The shaper of the link towards `peer` (its settings are the shaped ones)."""
        return self._shapers.get(peer)

    def handoff_ack_timeout_s(self, peer_datacenter: str | None) -> float:
        """How long RLD waits for MD's acknowledgement of the final handoff over the link to
        `peer_datacenter`: the floor plus four round trips, at most handoff_timeout_s."""
        shaper = self._shapers.get(peer_datacenter) if peer_datacenter else None
        rtt_s = shaper.settings.rtt_s if shaper is not None else 0.0
        return min(self.settings.handoff_timeout_s, self.settings.handoff_ack_floor_s + 4 * rtt_s)

    def wan_client(self, peer_datacenter: str | None) -> FabricClient:
        """The WAN link's shaped client towards that datacenter; a peer with no configured
        link gets unshaped WAN (still counted as WAN, and logged)."""
        client = self._wan_clients.get(peer_datacenter) if peer_datacenter else None
        if client is None:
            log.warning("no link configured towards %s: WAN transfer is unshaped", peer_datacenter)
            return self._unshaped_wan
        return client

    # -- the state document -------------------------------------------------------------------

    def fabrics_json(self) -> dict[str, Any]:
        """Bytes, transfers and failures per fabric (the state document's ``fabrics``)."""
        fabrics = {}
        for fabric in FabricName.ALL:
            sent = self.counters.totals(fabric, Direction.SENT)
            received = self.counters.totals(fabric, Direction.RECEIVED)
            fabrics[fabric] = {
                "sent_bytes": sent.wire_bytes,
                "received_bytes": received.wire_bytes,
                "sent_payload_bytes": sent.payload_bytes,
                "received_payload_bytes": received.payload_bytes,
                "transfers": sent.transfers + received.transfers,
                "failures": sent.failures + received.failures,
            }
        return fabrics

    def to_json(self) -> dict[str, Any]:
        """Each link as declared, with its connection pool (the state document's ``links``)."""
        return {peer: self._link_json(s) for peer, s in self._shapers.items()}

    def _link_json(self, shaper: LinkShaper) -> dict[str, Any]:
        scale, speed = self.settings.kv_scale, self.settings.speedup
        declared = _declared(shaper, scale, speed)
        doc = link_json(declared) | {"connections": pool_json(shaper.pool.stats())}
        if scale != 1 or speed != 1:
            doc["wire_bandwidth_gbps"] = shaper.settings.bandwidth_gbps
            doc["kv_scale"] = scale
        if speed != 1:
            doc["speedup"] = speed
        return doc

    def add_utilisation(self, links: dict[str, Any]) -> None:
        """Add each link's use since the last call (a heartbeat's) to `links` (to_json's)."""
        now = time.monotonic()
        for peer, shaper in self._shapers.items():
            granted = shaper.bytes_granted
            last = self._marks.get(peer)
            self._marks[peer] = (now, granted)
            if last is not None and now > last[0] and peer in links:
                rate = shaper.settings.bandwidth_gbps * 1e9 / 8
                used = (granted - last[1]) / (now - last[0]) / rate if rate > 0 else 0.0
                links[peer]["utilisation"] = round(min(1.0, max(0.0, used)), 4)


def pool_json(stats: PoolStats) -> dict[str, Any]:
    """The WAN connection pool's queue, for operators (PROTOCOL.md, state document)."""
    return {
        "in_use": stats.in_use,
        "waiting": stats.waiting,
        "acquisitions": stats.acquisitions,
        "background_acquisitions": stats.background_acquisitions,
        "total_wait_s": round(stats.total_wait_s, 6),
    }


def _declared(shaper: LinkShaper, kv_scale: float, speedup: float = 1.0) -> LinkSettings:
    """The link as declared: the shaper runs at bandwidth x speedup / kv_scale and RTT /
    speedup (Links.set)."""
    return dataclasses.replace(
        shaper.settings,
        bandwidth_gbps=shaper.settings.bandwidth_gbps * kv_scale / speedup,
        rtt_ms=shaper.settings.rtt_ms * speedup,
    )


def link_json(link: LinkSettings) -> dict[str, Any]:
    return {
        "bandwidth_gbps": link.bandwidth_gbps,
        "rtt_ms": link.rtt_ms,
        "pool_size": link.pool_size,
    }
