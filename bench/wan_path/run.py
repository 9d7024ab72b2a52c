"""The KV path across the WAN, measured per transport format, with and without streaming.

The scenario, fixed before the first run (never retuned after seeing a result):

* **Models** (real PyTorch engines, float32, on this machine's CPU): ``baton-tiny`` (random
  weights, 4 KiB of KV a token) and a Hugging Face layout checkpoint made here with random
  weights (``bench/harness/checkpoint.py``'s Qwen2 layout, 8 layers, 2 KV heads of 64: 8 KiB a
  token), both loaded by the agents as any checkpoint is.
* **Path:** P in datacenter A, MD in datacenter B, one fresh pair of agents per configuration
  (MD's cache starts empty, so every request's delta is its whole prompt), the link shaped to
  0.2 Gbit/s, 20 ms RTT, 4 connections (``0.2:20:4``), chunked prefill of 256 tokens
  (``--max-batch-tokens``); a reference ``single`` engine per model for the lossless tokens.
* **Requests:** 8 prompts of 2,048 tokens (``make_prompt`` seeds 100-107), P-MD, greedy, 32
  tokens each, top-1 logprobs asked, one at a time.
* **Configurations:** the engine's own format (float32), bfloat16, float16 and int8 on the
  link; the own format and int8 again with the streamed export (``--kv-stream-tokens 256``).
* **Measured per request** (P's ``done`` stats): WAN bytes (the KV the payload stands for, at
  its encoded size) per prompt token; ``prefill_s`` (P's prefill); ``ttft_s``, P's start to
  MD's first token (the prefill, the transfer, MD's import and first step); ``kv_wait_s``, P's
  token ready to MD's first token; the streamed pieces. **Agreement** with the lossless path
  (``single``'s greedy tokens): tokens equal position by position, requests identical, and the
  logprob error: the largest difference of the chosen token's logprob at the positions before
  the first disagreement (MD's from index 1: index 0 is P's token).

Report: bench/wan_path/REPORT.md (``python -m bench.wan_path``); raw results under
``var/bench-wan-path/``. About 5-10 minutes on 2 cores.

**The formats at the paper's scale** (``python -m bench.wan_path --models emulated``; report
bench/wan_path/REPORT-emulated.md), fixed before its first run by the rule "the paper's model,
GPUs, link and context, emulated": P an emulated ``paper-dsv4`` engine on a GPU-A unit, MD one
on a GPU-B unit (``pdd.profiles``), ``--kv-scale 100``, the link the paper scenario's (20 Gbit/s,
20 ms, 76 connections: ``planner/scenarios/_common.json``), 8 prompts of 65,536 tokens (seeds
100-107), MD cold, P-MD, 32 tokens each, one at a time; the engine's own format (the profile's
KV taken as bfloat16), float32 and int8 on the link. The same figures; agreement is with an
emulated ``single`` (its tokens are a function of the context: any difference is a fault).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from agents.node.launch import AgentProcess
from agents.node.loopback import make_prompt, pdd_body, stream_events, summarize
from pdd.vocab import HandoffMode, Pipeline

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
LINK = "0.2:20:4"
PROMPTS = 8
PROMPT_TOKENS = 2048
SEEDS = tuple(range(100, 100 + PROMPTS))
MAX_TOKENS = 32
CHUNK = 256
CONFIGS: tuple[tuple[str, str | None, bool], ...] = (
    ("own", None, False),
    ("own, streamed", None, True),
    ("bfloat16", "bfloat16", False),
    ("float16", "float16", False),
    ("int8", "int8", False),
    ("int8, streamed", "int8", True),
)


# The paper-scale arm (docstring): emulated engines, the paper's link and context.
EMULATED = "profile:paper-dsv4"
EMULATED_LINK = "20:20:76"
EMULATED_PROMPT_TOKENS = 65_536
EMULATED_CONFIGS: tuple[tuple[str, str | None, bool], ...] = (
    ("own", None, False),
    ("float32", "float32", False),
    ("int8", "int8", False),
)


def _args(role: str, dc: str, model: str, *extra: str) -> list[str]:
    if model == EMULATED:
        from pdd.profiles import PAPER_GPUS

        gpu = PAPER_GPUS["GPU-B" if role == "main_decode" and dc == "dc-b" else "GPU-A"]
        link = [a.replace(LINK, EMULATED_LINK) for a in extra]
        return [
            "--role", role, "--model", model, "--datacenter", dc, "--listen", "127.0.0.1:0",
            "--kv-listen", "127.0.0.1:0", "--threads", "1", "--gpu", json.dumps(gpu),
            "--kv-scale", "100", *link,
        ]  # fmt: skip
    return [
        "--role", role, "--model", model, "--datacenter", dc, "--listen", "127.0.0.1:0",
        "--kv-listen", "127.0.0.1:0", "--threads", "1", "--max-batch-tokens", str(CHUNK),
        *extra,
    ]  # fmt: skip


def _sampling() -> dict[str, Any]:
    return {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "logprobs": 1}


def reference(model: str, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """``single``'s greedy tokens and logprobs for each prompt (the lossless path)."""
    one = AgentProcess(_args("main_decode", "dc-a", model), "wan-single", 1)
    out = []
    try:
        one.start()
        for prompt in prompts:
            events, _, _ = stream_events(
                f"{one.http}/v1/generate", {"prompt_ids": prompt, "sampling": _sampling()}
            )
            tokens = [e for e in events if e.get("type") == "token"]
            out.append({"ids": [e["token_id"] for e in tokens],
                        "logprobs": [e.get("logprob") for e in tokens]})  # fmt: skip
    finally:
        one.kill()
        one.cleanup()
    return out


def run_config(model: str, fmt: str | None, streamed: bool,
               prompts: list[list[int]]) -> list[dict[str, Any]]:  # fmt: skip
    """One fresh P / MD pair; each prompt's P-MD answer and P's stats."""
    extra = ("--kv-stream-tokens", str(CHUNK)) if streamed else ()
    md = AgentProcess(_args("main_decode", "dc-b", model, "--link", f"dc-a={LINK}"), "wan-md", 2)
    p = AgentProcess(_args("prefill", "dc-a", model, "--link", f"dc-b={LINK}", *extra),
                     "wan-p", 2)  # fmt: skip
    rows = []
    try:
        md.start()
        p.start()
        for k, prompt in enumerate(prompts):
            body = pdd_body(
                f"wan-{k}", prompt, MAX_TOKENS, Pipeline.P_MD, HandoffMode.ONE_SHOT, p, None, md
            )
            body["sampling"] = _sampling()
            if fmt is not None:
                body["main"]["kv_format"] = fmt
            events, _, _ = stream_events(f"{p.http}/v1/pdd/generate", body)
            got = summarize(events)
            tokens = [e for e in events if e.get("type") == "token"]
            rows.append({"ids": got["output_token_ids"], "error": got["error"],
                         "logprobs": [e.get("logprob") for e in tokens],
                         "stats": got["stats"]})  # fmt: skip
    finally:
        for proc in (p, md):
            proc.kill()
            proc.cleanup()
    return rows


def agreement(rows: list[dict], refs: list[dict]) -> dict[str, Any]:
    equal = total = identical = 0
    worst = 0.0
    for row, ref in zip(rows, refs, strict=True):
        pairs = list(zip(row["ids"], ref["ids"], strict=False))
        equal += sum(a == b for a, b in pairs)
        total += len(ref["ids"])
        identical += row["ids"] == ref["ids"]
        for i, (a, b) in enumerate(pairs):
            if a != b:
                break
            lp, lr = row["logprobs"][i], ref["logprobs"][i]
            if i >= 1 and lp is not None and lr is not None:
                worst = max(worst, abs(lp - lr))
    return {"tokens_equal": equal, "tokens": total, "requests_identical": identical,
            "requests": len(rows), "max_logprob_error": worst}  # fmt: skip


def summarise(rows: list[dict], prompt_tokens: int = PROMPT_TOKENS) -> dict[str, Any]:
    ok = [r for r in rows if not r["error"]]

    def med(key: str) -> float | None:
        values = [r["stats"].get(key) for r in ok if r["stats"].get(key) is not None]
        return statistics.median(values) if values else None

    wan = [r["stats"]["kv_bytes"]["wan"] / prompt_tokens for r in ok]
    return {
        "ok": len(ok),
        "failed": len(rows) - len(ok),
        "bytes_per_token": statistics.median(wan) if wan else None,
        "prefill_s": med("prefill_s"),
        "ttft_s": med("ttft_s"),
        "kv_wait_s": med("kv_wait_s"),
        "pieces": med("kv_stream_pieces"),
        "errors": [r["error"] for r in rows if r["error"]][:3],
    }


def render(results: dict[str, Any]) -> str:
    emulated = list(results["models"]) == ["emulated"]
    lines = [
        "# The KV path across the WAN: formats and the streamed export",
        "",
        "Scenario (fixed before the first run): `bench/wan_path/run.py`'s docstring. Reproduce:",
        f"`python -m bench.wan_path{' --models emulated' if emulated else ''}`; raw results "
        f"under `{results.get('out', 'var/bench-wan-path/')}`.",
        "",
        f"Run: {results['started']}, {results['machine']['cpus']} CPUs, commit "
        f"{results['commit']}, {results['wall_s'] / 60:.1f} min. Times are medians over the "
        f"{PROMPTS} requests, in seconds.",
        "",
    ]
    for model, by_config in results["models"].items():
        lines += [
            f"## {model}",
            "",
            "| format | streamed | bytes / token on the WAN | prefill | P start to MD's first "
            "token (ttft) | P's token ready to MD's first token | pieces | tokens equal to "
            "lossless | requests identical | max logprob error | failed |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for entry in by_config.values():
            s, a = entry["summary"], entry["agreement"]

            def f(x: Any, d: int = 3) -> str:
                return "n/a" if x is None else f"{x:.{d}f}"

            own = "own (bfloat16)" if model == "emulated" else "own (float32)"
            lines.append(
                f"| {entry['format'] or own} | {'yes' if entry['streamed'] else 'no'}"
                f" | {f(s['bytes_per_token'], 0)} | {f(s['prefill_s'])} | {f(s['ttft_s'])} | "
                f"{f(s['kv_wait_s'])} | {f(s['pieces'], 0)} | {a['tokens_equal']} / "
                f"{a['tokens']} | {a['requests_identical']} / {a['requests']} | "
                f"{a['max_logprob_error']:.2e} | {s['failed']} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.wan_path", description=__doc__)
    parser.add_argument("--out", default=str(ROOT / "var" / "bench-wan-path"))
    parser.add_argument(
        "--models",
        default="baton-tiny,qwen2",
        help="baton-tiny and/or qwen2 (the random Hugging Face checkpoint), or emulated (the "
        "paper-scale arm, on its own)",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    wanted = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in wanted if m not in ("baton-tiny", "qwen2", "emulated")]
    if unknown or not wanted or ("emulated" in wanted and wanted != ["emulated"]):
        print(
            f"--models: {unknown or wanted} (known: baton-tiny, qwen2; or emulated alone)",
            file=sys.stderr,
        )
        return 2
    began = time.monotonic()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    results: dict[str, Any] = {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "commit": commit,
        "out": os.path.relpath(out, ROOT) + "/",
        "models": {},
    }
    length = EMULATED_PROMPT_TOKENS if wanted == ["emulated"] else PROMPT_TOKENS
    prompts = [make_prompt(length, seed) for seed in SEEDS]
    for name in wanted:
        model = EMULATED if name == "emulated" else name
        if name == "qwen2":
            from bench.harness.checkpoint import make_checkpoint

            model = str(make_checkpoint("qwen2", out / "ckpt-qwen2"))
        print(f"[wan-path] {name}: reference (single)", flush=True)
        refs = reference(model, prompts)
        by_config: dict[str, Any] = {}
        for label, fmt, streamed in EMULATED_CONFIGS if name == "emulated" else CONFIGS:
            print(f"[wan-path] {name}: {label}", flush=True)
            rows = run_config(model, fmt, streamed, prompts)
            by_config[label] = {
                "format": fmt,
                "streamed": streamed,
                "summary": summarise(rows, length),
                "agreement": agreement(rows, refs),
            }
            (out / f"{name}-{label.replace(', ', '-')}.json").write_text(json.dumps(rows) + "\n")
            print(f"[wan-path]   {json.dumps(by_config[label]['summary'])}", flush=True)
        results["models"][name] = by_config
    results["wall_s"] = round(time.monotonic() - began, 1)
    (out / "summary.json").write_text(json.dumps(results, indent=2) + "\n")
    text = render(results)
    (out / "REPORT.md").write_text(text)
    if wanted == ["baton-tiny", "qwen2"]:
        (HERE / "summary.json").write_text(json.dumps(results, indent=2) + "\n")
        (HERE / "REPORT.md").write_text(text)
    elif wanted == ["emulated"]:
        (HERE / "summary-emulated.json").write_text(json.dumps(results, indent=2) + "\n")
        (HERE / "REPORT-emulated.md").write_text(text)
    print(f"[wan-path] done in {results['wall_s'] / 60:.1f} min: {out / 'REPORT.md'}")
    return 0
