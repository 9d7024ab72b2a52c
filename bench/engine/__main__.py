"""This engine vs `transformers` on the same random-weight checkpoint (bench/harness/checkpoint.py,
Llama and Qwen2 layouts): decode tokens/s per batch, prefill tokens/s of one long prompt, the
machine's memory-bandwidth floor and each decode step's share of it, and the handoff's
recompute (`Engine.extend` of k tokens on a cached context). Runs are interleaved (engine,
transformers, engine, transformers, ...) round by round; figures are medians over rounds with
[min-max]. Prints a summary and writes every raw run as JSON.

    OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m bench.engine \\
        --out var/bench-engine/float32.json

`--agreement` instead measures greedy-token agreement of `--dtype` (with `--decode-weights`
if given: int8, stream) with the default float32 engine over a fixed prompt set;
`--fast-vs-general` interleaves engine configurations step by step (`--arms general fast`,
`fast int8`, `fast compiled`, ...). The scenario (the defaults below) was fixed before the
first run; `--shape large` (added later, its rule in bench/harness/checkpoint.py) is another
scenario, fixed before its first run.

The engine's other runs, each with its own options (`python -m bench.engine TOOL --help`):

    python -m bench.engine throughput     # the engine alone on baton-tiny or --model FOLDER;
                                          # --compare-wait-policies: the thread settings
    python -m bench.engine handoff        # docs/pdd.md's handoff: recompute vs ship the KV
    python -m bench.engine profile-step   # one decode step timed (--profile: by op)"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from agents.engine import Engine, EngineConfig, SamplingParams, load_model
from agents.engine.config import parse_dtype
from bench.harness.checkpoint import LAYOUTS, SHAPES, checkpoint_dir, make_checkpoint

BLOCK_SIZE = 16
# The engine's other runs: `python -m bench.engine TOOL ...` runs TOOL's main.
TOOLS = {
    "throughput": "bench.engine.throughput",
    "handoff": "bench.engine.handoff",
    "profile-step": "bench.engine.profile_step",
}
# --fast-vs-general --arms
ARM_KINDS = ("general", "fast", "int8", "packed", "stream", "stream-ops", "compiled")
CKPT_DIR = Path("var/bench-engine")


def _prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen).tolist()


def _checkpoint(layout: str, args) -> Path:
    """The random checkpoint of `layout` in `--shape`, written on first use."""
    return make_checkpoint(layout, checkpoint_dir(CKPT_DIR, layout, args.shape), shape=args.shape)


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_bandwidth(device: torch.device, mb: int = 512, repeats: int = 7) -> dict[str, float]:
    """Read bandwidth (a sum over a large tensor) and copy bandwidth (read + write), GB/s."""
    n = mb * 1_000_000 // 4
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    sums, copies = [], []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        src.sum()
        _sync(device)
        sums.append(time.perf_counter() - start)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        copies.append(time.perf_counter() - start)
    nbytes = n * 4
    return {
        "read_gbps": nbytes / min(sums) / 1e9,
        "copy_gbps": 2 * nbytes / min(copies) / 1e9,
        "read_gbps_median": nbytes / statistics.median(sums) / 1e9,
    }


class EngineArm:
    """Decode / prefill / recompute runs on this engine."""

    def __init__(self, loaded, dtype: str, device: str, name: str = "engine") -> None:
        self.loaded, self.dtype, self.device, self.name = loaded, dtype, device, name
        self.decode_weights: str | None = None
        self.decode_compile = False

    def _engine(self, batch: int, tokens_each: int) -> Engine:
        blocks = batch * (-(-tokens_each // BLOCK_SIZE)) + 16
        config = EngineConfig(
            block_size=BLOCK_SIZE,
            num_blocks=blocks,
            max_running=batch,
            max_queued=batch,
            max_batch_tokens=max(2048, batch * tokens_each),
            dtype=self.dtype,
            device=self.device,
            decode_weights=self.decode_weights,
            decode_compile=self.decode_compile,
        )
        return Engine(self.loaded, config)

    def decode(self, prompts: list[list[int]], steps: int) -> dict:
        engine = self._engine(len(prompts), len(prompts[0]) + steps + 2)
        params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        tokens: dict[str, list[int]] = {}
        first = engine.step()  # all prompts in one forward
        assert len(first) == len(prompts)
        step_s = []
        for _ in range(steps):
            start = time.perf_counter()
            outs = engine.step()
            step_s.append(time.perf_counter() - start)
            for o in outs:
                tokens.setdefault(o.request_id, []).extend(o.token_ids)
        return {
            "step_ms": 1000 * statistics.median(step_s),
            "tokens": [tokens[f"r{i}"] for i in range(len(prompts))],
        }

    def prefill(self, prompt: list[int]) -> float:
        engine = self._engine(1, len(prompt) + 2)
        start = time.perf_counter()
        engine.prefill("p", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        return time.perf_counter() - start

    def recompute(self, context: list[int], k: int, repeats: int) -> float:
        engine = self._engine(1, len(context) + k + 2)
        times = []
        for rep in range(repeats + 1):
            rid = f"k{k}-{rep}"
            engine.prefill(rid, context, SamplingParams(max_tokens=k + 1, ignore_eos=True))
            handed = _prompts(1, k - 1, self.loaded.config.vocab_size, seed=rep)[0] if k > 1 else []
            start = time.perf_counter()
            engine.extend(rid, handed)  # one forward over the first token + k - 1 = k positions
            elapsed = time.perf_counter() - start
            engine.release(rid)
            if rep:
                times.append(1000 * elapsed)
        return statistics.median(times)


class HFArm:
    """The same runs on `transformers`: a manual greedy loop over its KV cache (what
    `generate(do_sample=False)` does, without its per-step bookkeeping)."""

    name = "transformers"

    def __init__(self, folder: Path, dtype: str, device: str) -> None:
        import transformers

        self.device = torch.device(device)
        self.model = (
            transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=parse_dtype(dtype))
            .to(self.device)
            .eval()
        )

    @torch.inference_mode()
    def decode(self, prompts: list[list[int]], steps: int) -> dict:
        ids = torch.tensor(prompts, device=self.device)
        out = self.model(ids, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
        step_s, tokens = [], [[] for _ in prompts]
        for _ in range(steps):
            _sync(self.device)
            start = time.perf_counter()
            out = self.model(nxt[:, None], past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
            got = nxt.tolist()
            step_s.append(time.perf_counter() - start)
            for row, t in zip(tokens, got, strict=True):
                row.append(t)
        return {"step_ms": 1000 * statistics.median(step_s), "tokens": tokens}

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> float:
        ids = torch.tensor([prompt], device=self.device)
        start = time.perf_counter()
        self.model(ids, use_cache=True).logits[:, -1].argmax(-1).tolist()
        return time.perf_counter() - start


def step_bytes(loaded, dtype: str, batch: int, context: int) -> int:
    """Bytes a decode step must read: every weight but the embedding table (a few rows of it),
    plus the batch's KV at `context` positions."""
    elem = torch.empty((), dtype=parse_dtype(dtype)).element_size()
    cfg, model = loaded.config, loaded.model
    params = sum(p.numel() for p in model.parameters())
    if not cfg.tie_word_embeddings:
        params -= model.model.embed_tokens.weight.numel()
    return params * elem + batch * context * cfg.kv_bytes_per_token(elem)


def run(args) -> dict:
    device = torch.device(args.device)
    result: dict = {
        "argv": sys.argv[1:],
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "device": str(device),
            "loadavg_start": os.getloadavg(),
        },
        "scenario": {
            "dtype": args.dtype,
            "batches": args.batch,
            "prompt_len": args.prompt_len,
            "decode_steps": args.decode_steps,
            "prefill_len": args.prefill_len,
            "recompute_ks": args.recompute_ks,
            "context_len": args.context_len,
            "rounds": args.rounds,
            "decode_weights": args.decode_weights,
            "decode_compile": args.decode_compile,
            "shape": args.shape,
            "floor_mb": args.floor_mb,
        },
        "bandwidth": memory_bandwidth(device, mb=args.floor_mb),
        "layouts": {},
    }
    print(f"bandwidth: {result['bandwidth']}", flush=True)
    for layout in args.layouts:
        folder = _checkpoint(layout, args)
        loaded = load_model(str(folder), parse_dtype(args.dtype))
        arms = [EngineArm(loaded, args.dtype, args.device), HFArm(folder, args.dtype, args.device)]
        if args.extra_dtype:  # a third arm: the engine in another dtype, its own model copy
            extra = load_model(str(folder), parse_dtype(args.extra_dtype))
            arms.append(
                EngineArm(extra, args.extra_dtype, args.device, f"engine_{args.extra_dtype}")
            )
        vocab = loaded.config.vocab_size
        for arm in arms:
            if isinstance(arm, EngineArm):  # --decode-weights / --decode-compile: every engine
                arm.decode_weights, arm.decode_compile = args.decode_weights, args.decode_compile
        runs: dict = {"decode": {}, "prefill": [], "recompute": {}}
        for arm in arms:  # warm-up, not recorded (with --decode-compile: both graphs compile)
            arm.decode(_prompts(2, 16, vocab), 4)
            if args.decode_compile:
                arm.decode(_prompts(1, 16, vocab), 4)
        for rnd in range(args.rounds):
            order = arms if rnd % 2 == 0 else arms[::-1]  # A, B, (C), then reversed
            for batch in args.batch:
                prompts = _prompts(batch, args.prompt_len, vocab, seed=batch)
                for arm in order:
                    r = arm.decode(prompts, args.decode_steps)
                    runs["decode"].setdefault(str(batch), {}).setdefault(arm.name, []).append(r)
                    print(f"{layout} r{rnd} b{batch} {arm.name}: {r['step_ms']:.2f} ms", flush=True)
            prompt = _prompts(1, args.prefill_len, vocab, seed=99)[0]
            runs["prefill"].append({arm.name: arm.prefill(prompt) for arm in order})
            context = _prompts(1, args.context_len, vocab, seed=7)[0]
            for k in args.recompute_ks:
                ms = arms[0].recompute(context, k, repeats=3)
                runs["recompute"].setdefault(str(k), []).append(ms)
        result["layouts"][layout] = {"runs": runs, "summary": summarize(runs, loaded, args, result)}
    return result


def summarize(runs: dict, loaded, args, result: dict) -> dict:
    bw = result["bandwidth"]["read_gbps"] * 1e9
    out: dict = {"decode": {}, "prefill": {}, "recompute_ms": {}}
    context = args.prompt_len + args.decode_steps // 2
    for batch, arms in runs["decode"].items():
        eng = [r["step_ms"] for r in arms["engine"]]
        hf = [r["step_ms"] for r in arms["transformers"]]
        floor_ms = 1000 * step_bytes(loaded, args.dtype, int(batch), context) / bw
        same = total = 0
        for a, b in zip(arms["engine"], arms["transformers"], strict=True):
            for x, y in zip(a["tokens"], b["tokens"], strict=True):
                same += sum(p == q for p, q in zip(x, y, strict=True))
                total += len(x)
        out["decode"][batch] = {
            "engine_step_ms": _spread(eng),
            "transformers_step_ms": _spread(hf),
            "engine_tok_s": int(batch) * 1000 / statistics.median(eng),
            "transformers_tok_s": int(batch) * 1000 / statistics.median(hf),
            "ratio_engine_over_transformers": _spread([h / e for e, h in zip(eng, hf)]),  # noqa: B905
            "floor_ms": floor_ms,
            "engine_step_over_floor": statistics.median(eng) / floor_ms,
            "transformers_step_over_floor": statistics.median(hf) / floor_ms,
            "greedy_tokens_equal": f"{same}/{total}",
        }
        extra = f"engine_{args.extra_dtype}"
        if args.extra_dtype and extra in arms:
            other = [r["step_ms"] for r in arms[extra]]
            out["decode"][batch][f"{extra}_step_ms"] = _spread(other)
            out["decode"][batch][f"{extra}_tok_s"] = int(batch) * 1000 / statistics.median(other)
            out["decode"][batch][f"{extra}_speedup_over_engine"] = _spread(
                [e / o for e, o in zip(eng, other)]  # noqa: B905
            )
    if args.extra_dtype:
        extra = f"engine_{args.extra_dtype}"
        other = [r[extra] for r in runs["prefill"]]
        out[f"prefill_{extra}_tok_s"] = args.prefill_len / statistics.median(other)
    eng = [r["engine"] for r in runs["prefill"]]
    hf = [r["transformers"] for r in runs["prefill"]]
    out["prefill"] = {
        "engine_tok_s": args.prefill_len / statistics.median(eng),
        "transformers_tok_s": args.prefill_len / statistics.median(hf),
        "ratio_engine_over_transformers": _spread([h / e for e, h in zip(eng, hf)]),  # noqa: B905
    }
    out["recompute_ms"] = {k: _spread(v) for k, v in runs["recompute"].items()}
    return out


@torch.inference_mode()
def agreement(args) -> dict:
    """Greedy tokens of the engine in --dtype vs float32, 8 fixed prompts x 32 tokens."""
    out = {}
    for layout in args.layouts:
        folder = _checkpoint(layout, args)
        vocab = load_model(str(folder)).config.vocab_size
        prompts = _prompts(8, args.prompt_len, vocab, seed=123)
        tokens = {}
        # the other arm: --dtype, with --decode-weights if given (int8 / stream:bfloat16 ...)
        other = f"{args.decode_weights}:{args.dtype}" if args.decode_weights else args.dtype
        for name in ("float32", other):
            dtype = args.dtype if name == other else "float32"
            arm = EngineArm(load_model(str(folder), parse_dtype(dtype)), dtype, args.device)
            arm.decode_weights = args.decode_weights if name == other else None
            tokens[name] = arm.decode(prompts, 32)["tokens"]
        ref, got = tokens["float32"], tokens[other]
        same = sum(a == b for x, y in zip(ref, got, strict=True) for a, b in zip(x, y, strict=True))
        prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))  # noqa: B905
                  for x, y in zip(ref, got, strict=True)]  # fmt: skip
        out[layout] = {"tokens_equal": f"{same}/{8 * 32}", "agreeing_prefix_per_prompt": prefix}
        print(layout, out[layout], flush=True)
    return out


def fast_vs_general(args) -> dict:
    """Engine configurations on one model (`--arms`, the first is the base: general = fast path
    off, fast, int8 / packed / stream = fast path with int8 / oneDNN-prepacked / skinny-kernel
    weights, stream-ops = stream with each op called from Python, compiled = fast path
    through torch.compile), one engine each over the same prompts, their decode steps
    interleaved one by one (the order reversed every step) after `--warmup-steps` untimed
    steps each (the compile happens there). An arm `kind:dtype` (`packed:bfloat16`) runs in
    that dtype instead of `--dtype`, on its own copy of the model."""
    out = {}
    for layout in args.layouts:
        folder = _checkpoint(layout, args)
        models = {}
        for name in args.arms:
            dtype = name.partition(":")[2] or args.dtype
            if dtype not in models:
                models[dtype] = load_model(str(folder), parse_dtype(dtype))
        vocab = next(iter(models.values())).config.vocab_size
        for batch in args.batch:
            prompts = _prompts(batch, args.prompt_len, vocab, seed=batch)
            engines, warmup_s = {}, {}
            steps = args.warmup_steps + 2 * args.decode_steps
            for name in args.arms:
                kind, _, dtype = name.partition(":")
                arm = EngineArm(models[dtype or args.dtype], dtype or args.dtype, args.device)
                engine = arm._engine(batch, args.prompt_len + steps + 2)
                engine.runner.decode_fast_path = kind != "general"
                engine.runner.decode_int8 = kind == "int8"
                engine.runner.decode_packed = kind == "packed"
                engine.runner.decode_stream = kind in ("stream", "stream-ops")
                engine.runner.decode_one_call = kind != "stream-ops"
                engine.runner.decode_compile = kind == "compiled"
                params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
                for i, p in enumerate(prompts):
                    engine.add_request(f"r{i}", p, params)
                engine.step()
                engines[name] = engine
            tokens = {name: [] for name in engines}
            for name, engine in engines.items():
                start = time.perf_counter()
                for _ in range(args.warmup_steps):
                    tokens[name].append(sorted((o.request_id, o.token_ids) for o in engine.step()))
                warmup_s[name] = time.perf_counter() - start
            times = {name: [] for name in engines}
            streams = _step_weights(engines[args.arms[0]]) if args.stream_floor else None
            stream_ms = []
            for step in range(2 * args.decode_steps):
                names = list(engines) if step % 2 == 0 else list(engines)[::-1]
                for name in names:
                    start = time.perf_counter()
                    outs = engines[name].step()
                    times[name].append(1000 * (time.perf_counter() - start))
                    tokens[name].append(sorted((o.request_id, o.token_ids) for o in outs))
                if streams is not None:  # the same bytes a step must read, read at full speed
                    start = time.perf_counter()
                    for tensor in streams:
                        tensor.sum()
                    stream_ms.append(1000 * (time.perf_counter() - start))
            base = args.arms[0]
            row: dict = {"warmup_s": warmup_s, f"{base}_step_ms": _spread(times[base])}
            for new in args.arms[1:]:
                row[f"{new}_step_ms"] = _spread(times[new])
                row[f"speedup_{new}"] = statistics.median(times[base]) / statistics.median(
                    times[new]
                )
                row[f"speedup_{new}_per_step"] = _spread(
                    [b / n for b, n in zip(times[base], times[new], strict=True)]
                )
                row[f"tokens_identical_{new}"] = tokens[base] == tokens[new]
                row[f"tokens_equal_{new}"] = sum(
                    a == b
                    for x, y in zip(tokens[base], tokens[new], strict=True)
                    for a, b in zip(x, y, strict=True)
                )
            row["tokens"] = sum(len(x) for x in tokens[base])
            if stream_ms:
                row["stream_floor_ms"] = _spread(stream_ms)
                row["stream_floor_bytes"] = sum(s.numel() * s.element_size() for s in streams)
                for name in args.arms:
                    row[f"{name}_over_stream_floor"] = _spread(
                        [a / s for a, s in zip(times[name], stream_ms, strict=True)]
                    )
            if len(args.arms) == 2:  # the keys of the first reports
                new = args.arms[1]
                row["speedup"] = row[f"speedup_{new}"]
                row["tokens_identical"] = row[f"tokens_identical_{new}"]
                row["tokens_equal"] = row[f"tokens_equal_{new}"]
            row["loadavg_end"] = os.getloadavg()
            out[f"{layout}/b{batch}"] = row
            print(f"{layout} b{batch}: {row}", flush=True)
    return out


def _step_weights(engine: Engine) -> list[torch.Tensor]:
    """What a decode step of `engine` reads: the weights it multiplies by (every parameter
    but the embedding table) and its batch's KV copy, up to the longest request."""
    model = engine.model
    out = [p for name, p in model.named_parameters() if name != "model.embed_tokens.weight"]
    if model.config.tie_word_embeddings:
        out.append(model.lm_head.weight)
    state = engine.runner.decode_state
    if state.k is not None:
        k_max = max(state.lengths) + 1
        out += [state.k[..., :k_max, :], state.v[..., :k_max, :]]
    return out


def print_summary(result: dict) -> None:
    for layout, data in result["layouts"].items():
        s = data["summary"]
        print(f"\n{layout}  ({result['scenario']['dtype']}, bandwidth "
              f"{result['bandwidth']['read_gbps']:.1f} GB/s read)")  # fmt: skip
        for batch, d in s["decode"].items():
            e, h, r = (
                d["engine_step_ms"],
                d["transformers_step_ms"],
                d["ratio_engine_over_transformers"],
            )
            print(
                f"  decode b{batch}: engine {e['median']:.2f} ms [{e['min']:.2f}-{e['max']:.2f}] "
                f"{d['engine_tok_s']:.0f} tok/s | transformers {h['median']:.2f} ms "
                f"[{h['min']:.2f}-{h['max']:.2f}] {d['transformers_tok_s']:.0f} tok/s | "
                f"ratio {r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}] | floor "
                f"{d['floor_ms']:.2f} ms, engine {d['engine_step_over_floor']:.2f}x floor, "
                f"transformers {d['transformers_step_over_floor']:.2f}x | tokens equal "
                f"{d['greedy_tokens_equal']}"
            )  # fmt: skip
            for key in [k for k in d if k.endswith("_speedup_over_engine")]:
                v, name = d[key], key.removesuffix("_speedup_over_engine")
                print(f"    {name}: {d[name + '_step_ms']['median']:.2f} ms, "
                      f"{d[name + '_tok_s']:.0f} tok/s, {v['median']:.2f}x the engine "
                      f"[{v['min']:.2f}-{v['max']:.2f}]")  # fmt: skip
        p = s["prefill"]
        r = p["ratio_engine_over_transformers"]
        print(f"  prefill: engine {p['engine_tok_s']:.0f} tok/s, transformers "
              f"{p['transformers_tok_s']:.0f} tok/s, ratio {r['median']:.2f}x "
              f"[{r['min']:.2f}-{r['max']:.2f}]")  # fmt: skip
        for k, v in s["recompute_ms"].items():
            print(f"  recompute k={k}: {v['median']:.2f} ms [{v['min']:.2f}-{v['max']:.2f}]")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in TOOLS:
        result = importlib.import_module(TOOLS[argv[0]]).main(argv[1:])
        return result if isinstance(result, int) else 0
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=f"other runs: python -m bench.engine {{{','.join(TOOLS)}}} --help",
    )
    ap.add_argument("--device", default=os.environ.get("BATON_ENGINE_DEVICE", "cpu"))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    ap.add_argument(
        "--shape",
        default="issue24",
        choices=list(SHAPES),
        help="the checkpoint's size: issue24 (107 MB of float32 weights), large (1.15 GB)",
    )
    ap.add_argument(
        "--floor-mb", type=int, default=512, help="the read floor: a sum over this many MB"
    )
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--recompute-ks", type=int, nargs="+", default=[1, 16, 64, 100])
    ap.add_argument("--context-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--extra-dtype", choices=["float32", "bfloat16", "float16"], help="add an engine arm"
    )
    ap.add_argument("--agreement", action="store_true")
    ap.add_argument("--fast-vs-general", action="store_true")
    ap.add_argument(
        "--arms",
        nargs="+",
        default=["general", "fast"],
        help="the engines --fast-vs-general interleaves (2 or more; the first is the base): "
        "general, fast, int8, packed, stream, stream-ops (stream op by op, not the layers in "
        "one call) or compiled, each optionally :float32 / :bfloat16",
    )
    ap.add_argument("--warmup-steps", type=int, default=3, help="--fast-vs-general: untimed")
    ap.add_argument(
        "--stream-floor",
        action="store_true",
        help="--fast-vs-general: after every round of steps, time a sum over what a step reads "
        "(the floor measured in place, under the same load)",
    )
    ap.add_argument(
        "--decode-weights",
        choices=["int8", "packed", "stream"],
        help="the engine's decode weights (EngineConfig.decode_weights); --agreement: against "
        "float32 with the model's own weights",
    )
    ap.add_argument(
        "--decode-compile", action="store_true", help="EngineConfig.decode_compile (the engine)"
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.fast_vs_general and len(args.arms) < 2:
        ap.error("--arms needs two or more engines")
    for name in args.arms:
        kind, _, dtype = name.partition(":")
        if kind not in ARM_KINDS or dtype not in ("", "float32", "bfloat16", "float16"):
            ap.error(f"--arms: unknown engine {name!r}")
    if args.agreement:
        result = {"agreement": agreement(args)}
    elif args.fast_vs_general:
        result = {"fast_vs_general": fast_vs_general(args)}
    else:
        result = run(args)
        print_summary(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
