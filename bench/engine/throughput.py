"""`python -m bench.engine throughput`: prefill / decode throughput of the engine alone
(baton-tiny, or a checkpoint folder with --model) at batch 1, 8 and 32, and the time of an
extend (the handoff's recompute) of k tokens on top of a cached context; prints JSON. The device
is $BATON_ENGINE_DEVICE (default cpu).

`--compare-wait-policies` instead runs the thread-settings comparison (bench/agents/REPORT.md,
"Engine threads"): each arm (engine processes x torch threads, OMP_WAIT_POLICY) as fresh
subprocesses of this tool, started together when an arm has several (agents sharing the
host), the arms interleaved round by round (A, B, A, B, ...), plus the CPU an idle engine
process burns per policy; prints medians and spreads, writes every raw run with --out."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from agents.engine import BATON_TINY, Engine, EngineConfig, SamplingParams, load_model
from agents.engine.config import parse_dtype
from bench.harness.output import publish

BLOCK_SIZE = 16
ROOT = Path(__file__).resolve().parents[2]


def _prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(32, 127, (length,), generator=gen).tolist()


def bench_batch(
    loaded, batch: int, prompt_len: int, decode_steps: int, dtype: str = "float32"
) -> dict[str, dict]:
    """One engine, `batch` distinct prompts: time the prefill forward, then `decode_steps`."""
    need = batch * (-(-(prompt_len + decode_steps + 1) // BLOCK_SIZE))
    config = EngineConfig(
        block_size=BLOCK_SIZE,
        num_blocks=need + 8,
        max_running=batch,
        max_queued=batch,
        max_batch_tokens=batch * prompt_len,
        dtype=dtype,
    )
    engine = Engine(loaded, config)
    params = SamplingParams(max_tokens=decode_steps + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", _prompt(prompt_len, seed=i), params)
    start = time.perf_counter()
    first = engine.step()  # every prompt in one forward
    prefill_s = time.perf_counter() - start
    assert len(first) == batch, "all prompts should prefill in one step"
    generated, step_s = 0, []
    for _ in range(decode_steps):
        start = time.perf_counter()
        generated += sum(len(out.token_ids) for out in engine.step())
        step_s.append(time.perf_counter() - start)
    decode_s = sum(step_s)
    assert generated == batch * decode_steps, "every request decodes every step"
    return {
        "prefill": {
            "tokens": batch * prompt_len,
            "seconds": prefill_s,
            "tokens_per_s": batch * prompt_len / prefill_s,
        },
        "decode": {
            "tokens": generated,
            "seconds": decode_s,
            "tokens_per_s": generated / decode_s,
            "step_ms": 1000 * decode_s / decode_steps,
            # Robust to other processes stealing the cores for part of the run.
            "step_ms_median": 1000 * statistics.median(step_s),
        },
    }


def bench_recompute(
    loaded, k: int, context_len: int, repeats: int, dtype: str = "float32"
) -> dict[str, float]:
    """Time `extend` of k known tokens (one forward over k positions) after a cached context."""
    config = EngineConfig(
        block_size=BLOCK_SIZE, num_blocks=4 * (context_len + k) // BLOCK_SIZE + 16, dtype=dtype
    )
    engine = Engine(loaded, config)
    prompt = _prompt(context_len, seed=1000)
    params = SamplingParams(max_tokens=k + 1, ignore_eos=True)
    times = []
    for rep in range(repeats + 1):
        rid = f"k{k}-{rep}"
        engine.prefill(rid, prompt, params)  # holds prompt KV + the first token, not computed
        handed_over = _prompt(k - 1, seed=rep) if k > 1 else []
        start = time.perf_counter()
        engine.extend(rid, handed_over)  # forward over first token + k-1 = k positions
        elapsed = time.perf_counter() - start
        engine.release(rid)
        if rep:  # the first run warms up allocations
            times.append(1000 * elapsed)
    return stats_ms(times)


def stats_ms(times_ms: list[float]) -> dict[str, float]:
    """Runs, mean, median, min, max and population std of timings in ms."""
    return {
        "runs": len(times_ms),
        "mean_ms": statistics.fmean(times_ms),
        "median_ms": statistics.median(times_ms),
        "min_ms": min(times_ms),
        "max_ms": max(times_ms),
        "std_ms": statistics.pstdev(times_ms),
    }


# -- thread settings: interleaved comparison of OpenMP wait policies ----------------------------

# (name, engine processes started together, torch threads each, OMP_WAIT_POLICY or None = the
# runtime's default). Fixed before the first run (2-core machine, 3 agents as in the testbed).
WAIT_POLICY_ARMS: tuple[tuple[str, int, int, str | None], ...] = (
    ("dedicated-active", 1, 2, "ACTIVE"),
    ("dedicated-passive", 1, 2, "PASSIVE"),
    ("dedicated-default", 1, 2, None),
    ("shared-3x2-active", 3, 2, "ACTIVE"),
    ("shared-3x2-passive", 3, 2, "PASSIVE"),
    ("shared-3x1-passive", 3, 1, "PASSIVE"),  # what --agents-per-host 3 gives on 2 cores
)
# The workload of every run in the comparison (the recompute part is left out: its figures
# come from `python -m bench.engine handoff`).
COMPARE_WORKLOAD = ["--batches", "1", "8", "32", "--prompt-len", "128", "--decode-steps", "32",
                    "--ks"]  # fmt: skip
IDLE_PROBE = """
import resource, time, torch
torch.set_num_threads({threads})
a = torch.randn(256, 256)
for _ in range(50):
    a @ a
time.sleep(0.2)
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
time.sleep({seconds})
r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
print(cpu / (t1 - t0))
"""


def _arm_env(threads: int, policy: str | None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    env.pop("OMP_WAIT_POLICY", None)
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    return env


def run_arm(procs: int, threads: int, policy: str | None, model: str, dtype: str) -> dict:
    """One round of one arm: `procs` fresh processes of this tool started together."""
    with tempfile.TemporaryDirectory(prefix="baton-threads-") as tmp:
        outs = [Path(tmp) / f"run{i}.json" for i in range(procs)]
        load = os.getloadavg()[0]
        started = time.monotonic()
        children = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.engine",
                    "throughput",
                    "--model",
                    model,
                    "--dtype",
                    dtype,
                    "--threads",
                    str(threads),
                    *COMPARE_WORKLOAD,
                    "--out",
                    str(out),
                ],  # fmt: skip
                env=_arm_env(threads, policy),
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for out in outs
        ]
        errors = [child.communicate()[1] for child in children]
        wall_s = time.monotonic() - started
        failed = [e for child, e in zip(children, errors, strict=True) if child.returncode]
        if failed:
            raise RuntimeError(f"a bench process failed: {failed[0][-2000:]}")
        runs = [json.loads(out.read_text()) for out in outs]
    return {"wall_s": wall_s, "load_avg_1m_at_start": load, "processes": runs}


def idle_burn(threads: int, policy: str | None, seconds: float = 2.0) -> float:
    """CPU seconds per second an engine process uses while idle after some work."""
    out = subprocess.run(
        [sys.executable, "-c", IDLE_PROBE.format(threads=threads, seconds=seconds)],
        env=_arm_env(threads, policy),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return float(out.stdout.strip().splitlines()[-1])


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def summarize_arms(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Per arm and batch: per-process decode / prefill tokens/s (median, min, max over every
    process of every round) and the arm's aggregate (summed over its processes, per round)."""
    summary: dict[str, dict] = {}
    for name, *_ in WAIT_POLICY_ARMS:
        runs = [r[name] for r in rounds if name in r]
        if not runs:
            continue
        batches: dict[str, dict] = {}
        for batch in runs[0]["processes"][0]["batches"]:
            per: dict[str, list[float]] = {"decode": [], "prefill": [], "step_ms_median": []}
            total: dict[str, list[float]] = {"decode": [], "prefill": []}
            for run in runs:
                figures = [p["batches"][batch] for p in run["processes"]]
                for kind in ("decode", "prefill"):
                    values = [f[kind]["tokens_per_s"] for f in figures]
                    per[kind] += values
                    total[kind].append(sum(values))
                per["step_ms_median"] += [f["decode"]["step_ms_median"] for f in figures]
            batches[batch] = {
                "per_process_decode_tokens_per_s": _spread(per["decode"]),
                "per_process_prefill_tokens_per_s": _spread(per["prefill"]),
                "decode_step_ms_median": _spread(per["step_ms_median"]),
                "aggregate_decode_tokens_per_s": _spread(total["decode"]),
                "aggregate_prefill_tokens_per_s": _spread(total["prefill"]),
            }
        summary[name] = {
            "wall_s": _spread([run["wall_s"] for run in runs]),
            "load_avg_1m_at_start": _spread([run["load_avg_1m_at_start"] for run in runs]),
            "batches": batches,
        }
    return summary


def compare_wait_policies(model: str, dtype: str, rounds: int) -> dict:
    started = time.time()
    results: list[dict[str, dict]] = []
    idle: dict[str, list[float]] = {"ACTIVE": [], "PASSIVE": [], "default": []}
    for index in range(rounds):
        this_round: dict[str, dict] = {}
        for name, procs, threads, policy in WAIT_POLICY_ARMS:
            print(f"[threads] round {index + 1}/{rounds}: {name}", file=sys.stderr, flush=True)
            this_round[name] = run_arm(procs, threads, policy, model, dtype)
        for policy in ("ACTIVE", "PASSIVE", None):
            idle[policy or "default"].append(idle_burn(2, policy))
        results.append(this_round)
    return {
        "scenario": {
            "arms": [
                {"name": n, "processes": p, "threads": t, "omp_wait_policy": w}
                for n, p, t, w in WAIT_POLICY_ARMS
            ],
            "workload": COMPARE_WORKLOAD,
            "rounds": rounds,
            "model": model,
            "dtype": dtype,
        },
        "machine": {
            "cores": len(os.sched_getaffinity(0)),
            "machine": platform.machine(),
            "torch": torch.__version__,
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        },
        "summary": summarize_arms(results),
        "idle_cpu_s_per_s_2_threads": {k: _spread(v) for k, v in idle.items()},
        "rounds": results,
    }


def print_comparison(result: dict) -> None:
    print("arm | batch | per-process decode tok/s median [min-max] | aggregate decode tok/s")
    for name, arm in result["summary"].items():
        for batch, fig in arm["batches"].items():
            per, agg = fig["per_process_decode_tokens_per_s"], fig["aggregate_decode_tokens_per_s"]
            print(
                f"{name} | {batch} | {per['median']:,.0f} [{per['min']:,.0f}-{per['max']:,.0f}]"
                f" | {agg['median']:,.0f} [{agg['min']:,.0f}-{agg['max']:,.0f}]"
            )
    for policy, burn in result["idle_cpu_s_per_s_2_threads"].items():
        print(f"idle CPU s/s, 2 threads, {policy}: {burn['median']:.3f}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.engine throughput", description=__doc__)
    parser.add_argument("--model", default=BATON_TINY)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument(
        "--ks", type=int, nargs="*", default=[1, 16, 64, 100], help="none: no recompute runs"
    )
    parser.add_argument("--context-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument(
        "--compare-wait-policies",
        action="store_true",
        help="run the interleaved thread-settings comparison (WAIT_POLICY_ARMS) instead",
    )
    parser.add_argument("--rounds", type=int, default=3, help="comparison rounds")
    args = parser.parse_args(argv)
    if args.compare_wait_policies:
        if args.rounds < 1:
            parser.error("--rounds must be >= 1")
        result = compare_wait_policies(args.model, args.dtype, args.rounds)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
        print_comparison(result)
        return result

    torch.set_num_threads(args.threads)
    try:
        loaded = load_model(args.model, parse_dtype(args.dtype))
    except ValueError as exc:
        parser.error(str(exc))
    warm = EngineConfig(num_blocks=16, dtype=args.dtype)
    Engine(loaded, warm).generate(_prompt(32, 0), SamplingParams(4))
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "device": warm.device,  # $BATON_ENGINE_DEVICE, else cpu
        "torch": torch.__version__,
        "threads": args.threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),  # None: the runtime's default
        "machine": platform.machine(),
        "prompt_len": args.prompt_len,
        "decode_steps": args.decode_steps,
        "batches": {
            str(b): bench_batch(loaded, b, args.prompt_len, args.decode_steps, args.dtype)
            for b in args.batches
        },
        "recompute_context_len": args.context_len,
        "recompute": {
            str(k): bench_recompute(loaded, k, args.context_len, args.repeats, args.dtype)
            for k in args.ks
        },
    }
    publish(result, args.out)
    return result
