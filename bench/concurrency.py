"""A standard benchmark client at concurrency 8, 32 and 128 against `make demo`'s stack: every
request completes (slower under load, 0 errors), tokens are exact, the control plane records
each request exactly once (issue 40).

    .venv/bin/python -m bench.concurrency [--levels 8,32,128] [--requests-per-level N]
        [--client auto|aiperf|openai] [--with-emulated] [--url URL --api-key KEY
        --operator-token TOKEN [--tenant demo]]

The client is NVIDIA's ``aiperf`` (0.13) when it is installed in ``var/aiperf-venv`` (never in
.venv; ``python3.11 -m venv var/aiperf-venv && var/aiperf-venv/bin/pip install aiperf==0.13.0``),
else this module's own closed-loop load generator on the official ``openai`` client (``--client``
chooses). Raw outputs go to var/bench-concurrency/<UTC stamp>/ (the stack's state and logs, each
level's prompts, aiperf's artifacts or the client's per-request results, the request records);
the run's REPORT.md and summary.json beside them, and, when the run is the fixed scenario below
(default levels and request counts), also to bench/concurrency/REPORT.md and summary.json.

Scenario (fixed before the first run from the rules stated; never retuned after seeing results):

- The stack: ``python -m bench.demo --no-traffic --no-emulated`` (what ``make demo`` starts:
  migrate, seed_demo, the control plane on uvicorn on the embedded defaults, the three
  ``baton-tiny`` agents P / RLD / MD with the demo's scaled 60 Mbit/s / 30 ms WAN link and
  policy), with no background traffic (``--no-traffic``: it would share the tenant and the
  cores) and without the idle emulated fleet (``--with-emulated`` adds it: 9 more agent
  processes on the same cores, none of this benchmark's requests go to it), in a state folder
  of its own (``BATON_VAR_DIR``: a fresh database every run), ``OMP_WAIT_POLICY=PASSIVE``.
  Every gateway setting at its default (the overload queue: 60 s timeout, 512 waiting, 128 per
  tenant; docs/gateway.md "Overload"). The key is the one the demo prints (tenant ``demo``,
  default limits: 600 requests and 2M tokens a minute), as a new user would use it.
- Requests: chat completions, streamed (``stream_options.include_usage``), model
  ``baton-tiny``, one user message, ``temperature`` 0 (so that a request sent alone must give
  the same text), ``max_tokens`` (aiperf: ``max_completion_tokens``) 128.
- Prompts: the issue's ~2.5-4.8K tokens, as many as baton-tiny's context allows: its context is
  4,096 tokens (seed_demo), its tokenizer one token per byte (pdd/tokenizer.py), the chat
  template adds 24 bytes, so a prompt of P ASCII characters needs P + 24 + 128 <= 4,096; P is
  drawn uniformly from 2,500 .. 3,900 characters (44 to spare), seeded per level, text of
  English words, each prompt unique (it starts with its level and index), so no two requests
  share a prefix block.
- Levels 8, 32, 128, in that order, on the same stack; closed loop as aiperf's concurrency mode:
  C workers, each sending its next request as soon as its last one ended; 6 requests per worker
  (the issue's 48 at concurrency 8): 48, 192 and 768 requests. No warm-up.
- After each level: the request records (``GET /api/v1/requests/?tenant_name=...&since=``, the
  operator token) are waited for, up to 120 s, until every request sent has one; then, for 8
  completed requests evenly spread over the level, the same prompt is sent alone (the official
  ``openai`` client, not streamed, temperature 0, same max_tokens) and its text compared.

Checks, per level (the goals, from the issue): completed == sent, where completed means HTTP
200, a finish_reason and a ``[DONE]``, with no error inside the stream; 0 failed (reported by
status, error code or error text); tokens exact: each sampled request's text equals the text
of the same prompt sent alone; records exactly once: every request sent (by the X-Request-Id
the client sent, the record's ``client_request_id``) has exactly one record, no other record of
the tenant in the level's window, a completed request's record says ``ok`` with the completion
tokens the stream's usage reported (a request refused with a 4xx at admission, a rate limit
say, gets no record from the gateway: it is counted apart, and fails the first goal).
Figures: TTFT, inter-token latency ((latency - TTFT) / (output tokens - 1) per request,
aiperf's definition) and request latency p50 / p99, output tokens/s over the level's wall time,
requests/s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.harness.host import git_commit

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "var" / "bench-concurrency"
REPORT_DIR = ROOT / "bench" / "concurrency"
AIPERF_VENV = ROOT / "var" / "aiperf-venv"
AIPERF_VERSION = "0.13.0"

MODEL = "baton-tiny"
LEVELS = (8, 32, 128)
REQUESTS_PER_WORKER = 6
PROMPT_CHARS = (2500, 3900)
MAX_TOKENS = 128
EXACT_SAMPLE = 8
SEED = 0
RECORDS_WAIT_S = 120.0
# "<|user|>\n" + content + "\n" + "<|assistant|>\n" (pdd.tokenizer.apply_chat_template)
CHAT_TEMPLATE_BYTES = 24

WORDS = (
    "the of and to in is that for it as with was on be by at this are from or an which have "
    "not but had they his her she he we you all were there been one their has would what so "
    "if about when who will more no out up into than them can only other new some could time "
    "these two may then do first any my now such like our over man me even most made after "
    "also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see "
    "men work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three"
).split()


def say(message: str) -> None:
    print(f"[concurrency] {message}", flush=True)


@dataclass(frozen=True)
class Scenario:
    levels: tuple[int, ...] = LEVELS
    requests_per_worker: int = REQUESTS_PER_WORKER
    requests_per_level: int | None = None  # overrides requests_per_worker x C when set
    prompt_chars: tuple[int, int] = PROMPT_CHARS
    max_tokens: int = MAX_TOKENS
    exact_sample: int = EXACT_SAMPLE
    seed: int = SEED
    model: str = MODEL

    def requests(self, level: int) -> int:
        return self.requests_per_level or self.requests_per_worker * level

    @property
    def is_fixed(self) -> bool:
        return self == Scenario()


@dataclass
class Target:
    """A running stack: the gateway's base URL, a tenant's API key, an operator's REST token."""

    url: str
    api_key: str
    operator_token: str
    tenant: str


@dataclass
class Result:
    """One request as the client saw it."""

    id: str  # the X-Request-Id the client sent
    index: int
    prompt: str = ""
    status: int | None = None
    error: str = ""
    code: str = ""  # the error's code (an OpenAI error body's, or the exception's type)
    done: bool = False
    finish_reason: str | None = None
    text: str = ""
    output_tokens: int = 0
    usage: dict[str, Any] | None = None
    response_id: str = ""
    ttft_s: float | None = None
    latency_s: float | None = None
    start_s: float = 0.0  # on the client's clock, seconds

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.done and bool(self.finish_reason) and not self.error

    @property
    def itl_s(self) -> float | None:
        if self.ttft_s is None or self.latency_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    def failure(self) -> str:
        """Why the request did not complete, as a kind to count by ("HTTP 503 overloaded");
        `error` has the words."""
        if self.status is not None and self.status != 200:
            return f"HTTP {self.status} {self.code}".strip()
        if self.error:
            return f"{'error in stream' if self.status == 200 else 'failed'} {self.code}".strip()
        if not self.finish_reason:
            return "stream ended without a finish_reason"
        if not self.done:
            return "stream ended without [DONE]"
        return ""


# -- prompts -------------------------------------------------------------------------------


def prompts(scenario: Scenario, level: int) -> list[str]:
    """The level's prompts: ASCII words, lengths uniform over scenario.prompt_chars, seeded."""
    rng = random.Random(f"{scenario.seed}-{level}")
    lo, hi = scenario.prompt_chars
    out = []
    for i in range(scenario.requests(level)):
        length = rng.randint(lo, hi)
        parts = [f"Request {level}-{i}."]
        size = len(parts[0])
        while size < length:
            word = rng.choice(WORDS)
            parts.append(word)
            size += 1 + len(word)
        out.append(" ".join(parts)[:length])
    return out


def messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


# -- parsing a stream ----------------------------------------------------------------------


def parse_events(result: Result, events: list[tuple[float, str]]) -> Result:
    """Fill `result` from a stream's `data:` payloads, each with its arrival time in seconds
    after the request started."""
    pieces = []
    content_chunks = 0
    for at, data in events:
        result.latency_s = at
        if data.strip() == "[DONE]":
            result.done = True
            continue
        try:
            chunk = json.loads(data)
        except ValueError:
            result.error = result.error or f"unparsable chunk: {data[:120]}"
            result.code = result.code or "unparsable"
            continue
        if not isinstance(chunk, dict):
            continue
        if chunk.get("error"):
            result.code, result.error = error_parts(chunk)
            continue
        result.response_id = result.response_id or str(chunk.get("id") or "")
        if chunk.get("usage"):
            result.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                pieces.append(content)
                content_chunks += 1
                if result.ttft_s is None:
                    result.ttft_s = at
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
    result.text = "".join(pieces)
    usage_tokens = (result.usage or {}).get("completion_tokens")
    result.output_tokens = usage_tokens if isinstance(usage_tokens, int) else content_chunks
    return result


def error_parts(body: Any) -> tuple[str, str]:
    """(code, message) from an OpenAI-style error body (a dict or its JSON), else ("", text)."""
    if isinstance(body, str | bytes):
        try:
            body = json.loads(body)
        except ValueError:
            return "", str(body)[:300]
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        return str(err.get("code") or err.get("type") or ""), str(err.get("message", ""))[:300]
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return "", body["error"][:300]
    return "", str(body)[:300]


# -- aiperf --------------------------------------------------------------------------------


def aiperf_bin() -> Path:
    return AIPERF_VENV / "bin" / "aiperf"


def aiperf_version() -> str | None:
    python = AIPERF_VENV / "bin" / "python"
    if not aiperf_bin().exists() or not python.exists():
        return None
    out = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('aiperf'))"],
        capture_output=True,
        text=True,
    )
    return (out.stdout.strip() or None) if out.returncode == 0 else None


BYTE_TOKENIZER = """
import sys
from tokenizers import Tokenizer, decoders, models
from tokenizers.pre_tokenizers import ByteLevel
from transformers import PreTrainedTokenizerFast
vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
tok.decoder = decoders.ByteLevel()
PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(sys.argv[1])
"""


def write_byte_tokenizer(folder: Path) -> Path:
    """A Hugging Face tokenizer folder with one token per byte, as baton-tiny's, for aiperf's
    token counts: made locally with the aiperf venv's own `tokenizers` (nothing downloaded).
    aiperf must get its absolute path, without HF_HUB_OFFLINE (0.13 then looks the path up as
    a hub repo id)."""
    folder = folder.resolve()
    if not (folder / "tokenizer.json").exists():
        subprocess.run(
            [str(AIPERF_VENV / "bin" / "python"), "-c", BYTE_TOKENIZER, str(folder)],
            check=True,
            capture_output=True,
        )
    return folder


def aiperf_command(
    target: Target, scenario: Scenario, level: int, dataset: Path, tokenizer: Path, out: Path
) -> list[str]:
    return [
        str(aiperf_bin()), "profile",
        "--model", scenario.model,
        "--url", target.url,
        "--endpoint-type", "chat",
        "--streaming",
        "--api-key", target.api_key,
        "--tokenizer", str(tokenizer),
        "--input-file", str(dataset),
        "--custom-dataset-type", "single_turn",
        "--dataset-sampling-strategy", "sequential",
        "--concurrency", str(level),
        "--request-count", str(scenario.requests(level)),
        "--extra-inputs", "temperature:0",
        "--use-server-token-count",
        "--ui", "none",
        "--export-level", "raw",
        "--artifact-dir", str(out),
        "--no-server-metrics",
        "--no-gpu-telemetry",
    ]  # fmt: skip


def parse_aiperf_raw(path: Path, prompt_index: dict[str, int]) -> list[Result]:
    """aiperf's profile_export_raw.jsonl as Results: one line a request, with the X-Request-ID
    it sent, the status, every SSE message with its perf_counter time, the payload, an error."""
    results = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        raw = json.loads(line)
        meta = raw.get("metadata") or {}
        headers = raw.get("request_headers") or {}
        rid = meta.get("x_request_id") or headers.get("X-Request-ID") or ""
        payload = raw.get("payload") or {}
        prompt = ""
        with contextlib.suppress(AttributeError, IndexError, KeyError, TypeError):
            prompt = payload["messages"][0]["content"]
        start = raw.get("start_perf_ns") or 0
        result = Result(
            id=rid,
            index=prompt_index.get(prompt, -1),
            prompt=prompt,
            status=raw.get("status"),
            start_s=(meta.get("request_start_ns") or 0) / 1e9,
        )
        events: list[tuple[float, str]] = []
        bodies = []
        for response in raw.get("responses") or []:
            at = (response.get("perf_ns", start) - start) / 1e9
            if "packets" in response:
                events += [
                    (at, p.get("value") or "")
                    for p in response["packets"]
                    if p.get("name") == "data"
                ]
            elif "text" in response:
                bodies.append(response["text"])
        if result.status == 200:
            parse_events(result, events)
        elif bodies:
            result.code, result.error = error_parts("".join(bodies))
        error = raw.get("error")
        if error and not result.error:
            # aiperf's ErrorDetails: an HTTP error's body is its message; else a client error.
            if isinstance(error, dict):
                result.code, result.error = error_parts(error.get("message") or "")
                if not result.code and result.status in (None, 200):
                    result.code = str(error.get("type") or error.get("code") or "error")
            else:
                result.error = str(error)
        if meta.get("was_cancelled") and not result.error:
            result.code, result.error = "cancelled", "cancelled by aiperf"
        results.append(result)
    return results


def run_aiperf_level(
    target: Target, scenario: Scenario, level: int, texts: list[str], out: Path, timeout_s: float
) -> tuple[list[Result], float]:
    dataset = out / "prompts.jsonl"
    dataset.write_text(
        "".join(json.dumps({"text": t, "output_length": scenario.max_tokens}) + "\n" for t in texts)
    )
    tokenizer = write_byte_tokenizer(OUT / "byte-tokenizer")
    artifacts = out / "aiperf"
    command = aiperf_command(target, scenario, level, dataset, tokenizer, artifacts)
    (out / "aiperf-command.txt").write_text(
        " ".join(c if c != target.api_key else "<key>" for c in command) + "\n"
    )
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    began = time.monotonic()
    with open(out / "aiperf.log", "w") as log:
        proc = subprocess.Popen(
            command, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            say(f"aiperf ran past {timeout_s:.0f} s and was stopped; log in {out / 'aiperf.log'}")
    wall = time.monotonic() - began
    raw = artifacts / "profile_export_raw.jsonl"
    if not raw.exists():
        raise SystemExit(f"[concurrency] aiperf wrote no raw export; see {out / 'aiperf.log'}")
    results = parse_aiperf_raw(raw, {t: i for i, t in enumerate(texts)})
    if results and all(r.start_s for r in results):
        # From the first request's start to the last one's end (aiperf's wall-clock stamps).
        ends = [r.start_s + (r.latency_s or 0.0) for r in results]
        wall = max(ends) - min(r.start_s for r in results)
    return results, wall


# -- the openai client ---------------------------------------------------------------------


def openai_client(target: Target, *, asynchronous: bool, timeout_s: float = 600.0):
    import openai

    cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
    return cls(
        base_url=f"{target.url}/v1", api_key=target.api_key, max_retries=0, timeout=timeout_s
    )


async def send_streamed(client, scenario: Scenario, rid: str, index: int, prompt: str) -> Result:
    """One streamed chat completion through the official client, its SSE lines read raw (the
    client hides a missing [DONE]); the times are on this process's perf_counter."""
    import openai

    result = Result(id=rid, index=index, prompt=prompt, start_s=time.perf_counter())
    events: list[tuple[float, str]] = []
    try:
        async with client.chat.completions.with_streaming_response.create(
            model=scenario.model,
            messages=messages(prompt),
            max_tokens=scenario.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Request-Id": rid},
        ) as response:
            result.status = response.status_code
            async for line in response.iter_lines():
                if line.startswith("data:"):
                    events.append((time.perf_counter() - result.start_s, line[5:].strip()))
    except openai.APIStatusError as exc:
        result.status = exc.status_code
        result.code, result.error = error_parts(exc.body if exc.body is not None else exc.message)
    except Exception as exc:  # a broken connection, a timeout: the request failed
        result.code, result.error = type(exc).__name__, str(exc)[:300]
    parse_events(result, events)
    if result.latency_s is None:
        result.latency_s = time.perf_counter() - result.start_s
    return result


async def closed_loop(
    target: Target, scenario: Scenario, level: int, texts: list[str], run_id: str
) -> tuple[list[Result], float]:
    """aiperf's concurrency mode: `level` workers, each sending its next request (the next
    prompt in order) as soon as its last one ended."""
    client = openai_client(target, asynchronous=True)
    queue = list(enumerate(texts))
    queue.reverse()
    results: list[Result] = []

    async def worker() -> None:
        while queue:
            index, prompt = queue.pop()
            rid = f"{run_id}-c{level}-{index}"
            results.append(await send_streamed(client, scenario, rid, index, prompt))

    began = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(level)))
    finally:
        await client.close()
    wall = time.perf_counter() - began
    results.sort(key=lambda r: r.index)
    return results, wall


# -- records and exactness -----------------------------------------------------------------


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def fetch_records(target: Target, since: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with httpx.Client(
        base_url=target.url,
        headers={"Authorization": f"Token {target.operator_token}"},
        timeout=60,
    ) as api:
        url: str | None = "/api/v1/requests/"
        params: dict[str, Any] | None = {
            "tenant_name": target.tenant,
            "since": since,
            "page_size": 500,
            "ordering": "created_at",
        }
        while url:
            response = api.get(url, params=params)
            response.raise_for_status()
            page = response.json()
            rows += page["results"]
            url, params = page.get("next"), None
    return rows


def wait_records(
    target: Target, since: str, ids: set[str], timeout_s: float = RECORDS_WAIT_S
) -> list[dict[str, Any]]:
    """The tenant's records since `since`, once every id in `ids` has one (or at the timeout),
    fetched once more 2 s later so that a late duplicate shows too."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = fetch_records(target, since)
        seen = {r.get("client_request_id") for r in rows}
        if ids <= seen or time.monotonic() >= deadline:
            break
        time.sleep(2)
    time.sleep(2)
    return fetch_records(target, since)


def not_admitted(r: Result) -> bool:
    """Answered 4xx before admission: anything but the overload queue's 429 `queue_full`."""
    return r.status is not None and 400 <= r.status < 500 and r.code != "queue_full"


def check_records(results: list[Result], rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_id: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_id.setdefault(row.get("client_request_id") or "", []).append(row)
    sent = {r.id for r in results}
    # Refused at admission (a rate limit, a bad request): the gateway keeps no record of these
    # (docs/gateway.md: only the overload queue's refusals are recorded, as `rejected`); they
    # fail the first goal, not this one.
    unadmitted = {r.id for r in results if not_admitted(r)}
    missing = sorted(i for i in sent - unadmitted if i not in by_id)
    unrecorded = sorted(i for i in unadmitted if i not in by_id)
    duplicated = sorted(i for i in sent if len(by_id.get(i, [])) > 1)
    extra = sorted(
        (row.get("client_request_id") or row.get("request_id") or "?")
        for i, group in by_id.items()
        if i not in sent
        for row in group
    )
    status_mismatch = []
    token_mismatch = []
    for r in results:
        group = by_id.get(r.id) or []
        if len(group) != 1 or not r.completed:
            continue
        row = group[0]
        if row.get("status") != "ok":
            status_mismatch.append(f"{r.id}: {row.get('status')} {row.get('error', '')[:80]}")
        if r.usage and row.get("completion_tokens") != r.usage.get("completion_tokens"):
            token_mismatch.append(
                f"{r.id}: record {row.get('completion_tokens')}, "
                f"stream {r.usage.get('completion_tokens')}"
            )
    return {
        "sent": len(sent),
        "records": len(rows),
        "exactly_once": len(sent) - len(missing) - len(unrecorded) - len(duplicated),
        "missing": missing,
        "refused_unrecorded": unrecorded,
        "duplicated": duplicated,
        "extra": extra,
        "status_mismatch": status_mismatch,
        "token_mismatch": token_mismatch,
        "ok": not (missing or duplicated or extra or status_mismatch or token_mismatch),
    }


def sample(results: list[Result], k: int) -> list[Result]:
    done = [r for r in results if r.completed]
    if len(done) <= k:
        return done
    step = len(done) / k
    return [done[int(i * step)] for i in range(k)]


def check_exact(
    target: Target, scenario: Scenario, results: list[Result], run_id: str, level: int
) -> dict[str, Any]:
    """Each sampled request's prompt sent alone (not streamed, temperature 0): same text?"""
    client = openai_client(target, asynchronous=False)
    mismatches = []
    errors = []
    checked = 0
    try:
        for r in sample(results, scenario.exact_sample):
            try:
                answer = client.chat.completions.create(
                    model=scenario.model,
                    messages=messages(r.prompt),
                    max_tokens=scenario.max_tokens,
                    temperature=0,
                    extra_headers={"X-Request-Id": f"{run_id}-exact-c{level}-{r.index}"},
                )
            except Exception as exc:
                errors.append(f"{r.id}: {type(exc).__name__}: {exc}"[:200])
                continue
            checked += 1
            alone = answer.choices[0].message.content or ""
            if alone != r.text:
                prefix = len(os.path.commonprefix([alone, r.text]))
                mismatches.append(
                    f"{r.id}: under load {len(r.text)} chars, alone {len(alone)}, "
                    f"first difference at {prefix}"
                )
    finally:
        client.close()
    return {
        "checked": checked,
        "matched": checked - len(mismatches),
        "mismatches": mismatches,
        "errors": errors,
        "ok": checked > 0 and not mismatches and not errors,
    }


# -- figures -------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between the two nearest ranks."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def level_figures(results: list[Result], wall_s: float) -> dict[str, Any]:
    done = [r for r in results if r.completed]
    failures: dict[str, dict[str, Any]] = {}
    for r in results:
        if not r.completed:
            kind = failures.setdefault(r.failure(), {"count": 0, "example": r.error[:200]})
            kind["count"] += 1
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    itl = [r.itl_s for r in done if r.itl_s is not None]
    latency = [r.latency_s for r in done if r.latency_s is not None]
    tokens = sum(r.output_tokens for r in done)
    return {
        "sent": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "failures": dict(sorted(failures.items(), key=lambda kv: -kv[1]["count"])),
        "finish_reasons": {
            reason: sum(1 for r in done if r.finish_reason == reason)
            for reason in sorted({r.finish_reason or "" for r in done})
        },
        "ttft_ms": {"p50": ms(pct(ttft, 50)), "p99": ms(pct(ttft, 99))},
        "itl_ms": {"p50": ms(pct(itl, 50)), "p99": ms(pct(itl, 99))},
        "latency_ms": {"p50": ms(pct(latency, 50)), "p99": ms(pct(latency, 99))},
        "output_tokens": tokens,
        "wall_s": round(wall_s, 2),
        "output_tokens_per_s": round(tokens / wall_s, 1) if wall_s > 0 else None,
        "requests_per_s": round(len(done) / wall_s, 3) if wall_s > 0 else None,
    }


# -- one level -----------------------------------------------------------------------------


def run_level(
    target: Target,
    scenario: Scenario,
    level: int,
    out: Path,
    *,
    client: str,
    run_id: str,
    timeout_s: float = 3600.0,
) -> dict[str, Any]:
    """Send the level's requests, then check completion, records and exactness."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    texts = prompts(scenario, level)
    since = utc_now()
    say(f"concurrency {level}: {len(texts)} requests ({client})")
    if client == "aiperf":
        results, wall = run_aiperf_level(target, scenario, level, texts, out, timeout_s)
    else:
        results, wall = asyncio.run(closed_loop(target, scenario, level, texts, run_id))
    with open(out / "results.jsonl", "w") as f:
        for r in results:
            f.write(json.dumps({**asdict(r), "prompt": f"{len(r.prompt)} chars"}) + "\n")
    figures = level_figures(results, wall)
    say(
        f"concurrency {level}: {figures['completed']}/{figures['sent']} completed, "
        f"{figures['failed']} failed in {figures['wall_s']} s; waiting for the records"
    )
    rows = wait_records(target, since, {r.id for r in results if not not_admitted(r)})
    (out / "records.json").write_text(json.dumps(rows, indent=1) + "\n")
    records = check_records(results, rows)
    exact = check_exact(target, scenario, results, run_id, level)
    say(
        f"concurrency {level}: records exactly once {records['exactly_once']}/{records['sent']} "
        f"(extra {len(records['extra'])}); exact {exact['matched']}/{exact['checked']}"
    )
    return {
        "concurrency": level,
        **figures,
        "records": records,
        "exact": exact,
        "ok": figures["failed"] == 0 and records["ok"] and exact["ok"],
    }


# -- the stack -----------------------------------------------------------------------------


class DemoStack:
    """`python -m bench.demo --no-traffic` in a process group of its own and a state folder of
    its own; the operator token and API key are read from what it prints."""

    def __init__(self, out: Path, *, port: int, emulated: bool, wait_s: float = 600.0) -> None:
        self.out = out
        self.port = port
        self.emulated = emulated
        self.wait_s = wait_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Target:
        self.out.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "BATON_VAR_DIR": str(self.out / "state"),
            "PYTHONUNBUFFERED": "1",
        }
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        argv = [
            sys.executable, "-m", "bench.demo", "--no-traffic",
            "--host", "127.0.0.1", "--port", str(self.port),
        ]  # fmt: skip
        if not self.emulated:
            argv.append("--no-emulated")
        printed = self.out / "demo.out"
        say(f"starting the demo stack: {' '.join(argv[1:])} (output in {printed})")
        with open(printed, "w") as log:
            self.proc = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + self.wait_s
        token = key = ""
        try:
            while not (token and key):
                if self.proc.poll() is not None:
                    raise SystemExit(
                        f"[concurrency] the demo exited ({self.proc.returncode}): "
                        f"{printed.read_text()[-1500:]}"
                    )
                if time.monotonic() > deadline:
                    raise SystemExit(f"[concurrency] the demo did not come up in {self.wait_s} s")
                time.sleep(1)
                for line in printed.read_text().splitlines():
                    if "API token:" in line:
                        token = line.split("API token:", 1)[1].split()[0]
                    if "API key " in line:
                        key = line.split("API key ", 1)[1].split(")")[0].strip()
        except BaseException:
            self.stop()
            raise
        return Target(
            url=f"http://127.0.0.1:{self.port}", api_key=key, operator_token=token, tenant="demo"
        )

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        # The demo stops its children on SIGTERM (SIGTERM, then SIGKILL after its grace).
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def served_context(target: Target, model: str) -> int | None:
    with httpx.Client(
        base_url=target.url,
        headers={"Authorization": f"Token {target.operator_token}"},
        timeout=30,
    ) as api:
        rows = api.get("/api/v1/models/", params={"page_size": 500}).json()["results"]
    for row in rows:
        if row.get("name") == model:
            return row.get("max_context_tokens")
    return None


def check_fits(target: Target, scenario: Scenario) -> None:
    context = served_context(target, scenario.model)
    need = scenario.prompt_chars[1] + CHAT_TEMPLATE_BYTES + scenario.max_tokens
    if context is None:
        raise SystemExit(f"[concurrency] the stack serves no model {scenario.model!r}")
    if need > context:
        raise SystemExit(
            f"[concurrency] the longest prompt needs {need} tokens, {scenario.model}'s "
            f"context is {context}"
        )


# -- the report ----------------------------------------------------------------------------


def goals(levels: list[dict[str, Any]]) -> dict[str, bool]:
    return {
        "every request completed, 0 errors": all(
            lv["failed"] == 0 and lv["completed"] == lv["sent"] for lv in levels
        ),
        "tokens exact (sampled requests = the same prompt alone)": all(
            lv["exact"]["ok"] for lv in levels
        ),
        "records exactly once": all(lv["records"]["ok"] for lv in levels),
    }


def cell(value: Any) -> str:
    return "-" if value is None else f"{value:,}" if isinstance(value, int | float) else str(value)


def render_report(summary: dict[str, Any]) -> str:
    sc = summary["scenario"]
    lines = [
        "# Concurrency 8 / 32 / 128 with a standard client against `make demo`",
        "",
        "Issue 40's goal: a standard benchmark client (NVIDIA's aiperf, or another) at",
        "concurrency 8, 32 and 128 against `make demo` completes every request, slower under",
        "load but with 0 errors; tokens exact and records exactly once. Scenario, checks and",
        "definitions: the docstring of [bench/concurrency.py](../concurrency.py).",
        "",
        "Command:",
        "",
        "```sh",
        summary["command"],
        "```",
        "",
        f"Run {summary['started']} at commit `{summary.get('commit')}` on {summary['machine']};",
        f"client: {summary['client']}; stack: {summary['stack']}.",
        "",
        f"Scenario: chat, streamed, `{sc['model']}`, temperature 0, max_tokens "
        f"{sc['max_tokens']}, prompts {sc['prompt_chars'][0]:,}-{sc['prompt_chars'][1]:,} "
        f"characters (= tokens, byte tokenizer), levels {', '.join(map(str, sc['levels']))}, "
        f"{sc['requests']} requests per level, closed loop, {sc['exact_sample']} requests a "
        "level re-sent alone.",
        "",
        "## Goals",
        "",
        "| goal | result |",
        "|---|---|",
    ]
    for goal, ok in summary["goals"].items():
        lines.append(f"| {goal} | {'**met**' if ok else '**not met**'} |")
    lines += [
        "",
        "## Per level",
        "",
        "| concurrency | sent | completed | failed | TTFT p50 / p99 ms | ITL p50 / p99 ms "
        "| latency p50 / p99 ms | output tok/s | req/s | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lv in summary["levels"]:
        lines.append(
            f"| {lv['concurrency']} | {lv['sent']} | {lv['completed']} | {lv['failed']} "
            f"| {cell(lv['ttft_ms']['p50'])} / {cell(lv['ttft_ms']['p99'])} "
            f"| {cell(lv['itl_ms']['p50'])} / {cell(lv['itl_ms']['p99'])} "
            f"| {cell(lv['latency_ms']['p50'])} / {cell(lv['latency_ms']['p99'])} "
            f"| {cell(lv['output_tokens_per_s'])} | {cell(lv['requests_per_s'])} "
            f"| {cell(lv['wall_s'])} |"
        )
    lines += [
        "",
        "| concurrency | failures (count: reason) | exact (matched / checked) "
        "| records exactly once / sent | missing | duplicated | extra | status or tokens off "
        "| refused at admission (no record due) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for lv in summary["levels"]:
        rec, ex = lv["records"], lv["exact"]
        failures = (
            "; ".join(
                f"{f['count']} x {kind} ({f['example'][:80]})" for kind, f in lv["failures"].items()
            )
            or "none"
        )
        off = len(rec["status_mismatch"]) + len(rec["token_mismatch"])
        lines.append(
            f"| {lv['concurrency']} | {failures} | {ex['matched']} / {ex['checked']} "
            f"| {rec['exactly_once']} / {rec['sent']} | {len(rec['missing'])} "
            f"| {len(rec['duplicated'])} | {len(rec['extra'])} | {off} "
            f"| {len(rec['refused_unrecorded'])} |"
        )
    lines += [
        "",
        f"Raw results: `{summary['raw']}` (per level: prompts, the client's per-request "
        "results or aiperf's artifacts, the request records).",
        "",
    ]
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.concurrency", description=__doc__)
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)))
    parser.add_argument(
        "--requests-per-level",
        type=int,
        help=f"every level sends this many (default {REQUESTS_PER_WORKER} x concurrency)",
    )
    parser.add_argument("--client", choices=("auto", "aiperf", "openai"), default="auto")
    parser.add_argument("--port", type=int, default=8000, help="the demo stack's port")
    parser.add_argument("--with-emulated", action="store_true", help="the idle emulated fleet too")
    parser.add_argument("--url", help="a running stack instead of starting one")
    parser.add_argument("--api-key", help="with --url: a tenant's gateway key")
    parser.add_argument("--operator-token", help="with --url: an operator's REST token")
    parser.add_argument("--tenant", default="demo", help="with --url: the key's tenant")
    parser.add_argument("--level-timeout-s", type=float, default=3600.0)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    try:
        levels = tuple(int(x) for x in args.levels.split(",") if x.strip())
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1 or (args.requests_per_level or 1) < 1:
        print("--levels: whole numbers >= 1; --requests-per-level >= 1", file=sys.stderr)
        return 2
    if args.url and not (args.api_key and args.operator_token):
        print("--url needs --api-key and --operator-token", file=sys.stderr)
        return 2
    scenario = Scenario(levels=levels, requests_per_level=args.requests_per_level)
    version = aiperf_version()
    client = args.client
    if client == "auto":
        client = "aiperf" if version else "openai"
    if client == "aiperf" and not version:
        print(
            "aiperf is not installed in var/aiperf-venv: python3.11 -m venv var/aiperf-venv && "
            f"var/aiperf-venv/bin/pip install aiperf=={AIPERF_VERSION}",
            file=sys.stderr,
        )
        return 2
    if client == "aiperf":
        client_name = f"aiperf {version} (var/aiperf-venv)"
    else:
        import openai

        client_name = f"this module's closed loop on the openai client {openai.__version__}"
    started = utc_now()
    stamp = started[:19].replace(":", "").replace("-", "")
    out = Path(args.out) / stamp
    out.mkdir(parents=True, exist_ok=True)
    run_id = f"cc{stamp[-6:]}"
    stack = (
        contextlib.nullcontext(
            Target(args.url.rstrip("/"), args.api_key, args.operator_token, args.tenant)
        )
        if args.url
        else DemoStack(out / "stack", port=args.port, emulated=args.with_emulated)
    )
    if args.url:
        stack_name = f"a running stack at {args.url}"
    else:
        stack_name = "`python -m bench.demo --no-traffic" + (
            "`" if args.with_emulated else " --no-emulated`"
        )
    results = []
    with stack as target:
        check_fits(target, scenario)
        for level in levels:
            results.append(
                run_level(
                    target, scenario, level, out / f"c{level}",
                    client=client, run_id=run_id, timeout_s=args.level_timeout_s,
                )
            )  # fmt: skip
            (out / "levels.json").write_text(json.dumps(results, indent=1) + "\n")
    summary = {
        "command": "OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m bench.concurrency "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": started,
        "commit": git_commit(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "client": client_name,
        "stack": stack_name,
        "scenario": {
            "model": scenario.model,
            "levels": list(levels),
            "requests": ", ".join(str(scenario.requests(c)) for c in levels),
            "prompt_chars": list(scenario.prompt_chars),
            "max_tokens": scenario.max_tokens,
            "exact_sample": scenario.exact_sample,
            "fixed": scenario.is_fixed,
        },
        "goals": goals(results),
        "levels": results,
        "raw": str(out.relative_to(ROOT)) if out.is_relative_to(ROOT) else str(out),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "REPORT.md").write_text(render_report(summary))
    if scenario.is_fixed:
        REPORT_DIR.mkdir(parents=True, exist_ok=True)
        shutil.copy(out / "summary.json", REPORT_DIR / "summary.json")
        shutil.copy(out / "REPORT.md", REPORT_DIR / "REPORT.md")
        say(f"wrote {REPORT_DIR / 'REPORT.md'} and summary.json")
    else:
        say(f"not the fixed scenario: report in {out / 'REPORT.md'} only")
    for goal, ok in summary["goals"].items():
        say(f"{'MET' if ok else 'NOT MET'}: {goal}")
    return 0 if all(summary["goals"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
