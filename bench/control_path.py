"""The control path at N = 10 / 100 / 1,000 nodes: how one web process carries N node agents'
heartbeats, with the fleet pages an operator opens meanwhile.

    .venv/bin/python -m bench.control_path [--nodes 10,100,1000] [--seconds 120] [--blocks 1000]

Raw outputs go to var/bench-control-path/ (n<N>/result.json and the processes' logs), the small
summary to bench/control_path/summary.json (--summary); the report is
bench/control_path/REPORT.md.

Scenario (fixed before the first run; never retuned after seeing results). For each N, in
the order given, from scratch:

- State: the PostgreSQL database ``baton_bench_control`` on 127.0.0.1:5432 dropped and created
  anew (``createdb``; dropped again afterwards), Redis db 9 flushed (and flushed afterwards).
- The control plane as production runs it: ONE uvicorn process
  (``bench.pdd.fleet.start_control_plane``: migrate, then ``uvicorn controlplane.asgi:application``
  with uvicorn's default options) with DATABASE_URL and REDIS_URL set to that database and db,
  a heartbeat every 2 s, 3 missed beats make a node offline, reconcile every 5 s (the settings'
  default) and every other setting at its default; plus ONE Celery worker with beat in it
  (``celery -A controlplane worker -B --loglevel=INFO``: the default prefork pool, as many pool
  processes as the machine has cores), which runs the health checks, agent probes and
  reconciles as production does.
- Declared over the REST API with the operator token: datacenters ``bench-a`` and ``bench-b``
  joined by a WAN link (20 Gbit/s, 20 ms, 16 connections), GPU type ``gpu-a`` (a unit price in
  each), one served model, N nodes of 8 GPUs (the first half, N // 2, in bench-a, the rest in
  bench-b) and one 8-GPU instance on each: prefill in bench-a, main_decode in bench-b.
- ONE probe process (asyncio; this module with --probe) plays all N agents over the agent
  protocol (agents/PROTOCOL.md). Each node listens on its own port on 127.0.0.1 with a minimal
  HTTP/1.1 server (``GET /health``: the agent's health answer; any other GET: its state
  document; any other method: 200 ``{}``) and talks to the control plane over its own
  keep-alive connection, as each real agent has its own client. Node i of N starts at
  i / N x 2 s (start times spread uniformly over the first interval); it registers
  (``POST /api/v1/agent/register``, retried every 2 s until accepted), a main-decode node then
  posts one KV events snapshot of --blocks block hashes (``POST /api/v1/agent/kv-events``, the
  format of agents/node/kv_events.py; no further events and no keep-alive posts), then it
  heartbeats (``POST /api/v1/agent/heartbeat``) every 2 s on the agent's fixed schedule
  (agents/node/control.py: a slow answer does not shift the schedule, a beat a whole interval
  late is skipped, never sent in a burst), one beat at a time, client timeout 10 s; a beat
  answered 401 or 404 registers again, as an agent does. Its state document is a real idle
  agent's: the instance ``running`` with its load, kv, cache and engine figures, tokens and KV
  endpoint, the node's fabrics, links, threads and engine options, ``kv_events`` and an empty
  ``incoming_prefix_blocks`` on a main-decode instance, and the ``control_plane`` heartbeat
  stats a real agent adds, which change at every beat.
- Bring-up: declaring (timed), then from the probe's start until
  ``GET /api/v1/nodes/?status=online`` counts N.
- Then the measured window of --seconds (default 120): every heartbeat sent in it (by send
  time) and its answer (late answers to beats sent in it are waited for); every 5 s the number
  of offline nodes and the length of the Celery queue; 5 times, evenly spread, one after
  another: ``GET /api/v1/nodes/?page_size=100`` (operator token), the fleet page ``/fleet/``
  (an operator's session) and ``/metrics``; the CPU of uvicorn, of the Celery worker (with its
  pool and beat processes), of the probe and of the whole machine (/proc), over the window;
  uvicorn's RSS at its end; ``node.offline`` events in the window (``GET /api/v1/events/``).
  No probe node ever stops, so every node.offline event is a node gone falsely offline.

Goals (from the issue), judged at N = 1,000: the heartbeat round trip's p99 <= 100 ms, 0
heartbeat errors (an answer other than 2xx, a timeout or a broken connection), 0 nodes falsely
offline in the window; and the node list, the fleet page and /metrics stay fast: each of their
5 fetches answered 200 within 1 s. The same checks are shown for every N.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import secrets
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import reduce
from operator import xor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench.harness.celery_worker import start_worker_with_beat as start_celery
from bench.harness.host import cpu_model, git_commit, machine_busy
from bench.harness.output import pct
from bench.harness.testbed import stop_on_signals

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "var" / "bench-control-path"
SUMMARY = ROOT / "bench" / "control_path" / "summary.json"

INTERVAL_S = 2.0  # heartbeat interval (BATON_HEARTBEAT_INTERVAL_S, as start_control_plane sets)
RECONCILE_S = 5.0  # the settings' default
TIMEOUT_S = 10.0  # an agent's client timeout
SAMPLE_EVERY_S = 5.0
PAGE_FETCHES = 5
GOAL_N = 1000
GOAL_P99_S = 0.100
GOAL_PAGE_S = 1.0
SLOW_KEPT = 5000
DB_NAME = "baton_bench_control"
PG_SERVER = "postgresql://postgres@127.0.0.1:5432"
REDIS_URL = "redis://127.0.0.1:6379/9"
CELERY_QUEUE = "celery"
MODEL = "bench-control"
GPU = "gpu-a"
DATACENTERS = (("bench-a", "city-a", "prefill"), ("bench-b", "city-b", "main_decode"))
LINK = {"bandwidth_gbps": 20, "rtt_ms": 20, "connection_pool_size": 16}
GPUS_PER_NODE = 8
BLOCK_SIZE = 16
MAX_BLOCKS_PER_BATCH = 16_384  # agents/node/kv_events.py
MAX_BLOCKS = 65_536  # one post (kv_events.MAX_BLOCKS_PER_POST)
RTT_WINDOW = 256  # round trips a real agent's stats keep
OPERATOR = "bench-ui"
PAGES = {
    "node_list": "/api/v1/nodes/?page_size=100",
    "fleet_page": "/fleet/",
    "metrics": "/metrics",
}


def say(message: str) -> None:
    print(f"[control-path] {message}", file=sys.stderr, flush=True)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


# -- HTTP/1.1 on raw keep-alive connections (the probe's side) --------------------------------


class HttpError(Exception):
    """An answer that is not HTTP/1.1."""


class Closed(ConnectionError):
    """The peer closed the connection before the first byte of an answer."""


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """(status, body, the server closes) of one HTTP/1.1 answer (Content-Length or chunked)."""
    line = await reader.readline()
    if not line:
        raise Closed("closed before an answer")
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise HttpError(f"not an HTTP answer: {line[:60]!r}")
    status = int(parts[1])
    length, chunked, close = 0, False, parts[0] == b"HTTP/1.0"
    while True:
        header = await reader.readline()
        if header in (b"\r\n", b"\n"):
            break
        if not header:
            raise ConnectionResetError("closed in the answer's headers")
        name, _, value = header.partition(b":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value
        elif name == b"connection":
            close = value == b"close"
    if not chunked:
        return status, (await reader.readexactly(length) if length else b""), close
    body = bytearray()
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return status, bytes(body), close
        body += await reader.readexactly(size)
        await reader.readexactly(2)


class Connection:
    """One keep-alive HTTP/1.1 connection to the control plane: what each agent's own client
    holds. A request on a reused connection the server closed meanwhile (its keep-alive
    timeout) is sent once more on a fresh one, as an HTTP client's pool does."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.opened = 0
        self.stale_retries = 0

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def request(
        self, method: str, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        head = "".join(
            [
                f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n",
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n",
                *(f"{k}: {v}\r\n" for k, v in headers.items()),
                "\r\n",
            ]
        ).encode()
        for _ in range(2):
            reused = self.writer is not None
            if self.reader is None or self.writer is None or self.reader.at_eof():
                self.close()
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
                self.opened += 1
                reused = False
            try:
                self.writer.write(head + body)
                await self.writer.drain()
                status, data, close = await read_response(self.reader)
            except Closed:
                self.close()
                if not reused:
                    raise
                self.stale_retries += 1
                continue
            except BaseException:  # a timeout's cancellation included: the answer is lost
                self.close()
                raise
            if close:
                self.close()
            return status, data
        raise Closed("closed before an answer, twice")


# -- the probe: N agents in one process --------------------------------------------------------


@dataclass
class ProbeNode:
    hostname: str
    token: str
    role: str
    datacenter: str
    instance_id: int
    port: int = 0
    conn: Connection | None = None
    links: dict[str, Any] = field(default_factory=dict)
    kv_events: dict[str, Any] | None = None
    registered: bool = False
    # What a real agent counts of its heartbeats (agents/node/control.py HeartbeatStats).
    answered: int = 0
    refused: int = 0
    refused_by_status: Counter = field(default_factory=Counter)
    timeouts: int = 0
    unreachable: int = 0
    rtts: deque = field(default_factory=lambda: deque(maxlen=RTT_WINDOW))

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"AgentToken {self.token}"}

    def heartbeat_stats(self) -> dict[str, Any]:
        rtts = sorted(self.rtts)

        def at(q: float) -> float | None:
            return round(rtts[min(len(rtts) - 1, int(q * len(rtts)))], 6) if rtts else None

        return {
            "heartbeats_answered": self.answered,
            "heartbeats_refused": self.refused,
            "heartbeats_refused_by_status": {str(k): v for k, v in self.refused_by_status.items()},
            "registrations_refused": 0,
            "last_refusal": None,
            "backoff_s": 0.0,
            "report_block_cap": None,
            "heartbeat_timeouts": self.timeouts,
            "unreachable": self.unreachable,
            "rtt_p50_s": at(0.5),
            "rtt_p99_s": at(0.99),
            "rtt_max_s": round(rtts[-1], 6) if rtts else None,
            "window": len(rtts),
        }


ZERO_FABRIC = {
    "sent_bytes": 0,
    "received_bytes": 0,
    "sent_payload_bytes": 0,
    "received_payload_bytes": 0,
    "transfers": 0,
    "failures": 0,
}
ENGINE_OPTIONS = {"device": "cuda", "dtype": "bfloat16", "decode_weights": "full"}


def state_document(node: ProbeNode) -> dict[str, Any]:
    """A real idle agent's state document (agents/node/agent.py state() and report())."""
    item: dict[str, Any] = {
        "instance_id": str(node.instance_id),
        "role": node.role,
        "model": MODEL,
        "source": "baton-tiny",
        "dtype": "bfloat16",
        "engine_kind": "torch",
        "state": "running",
        "tokens_generated": 18_432,
        "kv_endpoint": {"host": "127.0.0.1", "port": node.port, "wan_port": node.port},
        "gpu": f"bench {GPU}",
        "load": {"running": 0, "queued": 0, "held": 0, "active_requests": 0, "max_running": 64},
        "kv": {"used_blocks": 0, "total_blocks": 65_536, "block_size": BLOCK_SIZE},
        "cache": {
            "lookups": 412,
            "hits": 301,
            "queried_tokens": 1_650_000,
            "matched_tokens": 1_104_000,
            "cached_blocks": 1000,
            "hit_rate": 0.669,
        },
        "engine": {
            "tokens_computed": 1_650_000,
            "tokens_sampled": 18_432,
            "forwards": 19_211,
            "preemptions": 0,
            "busy_s": 412.5,
        },
    }
    if node.role == "main_decode":
        if node.kv_events is not None:
            item["kv_events"] = node.kv_events
        item["incoming_prefix_blocks"] = []
    return {
        "node": node.hostname,
        "datacenter": node.datacenter,
        "protocol": 1,
        "draining": False,
        "active_requests": 0,
        "instances": [item],
        "tokens_by_role": {
            "prefill": 18_432 if node.role == "prefill" else 0,
            "relay_decode": 0,
            "main_decode": 18_432 if node.role == "main_decode" else 0,
        },
        "late_kv_cached": 0,
        "kv_in_flight": {
            "incoming": 0,
            "reservations": 0,
            "prefix_hits": 0,
            "recomputed_imports": 0,
            "recomputed_tokens": 0,
        },
        "fabrics": {"wan": dict(ZERO_FABRIC), "intra_dc": dict(ZERO_FABRIC)},
        "links": {
            peer: {
                **link,
                "connections": {
                    "in_use": 0,
                    "waiting": 0,
                    "acquisitions": 0,
                    "background_acquisitions": 0,
                    "total_wait_s": 0.0,
                },
                "utilisation": 0.0,
            }
            for peer, link in node.links.items()
        },
        "threads": {
            "torch_threads": 8,
            "omp_wait_policy": "active",
            "source": "auto: 1 agent per host",
            "threads_source": "default: cores // agents_per_host",
            "cores": 64,
            "agents_per_host": 1,
            "set_before_torch": True,
            "environment": {"OMP_NUM_THREADS": "8", "OMP_WAIT_POLICY": "ACTIVE"},
        },
        "engine_options": ENGINE_OPTIONS,
        "control_plane": node.heartbeat_stats(),
    }


def kv_snapshot(node: ProbeNode, blocks: int) -> dict[str, Any]:
    """A KV events post carrying a snapshot of `blocks` cached blocks (one chain), as an agent
    sends after its engine started: "cleared", then the blocks stored, in batches of at most
    MAX_BLOCKS_PER_BATCH, each with the digest of the cache after it."""
    hashes = [((node.instance_id & 0xFFFFFFFF) << 32) | (k + 1) for k in range(blocks)]
    epoch = secrets.token_hex(6)
    batches, held, digest, parent = [], 0, 0, None
    for start in range(0, max(blocks, 1), MAX_BLOCKS_PER_BATCH):
        chunk = hashes[start : start + MAX_BLOCKS_PER_BATCH]
        events: list[dict[str, Any]] = [{"type": "cleared"}] if start == 0 else []
        if chunk:
            events.append(
                {
                    "type": "stored",
                    "parent": None if parent is None else f"{parent:016x}",
                    "blocks": [f"{h:016x}" for h in chunk],
                }
            )
            parent = chunk[-1]
        held += len(chunk)
        digest = reduce(xor, chunk, digest)
        batches.append(
            {
                "seq": len(batches) + 1,
                "events": events,
                "digest": {"blocks": held, "xor": f"{digest:016x}"},
            }
        )
    node.kv_events = {
        "epoch": epoch,
        "seq": len(batches),
        "acked": 0,
        "pending_batches": len(batches),
        "digest": {"blocks": held, "xor": f"{digest:016x}"},
        "resyncs": 0,
    }
    item = {"instance_id": str(node.instance_id), **node.kv_events, "batches": batches}
    return {"instances": [item]}


@dataclass
class Tally:
    """Heartbeats sent in a span (by send time) and how they were answered."""

    sent: int = 0
    ok: int = 0
    errors: Counter = field(default_factory=Counter)
    rtts: list[float] = field(default_factory=list)
    late: int = 0  # answered later than one interval
    in_flight: int = 0
    # (monotonic send time, round trip or None when unanswered) of the beats over the goal's
    # p99 or failed, the first SLOW_KEPT: to line stalls up with what else happened.
    slow: list[tuple[float, float | None]] = field(default_factory=list)

    def to_json(self, interval_s: float) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "answered_2xx": self.ok,
            "errors": dict(sorted(self.errors.items())),
            "error_total": sum(self.errors.values()),
            "rtt_p50_ms": ms(pct(self.rtts, 0.5)),
            "rtt_p99_ms": ms(pct(self.rtts, 0.99)),
            "rtt_max_ms": ms(max(self.rtts) if self.rtts else None),
            "rtt_mean_ms": ms(statistics.fmean(self.rtts) if self.rtts else None),
            f"answered_later_than_{interval_s:g}s": self.late,
        }


class Probe:
    """N agents in one event loop (the scenario in the module docstring)."""

    def __init__(
        self,
        base_url: str,
        nodes: list[ProbeNode],
        *,
        blocks: int,
        interval_s: float = INTERVAL_S,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        parts = urlsplit(base_url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.nodes = nodes
        self.blocks = blocks
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.total = Tally()
        self.window: Tally | None = None
        self.window_open = False
        self.served: Counter = Counter()  # requests the control plane sent to the agents
        self.registrations: Counter = Counter()  # "ok" and the failures, by kind
        self.kv_posts: Counter = Counter()
        self.registered = 0
        self.all_registered = asyncio.Event()
        self.started = 0.0
        self.registered_s: float | None = None
        self._servers: list[asyncio.Server] = []
        self._tasks: list[asyncio.Task] = []
        self._window_marks: dict[str, Any] = {}
        self._refusals_logged: set[tuple[str, int]] = set()
        self.loop_lags: list[float] = []
        self._peers: set[asyncio.StreamWriter] = set()  # the control plane's open connections

    # -- the agents' endpoints ------------------------------------------------------------

    async def listen(self) -> None:
        """Bind every node's endpoint (a free port on 127.0.0.1 each)."""
        for node in self.nodes:
            server = await asyncio.start_server(
                lambda r, w, node=node: self._serve(node, r, w), "127.0.0.1", 0
            )
            node.port = server.sockets[0].getsockname()[1]
            node.conn = Connection(self.host, self.port)
            self._servers.append(server)

    def answer(self, node: ProbeNode, method: str, path: str) -> dict[str, Any]:
        path = path.split("?", 1)[0]
        if method == "GET" and path == "/health":
            self.served["GET /health"] += 1
            return {
                "status": "ok",
                "node": node.hostname,
                "protocol": 1,
                "engine_options": ENGINE_OPTIONS,
            }
        if method == "GET":
            self.served["GET /state" if path == "/state" else "GET other"] += 1
            return state_document(node)
        self.served[f"{method} other"] += 1
        return {}

    async def _serve(
        self, node: ProbeNode, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._peers.add(writer)
        try:
            while True:
                line = await reader.readline()
                if not line.strip():
                    break
                method, path = (line.decode("latin-1").split() + ["", ""])[:2]
                length, close = 0, False
                while True:
                    header = await reader.readline()
                    if header in (b"\r\n", b"\n", b""):
                        break
                    name, _, value = header.partition(b":")
                    name = name.strip().lower()
                    if name == b"content-length":
                        length = int(value.strip())
                    elif name == b"connection":
                        close = value.strip().lower() == b"close"
                if length:
                    await reader.readexactly(length)
                body = json.dumps(self.answer(node, method, path)).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
                if close:
                    break
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            self._peers.discard(writer)
            writer.close()

    # -- the agents' side of the protocol ---------------------------------------------------

    async def _post(self, node: ProbeNode, path: str, body: bytes) -> tuple[int, bytes]:
        assert node.conn is not None
        async with asyncio.timeout(self.timeout_s):
            return await node.conn.request("POST", path, body, node.headers)

    async def register(self, node: ProbeNode) -> bool:
        doc = state_document(node) | {"endpoint": f"http://127.0.0.1:{node.port}"}
        try:
            status, data = await self._post(
                node, "/api/v1/agent/register", json.dumps(doc).encode()
            )
        except TimeoutError:
            self.registrations["timeout"] += 1
            return False
        except (OSError, HttpError, asyncio.IncompleteReadError) as exc:
            self.registrations[f"connection:{type(exc).__name__}"] += 1
            return False
        if status != 200:
            self.refusal("registration", status, data)
            self.registrations[f"http_{status}"] += 1
            return False
        answer = json.loads(data)
        node.links = {
            peer: {k: link[k] for k in ("bandwidth_gbps", "rtt_ms", "pool_size") if k in link}
            for peer, link in (answer.get("links") or {}).items()
        }
        node.registered = True
        self.registrations["ok"] += 1
        return True

    async def post_kv_snapshot(self, node: ProbeNode, body: dict[str, Any]) -> None:
        try:
            status, data = await self._post(
                node, "/api/v1/agent/kv-events", json.dumps(body).encode()
            )
        except TimeoutError:
            self.kv_posts["timeout"] += 1
            return
        except (OSError, HttpError, asyncio.IncompleteReadError) as exc:
            self.kv_posts[f"connection:{type(exc).__name__}"] += 1
            return
        if status != 200:
            self.refusal("KV events", status, data)
            self.kv_posts[f"http_{status}"] += 1
            return
        answer = (json.loads(data).get("instances") or {}).get(str(node.instance_id)) or {}
        assert node.kv_events is not None
        if "acked" in answer:
            node.kv_events["acked"] = int(answer["acked"])
            node.kv_events["pending_batches"] = node.kv_events["seq"] - int(answer["acked"])
        self.kv_posts["resync_asked" if answer.get("resync") else "ok"] += 1

    async def beat(self, node: ProbeNode) -> int | None:
        """One heartbeat; its HTTP status (None when unanswered)."""
        tallies = [self.total] + ([self.window] if self.window_open and self.window else [])
        for tally in tallies:
            tally.sent += 1
            tally.in_flight += 1
        outcome, rtt, status = "", None, None
        body = json.dumps(state_document(node)).encode()
        sent = time.monotonic()
        try:
            status, data = await self._post(node, "/api/v1/agent/heartbeat", body)
        except TimeoutError:
            outcome = "timeout"
            node.timeouts += 1
        except (OSError, HttpError, asyncio.IncompleteReadError) as exc:
            outcome = f"connection:{type(exc).__name__}"
            node.unreachable += 1
        else:
            rtt = time.monotonic() - sent
            if 200 <= status < 300:
                node.answered += 1
                node.rtts.append(rtt)
            else:
                self.refusal("heartbeat", status, data)
                outcome = f"http_{status}"
                node.refused += 1
                node.refused_by_status[status] += 1
        for tally in tallies:
            tally.in_flight -= 1
            if (outcome or (rtt or 0.0) > GOAL_P99_S) and len(tally.slow) < SLOW_KEPT:
                tally.slow.append((round(sent, 3), None if rtt is None else round(rtt, 4)))
            if outcome:
                tally.errors[outcome] += 1
            else:
                tally.ok += 1
                tally.rtts.append(rtt or 0.0)
            if rtt is not None and rtt > self.interval_s:
                tally.late += 1
        return status

    def refusal(self, what: str, status: int, body: bytes) -> None:
        """The first refusal of each kind and status, on stderr (the probe's log)."""
        if (what, status) not in self._refusals_logged:
            self._refusals_logged.add((what, status))
            print(f"{what} answered HTTP {status}: {body[:500]!r}", file=sys.stderr, flush=True)

    def _next_beat(self, due: float, now: float) -> float:
        due += self.interval_s
        return due if due > now else now + self.interval_s

    async def run_node(self, node: ProbeNode, offset_s: float) -> None:
        await asyncio.sleep(offset_s)
        due = time.monotonic()
        # A main decoder's engine runs before it registers: its KV event log holds the
        # snapshot, pending, and its reports say so (kv_events).
        snapshot = None
        if node.role == "main_decode" and self.blocks > 0:
            snapshot = kv_snapshot(node, self.blocks)
        while not await self.register(node):
            due = self._next_beat(due, time.monotonic())
            await asyncio.sleep(max(0.0, due - time.monotonic()))
        if snapshot is not None:
            await self.post_kv_snapshot(node, snapshot)
        self.registered += 1
        if self.registered == len(self.nodes):
            self.registered_s = time.monotonic() - self.started
            self.all_registered.set()
        while True:
            due = self._next_beat(due, time.monotonic())
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if await self.beat(node) in (401, 404):
                self.registrations["again"] += 1
                await self.register(node)

    async def watch_lag(self, every_s: float = 0.1) -> None:
        """How late the probe's own event loop wakes up (in the window): a busy probe would
        add this to the round trips it measures."""
        while True:
            start = time.monotonic()
            await asyncio.sleep(every_s)
            if self.window_open:
                self.loop_lags.append(time.monotonic() - start - every_s)

    async def start(self) -> None:
        """Bind every endpoint, then start every node at its offset in the first interval."""
        await self.listen()
        self.started = time.monotonic()
        n = len(self.nodes)
        self._tasks = [
            asyncio.create_task(self.run_node(node, self.interval_s * i / n))
            for i, node in enumerate(self.nodes)
        ]
        self._tasks.append(asyncio.create_task(self.watch_lag()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for node in self.nodes:
            if node.conn is not None:
                node.conn.close()
        for server in self._servers:
            server.close()
        # The control plane's connections still open: closed, so their handlers see the end
        # of input and return (rather than being cancelled when the loop ends).
        for writer in list(self._peers):
            writer.close()
        for _ in range(50):
            if not self._peers:
                break
            await asyncio.sleep(0.01)

    # -- the measured window ------------------------------------------------------------------

    def open_window(self) -> None:
        self.window, self.window_open = Tally(), True
        self.loop_lags = []
        self._window_marks = {
            "t": time.monotonic(),
            "cpu": time.process_time(),
            "served": Counter(self.served),
        }

    async def close_window(self) -> dict[str, Any]:
        """Stop counting new beats, wait for the window's beats still in flight (at most the
        client timeout), and return the window's figures."""
        assert self.window is not None
        self.window_open = False
        span = time.monotonic() - self._window_marks["t"]
        cpu = time.process_time() - self._window_marks["cpu"]
        served = Counter(self.served)
        served.subtract(self._window_marks["served"])
        deadline = time.monotonic() + self.timeout_s + 5
        while self.window.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return {
            "seconds": round(span, 2),
            "expected_beats": round(len(self.nodes) * span / self.interval_s),
            "heartbeats": self.window.to_json(self.interval_s),
            "still_in_flight": self.window.in_flight,
            "probe_cpu_cores_self": round(cpu / span, 3) if span else None,
            "probe_loop_lag_p99_ms": ms(pct(self.loop_lags, 0.99)),
            "probe_loop_lag_max_ms": ms(max(self.loop_lags, default=None)),
            "served_to_control_plane": dict(sorted(served.items())),
            "slow_beats": self.window.slow,
        }

    def bring_up(self) -> dict[str, Any]:
        return {
            "registered_s": None if self.registered_s is None else round(self.registered_s, 2),
            "registrations": dict(sorted(self.registrations.items())),
            "kv_snapshots": dict(sorted(self.kv_posts.items())),
        }

    def final(self) -> dict[str, Any]:
        return {
            "heartbeats_total": self.total.to_json(self.interval_s),
            "registrations": dict(sorted(self.registrations.items())),
            "served_to_control_plane": dict(sorted(self.served.items())),
            "connections_opened": sum(n.conn.opened for n in self.nodes if n.conn),
            "stale_connection_retries": sum(n.conn.stale_retries for n in self.nodes if n.conn),
            "cpu_s": round(time.process_time(), 2),
        }


def emit(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


async def probe_main(config_path: Path) -> None:
    """The probe process: starts the nodes of the config, then obeys one command per line on
    stdin (start, end, stop; end of input stops too), answering with JSON lines on stdout."""
    config = json.loads(config_path.read_text())
    nodes = [ProbeNode(**n) for n in config["nodes"]]
    probe = Probe(config["base_url"], nodes, blocks=config["blocks"])
    await probe.start()
    emit({"event": "listening", "nodes": len(nodes)})

    async def registered() -> None:
        await probe.all_registered.wait()
        emit({"event": "registered", **probe.bring_up()})

    watcher = asyncio.create_task(registered())
    loop = asyncio.get_running_loop()
    commands = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(commands), sys.stdin)
    try:
        while line := await commands.readline():
            command = line.decode().strip()
            if command == "start":
                probe.open_window()
                emit({"event": "started"})
            elif command == "end":
                emit({"event": "window", **await probe.close_window()})
            elif command == "stop":
                break
    finally:
        watcher.cancel()
        emit({"event": "final", **probe.final()})
        await probe.stop()


class ProbeProcess:
    """The probe as a child process in its own session; its JSON lines read by a thread."""

    def __init__(self, config_path: Path, log_path: Path) -> None:
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "bench.control_path", "--probe", str(config_path)],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
            )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.put(json.loads(line))
        self.events.put({"event": "exited"})

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def wait_event(self, name: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                event = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"the probe sent no {name!r} within {timeout_s:g} s") from None
            if event["event"] == name:
                return event
            if event["event"] == "exited":
                raise RuntimeError(f"the probe exited (rc {self.proc.wait()}) before {name!r}")

    def stop(self) -> dict[str, Any] | None:
        """Ask it to stop; its last figures (None if it sent none)."""
        try:
            self.send("stop")
            final = self.wait_event("final", 60)
            self.proc.wait(timeout=30)
        except (OSError, TimeoutError, RuntimeError, subprocess.TimeoutExpired):
            final = None
        self.kill()
        return final

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


# -- measuring processes and the machine (/proc) -----------------------------------------------


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds of every process in process group `pgid` so far (with their reaped
    children's), from /proc."""
    ticks = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            ticks += sum(int(fields[i]) for i in (11, 12, 13, 14))
    return ticks / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


# -- the control plane's side: database, Redis, Celery, REST -----------------------------------


def reset_database() -> None:
    """Drop (if there) and create baton_bench_control; never any other database."""
    drop_database()
    subprocess.run(
        ["createdb", "-h", "127.0.0.1", "-U", "postgres", DB_NAME], check=True, timeout=60
    )


def drop_database() -> None:
    subprocess.run(
        ["dropdb", "-h", "127.0.0.1", "-U", "postgres", "--if-exists", "--force", DB_NAME],
        check=True,
        timeout=60,
    )


def database_rows(table: str) -> int:
    import psycopg

    with psycopg.connect(f"{PG_SERVER}/{DB_NAME}") as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
    return int(row[0]) if row else 0


def redis_client():
    import redis

    return redis.Redis.from_url(REDIS_URL, socket_timeout=5)


class Rest:
    """The REST API with the operator token, on one keep-alive client."""

    def __init__(self, base_url: str, token: str) -> None:
        self.http = httpx.Client(
            base_url=base_url, headers={"Authorization": f"Token {token}"}, timeout=60
        )

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post(f"/api/v1/{path}/", json=body)
        if r.status_code >= 300:
            raise RuntimeError(f"POST /api/v1/{path}/ -> {r.status_code}: {r.text[:500]}")
        return r.json()

    def count(self, path: str, **params: Any) -> int:
        r = self.http.get(f"/api/v1/{path}/", params={**params, "page_size": 1})
        r.raise_for_status()
        return int(r.json()["count"])

    def all(self, path: str, **params: Any) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        page = 1
        while True:
            r = self.http.get(f"/api/v1/{path}/", params={**params, "page": page, "page_size": 500})
            r.raise_for_status()
            data = r.json()
            rows.extend(data["results"])
            if not data.get("next"):
                return rows
            page += 1

    def close(self) -> None:
        self.http.close()


def declare(rest: Rest, n: int, gpu_type: int) -> list[dict[str, Any]]:
    """The fleet of the scenario over REST; the probe's nodes (with their agent tokens)."""
    dcs = {
        name: rest.post("datacenters", {"name": name, "region": region, "rdma_domain": name})["id"]
        for name, region, _ in DATACENTERS
    }
    (a, _, _), (b, _, _) = DATACENTERS
    rest.post(
        "wan-links",
        {"from_datacenter": dcs[a], "to_datacenter": dcs[b], **LINK, "monthly_cost": "0"},
    )
    for name in dcs:
        rest.post(
            "unit-prices",
            {
                "gpu_type": gpu_type,
                "datacenter": dcs[name],
                "price_per_gpu_hour": "2.00",
                "currency": "USD",
                "effective_from": "2026-01-01T00:00:00Z",
            },
        )
    model = rest.post(
        "models",
        {
            "name": MODEL,
            "source": "baton-tiny",
            "num_layers": 4,
            "kv_bytes_per_token": 4096,
            "max_context_tokens": 32_768,
            "kv_block_size": BLOCK_SIZE,
        },
    )["id"]
    nodes = []
    for i in range(n):
        dc, _, role = DATACENTERS[0] if i < n // 2 else DATACENTERS[1]
        row = rest.post(
            "nodes",
            {
                "hostname": f"{dc}-{role.replace('_', '-')}-{i:04d}",
                "datacenter": dcs[dc],
                "gpu_type": gpu_type,
                "gpu_count": GPUS_PER_NODE,
            },
        )
        inst = rest.post(
            "instances",
            {"role": role, "node": row["id"], "served_model": model, "gpu_count": GPUS_PER_NODE},
        )
        nodes.append(
            {
                "hostname": row["hostname"],
                "token": row["agent_token"],
                "role": role,
                "datacenter": dc,
                "instance_id": inst["id"],
            }
        )
        if (i + 1) % 100 == 0 or i + 1 == n:
            say(f"declared {i + 1}/{n} nodes")
    return nodes


def operator_session(base_url: str, username: str, password: str) -> httpx.Client:
    """A browser's session: the login form, then its cookie on every page."""
    client = httpx.Client(base_url=base_url, timeout=60, follow_redirects=False)
    client.get("/login/").raise_for_status()
    r = client.post(
        "/login/",
        data={
            "username": username,
            "password": password,
            "csrfmiddlewaretoken": client.cookies.get("csrftoken", ""),
        },
        headers={"Referer": f"{base_url}/login/"},
    )
    if r.status_code != 302:
        raise RuntimeError(f"operator login failed: HTTP {r.status_code}")
    return client


def timed_get(client: httpx.Client, path: str, t0: float) -> dict[str, Any]:
    """One fetch: its duration, status and size, and when it started (s after `t0`)."""
    start = time.monotonic()
    at = round(start - t0, 2)
    try:
        r = client.get(path)
    except httpx.HTTPError as exc:
        return {"at": at, "s": round(time.monotonic() - start, 4), "error": type(exc).__name__}
    return {
        "at": at,
        "s": round(time.monotonic() - start, 4),
        "status": r.status_code,
        "bytes": len(r.content),
    }


def page_figures(fetches: list[dict[str, Any]]) -> dict[str, Any]:
    times = [f["s"] for f in fetches]
    return {
        "fetches": len(fetches),
        "all_200": all(f.get("status") == 200 for f in fetches),
        "median_ms": ms(statistics.median(times)) if times else None,
        "max_ms": ms(max(times)) if times else None,
        "each_ms": [ms(t) for t in times],
    }


# -- one N ---------------------------------------------------------------------------------------


def wait_online(rest: Rest, n: int, timeout_s: float) -> None:
    """Until GET /api/v1/nodes/?status=online counts `n`."""
    deadline = time.monotonic() + timeout_s
    online = rest.count("nodes", status="online")
    while online != n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{online} of {n} nodes online after {timeout_s:g} s")
        time.sleep(1.0)
        online = rest.count("nodes", status="online")


def measure_window(
    rest: Rest,
    session: httpx.Client,
    probe: ProbeProcess,
    pgids: dict[str, int],
    web_pid: int,
    seconds: float,
    queue_length,
) -> dict[str, Any]:
    """The measured window (the scenario in the module docstring)."""
    since = datetime.now(UTC)
    offline_before = rest.count("events", kind="node.offline")
    clients = {"node_list": rest.http, "fleet_page": session, "metrics": session}
    fetches: dict[str, list[dict[str, Any]]] = {name: [] for name in PAGES}
    samples: list[dict[str, Any]] = []
    cpu0 = {name: group_cpu_seconds(pgid) for name, pgid in pgids.items()}
    busy0 = machine_busy()
    probe.send("start")
    probe.wait_event("started", 60)
    t0 = time.monotonic()
    fetch_at = [t0 + (k + 0.5) * seconds / PAGE_FETCHES for k in range(PAGE_FETCHES)]
    next_sample = t0
    while True:
        now = time.monotonic()
        if now >= t0 + seconds and not fetch_at:
            break
        if now >= next_sample and now < t0 + seconds:
            samples.append(
                {
                    "t": round(now - t0, 1),
                    "offline": rest.count("nodes", status="offline"),
                    "celery_queue": queue_length(),
                }
            )
            next_sample += SAMPLE_EVERY_S
        if fetch_at and now >= fetch_at[0]:
            fetch_at.pop(0)
            for name, path in PAGES.items():
                fetches[name].append(timed_get(clients[name], path, t0))
        upcoming = [t0 + seconds, *fetch_at[:1]]
        if next_sample < t0 + seconds:
            upcoming.append(next_sample)
        time.sleep(max(0.0, min(min(upcoming) - time.monotonic(), 1.0)))
    span = time.monotonic() - t0
    cpu1 = {name: group_cpu_seconds(pgid) for name, pgid in pgids.items()}
    busy1 = machine_busy()
    rss = rss_mb(web_pid)
    probe.send("end")
    window = probe.wait_event("window", TIMEOUT_S + 60)
    offline_after = rest.count("events", kind="node.offline")
    offline_events = [
        e
        for e in rest.all("events", kind="node.offline")
        if datetime.fromisoformat(e["created_at"]) >= since
    ]
    busy = (busy1[0] - busy0[0]) / max(busy1[1] - busy0[1], 1)
    return {
        "seconds": round(span, 1),
        "heartbeats": window["heartbeats"],
        "expected_beats": window["expected_beats"],
        "still_in_flight_after_timeout": window["still_in_flight"],
        "served_to_control_plane": window["served_to_control_plane"],
        "cpu_cores": {name: round((cpu1[name] - cpu0[name]) / span, 3) for name in pgids},
        "probe_cpu_cores_self": window["probe_cpu_cores_self"],
        "probe_loop_lag_p99_ms": window["probe_loop_lag_p99_ms"],
        "probe_loop_lag_max_ms": window["probe_loop_lag_max_ms"],
        "machine_busy_fraction": round(busy, 3),
        "machine_busy_cores": round(busy * (os.cpu_count() or 1), 2),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "uvicorn_rss_mb": rss,
        "node_offline_events": offline_after - offline_before,
        "nodes_gone_offline": len({e.get("node") for e in offline_events}),
        "offline_max_sampled": max((s["offline"] for s in samples), default=0),
        "celery_queue_max": max(
            (s["celery_queue"] for s in samples if s["celery_queue"] is not None), default=None
        ),
        "samples": samples,
        "pages": {name: page_figures(fetches[name]) for name in PAGES},
        "page_fetches": fetches,
        # Beats over 100 ms or failed: [s after the window's start, round trip or null].
        "slow_beats": [[round(t - t0, 3), rtt] for t, rtt in window["slow_beats"]],
    }


def run_one(
    n: int,
    *,
    seconds: float,
    blocks: int,
    out: Path,
    production: bool = True,
    bring_up_timeout_s: float | None = None,
    gil_switch_ms: float | None = None,
) -> dict:
    """One N of the scenario; `production=False` (the tests) runs it on the embedded control
    plane instead (SQLite, no Redis, no Celery: the web process's own beat)."""
    bring_up_timeout_s = bring_up_timeout_s or 600.0 + n
    from bench.harness.control_plane import start_control_plane

    out.mkdir(parents=True, exist_ok=True)
    extra: dict[str, str] = {"BATON_RECONCILE_INTERVAL_S": str(RECONCILE_S)}
    if gil_switch_ms is not None:  # else the web process's default (controlplane/settings.py)
        extra["BATON_GIL_SWITCH_INTERVAL_MS"] = f"{gil_switch_ms:g}"
    if production:
        reset_database()
        redis_client().flushdb()
        extra |= {"DATABASE_URL": f"{PG_SERVER}/{DB_NAME}", "REDIS_URL": REDIS_URL}
    kind = "PostgreSQL, Redis, Celery" if production else "embedded"
    say(f"N={n}: starting the control plane ({kind})")
    cp = start_control_plane(out, extra)
    probe: ProbeProcess | None = None
    rest: Rest | None = None
    session: httpx.Client | None = None
    result: dict[str, Any] = {
        "nodes": n,
        "production": production,
        "blocks": blocks,
        "gil_switch_ms": gil_switch_ms,
    }
    try:
        web = cp.cluster.processes[0]
        pgids = {"uvicorn": web.pid}
        queue_length = lambda: None  # noqa: E731 - no broker on the embedded defaults
        if production:
            result["migrations_in_bench_database"] = database_rows("django_migrations")
            if not result["migrations_in_bench_database"]:
                raise RuntimeError(f"migrate did not run against {DB_NAME}")
            worker = start_celery(cp.cluster.env, cp.cluster.tmp, out / "worker.log")
            cp.cluster.processes.append(worker)
            pgids["celery"] = worker.pid
            broker = redis_client()
            queue_length = lambda: int(broker.llen(CELERY_QUEUE))  # noqa: E731
        password = secrets.token_urlsafe(16)
        cp.cluster.manage("baton_user", OPERATOR, "--role", "operator", f"--password={password}")
        rest = Rest(cp.url, cp.cluster.operator_token)
        t0 = time.monotonic()
        nodes = declare(rest, n, cp.gpu_types[GPU])
        result["declare_s"] = round(time.monotonic() - t0, 1)
        config = out / "probe-config.json"  # agent tokens: var/ only, the database is dropped
        config.write_text(json.dumps({"base_url": cp.url, "blocks": blocks, "nodes": nodes}))
        say(f"N={n}: declared in {result['declare_s']} s; starting the probe")
        t0 = time.monotonic()
        probe = ProbeProcess(config, out / "probe.log")
        pgids["probe"] = probe.proc.pid
        bring_up = probe.wait_event("registered", bring_up_timeout_s)
        wait_online(rest, n, bring_up_timeout_s)
        result["bring_up"] = {"online_s": round(time.monotonic() - t0, 1), **bring_up}
        result["bring_up"].pop("event", None)
        result["bring_up"]["node_offline_events"] = rest.count("events", kind="node.offline")
        say(f"N={n}: all online after {result['bring_up']['online_s']} s; window of {seconds:g} s")
        session = operator_session(cp.url, OPERATOR, password)
        result["window"] = measure_window(
            rest, session, probe, pgids, web.pid, seconds, queue_length
        )
        final = probe.stop() or {}
        final.pop("event", None)
        result["probe"] = final
        if production:
            result["nodes_in_bench_database"] = database_rows("fleet_node")
    finally:
        for client in (session, rest):
            if client is not None:
                client.close()
        if probe is not None:
            probe.kill()
        cp.stop()
        if production:
            drop_database()
            redis_client().flushdb()
    result["goals"] = goals(result)
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def goals(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals (module docstring) checked on one N's result."""
    window = result.get("window") or {}
    beats = window.get("heartbeats") or {}
    pages = window.get("pages") or {}
    p99 = beats.get("rtt_p99_ms")
    checks = {
        "heartbeat_p99_le_100ms": p99 is not None and p99 <= GOAL_P99_S * 1000,
        "zero_heartbeat_errors": beats.get("error_total") == 0
        and window.get("still_in_flight_after_timeout") == 0,
        "zero_nodes_falsely_offline": window.get("node_offline_events") == 0
        and window.get("offline_max_sampled") == 0,
        "pages_fast": bool(pages)
        and all(
            p["all_200"] and p["fetches"] == PAGE_FETCHES and p["max_ms"] <= GOAL_PAGE_S * 1000
            for p in pages.values()
        ),
    }
    return {**checks, "all_met": all(checks.values())}


def small_summary(results: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for r in results:
        w = r.get("window") or {}
        b = w.get("heartbeats") or {}
        rows.append(
            {
                "nodes": r["nodes"],
                "gil_switch_ms": r.get("gil_switch_ms"),
                "declare_s": r.get("declare_s"),
                "online_s": (r.get("bring_up") or {}).get("online_s"),
                "window_s": w.get("seconds"),
                "heartbeats_sent": b.get("sent"),
                "answered_2xx": b.get("answered_2xx"),
                "errors": b.get("errors"),
                "rtt_p50_ms": b.get("rtt_p50_ms"),
                "rtt_p99_ms": b.get("rtt_p99_ms"),
                "rtt_max_ms": b.get("rtt_max_ms"),
                "answered_later_than_2s": b.get(f"answered_later_than_{INTERVAL_S:g}s"),
                "node_offline_events": w.get("node_offline_events"),
                "cpu_cores": w.get("cpu_cores"),
                "probe_loop_lag_p99_ms": w.get("probe_loop_lag_p99_ms"),
                "machine_busy_cores": w.get("machine_busy_cores"),
                "uvicorn_rss_mb": w.get("uvicorn_rss_mb"),
                "celery_queue_max": w.get("celery_queue_max"),
                "pages_ms": {
                    k: {"median": p["median_ms"], "max": p["max_ms"], "all_200": p["all_200"]}
                    for k, p in (w.get("pages") or {}).items()
                },
                "goals": r.get("goals"),
            }
        )
    goal_row = next((r for r in results if r["nodes"] == GOAL_N), None)
    return {
        "command": "python -m bench.control_path "
        f"--nodes {','.join(str(r['nodes']) for r in results)} "
        f"--seconds {args.seconds:g} --blocks {args.blocks}"
        + ("" if args.gil_switch_ms is None else f" --gil-switch-ms {args.gil_switch_ms:g}"),
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "results": rows,
        "goals_at_1000": None if goal_row is None else goal_row["goals"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.control_path")
    parser.add_argument("--nodes", default="10,100,1000", help="comma-separated Ns")
    parser.add_argument("--seconds", type=float, default=120.0, help="the measured window")
    parser.add_argument("--blocks", type=int, default=1000, help="KV snapshot of each MD")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--summary", default=str(SUMMARY))
    parser.add_argument(
        "--gil-switch-ms",
        type=float,
        help="the web process's BATON_GIL_SWITCH_INTERVAL_MS (default: its own, 0.5; "
        "5 is CPython's, for an A/B)",
    )
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # the probe process's config
    args = parser.parse_args(argv)
    # run_one's cleanup then stops uvicorn, the Celery worker and the probe, and drops the
    # bench database, whatever stopped the run (left running, they served the next run's
    # database and Redis db and skewed its figures).
    stop_on_signals()
    if args.probe:
        asyncio.run(probe_main(Path(args.probe)))
        return 0
    try:
        ns = [int(x) for x in args.nodes.split(",") if x.strip()]
    except ValueError:
        ns = []
    bad_switch = args.gil_switch_ms is not None and not 0 <= args.gil_switch_ms <= 100
    if (
        not ns
        or min(ns) < 2
        or args.seconds <= 0
        or not 0 <= args.blocks <= MAX_BLOCKS
        or bad_switch
    ):
        print(
            f"--nodes: whole numbers >= 2; --seconds > 0; --blocks 0..{MAX_BLOCKS}; "
            "--gil-switch-ms 0..100",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    results = []
    for n in ns:
        result = run_one(
            n,
            seconds=args.seconds,
            blocks=args.blocks,
            out=out / f"n{n}",
            gil_switch_ms=args.gil_switch_ms,
        )
        say(f"N={n}: {json.dumps(small_summary([result], args)['results'][0])}")
        results.append(result)
    (out / "summary.json").write_text(json.dumps(results, indent=1) + "\n")
    summary = small_summary(results, args)
    Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
    Path(args.summary).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
