"""REPORT.md from a results dict (``bench.pdd.run`` writes one), plus its plots. The text
needs nothing but the dict, so the tests render a small canned one."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdd.vocab import Pipeline

SYSTEM_ORDER = ("idc-pd", "cdc-pd", "pdd")
LABELS = {"idc-pd": "IDC-PD", "cdc-pd": "CDC-PD", "pdd": "PDD"}
GOAL_TEXT = {
    "pdd_vs_cdc_p90": "PDD / CDC-PD P90 TTFT <= 0.5",
    "pdd_vs_idc_p90": "PDD / IDC-PD P90 TTFT <= 1.1",
    "rld_share": "RLD token share <= 10%",
    "sim_error": "simulator within 15% of live P90 TTFT",
    "relayed_cached": "<= 2% of requests relayed although MD held > 90% of the prompt",
}


def s(x: Any, digits: int = 3) -> str:
    """Seconds (or any float) for a table cell."""
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        if math.isinf(x):
            return "inf"
        return f"{x:.{digits}f}"
    return str(x)


def pct(x: float | None) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{100 * x:.1f}%"


def mb(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e6:.1f}"


def rate_label(results: Mapping, key: str) -> str:
    for r in results["scaling"]["rates"]:
        if r["key"] == key:
            return f"{100 * r['utilisation']:.0f}% ({r['rps']:.2f} req/s)"
    return key


def systems(results: Mapping) -> list[str]:
    return [k for k in SYSTEM_ORDER if k in results.get("live", {})]


def rate_keys(results: Mapping) -> list[str]:
    return [r["key"] for r in results["scaling"]["rates"]]


def render(results: Mapping[str, Any], plots: Mapping[str, str] | None = None) -> str:
    meta = results["meta"]
    sc = results["scaling"]
    sla = sc["sla"]
    link = sc["link"]
    out: list[str] = []
    w = out.append
    opening_s = (
        sla["opening_tokens"] * sc["kv_bytes_per_token"] * 8 / (link["bandwidth_gbps"] * 1e9)
    )
    title = "Live PDD benchmark: IDC-PD, CDC-PD and PDD on real agents"
    if meta.get("quick"):
        title += " (QUICK RUN: development size, not the benchmark)"
    w(f"# {title}\n")
    w(
        f"Reproduce: `{meta['command']}` (wall time **{meta['wall_s'] / 60:.1f} min** on "
        f"{meta.get('machine', 'this machine')}, {meta.get('started', '')})."
        + (
            f" This text was rendered again from that run's results.json on "
            f"{meta['rendered_again']} (`python -m bench.pdd --render "
            "var/bench-pdd/full/results.json`); the figures are the run's."
            if meta.get("rendered_again")
            else ""
        )
        + "\n"
    )
    w(
        "Three fleets, one after another on one control plane and database, each built over the "
        "REST API (datacenters, GPU types, unit prices, WAN link, model, nodes, instances; the "
        "agents register with their node tokens), replay the same agentic trace through the "
        "gateway with the official `openai` client (streaming chat completions, greedy). "
        "Latencies are the client's: TTFT is the first content delta, the largest stall the "
        "largest gap between content deltas, TPOT the mean gap after the first token.\n"
    )
    # --- headline -----------------------------------------------------------------------------
    w("## Goals\n")
    w("| goal | " + " | ".join(rate_label(results, k) for k in rate_keys(results)) + " | met |")
    w("|---|" + "---|" * (len(rate_keys(results)) + 1))
    for goal, text in GOAL_TEXT.items():
        rows = [g for g in results.get("goals", []) if g["goal"] == goal]
        if not rows:
            continue
        cells = []
        for key in rate_keys(results):
            mine = [g for g in rows if g["rate"] == key]
            if not mine:
                cells.append("-")
                continue
            if goal == "sim_error":
                cells.append(
                    ", ".join(f"{g['what'].rsplit(', ', 1)[-1]} {pct(g['value'])}" for g in mine)
                )
            elif goal in ("rld_share", "relayed_cached"):
                cells.append(pct(mine[0]["value"]))
            else:
                cells.append(s(mine[0]["value"], 2))
        met = all(g["met"] for g in rows)
        w(f"| {text} | " + " | ".join(cells) + f" | {'yes' if met else '**no**'} |")
    w("")
    why = explain(results)
    if why:
        w("Why, from the run's own figures (diagnostics in the tables below):\n")
        for line in why:
            w(f"- {line}")
        w("")
    # --- scaling ------------------------------------------------------------------------------
    w("## Scaling (fixed before the first run)\n")
    w(
        f"- **WAN** as in the demo: {link['bandwidth_gbps'] * 1000:.0f} Mbit/s, "
        f"{link['rtt_ms']:.0f} ms RTT, {link['connection_pool_size']} connections. baton-tiny has "
        f"{sc['kv_bytes_per_token'] // 1024} KiB of KV per token, so the trace's median opening "
        f"({sla['opening_tokens']} tokens) takes "
        f"{opening_s:.2f}"
        " s on the idle link, about what production KV takes on a shared 20 Gbit/s line."
    )
    w(f"- **Trace**: {sc['workload']}")
    w(
        "- **Rates**: for each target utilisation u of CDC-PD's WAN, the rate whose own trace "
        "(same seed) has u = (sum over requests of prompt tokens minus the trace's reusable "
        "prefix, i.e. MD holds the session's previous turn) x KV bytes per token / (arrival "
        "span x link bandwidth), found by bisection on the rate before any run:"
    )
    w("")
    w("| target | rate (req/s) | requests | mean KV delta (tokens) | trace utilisation |")
    w("|---|---|---|---|---|")
    for r in sc["rates"]:
        w(
            f"| {pct(r['utilisation'])} | {r['rps']:.3f} | {r['requests']} | "
            f"{r['mean_delta_tokens']:.0f} | {pct(r['trace_utilisation'])} |"
        )
    w("")
    w(
        f"- **SLA**: TTFT P90 <= **{sla['ttft_p90_s']:.2f} s** and P99 <= "
        f"**{sla['ttft_p99_s']:.2f} s**: {sla['factor_p90']:g}x and {sla['factor_p99']:g}x the "
        f"idle in-DC TTFT of the median opening ({sla['basis_s']:.3f} s: its prefill at the "
        "measured engine speed plus one decode step; P99 / P90 = 1.5 as the paper's 15 s / "
        "10 s). A request is *good* when it completed with TTFT within the P90 bound; "
        "goodput = good requests per second of the arrival span; BCR = goodput / fleet cost "
        "per hour."
    )
    w(
        f"- **Engines** measured in-process before the runs (baton-tiny, 1 thread, passive wait): "
        f"{_engine_text(results['engine'])}. The simulator runs on these."
    )
    fabric = results["engine"].get("fabric")
    if fabric:
        relay = fabric.get("relay")
        if relay:
            w(
                "- **KV handoffs** measured on agents on loopback before the runs (one request "
                "at a time, the median of the repeated requests per point): a plain one, P to MD "
                f"in its datacenter, {fabric['latency_ms']:.1f} ms + bytes at "
                f"{fabric['gbps']:.2f} Gbit/s (within {100 * fabric['max_error']:.0f}%), the "
                "simulator's intra-DC fabric; a relay's, P to RLD while it ships MD's KV too, "
                f"{relay['latency_ms']:.1f} ms + bytes at {relay['gbps']:.2f} Gbit/s (within "
                f"{100 * relay['max_error']:.0f}%), its relay handoff."
            )
        else:
            w(
                "- **KV fabric** measured on agents on loopback before the runs (one p-rld-md "
                "request at a time, RLD decoding over the intra-datacenter fabric): "
                f"{fabric['latency_ms']:.1f} ms + bytes at {fabric['gbps']:.2f} Gbit/s per "
                f"handoff (within {100 * fabric['max_error']:.0f}%); the simulator's intra-DC "
                "fabric."
            )
    reports_s = results["meta"].get("sim_link_reports_s")
    if reports_s:
        w(
            "- **The WAN link's use**, as the simulated policy reads it: from the P agent's "
            f"heartbeat every {reports_s:g} s (the bytes of the last interval), as the live "
            "gateway reads it, not at the moment of each decision."
        )
    if results["meta"].get("sim_decision_in_flight"):
        w(
            "- **MD's prefix**, as the simulated policy reads it: with the KV already on its "
            "way to MD, as the live gateway counts an MD agent's incoming blocks."
        )
    w("- **Fleets** (GPUs are nominal: every engine is one CPU process here):")
    for key in systems(results):
        f = results["fleets"][key]
        parts = ", ".join(
            f"{c['role']} {c['gpu_count']}x {c['gpu_type']}@{c['datacenter']} "
            f"({c['price_per_gpu_hour']:.2f}/GPU-h)"
            for c in f["cost_rows"]
        )
        w(
            f"  - {LABELS[key]}: {parts}; **{f['cost_per_hour']:.2f} per hour**; "
            f"policy {f['policy_note']}"
        )
    w("")
    # --- live table ---------------------------------------------------------------------------
    w("## Live results\n")
    w(
        "| system | rate | TTFT P50 / P90 / P99 (s) | TPOT (ms) | e2e P50 / P90 (s) | "
        "largest stall P99 (s) | RLD share | relayed | WAN MB (wire) | WAN busy | handoff KB | "
        "goodput (req/s) | SLA | cost/h | BCR |"
    )
    w("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for key in systems(results):
        for rk in rate_keys(results):
            r = results["live"][key].get(rk)
            if r is None:
                continue
            t = r["ttft_s"]
            relayed = r["pipelines"].get(Pipeline.P_RLD_MD, 0)
            w(
                f"| {LABELS[key]} | {rate_label(results, rk)} | {s(t['p50'])} / {s(t['p90'])} / "
                f"{s(t['p99'])} | {s(r['tpot_s']['mean'] * 1000, 1)} | {s(r['e2e_s']['p50'])} / "
                f"{s(r['e2e_s']['p90'])} | {s(r['max_gap_s']['p99'])} | {pct(r['rld_share'])} | "
                f"{relayed} of {r['records']} | {mb(r['wan_bytes'])} ({mb(r['wan_wire_bytes'])}) | "
                f"{pct(r['wan_utilisation'])} | {r['handoff_bytes'] / 1e3:.1f} | "
                f"{r['goodput_rps']:.2f} | {'met' if r['sla_met'] else 'missed'} | "
                f"{r['cost_per_hour']:.2f} | {r['bcr']:.4f} |"
            )
    w("")
    w(
        "Requests and records (a completed request is one whose stream reached `[DONE]` with its "
        "usage; the gateway's record is matched by the response id):\n"
    )
    w(
        "| system | rate | sent | completed | failed | completed without a record | "
        "relayed though MD held > 90% (of which the decision knew) | record TTFT P50 / P90 "
        "(s) | record prefill / KV wait / max gap means (s) | prewarmed sessions | "
        "unfinished at the drain cap (of them never sent) |"
    )
    w("|---|---|---|---|---|---|---|---|---|---|---|")
    for key in systems(results):
        for rk in rate_keys(results):
            r = results["live"][key].get(rk)
            if r is None:
                continue
            m = r["record_means"]
            w(
                f"| {LABELS[key]} | {rate_label(results, rk)} | {r['sent']} | {r['completed']} | "
                f"{r['failed']} | **{r['missing_records']}** | {r['relayed_cached']} "
                f"({r.get('relayed_cached_known', '-')}) | "
                f"{s(r['record_ttft_s']['p50'])} / {s(r['record_ttft_s']['p90'])} | "
                f"{s(m.get('prefill_s'))} / {s(m.get('kv_wait_s'))} / {s(m.get('max_gap_s'))} | "
                f"{r.get('prewarm_sessions', '-')} | {r.get('unfinished_at_drain', '-')} "
                f"({_never_sent(r)}) |"
            )
    w("")
    w(
        "CPU (cores, of the machine's 2) used by each of the benchmark's processes over each run, "
        "and the machine's mean 1-minute load average (other work on the machine included):\n"
    )
    roles = ("prefill", "relay_decode", "main_decode", "gateway", "client")
    w("| system | rate | " + " | ".join(roles) + " | load average |")
    w("|---|---|" + "---|" * (len(roles) + 1))
    for key in systems(results):
        for rk in rate_keys(results):
            r = results["live"][key].get(rk)
            if r is None:
                continue
            cpu = r.get("cpu") or {}
            cells = [s(cpu.get(role), 2) for role in roles]
            w(
                f"| {LABELS[key]} | {rate_label(results, rk)} | "
                + " | ".join(cells)
                + f" | {s(cpu.get('load_avg'), 2)} |"
            )
    w("")
    _engine_busy_table(results, w)
    # --- simulator ----------------------------------------------------------------------------
    if results.get("sim"):
        w("## Simulator beside it\n")
        host = _sim_host(results)
        dedicated = results.get("sim_dedicated") or {}
        if host:
            where = (
                f"one unit per role, every engine on a host of {host['cores']:g} cores shared "
                "as the live agents share this machine's (planner/host.py: while more tasks are "
                "busy than cores, each one's work is stretched by busy tasks / cores), with the "
                f"gateway's {1000 * host.get('request_cpu_s', 0.0):.1f} ms of CPU per request "
                "(bench/gateway/REPORT.md) as one more task"
                + ("; *dedicated*: every engine alone at its measured speed" if dedicated else "")
            )
        else:
            where = "one unit per role, dedicated hardware (the live agents share two cores)"
        w(
            "`planner` (planner/sim.py through planner.api.run_fleet) on the same trace, link, "
            f"prices, policies and the measured engine step times; {where}. "
            "`.venv/bin/python -m bench.pdd.live_check` regenerates these figures from "
            "summary.json.\n"
        )
        extra = " dedicated P90 (s) |" if dedicated else ""
        w(
            "| system | rate | live TTFT P50 / P90 / P99 (s) | simulated P50 / P90 / P99 (s) | "
            f"P90 error |{extra} live RLD share | simulated RLD share | simulated relayed | "
            "simulated WAN busy |"
        )
        w("|---|---|---|---|---|" + ("---|" if dedicated else "") + "---|---|---|---|")
        for key in systems(results):
            for rk in rate_keys(results):
                r = results["live"][key].get(rk)
                m = results["sim"].get(key, {}).get(rk)
                if r is None or m is None:
                    continue
                lt, st = r["ttft_s"], m["ttft_s"]
                err = (st["p90"] - lt["p90"]) / lt["p90"] if lt["p90"] else float("nan")
                alone = dedicated.get(key, {}).get(rk)
                cell = ""
                if dedicated:
                    cell = f" {s(alone['ttft_s']['p90']) if alone else '-'} |"
                w(
                    f"| {LABELS[key]} | {rate_label(results, rk)} | {s(lt['p50'])} / "
                    f"{s(lt['p90'])} / {s(lt['p99'])} | {s(st['p50'])} / {s(st['p90'])} / "
                    f"{s(st['p99'])} | {'+' if err >= 0 else ''}{pct(err)} |{cell} "
                    f"{pct(r['rld_share'])} | {pct(m['rld_share'])} | "
                    f"{m['pipelines'].get(Pipeline.P_RLD_MD, 0)} of {m['requests']} | "
                    f"{pct(m['wan_utilisation'])} |"
                )
        w("")
    # --- correctness --------------------------------------------------------------------------
    if results.get("spot"):
        w("## Correctness spot-check\n")
        w(
            "Greedy requests through the gateway against the `single` pipeline "
            "(`POST /v1/generate` on the MD agent, the whole request on one engine):\n"
        )
        w(
            "| system | prompt tokens | max tokens | pipeline | tokens (gateway / single) | same "
            "text |"
        )
        w("|---|---|---|---|---|---|")
        for key in systems(results):
            for c in results["spot"].get(key, []):
                w(
                    f"| {LABELS[key]} | {c['prompt_tokens']} | {c['max_tokens']} | "
                    f"{c.get('pipeline') or '-'} | {c.get('gateway_tokens')} / "
                    f"{c.get('single_tokens')} | {'yes' if c.get('same') else '**no**'} |"
                )
        w("")
    if plots:
        w("## Plots\n")
        for name, caption in plots.items():
            w(f"![{caption}]({name})\n")
    if results.get("notes"):
        w("## Notes\n")
        for line in results["notes"]:
            w(f"- {line}")
        w("")
    if results.get("errors"):
        w("## Errors during the run\n")
        for line in results["errors"]:
            w(f"- {line}")
        w("")
    return "\n".join(out).rstrip() + "\n"


def _smooth(values: list[float], k: int = 5) -> list[float]:
    """Trailing mean over k samples (the 1-s counter samples jitter with the poll times)."""
    out = []
    for i in range(len(values)):
        window = values[max(0, i - k + 1) : i + 1]
        out.append(sum(window) / len(window))
    return out


def _engine_text(engine: Mapping) -> str:
    p, d = engine["prefill"], engine["decode"]
    return (
        f"prefill {p['overhead_s'] * 1e3:.1f} ms + {p['per_token_s'] * 1e6:.0f} us/token + "
        f"{p['per_pair_s'] * 1e9:.0f} ns per token-pair of attention (fit within "
        f"{100 * p['max_error']:.0f}%); decode step {d['overhead_s'] * 1e3:.1f} ms + "
        f"{d['per_ctx_token_s'] * 1e6:.2f} us per context token in the batch (within "
        f"{100 * d['max_error']:.0f}%)"
    )


def plot(results: Mapping[str, Any], out_dir: Path) -> dict[str, str]:
    """TTFT CDFs per system (a panel per rate) and PDD's RLD share and WAN use over time.
    Returns {file name: caption}; empty without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    made: dict[str, str] = {}
    keys = rate_keys(results)
    cdf = results.get("cdf", {})
    if cdf:
        fig, axes = plt.subplots(1, len(keys), figsize=(3.6 * len(keys), 3.0), squeeze=False)
        for ax, rk in zip(axes[0], keys, strict=True):
            for key in systems(results):
                values = sorted(v for v in cdf.get(key, {}).get(rk, []) if math.isfinite(v))
                if not values:
                    continue
                n = len(cdf[key][rk])
                ax.step(
                    values,
                    [(i + 1) / n for i in range(len(values))],
                    where="post",
                    label=LABELS[key],
                )
            ax.axvline(results["scaling"]["sla"]["ttft_p90_s"], color="grey", ls=":", lw=1)
            ax.set_title(rate_label(results, rk), fontsize=9)
            ax.set_xlabel("TTFT (s)", fontsize=8)
            ax.set_xscale("log")
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("share of requests", fontsize=8)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / "ttft_cdf.png", dpi=80)
        plt.close(fig)
        made["ttft_cdf.png"] = "TTFT CDF per system, one panel per rate (dotted: SLA P90 bound)"
    series = results.get("series", {})
    if series:
        fig, axes = plt.subplots(2, 1, figsize=(7.5, 4.5), sharex=True)
        for key in systems(results):
            for rk in keys:
                ser = series.get(key, {}).get(rk)
                if not ser:
                    continue
                label = f"{LABELS[key]} {rate_label(results, rk).split(' ')[0]}"
                if key == "pdd" and ser.get("rld_share"):
                    axes[0].plot(ser["rld_t"], [100 * v for v in ser["rld_share"]], label=label)
                if key != "idc-pd" and ser.get("wan_busy"):
                    axes[1].plot(
                        ser["t"],
                        [100 * v for v in _smooth(ser["wan_busy"])],
                        label=label,
                        ls="-" if key == "pdd" else "--",
                    )
        axes[0].set_ylabel("PDD RLD share (%)", fontsize=8)
        axes[1].set_ylabel("WAN busy (%)", fontsize=8)
        axes[1].set_xlabel("seconds into the run", fontsize=8)
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=7)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=6, ncol=3)
        fig.tight_layout()
        fig.savefig(out_dir / "rld_wan.png", dpi=80)
        plt.close(fig)
        made["rld_wan.png"] = (
            "PDD's RLD token share (5-s bins, by send time) and WAN use (wire bytes per second "
            "over the link's bandwidth, P and RLD agents' counters, 5-s trailing mean) over "
            "each run; the counters add a transfer's bytes when it ends, so completions that "
            "bunch up show above 100%"
        )
    return made


def _sim_host(results: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The shared host the simulated figures ran on, if any (``meta.sim_host``)."""
    host = (results.get("meta") or {}).get("sim_host")
    return host if isinstance(host, Mapping) else None


def _never_sent(r: Mapping) -> str:
    if "unfinished_at_drain" not in r or "requests" not in r:
        return "-"
    return str(r["requests"] - r["sent"])


def _tail(r: Mapping) -> Mapping:
    return (r.get("diagnostics") or {}).get("tail") or {}


def explain(results: Mapping[str, Any]) -> list[str]:
    """One line per missed goal and rate, built from the run's diagnostics."""
    live = results.get("live", {})
    lines: list[str] = []
    loads: dict[str, list[float]] = {}
    used: list[float] = []
    for key in systems(results):
        for r in live[key].values():
            cpu = r.get("cpu") or {}
            if cpu.get("load_avg") is not None:
                loads.setdefault(key, []).append(cpu["load_avg"])
            own = [v for k, v in cpu.items() if k != "load_avg" and v is not None]
            if own:
                used.append(sum(own))
    if loads and used:
        parts = ", ".join(f"{LABELS[k]} {min(v):.1f}-{max(v):.1f}" for k, v in loads.items())
        lines.append(
            "The testbed is CPU-bound as well as WAN-bound: the benchmark's own processes took "
            f"{min(used):.1f}-{max(used):.1f} of the 2 cores and other work ran beside them, "
            f"unevenly (1-minute load average during the runs: {parts}), so the systems compare "
            "under different CPU contention, and P's prefill time (record prefill means) grows "
            "with the rate even in IDC-PD, which has no WAN."
        )
    for g in results.get("goals", []):
        if g["met"]:
            continue
        rk, label = g["rate"], rate_label(results, g["rate"])
        pdd = live.get("pdd", {}).get(rk, {})
        if g["goal"] in ("pdd_vs_cdc_p90", "pdd_vs_idc_p90"):
            other = "cdc-pd" if g["goal"] == "pdd_vs_cdc_p90" else "idc-pd"
            o = live.get(other, {}).get(rk, {})
            tp, to = _tail(pdd), _tail(o)
            lines.append(
                f"{GOAL_TEXT[g['goal']]} at {label}: {s(g['value'], 2)}. PDD P90 "
                f"{s(pdd['ttft_s']['p90'], 2)} s against {LABELS[other]} "
                f"{s(o['ttft_s']['p90'], 2)} s. PDD's slowest tenth waited "
                f"{s(tp.get('prefill_s'), 2)} s for P and {s(tp.get('kv_wait_s'), 2)} s for KV "
                f"on average ({pct(tp.get('relayed_share'))} relayed, "
                f"{pct(tp.get('opening_share'))} low-hit); {LABELS[other]}'s "
                f"{s(to.get('prefill_s'), 2)} s and {s(to.get('kv_wait_s'), 2)} s."
            )
        elif g["goal"] == "rld_share":
            d = pdd.get("diagnostics") or {}
            relayed = d.get("relayed", 0)
            alone = d.get("relayed_rld_alone", 0)
            n = pdd.get("records") or 1
            lines.append(
                f"RLD share at {label}: {pct(g['value'])}. The policy relayed {relayed} of {n} "
                f"requests ({pct(relayed / n)}), and RLD finished {alone} of them alone: outputs "
                f"average {s(d.get('mean_output_tokens'), 1)} tokens, fewer than RLD decodes "
                "while a relayed request's KV crosses the busy link, so nearly every relayed "
                "token is RLD's and the share follows the relayed fraction."
            )
        elif g["goal"] == "relayed_cached":
            k = pdd.get("relayed_cached_known", 0)
            n = pdd.get("relayed_cached", 0)
            lines.append(
                f"Relayed although MD held > 90% at {label}: {n} requests ({pct(g['value'])}); "
                f"the decision itself estimated MD's hit above 90% for {k} of them (relayed for "
                "the estimated WAN time on a busy link or a full MD, not for a stale view of "
                f"MD's cache), the other {n - k} on an estimate below 90% (a stale view)."
            )
        elif g["goal"] == "sim_error":
            system = g["what"].rsplit(", ", 1)[-1]
            r = live.get(system, {}).get(rk, {})
            m = results.get("sim", {}).get(system, {}).get(rk, {})
            d = (r.get("diagnostics") or {}).get("all") or {}
            cpu = r.get("cpu") or {}
            used = sum(v for k, v in cpu.items() if k != "load_avg" and v is not None)
            host = _sim_host(results)
            means = m.get("means") or {}
            if host:
                simulated = (
                    f" (simulated: {s(means['prefill_s'], 2)} s and {s(means['kv_wait_s'], 2)} s)"
                    if means.get("prefill_s") is not None and means.get("kv_wait_s") is not None
                    else ""
                )
                model = (
                    f"on average{simulated}; the simulator shares "
                    f"{host['cores']:g} cores among the engines and the gateway's "
                    f"{1000 * host.get('request_cpu_s', 0.0):.1f} ms per request, "
                    + (
                        "the KV handoff as measured on the agents, and no term for"
                        if results["engine"].get("fabric")
                        else "with no term for the KV handoff's CPU,"
                    )
                    + " the processes' work outside the engine steps or "
                    "other work on the machine, while here"
                )
            else:
                model = (
                    "on average; the simulator runs each engine alone at the measured speed, "
                    "while here"
                )
            lines.append(
                f"Simulator at {label}, {LABELS.get(system, system)}: P90 "
                f"{s((m.get('ttft_s') or {}).get('p90'), 2)} s simulated against "
                f"{s(r['ttft_s']['p90'], 2)} s live ({pct(g['value'])} off). Live requests "
                f"spent {s(d.get('prefill_s'), 2)} s in P and {s(d.get('kv_wait_s'), 2)} s "
                f"waiting for KV {model} the benchmark's processes used {used:.2f} cores at a "
                f"load average of {s(cpu.get('load_avg'), 2)} on "
                f"{host['cores'] if host else 2:g} cores."
            )
    return lines


def _engine_busy_table(results: dict, w) -> None:
    """The engines' busy time live (the agents' ``engine.busy_s``) beside the simulator's engines
    (its shared host's CPU per role), where the run measured it."""
    roles = ("prefill", "relay_decode", "main_decode")
    rows = [
        (key, rk, r)
        for key in systems(results)
        for rk in rate_keys(results)
        if (r := results["live"][key].get(rk)) is not None and r.get("engine_busy")
    ]
    if not rows:
        return
    w(
        "Engine threads busy (wall seconds per second, summed over a role's instances: the "
        "agents' `engine.busy_s`, prefill, decode and the KV export and import they run), live "
        "against the simulator's engines on its shared host (its CPU per role), as live / "
        "simulated:\n"
    )
    w("| system | rate | " + " | ".join(roles) + " |")
    w("|---|---|" + "---|" * len(roles))
    for key, rk, r in rows:
        sim = (((results.get("sim") or {}).get(key) or {}).get(rk) or {}).get("host") or {}
        sim_cpu = sim.get("cpu") or {}
        cells = []
        for role in roles:
            live = r["engine_busy"].get(role)
            cells.append("-" if live is None else f"{s(live, 3)} / {s(sim_cpu.get(role), 3)}")
        w(f"| {LABELS[key]} | {rate_label(results, rk)} | " + " | ".join(cells) + " |")
    w("")
