"""The gateway at 1 / 32 / 256 / 1,024 concurrent streams and with 64K-token prompts, side by side
with the agents called directly, in one run; then 1, 2 and 4 gateway processes (issue 40,
"Benchmarks"). Report: bench/gateway/SCALE.md; small summary: bench/gateway/scale_summary.json.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m bench.gateway_scale [--quick]

Raw output (every phase's figures, the processes' logs) goes to var/bench-gateway-scale/.

Scenario (fixed before the first run, by the rule "the production control path, a fleet whose
agents cost little CPU per token, unique prompts, the same closed-loop load on both arms,
interleaved"; never retuned after seeing results):

- Control plane, production path: PostgreSQL database ``baton_bench_gwscale`` on 127.0.0.1
  (dropped if there, created with ``createdb``, dropped at the end; no other database is
  touched) and Redis db 10 (flushed before and after); migrate and an operator by
  ``bench.pdd.fleet.start_control_plane``; the web process replaced by uvicorn with the options
  of docker/Dockerfile (``--timeout-keep-alive 5 --h11-max-incomplete-event-size 16384
  --limit-concurrency 8192``) and ``--workers G`` (G = 1: one process; G > 1: uvicorn's
  supervisor and G workers sharing one listening socket); one Celery worker with beat in it
  (``bench.harness.celery_worker.start_worker_with_beat``: health checks, probes,
  reconciles). Every other setting at its default: record writer, journal, stream
  coalescing (``BATON_GATEWAY_COALESCE_FROM`` 64, ``BATON_GATEWAY_STREAM_INTERVAL_S`` 0.02),
  direct streams (one hop per token).
- Fleet, declared over REST: datacenters ``gws-a`` (one prefill node of 8 GPUs of the
  control plane's ``gpu-a``) and ``gws-b`` (two main-decode nodes of 1 ``gpu-b`` each), a WAN
  link of 100 Gbit/s, 1 ms, 64 connections; no relay-decode instance and the policy's
  ``wan_time_threshold_s`` 1e9 and ``relay_when_main_saturated`` false, so every request is
  P-MD. Served model ``gws-small``: an emulated engine (docs/emulation.md) of the profile
  ``PROFILE`` below (a small dense model: 1 B active parameters, 128 bytes of KV per token, a
  decode step of ~10.3 ms, i.e. ~97 tokens/s per stream at any batch up to 2,048, and a
  64K-token prefill of ~0.14 s on the 8-GPU prefill unit), written to the run's folder and
  named ``profile:<path>``. Agents: ``--kv-scale 16 --max-queued 4096`` (the engine's decode
  batch is the profile's 2,048, so 1,024 streams fit on one MD and never queue), speedup 1,
  one thread, ``--log-level ERROR``, heartbeats every 2 s.
- Requests: ``/v1/completions``, streamed, ``temperature`` 0, ``max_tokens`` 64, a prompt of
  exactly 1,024 tokens (the byte tokenizer: 1,024 ASCII bytes) that is unique from its first
  block (``<phase><arm><client><n>|`` then a fixed filler), so no request hits another's
  prefix cache; the long-prompt arm: the same with 65,536 tokens.
- The direct arm sends P's ``POST /v1/pdd/generate`` the body the gateway builds
  (``routing.gateway.runner.build_plan``: the same prompt ids, sampling, ``pipeline`` p-md,
  ``main``, ``direct``, ``early_first_token`` as the policy says), P and MD taken round robin
  (the gateway's policy chooses by load), reads P's NDJSON stream up to its ``continue`` and
  then the MD stream that event names, as the gateway does.
- Load: a closed loop. C clients (C = 1, 32, 256, 1,024), each on its own keep-alive HTTP/1.1
  connection(s) (raw asyncio streams, no HTTP library), sending its next request as soon as
  the previous one ends. One load-generator process per 256 clients (1, 1, 1, 4), all started
  at the same instant. A phase: warm-up until every client has finished one request and at
  least 5 s have passed (at most 300 s: the window then opens anyway, marked not warm), then a
  20-s measured window, then the clients stop and their open requests finish (at most 120 s).
  Per level four phases, interleaved: gateway, direct, gateway, direct; after them 4 prompts
  are sent through both arms one by one and their answers compared.
- Order: G = 1 with every level (1, 32, 256, 1,024) and the long-prompt arm (1 and 32
  streams); then G = 2 and G = 4, and G = 1 once more, each at the highest level at which
  G = 1's gateway phases had no error (the fleet and the database stay; only the web
  processes restart).
- Measured per phase (window only): requests/s (answers that ended in it), streamed tokens/s
  (tokens whose chunk arrived in it), per request started in it: latency (send to ``[DONE]`` /
  ``done``), time to first token, inter-chunk gap (between consecutive HTTP chunks carrying
  tokens), time per output token; errors by kind; CPU (/proc) of the gateway's process group
  (each worker too), the Celery worker's, each agent's and each load generator's, and the
  machine's; the gateway's Server-Timing stages; each emulated engine's ``behind_s``.
  Gateway CPU per request = (its CPU over a gateway window - its CPU rate over the direct
  windows x that window) / the requests that ended in it; per token alike; with the long
  prompts, minus the ``tokenize`` stage (the byte tokenizer; "tokenizer aside").
- Correct: every answer's tokens equal the emulated engine's greedy tokens for its prompt
  (``agents.engine.emulated``: a pure function of the context), and the cross-arm answers
  equal; every request sent through the gateway (its ``X-Request-Id``) has exactly one
  RequestRecord row, counted in the database after each level.

Goals (issue 40, judged on G = 1 unless said): overhead (median latency, gateway - direct)
<= 2 ms at 1 stream and <= 10 ms at 32 streams; >= 20K streamed tokens/s per gateway process
with <= 20 ms p99 added inter-chunk delay (gateway p99 gap - direct p99 gap), at the level of
G = 1's highest gateway throughput; control plane CPU <= 3 ms per 64K-token request, tokenizer
aside (1 stream; 32 shown too); 4 gateway processes >= 3.5x one's tokens/s; tokens exact and
records exactly once at every level. The load generator is named as the limit when one of its
processes used >= 90% of a core over a window.

``--quick``: a smoke run of the same code (1 and 32 streams, long prompts at 1 stream, G = 1,
warm-ups of at least 1 s and 4-s windows): its figures are not the benchmark's.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import queue
import re
import resource
import secrets
import select
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from array import array
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.harness.output import pct
from pdd.vocab import Pipeline

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "var" / "bench-gateway-scale"
SUMMARY = ROOT / "bench" / "gateway" / "scale_summary.json"

DB_NAME = "baton_bench_gwscale"
PG_SERVER = "postgresql://postgres@127.0.0.1:5432"
REDIS_URL = "redis://127.0.0.1:6379/10"
MODEL = "gws-small"
# A small dense model on the emulated engine (pdd/profiles.py's JSON form).
PROFILE: dict[str, Any] = {
    "name": "gws-small",
    "model": {
        "name": "small-dense-1b",
        "active_params_b": 1.0,
        "attn_flops_per_token_ctx": 131_072,
        "kv_bytes_per_token": 128,
        "decode_weight_gb": 1.0,
    },
    "engine": {
        "prefill_efficiency": 0.4,
        "prefill_overhead_s": 0.002,
        "prefill_batch_tokens": 16_384,
        "decode_mem_efficiency": 0.5,
        "decode_overhead_s": 0.010,
        "max_decode_batch": 2048,
        "prefill_half_tokens": 512,
        "prefill_order": "fifo",
    },
    "resident_weight_gb": 2.0,
    "max_position": 131_072,
}
DATACENTERS = (("gws-a", "city-a"), ("gws-b", "city-b"))
LINK = {"bandwidth_gbps": 100, "rtt_ms": 1, "connection_pool_size": 64}
P_GPUS, MD_GPUS = 8, 1
KV_SCALE = 16
POLICY = {"wan_time_threshold_s": 1e9, "relay_when_main_saturated": False}
UVICORN_OPTIONS = (
    "--timeout-keep-alive", "5", "--h11-max-incomplete-event-size", "16384",
    "--limit-concurrency", "8192",
)  # fmt: skip
BASE_PORT = 23500
STREAMS_PER_LOADGEN = 256
CROSS_CHECKS = 4
GOALS = {
    "overhead_1_stream_ms": 2.0,
    "overhead_32_streams_p50_ms": 10.0,
    "tokens_per_s_per_gateway_process": 20_000,
    "added_chunk_gap_p99_ms": 20.0,
    "control_plane_cpu_ms_per_64k_request": 3.0,
    "scale_4_over_1": 3.5,
    "loadgen_core_limit": 0.9,
}
# Printable ASCII without '"' and '\\', so a prompt goes into a JSON string as it is.
FILLER = b"the quick brown fox jumps over the lazy dog 0123456789; "
HEAD_LEN = 18  # b"%04d%s%05d%07d|": phase, arm, client, request


@dataclass
class Config:
    levels: tuple[int, ...] = (1, 32, 256, 1024)
    long_levels: tuple[int, ...] = (1, 32)
    gateways: tuple[int, ...] = (1, 2, 4)
    prompt_tokens: int = 1024
    long_prompt_tokens: int = 65_536
    max_tokens: int = 64
    warmup_s: float = 5.0
    measure_s: float = 20.0
    drain_s: float = 120.0
    warm_max_s: float = 300.0  # the window opens then even if some client has no answer yet
    n_prefill: int = 1
    n_main: int = 2
    production: bool = True  # PostgreSQL + Redis + Celery; False: embedded SQLite (tests)
    # The agents' API (registration, heartbeats, KV events) on a web process of its own, apart
    # from the gateway's (--agent-api-process: partial reruns only; not the fixed scenario).
    agent_api_process: bool = False
    cross_checks: int = CROSS_CHECKS
    out: Path = OUT
    label: str = "full"


def quick_config(out: Path = OUT) -> Config:
    return Config(
        levels=(1, 32), long_levels=(1,), gateways=(1,), warmup_s=1.0, measure_s=4.0,
        drain_s=60.0, out=out, label="quick",
    )  # fmt: skip


def say(message: str) -> None:
    print(f"[gateway-scale] {message}", file=sys.stderr, flush=True)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# -- prompts and the tokens an emulated engine answers them with -------------------------------


def filler(length: int) -> bytes:
    return (FILLER * (length // len(FILLER) + 1))[:length]


def prompt_head(phase: int, arm: str, client: int, n: int) -> bytes:
    head = b"%04d%s%05d%07d|" % (phase % 10_000, arm.encode(), client % 100_000, n % 10_000_000)
    assert len(head) == HEAD_LEN
    return head


def expected_tokens(prompt_ids: list[int] | bytes, n: int) -> list[int]:
    """The emulated engine's greedy answer: each token a function of the whole context so far
    (agents.engine.emulated.context_token), computed incrementally."""
    from agents.engine.emulated import FIRST_TOKEN, NUM_TOKENS

    h = hashlib.blake2b(digest_size=8)
    # array("I", <bytes>) would read the bytes as machine words: pass the ids as a list.
    h.update(array("I", list(prompt_ids)).tobytes())
    out: list[int] = []
    for _ in range(n):
        token = FIRST_TOKEN + int.from_bytes(h.digest()[:8], "little") % NUM_TOKENS
        out.append(token)
        h.update(array("I", [token]).tobytes())
    return out


# -- a streaming HTTP/1.1 client on raw asyncio streams ----------------------------------------


class Closed(ConnectionError):
    """The peer closed the connection before the first byte of an answer."""


class StreamConn:
    """One keep-alive HTTP/1.1 connection. ``post`` sends a request and hands each chunk of a
    chunked answer (one server write) to ``on_chunk(data, arrival time)`` as it is read; a
    request on a reused connection the server closed meanwhile is sent once more on a fresh
    one."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def post(self, path: str, body: bytes, headers: bytes, on_chunk) -> tuple[int, dict]:
        head = (
            b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n%s\r\n"
            % (path.encode(), self.host.encode(), self.port, len(body), headers)
        )
        for _ in range(2):
            reused = self.writer is not None
            if self.reader is None or self.writer is None or self.reader.at_eof():
                self.close()
                self.reader, self.writer = await asyncio.open_connection(
                    self.host, self.port, limit=1 << 22
                )
                sock = self.writer.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                reused = False
            try:
                self.writer.write(head + body)
                line = await self.reader.readline()
                if not line:
                    raise Closed("closed before an answer")
                return await self._answer(line, on_chunk)
            except Closed:
                self.close()
                if not reused:
                    raise
            except BaseException:
                self.close()
                raise
        raise Closed("closed before an answer, twice")

    async def _answer(self, line: bytes, on_chunk) -> tuple[int, dict]:
        reader = self.reader
        assert reader is not None
        parts = line.split(None, 2)
        status = int(parts[1])
        headers: dict[str, str] = {}
        while True:
            raw = await reader.readline()
            if raw in (b"\r\n", b"\n"):
                break
            if not raw:
                raise ConnectionResetError("closed in the answer's headers")
            name, _, value = raw.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", ""):
            while True:
                size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                data = await reader.readexactly(size + 2)
                on_chunk(data[:-2], time.monotonic())
        else:
            length = int(headers.get("content-length", "0") or 0)
            if length:
                on_chunk(await reader.readexactly(length), time.monotonic())
        if headers.get("connection", "").lower() == "close":
            self.close()
        return status, headers


# -- the load generator (its own processes) ----------------------------------------------------

TEXT_RE = re.compile(rb'"text":"((?:[^"\\]|\\.)*)"')
TOKEN_ID_RE = re.compile(rb'"token_id":(\d+)')


@dataclass
class Rec:
    """One request as the client saw it."""

    arm: str
    key: str
    prompt: bytes
    t_send: float
    t_head: float | None = None
    t_first: float | None = None
    t_end: float | None = None
    error: str = ""
    chunks_t: list[float] = field(default_factory=list)
    chunks_raw: list[Any] = field(default_factory=list)  # escaped text (gateway) / ids (direct)
    timing: dict[str, float] = field(default_factory=dict)
    follow: dict | None = None

    def fail(self, kind: str) -> None:
        if not self.error:
            self.error = kind[:160]


def _server_timing(header: str) -> dict[str, float]:
    stages = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        if name and dur:
            try:
                stages[name] = float(dur)
            except ValueError:
                pass
    return stages


def _error_kind(status: int, body: bytes) -> str:
    code = ""
    try:
        doc = json.loads(body or b"{}")
        err = doc.get("error") if isinstance(doc, dict) else None
        code = (err.get("code") or err.get("type") or "") if isinstance(err, dict) else ""
        code = code or (doc.get("code") or "" if isinstance(doc, dict) else "")
    except ValueError:
        pass
    return f"http {status}" + (f" {code}" if code else "")


class Load:
    """One load-generator process's share of a phase."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.recs: list[Rec] = []
        self.length = spec["prompt_tokens"]
        self.tail = filler(self.length)[HEAD_LEN:]
        self.tail_ids = b",".join(b"%d" % b for b in self.tail)
        self.max_tokens = spec["max_tokens"]

    # gateway arm
    async def gateway(self, conns: dict, key: str, prompt: bytes) -> Rec:
        s = self.spec
        rec = Rec("gateway", key, prompt, time.monotonic())
        body = b'{"model":"%s","prompt":"%s","max_tokens":%d,"temperature":0,"stream":true}' % (
            s["model"].encode(), prompt, self.max_tokens,
        )  # fmt: skip
        headers = b"Authorization: Bearer %s\r\nX-Request-Id: %s\r\n" % (
            s["api_key"].encode(), key.encode(),
        )  # fmt: skip
        errors: list[bytes] = []

        def on_chunk(data: bytes, now: float) -> None:
            if rec.t_head is None:
                rec.t_head = now
            texts = [t for t in TEXT_RE.findall(data) if t]
            if texts:
                if rec.t_first is None:
                    rec.t_first = now
                rec.chunks_t.append(now)
                rec.chunks_raw.append(b"".join(texts))
            if b"data: [DONE]" in data:
                rec.t_end = now
            elif b'"error"' in data:
                errors.append(data)

        conn = conns.get("gw")
        if conn is None:
            conn = conns["gw"] = StreamConn(s["gateway_host"], s["gateway_port"])
        status, head = await conn.post("/v1/completions", body, headers, on_chunk)
        rec.timing = _server_timing(head.get("server-timing", ""))
        if status != 200:
            rec.t_end = None
            raw = b"".join(errors) or (rec.chunks_raw[0] if rec.chunks_raw else b"")
            rec.fail(_error_kind(status, raw))
            rec.chunks_t.clear()
            rec.chunks_raw.clear()
        elif errors:
            rec.fail("stream error: " + errors[0][:120].decode(errors="replace"))
        elif rec.t_end is None:
            rec.fail("ended without [DONE]")
        return rec

    # direct arm
    async def direct(self, conns: dict, key: str, prompt: bytes, n: int) -> Rec:
        s = self.spec
        rec = Rec("direct", key, prompt, time.monotonic())
        mains = s["mains"]
        prefills = s["prefills"]
        main = mains[n % len(mains)]
        pre = prefills[n % len(prefills)]
        early = b',"early_first_token":true' if s["early_first_token"] else b""
        head_ids = b",".join(b"%d" % b for b in prompt[:HEAD_LEN])
        tail_ids = self.tail_ids if prompt[HEAD_LEN:] == self.tail else (
            b",".join(b"%d" % b for b in prompt[HEAD_LEN:])
        )  # fmt: skip
        body = (
            b'{"request_id":"direct-%s","instance":"%s","prompt_ids":[%s,%s],'
            b'"sampling":{"max_tokens":%d,"temperature":0.0,"top_p":1.0,"seed":null},'
            b'"pipeline":"%s","main":%s,"direct":true%s}'
            % (key.encode(), pre["instance"].encode(), head_ids, tail_ids, self.max_tokens,
               Pipeline.P_MD.encode(), json.dumps(main, separators=(",", ":")).encode(), early)
        )  # fmt: skip
        headers = s["data_headers"].encode()
        pending = bytearray()
        failed: list[bytes] = []

        def on_chunk(data: bytes, now: float) -> None:
            if rec.t_head is None:
                rec.t_head = now
            pending.extend(data)
            if b"\n" not in data:
                return
            lines = bytes(pending).split(b"\n")
            pending[:] = lines.pop()
            ids: list[int] = []
            for line in lines:
                # The event's own type is its first key (a continue event carries a token event
                # inside its body).
                if line.startswith(b'{"type":"token"'):
                    found = TOKEN_ID_RE.search(line)
                    if found:
                        ids.append(int(found.group(1)))
                elif line.startswith(b'{"type":"continue"'):
                    rec.follow = json.loads(line)
                elif line.startswith(b'{"type":"done"'):
                    rec.t_end = now
                elif line.startswith(b'{"type":"error"'):
                    failed.append(line)
            if ids:
                if rec.t_first is None:
                    rec.t_first = now
                rec.chunks_t.append(now)
                rec.chunks_raw.append(ids)

        url = urlsplit(pre["http"])
        conn = conns.get(url.netloc)
        if conn is None:
            conn = conns[url.netloc] = StreamConn(url.hostname or "127.0.0.1", url.port or 80)
        status, _ = await conn.post("/v1/pdd/generate", body, headers, on_chunk)
        if status == 200 and rec.follow is not None and not failed:
            follow = rec.follow
            target = urlsplit(follow["url"])
            conn = conns.get(target.netloc)
            if conn is None:
                conn = conns[target.netloc] = StreamConn(target.hostname or "", target.port or 80)
            pending.clear()
            # P leaves the prompt out of the decoder's call (agents/PROTOCOL.md): put it back,
            # as the gateway does.
            rest = json.dumps(
                {k: v for k, v in follow["body"].items() if k != "prompt_ids"},
                separators=(",", ":"),
            ).encode()
            next_body = b'{"prompt_ids":[%s,%s],%s' % (head_ids, tail_ids, rest[1:])
            status, _ = await conn.post(target.path, next_body, headers, on_chunk)
        if status != 200:
            rec.fail(_error_kind(status, bytes(pending)))
            rec.t_end = None
        elif failed:
            rec.fail("stream error: " + failed[0][:120].decode(errors="replace"))
        elif rec.t_end is None:
            rec.fail("ended without done" if rec.follow else "P ended without continue")
        rec.follow = None
        return rec

    async def one(self, conns: dict, arm: str, client: int, n: int) -> Rec:
        s = self.spec
        # A cross-check's two phases ask the same prompts (its phase number and arm letter).
        phase = s.get("prompt_phase") or s["phase"]
        head = prompt_head(phase, s.get("prompt_arm") or arm[0], client, n)
        prompt = head + self.tail
        key = f"{s['key_prefix']}{client:05d}-{n:07d}"
        try:
            if arm == "gateway":
                return await self.gateway(conns, key, prompt)
            return await self.direct(conns, key, prompt, client + n)
        except (ConnectionError, OSError, asyncio.IncompleteReadError) as exc:
            for conn in conns.values():
                conn.close()
            conns.clear()
            rec = Rec(arm, key, prompt, time.monotonic())
            rec.fail(f"connection: {type(exc).__name__}")
            return rec

    async def run(self, stops: queue.Queue) -> dict:
        """The clients until the orchestrator's stop (``stops``) or, for a fixed number of
        requests, until each has sent them. Says ``warm`` on stdout once every client has
        finished a request and the warm-up time has passed."""
        s = self.spec
        fixed = s["requests"]
        started = time.monotonic()
        stop = asyncio.Event()
        finished_one: set[int] = set()
        warm_sent = False

        def warm() -> None:
            nonlocal warm_sent
            if warm_sent or fixed is not None or len(finished_one) < len(s["clients"]):
                return
            warm_sent = True
            emit({"warm": time.monotonic()})

        async def client(c: int) -> None:
            conns: dict[str, StreamConn] = {}
            n = 0
            try:
                while not stop.is_set() and (fixed is None or n < fixed):
                    self.recs.append(await self.one(conns, s["arm"], c, n))
                    n += 1
                    if n == 1:
                        finished_one.add(c)
                        warm()
            finally:
                for conn in conns.values():
                    conn.close()

        async def warm_up() -> None:
            await asyncio.sleep(max(0.0, started + s["warmup_s"] - time.monotonic()))
            warm()

        async def stopper() -> None:
            await asyncio.get_running_loop().run_in_executor(None, stops.get)
            stop.set()

        tasks = [asyncio.ensure_future(client(c)) for c in s["clients"]]
        helpers = [asyncio.ensure_future(warm_up())]
        if fixed is None:
            helpers.append(asyncio.ensure_future(stopper()))
            await stop.wait()
        done, pending = await asyncio.wait(tasks, timeout=s["drain_s"])
        for task in [*pending, *helpers]:
            task.cancel()
        await asyncio.gather(*pending, *helpers, return_exceptions=True)
        for task in done:
            if task.exception() is not None:
                say(f"a client failed: {task.exception()!r}")
        return {"unfinished": len(pending)}


def finish_recs(recs: list[Rec], max_tokens: int) -> list[dict]:
    """Each request's figures, its tokens checked against the emulated engine's (after the
    window, so the check costs the load generator nothing while it measures)."""
    out = []
    for rec in recs:
        tokens: list[int] | None = None
        counts: list[int] = []
        if rec.arm == "gateway":
            text = ""
            for raw in rec.chunks_raw:
                piece = json.loads(b'"' + raw + b'"')
                counts.append(len(piece))
                text += piece
            tokens = list(text.encode("latin-1", errors="replace"))
        else:
            tokens = []
            for ids in rec.chunks_raw:
                counts.append(len(ids))
                tokens += ids
        exact = None
        if not rec.error:
            exact = tokens == expected_tokens(rec.prompt, max_tokens)
        out.append(
            {
                "arm": rec.arm, "key": rec.key, "error": rec.error, "t_send": rec.t_send,
                "t_head": rec.t_head, "t_first": rec.t_first, "t_end": rec.t_end,
                "tokens": len(tokens), "exact": exact, "chunks_t": rec.chunks_t,
                "chunks_n": counts, "timing": rec.timing,
                "answer": bytes(tokens).decode("latin-1") if rec.key.startswith("x") else None,
            }
        )  # fmt: skip
    return out


def emit(doc: dict) -> None:
    print(json.dumps(doc), flush=True)


def loadgen_main() -> int:
    """The load generator process. Reads JSON lines on stdin: a phase's spec, then (unless the
    phase is a fixed number of requests) a stop; answers on stdout: ``warm`` when the phase's
    clients are warm, ``done`` with the file holding its results."""
    raise_fd_limit()
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            lines.put(json.loads(line))
        lines.put({"exit": True})

    threading.Thread(target=read, daemon=True).start()
    while True:
        spec = lines.get()
        if spec.get("exit"):
            return 0
        if "arm" not in spec:
            continue  # a stop for a phase that already ended
        load = Load(spec)
        summary = asyncio.run(load.run(lines))
        summary["recs"] = finish_recs(load.recs, spec["max_tokens"])
        Path(spec["out"]).write_text(json.dumps(summary))
        emit({"done": spec["out"]})


class LoadGen:
    """A load-generator process of this module (``--loadgen``)."""

    def __init__(self, index: int, log_path: Path) -> None:
        self.index = index
        self.log = open(log_path, "w")  # noqa: SIM115 - held for the process's life
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.gateway_scale", "--loadgen"],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, bufsize=0,
        )  # fmt: skip
        self.buffer = b""

    def send(self, doc: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(doc).encode() + b"\n")

    def read(self, kind: str, timeout_s: float) -> dict | None:
        """The next line of ``kind`` (``warm`` or ``done``; other lines are skipped), None if
        none came within ``timeout_s``."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                doc = json.loads(line)
                if kind in doc:
                    return doc
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                data = os.read(self.proc.stdout.fileno(), 1 << 16)
                if not data:
                    raise RuntimeError(f"load generator {self.index} exited ({self.proc.poll()})")
                self.buffer += data

    def results(self, timeout_s: float) -> dict:
        doc = self.read("done", timeout_s)
        if doc is None:
            raise TimeoutError(f"load generator {self.index} gave no results in {timeout_s} s")
        return json.loads(Path(doc["done"]).read_text())

    def stop(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


# -- processes and the machine (/proc) ---------------------------------------------------------


def proc_cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def group_members(pgid: int) -> dict[int, float]:
    """pid -> CPU seconds (with reaped children's) of each process in group ``pgid``."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            out[int(entry.name)] = sum(int(fields[i]) for i in (11, 12, 13, 14)) / os.sysconf(
                "SC_CLK_TCK"
            )
    return out


class Meter:
    """CPU seconds of the named process groups and pids, and the machine's busy jiffies."""

    def __init__(self, groups: dict[str, int], pids: dict[str, int]) -> None:
        self.groups, self.pids = groups, pids

    def sample(self) -> dict[str, Any]:
        from bench.harness.host import machine_busy

        members = {name: group_members(pgid) for name, pgid in self.groups.items()}
        return {
            "t": time.monotonic(),
            "groups": {name: sum(m.values()) for name, m in members.items()},
            "members": {name: m for name, m in members.items()},
            "pids": {name: proc_cpu_s(pid) for name, pid in self.pids.items()},
            "machine": machine_busy(),
        }


def cpu_delta(a: dict, b: dict) -> dict[str, Any]:
    span = b["t"] - a["t"]
    cores = {name: round((b["groups"][name] - a["groups"][name]) / span, 3) for name in b["groups"]}
    gw_workers = {
        str(pid): round((cpu - a["members"]["gateway"].get(pid, 0.0)) / span, 3)
        for pid, cpu in b["members"].get("gateway", {}).items()
    }
    loadgen = {
        name: round((b["pids"][name] - a["pids"].get(name, 0.0)) / span, 3) for name in b["pids"]
    }
    busy = (b["machine"][0] - a["machine"][0]) / max(1, b["machine"][1] - a["machine"][1])
    return {
        "span_s": round(span, 3),
        "cores": cores,
        "gateway_processes_cores": gw_workers,
        "loadgen_cores": loadgen,
        "machine_busy": round(busy, 3),
        "gateway_cpu_s": b["groups"].get("gateway", 0.0) - a["groups"].get("gateway", 0.0),
    }


# -- the control plane and the fleet -----------------------------------------------------------


def reset_database() -> None:
    """Drop (if there) and create baton_bench_gwscale; never any other database."""
    drop_database()
    subprocess.run(
        ["createdb", "-h", "127.0.0.1", "-U", "postgres", DB_NAME], check=True, timeout=60
    )


def drop_database() -> None:
    subprocess.run(
        ["dropdb", "-h", "127.0.0.1", "-U", "postgres", "--if-exists", "--force", DB_NAME],
        check=True, timeout=60,
    )  # fmt: skip


def flush_redis() -> None:
    import redis

    # A db a 1,024-stream run filled takes longer than a few seconds to flush.
    redis.Redis.from_url(REDIS_URL, socket_timeout=120).flushdb()


class Plane:
    """The control plane (start_control_plane's, its web process replaced by ``--workers G``),
    the Celery worker (production), the fleet's agents."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.cp = None
        self.web: subprocess.Popen | None = None
        self.workers = 0
        self.celery: subprocess.Popen | None = None
        self.agents: dict = {}
        self.nodes: list[dict] = []
        self.api_key = ""
        self.port = 0
        self.agent_api_url = ""  # the agents' own web process, when the config has one

    def start(self) -> None:
        from bench.harness.celery_worker import start_worker_with_beat as start_celery
        from bench.harness.control_plane import start_control_plane

        out = self.config.out
        extra: dict[str, str] = {}
        if self.config.production:
            reset_database()
            flush_redis()
            extra = {"DATABASE_URL": f"{PG_SERVER}/{DB_NAME}", "REDIS_URL": REDIS_URL}
        self.cp = start_control_plane(out, extra)
        cluster = self.cp.cluster
        self.port = int(cluster.url.rsplit(":", 1)[1])
        self.web = cluster.processes[0]
        if self.config.production:
            self.celery = start_celery(cluster.env, cluster.tmp, out / "celery.log")
            cluster.processes.append(self.celery)
        if self.config.agent_api_process:
            self.start_agent_api()

    def start_agent_api(self) -> None:
        """One more web process, on a port of its own, that only the agents call: their
        heartbeats no longer wait for the event loop that streams the tokens. It shares the
        database and Redis (the live view) with the gateway's processes."""
        from bench.harness.host import port_in_use
        from bench.harness.testbed import service_up

        if not self.config.production:
            # Without Redis each web process keeps the agents' reports to itself: the gateway
            # would never see the reports the agents' own process took.
            raise ValueError("an agents' web process of its own needs Redis (the production path)")
        cluster = self.cp.cluster
        port = next(p for p in range(self.port + 50, self.port + 500) if not port_in_use(
            "127.0.0.1", p))  # fmt: skip
        with open(self.config.out / "web-agent-api.log", "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "controlplane.asgi:application",
                 "--host", "127.0.0.1", "--port", str(port), *UVICORN_OPTIONS],
                cwd=ROOT, env=cluster.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        cluster.processes.append(proc)
        self.agent_api_url = f"http://127.0.0.1:{port}"
        cluster.wait_for(lambda: service_up(self.agent_api_url), 180, "the agents' web process")

    def start_web(self, workers: int) -> None:
        """Stop the web process(es) and start ``uvicorn --workers <workers>`` on the same port."""
        from bench.harness.testbed import service_up

        cluster = self.cp.cluster
        if self.web is not None and self.web.poll() is None:
            os.killpg(self.web.pid, signal.SIGTERM)
            try:
                self.web.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.web.pid, signal.SIGKILL)
                self.web.wait(timeout=10)
        with open(self.config.out / f"web-g{workers}.log", "w") as log:
            web = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "controlplane.asgi:application",
                 "--host", "127.0.0.1", "--port", str(self.port), "--workers", str(workers),
                 *UVICORN_OPTIONS],
                cwd=ROOT, env=cluster.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        cluster.processes = [web if p is self.web else p for p in cluster.processes]
        self.web, self.workers = web, workers
        cluster.wait_for(lambda: service_up(cluster.url), 180, "the web process(es) to answer")
        deadline = time.monotonic() + 120
        while len(group_members(web.pid)) < workers + (1 if workers > 1 else 0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"uvicorn did not start {workers} workers")
            time.sleep(0.5)

    def declare(self) -> None:
        cp, config = self.cp, self.config
        profile_path = config.out / "profile.json"
        profile_path.write_text(json.dumps(PROFILE, indent=1) + "\n")
        dcs = {
            name: cp.post("datacenters", {"name": name, "region": region, "rdma_domain": name})[
                "id"
            ]
            for name, region in DATACENTERS
        }
        cp.post(
            "wan-links",
            {"from_datacenter": dcs["gws-a"], "to_datacenter": dcs["gws-b"], **LINK,
             "monthly_cost": "0"},
        )  # fmt: skip
        for gpu, dc in (("gpu-a", "gws-a"), ("gpu-b", "gws-b")):
            cp.post(
                "unit-prices",
                {"gpu_type": cp.gpu_types[gpu], "datacenter": dcs[dc], "price_per_gpu_hour": "2",
                 "currency": "USD", "effective_from": "2026-01-01T00:00:00Z"},
            )  # fmt: skip
        model = cp.post(
            "models",
            {"name": MODEL, "source": f"profile:{profile_path.resolve()}", "num_layers": 16,
             "kv_bytes_per_token": PROFILE["model"]["kv_bytes_per_token"],
             "max_context_tokens": PROFILE["max_position"], "kv_block_size": 16},
        )["id"]  # fmt: skip
        tenant = cp.post(
            "tenants",
            {"name": "gwscale", "requests_per_minute": 10_000_000,
             "tokens_per_minute": 10_000_000_000},
        )  # fmt: skip
        self.api_key = cp.post("api-keys", {"tenant": tenant["id"], "name": "gwscale"})["key"]
        from bench.harness.host import port_in_use

        ports = (p for p in range(BASE_PORT, BASE_PORT + 500) if not port_in_use("127.0.0.1", p))
        plan = [("prefill", "gws-a", "gpu-a", P_GPUS, i) for i in range(config.n_prefill)] + [
            ("main_decode", "gws-b", "gpu-b", MD_GPUS, i) for i in range(config.n_main)
        ]
        for role, dc, gpu, gpus, i in plan:
            port = next(ports)
            row = cp.post(
                "nodes",
                {"hostname": f"gws-{'p' if role == 'prefill' else 'md'}-{i + 1}",
                 "datacenter": dcs[dc], "gpu_type": cp.gpu_types[gpu], "gpu_count": gpus,
                 "agent_endpoint": f"http://127.0.0.1:{port}"},
            )  # fmt: skip
            self.nodes.append({**row, "role": role, "dc": dc, "port": port, "gpus": gpus})
        for node in self.nodes:
            cp.post(
                "instances",
                {"role": node["role"], "node": node["id"], "served_model": model,
                 "gpu_count": node["gpus"]},
            )  # fmt: skip
        cp.patch_policy(POLICY)

    def start_agents(self) -> None:
        from bench.harness.emulated import all_running, load_command_tokens, start_agents

        options = ("--kv-scale", str(KV_SCALE), "--max-queued", "4096", "--log-level", "ERROR")
        start_agents(
            self.cp, self.nodes, self.agents, options=options, parallel=4,
            control_plane_url=self.agent_api_url,
        )  # fmt: skip
        self.cp.cluster.wait_for(
            lambda: all_running(self.cp, len(self.nodes)), 240, "every instance to run"
        )
        load_command_tokens(self.cp)

    def state(self, host: str) -> dict:
        import httpx

        from bench.harness.emulated import COMMAND_TOKENS

        proc = self.agents[host]
        r = httpx.get(
            f"{proc.http}/state",
            headers={"Authorization": f"Bearer {COMMAND_TOKENS.get(host, '')}"},
            timeout=30,
        )
        r.raise_for_status()
        return r.json()

    def targets(self) -> tuple[list[dict], list[dict]]:
        """(prefills, mains) as the gateway's plan names them (runner._target)."""
        prefills, mains = [], []
        for node in self.nodes:
            host = node["hostname"]
            doc = self.state(host)
            inst = doc["instances"][0]
            kv = inst["kv_endpoint"]
            target = {
                "instance": str(inst["instance_id"]),
                "http": self.agents[host].http,
                "kv_host": kv["host"],
                "kv_port": kv["port"],
                "datacenter": node["dc"],
            }
            if kv.get("wan_port"):
                target["wan_port"] = kv["wan_port"]
            (prefills if node["role"] == "prefill" else mains).append(target)
        return prefills, mains

    def behind_s(self) -> dict[str, float]:
        out = {}
        for node in self.nodes:
            try:
                inst = self.state(node["hostname"])["instances"][0]
                out[node["hostname"]] = float((inst.get("emulation") or {}).get("behind_s", 0.0))
            except Exception:  # noqa: BLE001 - a figure, not a check
                continue
        return out

    def heartbeats(self) -> dict[str, dict]:
        """Each agent's account of its heartbeats (its state's ``control_plane`` block: round
        trips of the last answered beats, timeouts, refusals): whether the beats reached the
        control plane in time, as the agent saw them; and how late its own event loop ran
        over the last minute (``loop_late_s``)."""
        keys = ("heartbeats_answered", "heartbeats_refused", "heartbeat_timeouts",
                "unreachable", "rtt_p50_s", "rtt_p99_s", "rtt_max_s")  # fmt: skip
        out = {}
        for node in self.nodes:
            try:
                state = self.state(node["hostname"])
            except Exception:  # noqa: BLE001 - a figure, not a check
                continue
            block = state.get("control_plane") or {}
            out[node["hostname"]] = {k: block.get(k) for k in keys} | {
                # How late the agent's own loop ran over the last minute (its state).
                "loop_late_60s": (state.get("loop_late_s") or {}).get("60s"),
            }
        return out

    def early_first_token(self) -> bool:
        with self.cp.cluster.api() as api:
            r = api.get("/api/v1/routing-policy/")
            r.raise_for_status()
            return bool((r.json().get("settings") or {}).get("stream_first_token_early", False))

    def records(self, prefix: str) -> list[tuple[str, str, int, str]]:
        """(client_request_id, status, completion_tokens, pipeline) of every record whose
        client id starts with ``prefix``."""
        sql = (
            "SELECT client_request_id, status, completion_tokens, pipeline "
            "FROM routing_requestrecord WHERE client_request_id LIKE %s"
        )
        if self.config.production:
            import psycopg

            with psycopg.connect(f"{PG_SERVER}/{DB_NAME}") as conn:
                return list(conn.execute(sql, (prefix + "%",)).fetchall())
        path = Path(self.cp.cluster.tmp) / "baton.sqlite3"
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=20) as conn:
            return list(conn.execute(sql.replace("%s", "?"), (prefix + "%",)).fetchall())

    def stop(self) -> None:
        for proc in self.agents.values():
            try:
                log = self.config.out / f"agent-{proc.name}.log"
                log.write_text(Path(proc.log_path).read_text())
            except OSError:
                pass
            proc.kill()
            proc.cleanup()
        if self.cp is not None:
            self.cp.stop()
        if self.config.production:
            drop_database()
            flush_redis()


# -- phases, levels, the run -------------------------------------------------------------------


@dataclass
class Ctx:
    plane: Plane
    gens: list[LoadGen]
    prefills: list[dict]
    mains: list[dict]
    early: bool
    run_tag: str
    phase: int = 0
    level: int = 0  # levels run so far (a level's client ids start with its number)


def run_phase(
    ctx: Ctx, *, arm: str, clients: int, prompt_tokens: int, key_prefix: str,
    requests: int | None = None, prompt_arm: str = "", prompt_phase: int = 0,
) -> dict:  # fmt: skip
    """One phase of one arm: ``clients`` closed-loop clients over the load generators. The
    measured window opens when every load generator is warm (each of its clients finished a
    request, and the warm-up time passed) and lasts ``measure_s``; then the clients stop and
    their open requests finish. With ``requests``, each client sends that many and stops (no
    window)."""
    config, plane = ctx.plane.config, ctx.plane
    ctx.phase += 1
    gens = ctx.gens[: min(len(ctx.gens), max(1, -(-clients // STREAMS_PER_LOADGEN)))]
    base = {
        "arm": arm, "phase": ctx.phase, "prompt_tokens": prompt_tokens,
        "max_tokens": config.max_tokens, "model": MODEL, "api_key": plane.api_key,
        "gateway_host": "127.0.0.1", "gateway_port": plane.port, "prefills": ctx.prefills,
        "mains": ctx.mains, "early_first_token": ctx.early, "data_headers": "",
        "key_prefix": key_prefix, "warmup_s": config.warmup_s, "drain_s": config.drain_s,
        "requests": requests, "prompt_arm": prompt_arm, "prompt_phase": prompt_phase,
    }  # fmt: skip
    groups = {"gateway": plane.web.pid}
    if plane.celery is not None:
        groups["celery"] = plane.celery.pid
    groups.update({f"agent:{h}": a.proc.pid for h, a in plane.agents.items() if a.proc})
    meter = Meter(groups, {f"loadgen-{g.index}": g.proc.pid for g in gens})
    measured = requests is None
    behind0 = plane.behind_s() if measured else {}
    started = time.monotonic()
    for i, gen in enumerate(gens):
        share = [c for c in range(clients) if c % len(gens) == i]
        gen.send({**base, "clients": share, "out": str(config.out / f"phase-{i}.json")})
    cpu = None
    t0 = t1 = warm = None
    if measured:
        deadline = started + config.warm_max_s
        warm = all(g.read("warm", max(0.0, deadline - time.monotonic())) for g in gens)
        t0 = time.monotonic()
        a = meter.sample()
        time.sleep(config.measure_s)
        t1 = time.monotonic()
        b = meter.sample()
        cpu = cpu_delta(a, b)
        for gen in gens:
            gen.send({"stop": t1})
    results = [g.results(config.drain_s + 120) for g in gens]
    behind1 = plane.behind_s() if measured else {}
    return {
        "arm": arm, "phase": ctx.phase, "clients": clients, "t0": t0, "t1": t1,
        "window_s": None if t0 is None or t1 is None else t1 - t0,
        "warm": warm, "warmup_taken_s": None if t0 is None else round(t0 - started, 2),
        "recs": [r for res in results for r in res["recs"]], "cpu": cpu,
        "unfinished_at_drain": sum(r["unfinished"] for r in results),
        "engine_behind_s": {h: round(behind1.get(h, 0.0) - behind0.get(h, 0.0), 3)
                            for h in behind1},
    }  # fmt: skip


def arm_figures(phases: list[dict]) -> dict[str, Any]:
    """One arm's figures over its phases (windows summed)."""
    window = sum(p["window_s"] for p in phases)
    ok_in, errors, started = [], {}, 0
    tokens_in = ended_in = 0
    gaps, tpots, inexact, checked, timing = [], [], 0, 0, {}
    per_chunk = []
    for p in phases:
        t0, t1 = p["t0"], p["t1"]
        for r in p["recs"]:
            for t, n in zip(r["chunks_t"], r["chunks_n"], strict=True):
                if t0 <= t < t1:
                    tokens_in += n
            if r["error"]:
                if t0 <= r["t_send"] < t1:
                    errors[r["error"]] = errors.get(r["error"], 0) + 1
                continue
            checked += 1
            inexact += not r["exact"]
            if r["t_end"] is not None and t0 <= r["t_end"] < t1:
                ended_in += 1
            if not t0 <= r["t_send"] < t1:
                continue
            started += 1
            ok_in.append(r)
            ts = r["chunks_t"]
            gaps += [b - a for a, b in zip(ts, ts[1:], strict=False)]
            per_chunk += r["chunks_n"]
            if r["tokens"] > 1 and r["t_first"] is not None:
                tpots.append((r["t_end"] - r["t_first"]) / (r["tokens"] - 1))
            for name, dur in r["timing"].items():
                timing.setdefault(name, []).append(dur)
    lat = [r["t_end"] - r["t_send"] for r in ok_in]
    ttft = [r["t_first"] - r["t_send"] for r in ok_in if r["t_first"] is not None]
    cpu = [p["cpu"] for p in phases if p["cpu"]]
    return {
        "phases": len(phases),
        "window_s": round(window, 2),
        "requests_ok_started": started,
        "requests_per_s": round(ended_in / window, 2) if window else None,
        "tokens_per_s": round(tokens_in / window, 1) if window else None,
        "latency_p50_ms": ms(pct(lat, 0.5)),
        "latency_p99_ms": ms(pct(lat, 0.99)),
        "ttft_p50_ms": ms(pct(ttft, 0.5)),
        "ttft_p99_ms": ms(pct(ttft, 0.99)),
        "chunk_gap_p50_ms": ms(pct(gaps, 0.5)),
        "chunk_gap_p99_ms": ms(pct(gaps, 0.99)),
        "tpot_p50_ms": ms(pct(tpots, 0.5)),
        "tpot_p99_ms": ms(pct(tpots, 0.99)),
        "tokens_per_chunk": round(statistics.fmean(per_chunk), 2) if per_chunk else None,
        "errors": errors,
        "error_total": sum(errors.values()),
        "unfinished_at_drain": sum(p["unfinished_at_drain"] for p in phases),
        "tokens_checked_requests": checked,
        "tokens_not_exact": inexact,
        "server_timing_median_ms": {
            k: round(statistics.median(v), 3) for k, v in sorted(timing.items())
        },
        "cpu_windows": cpu,
        "engine_behind_s": [p["engine_behind_s"] for p in phases],
    }


def gateway_cpu(gateway: list[dict], direct: list[dict], g: dict, long: bool) -> dict:
    """The gateway processes' CPU per request and per token over the gateway windows, net of
    their CPU rate over the direct windows (heartbeats, refreshers: what they spend anyway)."""
    gw_s = sum(p["cpu"]["gateway_cpu_s"] for p in gateway if p["cpu"])
    gw_span = sum(p["cpu"]["span_s"] for p in gateway if p["cpu"])
    idle_s = sum(p["cpu"]["gateway_cpu_s"] for p in direct if p["cpu"])
    idle_span = sum(p["cpu"]["span_s"] for p in direct if p["cpu"])
    idle_rate = idle_s / idle_span if idle_span else 0.0
    requests = (g["requests_per_s"] or 0) * g["window_s"]
    tokens = (g["tokens_per_s"] or 0) * g["window_s"]
    net = gw_s - idle_rate * gw_span
    out = {
        "gateway_cores_gateway_arm": round(gw_s / gw_span, 3) if gw_span else None,
        "gateway_cores_direct_arm": round(idle_rate, 3),
        "cpu_ms_per_request": round(gw_s / requests * 1000, 3) if requests else None,
        "cpu_ms_per_request_net": round(net / requests * 1000, 3) if requests else None,
        "cpu_us_per_token_net": round(net / tokens * 1e6, 2) if tokens else None,
    }
    if long and requests:
        tokenize = g["server_timing_median_ms"].get("tokenize", 0.0)
        out["tokenize_ms_median"] = tokenize
        out["cpu_ms_per_request_net_tokenizer_aside"] = round(net / requests * 1000 - tokenize, 3)
    return out


def loadgen_limit(phases: list[dict]) -> dict:
    cores = [
        c for p in phases if p["cpu"] for c in p["cpu"]["loadgen_cores"].values()
    ]  # one value per load-generator process and window
    worst = max(cores) if cores else None
    return {
        "loadgen_max_core": worst,
        "loadgen_is_limit": worst is not None and worst >= GOALS["loadgen_core_limit"],
        "machine_busy_max": max((p["cpu"]["machine_busy"] for p in phases if p["cpu"]),
                                default=None),
    }  # fmt: skip


def wait_records(plane: Plane, prefix: str, keys: list[str], timeout_s: float = 90.0) -> dict:
    """Every gateway request of a level (its X-Request-Id) against the records: exactly one
    row each, none unknown."""
    want = set(keys)
    deadline = time.monotonic() + timeout_s
    rows: list = []
    while True:
        rows = plane.records(prefix)
        have = {r[0] for r in rows}
        if want <= have or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r[0]] = counts.get(r[0], 0) + 1
    status: dict[str, int] = {}
    pipelines: dict[str, int] = {}
    for r in rows:
        status[r[1]] = status.get(r[1], 0) + 1
        pipelines[r[3] or "-"] = pipelines.get(r[3] or "-", 0) + 1
    missing = len(want - set(counts))
    duplicated = sum(1 for k, n in counts.items() if n > 1)
    unknown = sum(1 for k in counts if k not in want)
    return {
        "gateway_requests_sent": len(want),
        "records": len(rows),
        "missing": missing,
        "duplicated": duplicated,
        "unknown": unknown,
        "exactly_once": missing == 0 and duplicated == 0 and unknown == 0,
        "by_status": status,
        "by_pipeline": pipelines,
    }


def cross_check(ctx: Ctx, prompt_tokens: int, key_prefix: str) -> dict:
    """The same prompts through both arms, one request at a time: equal answers; the gateway's
    requests recorded exactly once."""
    config = ctx.plane.config
    if config.cross_checks <= 0:
        return {"prompts": 0, "equal": 0}
    answers, keys = {}, []
    same = ctx.phase + 1
    for arm in ("gateway", "direct"):
        phase = run_phase(
            ctx, arm=arm, clients=1, prompt_tokens=prompt_tokens,
            key_prefix=f"x{key_prefix}{arm[0]}-", requests=config.cross_checks,
            prompt_arm="x", prompt_phase=same,
        )  # fmt: skip
        answers[arm] = [(r["answer"], r["error"], r["exact"]) for r in phase["recs"]]
        if arm == "gateway":
            keys = [r["key"] for r in phase["recs"]]
    pairs = list(zip(answers["gateway"], answers["direct"], strict=False))
    return {
        "prompts": len(pairs),
        "equal": sum(1 for g, d in pairs if g[0] == d[0] and not g[1] and not d[1]),
        "exact": sum(1 for g, d in pairs if g[2] and d[2]),
        "errors": [e for g, d in pairs for e in (g[1], d[1]) if e],
        "records": wait_records(ctx.plane, f"x{key_prefix}g-", keys),
    }


def run_level(ctx: Ctx, clients: int, prompt_tokens: int, name: str, long: bool = False) -> dict:
    plane = ctx.plane
    ctx.level += 1
    # Unique per level, even for a level run again (G = 1 at the end): its records' prefix.
    prefix = f"gws{ctx.run_tag}-{ctx.level:02d}{name}-"
    say(f"{name}: {clients} stream(s), {prompt_tokens}-token prompts, G={plane.workers}")
    phases: dict[str, list[dict]] = {"gateway": [], "direct": []}
    for arm in ("gateway", "direct", "gateway", "direct"):
        phase = run_phase(
            ctx, arm=arm, clients=clients, prompt_tokens=prompt_tokens,
            key_prefix=f"{prefix}{ctx.phase + 1:04d}-",
        )  # fmt: skip
        phases[arm].append(phase)
        done = sum(1 for r in phase["recs"] if not r["error"])
        say(f"  {arm}: {done} ok, {len(phase['recs']) - done} failed")
    keys = [r["key"] for p in phases["gateway"] for r in p["recs"]]
    g, d = arm_figures(phases["gateway"]), arm_figures(phases["direct"])
    records = wait_records(plane, prefix, keys)
    cross = cross_check(ctx, prompt_tokens, prefix)
    diff = {}
    for k in ("latency_p50_ms", "latency_p99_ms", "ttft_p50_ms", "ttft_p99_ms",
              "chunk_gap_p50_ms", "chunk_gap_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):  # fmt: skip
        if g[k] is not None and d[k] is not None:
            diff[k] = round(g[k] - d[k], 3)
    level = {
        "name": name,
        "clients": clients,
        "prompt_tokens": prompt_tokens,
        "gateway_processes": plane.workers,
        "gateway": g,
        "direct": d,
        "gateway_minus_direct": diff,
        "throughput_ratio": (
            round(g["tokens_per_s"] / d["tokens_per_s"], 3) if d["tokens_per_s"] else None
        ),
        "gateway_cpu": gateway_cpu(phases["gateway"], phases["direct"], g, long),
        "loadgen": loadgen_limit(phases["gateway"] + phases["direct"]),
        "records": records,
        "cross_arm": cross,
        "heartbeats": plane.heartbeats(),
    }
    (plane.config.out / f"{ctx.level:02d}-{name}.json").write_text(
        json.dumps(level, indent=1) + "\n"
    )
    say(
        f"  {name}: gateway {g['tokens_per_s']} tok/s p50 {g['latency_p50_ms']} ms, direct "
        f"{d['tokens_per_s']} tok/s p50 {d['latency_p50_ms']} ms; records "
        f"{'exactly once' if records.get('exactly_once') else records}"
    )
    return level


def ready(plane: Plane, timeout_s: float = 180.0) -> None:
    """One gateway request answered in full (the live view holds the fleet) before a level."""
    import httpx

    body = {"model": MODEL, "prompt": "ready?", "max_tokens": 2, "temperature": 0}
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.post(
                f"{plane.cp.url}/v1/completions", json=body, timeout=60,
                headers={"Authorization": f"Bearer {plane.api_key}"},
            )  # fmt: skip
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(1.0)
    raise TimeoutError(f"the gateway did not answer a request in {timeout_s} s: {last}")


def goals(result: dict) -> dict:
    """The issue's goals (module docstring) on a run's result; None where not measured."""
    levels: dict[int, dict] = {}
    for lv in result["levels"]:  # G = 1's sweep (not the repeat at the end)
        if lv["gateway_processes"] == 1:
            levels.setdefault(lv["clients"], lv)
    longs = {lv["clients"]: lv for lv in result["long"]}
    out: dict[str, Any] = {}
    for c, key in ((1, "overhead_1_stream_ms"), (32, "overhead_32_streams_p50_ms")):
        goal = GOALS[key]
        lv = levels.get(c)
        value = lv["gateway_minus_direct"].get("latency_p50_ms") if lv else None
        out[key] = {
            "measured": value,
            "goal": goal,
            "met": None if value is None else value <= goal,
        }
    best = max(levels.values(), key=lambda lv: lv["gateway"]["tokens_per_s"] or 0, default=None)
    if best is not None:
        tps = best["gateway"]["tokens_per_s"]
        gap = best["gateway_minus_direct"].get("chunk_gap_p99_ms")
        out["tokens_per_s_per_process"] = {
            "measured": tps, "at_clients": best["clients"],
            "goal": GOALS["tokens_per_s_per_gateway_process"],
            "met": tps is not None and tps >= GOALS["tokens_per_s_per_gateway_process"],
        }  # fmt: skip
        out["added_chunk_gap_p99_ms"] = {
            "measured": gap, "at_clients": best["clients"], "goal": GOALS["added_chunk_gap_p99_ms"],
            "met": None if gap is None else gap <= GOALS["added_chunk_gap_p99_ms"],
        }  # fmt: skip
    one = longs.get(1)
    value = one["gateway_cpu"].get("cpu_ms_per_request_net_tokenizer_aside") if one else None
    out["control_plane_cpu_ms_per_64k_request"] = {
        "measured": value, "goal": GOALS["control_plane_cpu_ms_per_64k_request"],
        "met": None if value is None else value <= GOALS["control_plane_cpu_ms_per_64k_request"],
    }  # fmt: skip
    scale = result.get("scaling") or {}
    ratio = scale.get("ratio_4_over_1")
    out["scale_4_over_1"] = {
        "measured": ratio, "goal": GOALS["scale_4_over_1"],
        "met": None if ratio is None else ratio >= GOALS["scale_4_over_1"],
    }  # fmt: skip
    all_levels = result["levels"] + result["long"]
    exact = all(
        lv["gateway"]["tokens_not_exact"] == 0 and lv["direct"]["tokens_not_exact"] == 0
        and lv["cross_arm"]["equal"] == lv["cross_arm"]["prompts"]
        for lv in all_levels
    )  # fmt: skip
    once = all(lv["records"].get("exactly_once") for lv in all_levels)
    out["tokens_exact"] = {"met": exact if all_levels else None}
    out["records_exactly_once"] = {"met": once if all_levels else None}
    return out


def machine() -> dict:
    from bench.harness.host import cpu_model, git_commit

    return {
        "cores": os.cpu_count(),
        "cpu_model": cpu_model(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "commit": git_commit(),
        "python": sys.version.split()[0],
    }


def run(config: Config) -> dict:
    """The whole scenario (or the smaller one ``config`` names); returns the result."""
    config.out.mkdir(parents=True, exist_ok=True)
    fds = raise_fd_limit()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    result: dict[str, Any] = {
        "label": config.label,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
        "profile": PROFILE,
        "machine_before": machine(),
        "fd_limit": fds,
        "levels": [],
        "long": [],
        "scaling": None,
    }
    plane = Plane(config)
    gens: list[LoadGen] = []
    try:
        kind = "PostgreSQL, Redis, Celery" if config.production else "embedded"
        say(f"starting the control plane ({kind})")
        plane.start()
        plane.start_web(config.gateways[0])
        plane.declare()
        say(f"declared {len(plane.nodes)} nodes; starting their agents")
        plane.start_agents()
        prefills, mains = plane.targets()
        top = max(config.levels + config.long_levels)
        gens = [
            LoadGen(i, config.out / f"loadgen-{i}.log")
            for i in range(max(1, -(-top // STREAMS_PER_LOADGEN)))
        ]
        ctx = Ctx(plane, gens, prefills, mains, plane.early_first_token(), secrets.token_hex(3))
        ready(plane)
        for c in config.levels:
            result["levels"].append(
                run_level(ctx, c, config.prompt_tokens, f"c{c}-g{plane.workers}")
            )
        for c in config.long_levels:
            result["long"].append(
                run_level(ctx, c, config.long_prompt_tokens, f"long{c}-g{plane.workers}", long=True)
            )
        if len(config.gateways) > 1 and config.levels:
            clean = [lv["clients"] for lv in result["levels"] if lv["gateway"]["error_total"] == 0]
            at = max(clean) if clean else max(config.levels)
            runs = [lv for lv in result["levels"] if lv["clients"] == at]
            for workers in (*config.gateways[1:], config.gateways[0]):
                say(f"restarting the web process with --workers {workers}")
                plane.start_web(workers)
                ready(plane)
                runs.append(run_level(ctx, at, config.prompt_tokens, f"c{at}-g{workers}"))
            result["levels"] += runs[1:]
            tps = {}
            for lv in runs:
                tps.setdefault(lv["gateway_processes"], []).append(lv["gateway"]["tokens_per_s"])
            one = statistics.fmean(tps.get(config.gateways[0], [0.0]) or [0.0])
            four = statistics.fmean(tps.get(4, [0.0])) if 4 in tps else None
            result["scaling"] = {
                "at_clients": at,
                "tokens_per_s_by_processes": tps,
                "ratio_over_1": {
                    n: round(statistics.fmean(v) / one, 3) if one else None for n, v in tps.items()
                },
                "direct_tokens_per_s": [lv["direct"]["tokens_per_s"] for lv in runs],
                "ratio_4_over_1": round(four / one, 3) if four and one else None,
                "loadgen": [lv["loadgen"] for lv in runs],
            }
    finally:
        # A failed clean-up (the full run's last Redis flush timed out) must not lose what was
        # measured: say so, and write the result anyway.
        for stop in [gen.stop for gen in gens] + [plane.stop]:
            try:
                stop()
            except Exception as exc:  # noqa: BLE001 - reported, the result still written
                say(f"clean-up failed: {type(exc).__name__}: {exc}")
    result["machine_after"] = machine()
    result["goals"] = goals(result)
    (config.out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def small_summary(result: dict) -> dict:
    def row(lv: dict) -> dict:
        g, d = lv["gateway"], lv["direct"]
        return {
            "clients": lv["clients"], "prompt_tokens": lv["prompt_tokens"],
            "gateway_processes": lv["gateway_processes"],
            "gateway_tokens_per_s": g["tokens_per_s"], "direct_tokens_per_s": d["tokens_per_s"],
            "gateway_requests_per_s": g["requests_per_s"],
            "direct_requests_per_s": d["requests_per_s"],
            "latency_p50_ms": [g["latency_p50_ms"], d["latency_p50_ms"]],
            "latency_p99_ms": [g["latency_p99_ms"], d["latency_p99_ms"]],
            "ttft_p50_ms": [g["ttft_p50_ms"], d["ttft_p50_ms"]],
            "chunk_gap_p99_ms": [g["chunk_gap_p99_ms"], d["chunk_gap_p99_ms"]],
            "overhead_p50_ms": lv["gateway_minus_direct"].get("latency_p50_ms"),
            "errors": [g["error_total"], d["error_total"]],
            "gateway_cpu": lv["gateway_cpu"], "loadgen": lv["loadgen"],
            "records_exactly_once": lv["records"].get("exactly_once"),
            "tokens_exact": g["tokens_not_exact"] == 0 and d["tokens_not_exact"] == 0,
        }  # fmt: skip

    return {
        "label": result["label"],
        "machine": result["machine_before"],
        "levels": [row(lv) for lv in result["levels"]],
        "long": [row(lv) for lv in result["long"]],
        "scaling": result["scaling"],
        "goals": result["goals"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gateway_scale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="a short smoke run (not the benchmark)"
    )
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--summary", default=None, help=f"write the small summary (e.g. {SUMMARY})")
    parser.add_argument(
        "--levels",
        help="only these stream counts with 1K prompts, no long prompts (e.g. 1024), on "
        "--gateways processes (1): "
        "a partial rerun of the scenario's levels, labelled so, not the benchmark",
    )
    parser.add_argument(
        "--gateways",
        type=int,
        default=1,
        choices=(1, 2, 4),
        help="with --levels: the web processes (uvicorn --workers) of the partial rerun",
    )
    parser.add_argument(
        "--agent-api-process",
        action="store_true",
        help="with --levels: the agents report to a web process of their own, apart from the "
        "gateway's (docs/operations.md, scale-out)",
    )
    parser.add_argument("--loadgen", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.loadgen:
        return loadgen_main()
    out = Path(args.out)
    config = quick_config(out) if args.quick else replace(Config(), out=out)
    if args.levels:
        try:
            levels = tuple(int(x) for x in args.levels.split(",") if x.strip())
        except ValueError:
            levels = ()
        if not levels or min(levels) < 1 or max(levels) > max(Config.levels):
            print(f"--levels: stream counts 1..{max(Config.levels)}", file=sys.stderr)
            return 2
        config = replace(
            config, levels=levels, long_levels=(), gateways=(args.gateways,), label="partial",
            agent_api_process=args.agent_api_process,
        )  # fmt: skip
    elif args.gateways != 1 or args.agent_api_process:
        print(
            "--gateways: only with --levels (the full scenario runs G = 1, 2 and 4)",
            file=sys.stderr,
        )
        return 2
    result = run(config)
    summary = small_summary(result)
    print(json.dumps(summary, indent=1))
    if args.summary:
        Path(args.summary).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
