"""Heterogeneity live: two emulated agents on the two published GPU types (the planner's
GPU-A and GPU-B units), each asked the same work in interleaved rounds (A, B, A, B, ...), wall
times measured at the client and compared with the hardware model's.

The scenario is fixed by rule before the first run: the paper profile (profile:paper-dsv4);
units of 8 chips with the planner's numbers; per round and agent (1) a 16,384-token prompt, one
token (a prefill chunk), (2) a 4,096-token prompt cached by a warm-up, then 201 tokens (200
decode steps at batch 1); 5 rounds; medians and [min-max] reported.

    python -m bench.emulated [--rounds 5] [--out bench/emulated]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from agents.node.launch import AgentProcess
from agents.node.loopback import make_prompt
from pdd.hardware import decode_step_time, forward_time, unit_from_json
from pdd.profiles import PAPER_GPUS, load_profile

PROFILE = "profile:paper-dsv4"
CHIP_A, CHIP_B = PAPER_GPUS["GPU-A"], PAPER_GPUS["GPU-B"]
PREFILL_TOKENS = 16_384
DECODE_PROMPT, DECODE_STEPS = 4096, 200


def start(name: str, chip: dict) -> AgentProcess:
    args = [
        "--role", "main_decode", "--model", PROFILE, "--gpu", json.dumps(chip),
        "--listen", "127.0.0.1:0", "--kv-listen", "127.0.0.1:0", "--threads", "1",
    ]  # fmt: skip
    return AgentProcess(args, name, agents_per_host=2).start()


def timed(agent: AgentProcess, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(wall seconds to the first token, wall seconds first -> last token), at the client."""
    body = {"prompt_ids": prompt, "sampling": {"max_tokens": max_tokens, "ignore_eos": True}}
    began = time.perf_counter()
    stamps: list[float] = []
    last: dict = {}
    with (
        httpx.Client(timeout=httpx.Timeout(30.0, read=600.0)) as http,
        http.stream("POST", f"{agent.http}/v1/generate", json=body) as response,
    ):
        response.raise_for_status()
        for line in response.iter_lines():
            if line.strip():
                last = json.loads(line)
                if last.get("type") == "token":
                    stamps.append(time.perf_counter())
    if last.get("type") != "done" or len(stamps) != max_tokens:
        raise RuntimeError(f"{agent.name}: request did not complete: {last}")
    return stamps[0] - began, stamps[-1] - stamps[0]


def spread(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.emulated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench/emulated")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        print("--rounds: must be >= 1", file=sys.stderr)
        return 2
    profile = load_profile(PROFILE)
    m, e = profile.model, profile.engine
    chips = {"GPU-A": CHIP_A, "GPU-B": CHIP_B}
    modelled = {}
    for name, chip in chips.items():
        unit = unit_from_json(chip)
        modelled[name] = {
            "prefill_s": forward_time([PREFILL_TOKENS], [0], m, unit, e),
            "decode_step_s": statistics.fmean(
                decode_step_time(DECODE_PROMPT + i + 1, m, unit, e, batch=1)
                for i in range(DECODE_STEPS)
            ),
        }
    agents = {name: start(f"emu-{name}", chip) for name, chip in chips.items()}
    measured: dict[str, dict[str, list[float]]] = {
        n: {"prefill_s": [], "decode_step_s": []} for n in chips
    }
    try:
        decode_prompt = make_prompt(DECODE_PROMPT, 1)
        for agent in agents.values():
            timed(agent, decode_prompt, 1)  # cache the decode prompt
        for r in range(args.rounds):
            for name, agent in agents.items():
                ttft, _ = timed(agent, make_prompt(PREFILL_TOKENS, 100 + r), 1)
                measured[name]["prefill_s"].append(ttft)
                _, span = timed(agent, decode_prompt, DECODE_STEPS + 1)
                measured[name]["decode_step_s"].append(span / DECODE_STEPS)
                print(f"round {r + 1}/{args.rounds} {name}: prefill {ttft:.3f} s, "
                      f"decode step {1e3 * span / DECODE_STEPS:.2f} ms", flush=True)  # fmt: skip
    finally:
        for agent in agents.values():
            agent.kill()
            agent.cleanup()
    summary: dict = {"rounds": args.rounds, "per_gpu": {}, "ratios_b_over_a": {}}
    for name in chips:
        summary["per_gpu"][name] = {}
        for key in ("prefill_s", "decode_step_s"):
            wall = spread(measured[name][key])
            summary["per_gpu"][name][key] = {
                "modelled": modelled[name][key],
                "wall": wall,
                "wall_over_modelled": wall["median"] / modelled[name][key],
            }
    for key in ("prefill_s", "decode_step_s"):
        a, b = measured["GPU-A"][key], measured["GPU-B"][key]
        summary["ratios_b_over_a"][key] = {
            "modelled_speed": modelled["GPU-A"][key] / modelled["GPU-B"][key],
            "wall_speed_per_round": spread([x / y for x, y in zip(a, b, strict=True)]),
        }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
