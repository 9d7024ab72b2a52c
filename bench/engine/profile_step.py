"""`python -m bench.engine profile-step`: time (and with --profile, profile) one engine decode
step at a given batch on the issue-24 random Qwen2 checkpoint. Run with OMP_NUM_THREADS=2
OMP_WAIT_POLICY=PASSIVE."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from agents.engine import Engine, EngineConfig, SamplingParams, load_model
from bench.harness.checkpoint import checkpoint_dir, make_checkpoint

# Self CPU time of the profiled steps by kind of work.
GROUPS = {
    "mkldnn::_linear_pointwise": "linear (weights)",
    "mkl::_mkl_linear": "linear (weights)",
    "aten::addmm": "linear (weights)",
    "aten::mm": "linear (weights)",
    "aten::_weight_int8pack_mm": "linear (weights)",
    "aten::bmm": "attention matmuls",
    "aten::_softmax": "attention softmax",
    "aten::index": "gathers (index)",
    "aten::index_select": "gathers (index)",
    "aten::_index_put_impl_": "KV writes (index_put)",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine profile-step")
    ap.add_argument("--layout", default="qwen2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--profile-steps", type=int, default=1, help="steps profiled (summed)")
    ap.add_argument("--compile", action="store_true", help="EngineConfig.decode_compile")
    ap.add_argument(
        "--decode-weights", choices=["int8", "packed", "stream"], help="EngineConfig.decode_weights"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    folder = make_checkpoint(args.layout, checkpoint_dir(Path("var/bench-engine"), args.layout))
    loaded = load_model(str(folder))
    n = args.batch
    cfg = EngineConfig(
        block_size=16,
        num_blocks=n * 20 + 8,
        max_running=n,
        max_queued=n,
        max_batch_tokens=n * args.prompt_len,
        dtype=args.dtype,
        decode_compile=args.compile,
        decode_weights=args.decode_weights,
    )
    eng = Engine(loaded, cfg)
    gen = torch.Generator().manual_seed(0)
    for i in range(n):
        ids = torch.randint(0, 8192, (args.prompt_len,), generator=gen).tolist()
        params = SamplingParams(max_tokens=args.steps + args.profile_steps + 2, ignore_eos=True)
        eng.add_request(f"r{i}", ids, params)
    eng.step()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    print(
        f"batch {n}: decode step median {statistics.median(times) * 1e3:.2f} ms "
        f"min {min(times) * 1e3:.2f} ms"
    )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.profile_steps):
                eng.step()
        events = prof.key_averages()
        print(events.table(sort_by="self_cpu_time_total", row_limit=18))
        steps = args.profile_steps
        print(f"ops per step: {sum(e.count for e in events) / steps:.0f}")
        groups: dict[str, float] = {}
        for e in events:
            group = GROUPS.get(e.key, "other")
            groups[group] = groups.get(group, 0.0) + e.self_cpu_time_total / steps
        total = sum(groups.values())
        for group, us in sorted(groups.items(), key=lambda kv: -kv[1]):
            print(f"  {group:28s} {us / 1e3:7.2f} ms/step  {100 * us / total:5.1f}%")
    return 0
