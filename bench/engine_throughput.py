"""Prefill / decode throughput of an engine (baton-tiny, or a checkpoint folder with --model) at
batch 1, 8 and 32, and the time of an extend (the handoff's recompute) of k tokens on top of a
cached context; prints JSON. The device is $BATON_ENGINE_DEVICE (default cpu)."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from agents.engine import BATON_TINY, Engine, EngineConfig, SamplingParams, load_model
from agents.engine.config import parse_dtype

BLOCK_SIZE = 16


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
    return {
        "runs": repeats,
        "mean_ms": statistics.fmean(times),
        "max_ms": max(times),
        "std_ms": statistics.pstdev(times),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=BATON_TINY)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 16, 64, 100])
    parser.add_argument("--context-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)

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
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
