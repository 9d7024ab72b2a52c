"""REPORT.md from the chaos summary (pure: a dict in, markdown out)."""

from __future__ import annotations

from typing import Any


def _spread(x: dict | None) -> str:
    if not x:
        return "-"
    if x["min"] == x["max"]:
        return f"{x['min']:.2f}"
    return f"{x['median']:.2f} ({x['min']:.2f}-{x['max']:.2f})"


def render(summary: dict[str, Any]) -> str:
    lines = [
        "# Chaos: faults against a real local fleet",
        "",
        f"Reproduce: `{summary.get('command', 'make chaos')}`  ",
        f"Date: {summary.get('date', '?')}, commit {summary.get('git_rev', '?')}, "
        f"wall {summary.get('duration_s', 0):.0f} s, host: {summary.get('host', '?')}.",
        "",
        "Fleet: `bench/harness/testbed.py` `start_cluster()` (uvicorn control plane on SQLite "
        "with the in-process beat; agents P and RLD in dc-a, MD in dc-b over the shaped WAN, "
        "1 Gbit/s / 5 ms, MD reached through the harness's fault-injecting TCP proxies "
        "(`wan_proxy=True`, bench/harness/proxy.py); a second P in dc-a for p-kill-two-p). "
        "Requests: streamed `/v1/completions`, `temperature 0`, checked "
        "token for token against the single-engine reference (MD's `/v1/generate` on the same "
        "prompt, taken before any fault).",
        "",
        "## Scenario rule (fixed before the first run)",
        "",
        *summary.get("rule", []),
        "",
        "## Results",
        "",
        "Tokens are counted in the stream's UTF-8 bytes (baton-tiny's ids). *Lost*: reference "
        "tokens missing from the stream; *duplicated*: stream tokens re-sending a stretch "
        "already delivered; *wrong*: other extra tokens; *errors*: requests that ended in an "
        "error (HTTP, SSE error event, broken connection); *missing / double records*: "
        "requests with no / more than one `RequestRecord`; *recovery*: seconds from the fault "
        "to the next request that succeeds, median (min-max) over trials; *gap*: the largest "
        "gap between streamed pieces at the client.",
        "",
        *_HEAD,
    ]
    lines += _rows(summary.get("faults", []))
    prev = summary.get("previous")
    if prev:
        lines += ["", f"Earlier, {prev['label']}, {prev.get('date', '?')}:", "", *_HEAD]
        lines += _rows(prev.get("faults", []))
    for f in summary.get("faults", []):
        lines += ["", f"### {f['name']}: {f['title']}", "", f"Expected: {f['expect']}", ""]
        if f["row"].get("stall_s"):
            lines += [
                "Stall after the fault (fault -> next piece, or the largest gap after it), "
                f"median (min-max): {_spread(f['row']['stall_s'])} s.",
                "",
            ]
        for t in f.get("trial_lines", []):
            lines.append(f"- {t}")
        for n in f.get("notes", []):
            lines.append(f"- **{n}**")
    if summary.get("celery"):
        lines += [
            "",
            "### celery-worker-kill: a Celery worker SIGKILLed while it runs a task (Redis broker)",
            "",
            "Expected: a second worker gets the task again (acks_late, reject on worker lost, "
            "visibility timeout 12 s above the 10 s time limit here; production 150 s / 120 s) "
            "and completes it once. The task is `controlplane.tasks.ping` (4 s), counting its "
            "starts and completions in Redis (bench/chaos/celery_trial.py).",
            "",
            "| rep | deliveries | completions | result | recovery s (kill -> result) | ok |",
            "|---|---|---|---|---|---|",
        ]
        for t in summary["celery"]:
            rec = t.get("recovery_s")
            lines.append(
                f"| r{t['rep']} | {t.get('deliveries', '-')} | {t.get('completions', '-')} | "
                f"`{t.get('result')}` | {'-' if rec is None else f'{rec:.1f}'} | "
                f"{'yes' if t.get('ok') else 'no: ' + str(t.get('error', ''))} |"
            )
    if summary.get("skipped"):
        lines += ["", "## Not run", ""]
        lines += [f"- {s}" for s in summary["skipped"]]
    if summary.get("findings"):
        lines += ["", "## Findings", ""]
        lines += [f"- {s}" for s in summary["findings"]]
    lines += [
        "",
        "Raw per-trial JSON: `var/chaos/` (git-ignored); the summary: `bench/chaos/summary.json`; "
        "earlier runs and what changed between them: `bench/chaos/HISTORY.md`.",
        "",
    ]
    return "\n".join(lines)


_HEAD = [
    "| fault | trials | requests | finished correct | lost tokens | duplicated tokens "
    "| wrong tokens | errors | missing records | double records | migrations "
    "| recovery s | max gap s |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
]


def _rows(faults: list[dict]) -> list[str]:
    out = []
    for f in faults:
        r = f["row"]
        out.append(
            f"| {f['name']} | {r['trials']} | {r.get('requests', 0)} | {r['finished_correct']} "
            f"| {r['lost_tokens']} | {r['duplicated_tokens']} | {r.get('wrong_tokens', 0)} "
            f"| {r['errors']} | {r['missing_records']} | {r['double_records']} "
            f"| {r.get('migrations', 0)} | {_spread(r.get('recovery_s'))} "
            f"| {_spread(r.get('max_gap_s'))} |"
        )
    return out
