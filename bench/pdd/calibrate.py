"""Engine step times on this machine, measured in-process before any live run (one thread,
passive waiting, as the agents run), and fitted to the two linear models the simulator uses:

* prefill of ``new`` tokens on top of ``cached`` ones: overhead + a x new + b x new x
  (cached + new / 2) (the linear layers, and causal attention over the context);
* one decode step of a batch holding ``ctx`` context tokens in all: overhead + c x ctx.

And the KV handoff between agents over the intra-datacenter fabric (``measure_fabric``): one
request at a time through real agent processes on loopback, fitted to the simulator's fabric
model, latency + bytes / bandwidth (``fit_fabric``), for two handoffs that cost differently:
a plain one (p-md with MD in P's datacenter: P exports the KV once and ships it once) and a
relay's (p-rld-md: P exports the KV twice, for RLD and for MD, and ships both at once, the WAN
one through its shaper). The step times above are
one engine in one process and contain none of the handoff's own work (P's export, the transfer
over loopback TCP, the decoder's import and admission).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

from pdd.vocab import Pipeline

PREFILL_POINTS = ((64, 0), (256, 0), (600, 0), (1000, 0), (1600, 0), (96, 1000), (200, 1500))
DECODE_POINTS = ((1, 200), (1, 1400), (4, 400), (4, 1200), (8, 1000), (16, 600))
FABRIC_PROMPTS = (300, 1300, 2400)  # prompt tokens of the handoff points (1.2-9.8 MB of KV)
BLOCK = 16


def measure(repeats: int = 2, decode_steps: int = 8) -> dict:
    """Run the points on baton-tiny; raw seconds per point (best of ``repeats``)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(1)
    from agents.engine import BATON_TINY, Engine, EngineConfig, SamplingParams, load_model

    loaded = load_model(BATON_TINY, torch.float32, 0)
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(32, 127, (n,), generator=gen).tolist()

    def engine(tokens: int, batch: int) -> Engine:
        cfg = EngineConfig(
            block_size=BLOCK,
            num_blocks=batch * (tokens // BLOCK + 8) + 64,
            max_running=max(batch, 1),
            max_queued=max(batch, 1) + 2,
            max_batch_tokens=max(4096, batch * tokens),
        )
        return Engine(loaded, cfg)

    prefill = []
    for new, cached in PREFILL_POINTS:
        best = float("inf")
        for r in range(repeats):
            eng = engine(new + cached + 32, 1)
            prompt = ids(cached + new)
            if cached:
                eng.add_request("warm", prompt[:cached], SamplingParams(max_tokens=1))
                while eng.has_work():
                    eng.step()
            eng.add_request(f"p{r}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
            start = time.perf_counter()
            eng.step()
            best = min(best, time.perf_counter() - start)
        prefill.append({"new": new, "cached": cached, "seconds": best})
    decode = []
    for batch, ctx in DECODE_POINTS:
        best = float("inf")
        for r in range(repeats):
            eng = engine(ctx + decode_steps + 4, batch)
            for i in range(batch):
                eng.add_request(
                    f"d{r}-{i}",
                    ids(ctx),
                    SamplingParams(max_tokens=decode_steps + 2, ignore_eos=True),
                )
            eng.step()  # all prompts in one forward
            start = time.perf_counter()
            for _ in range(decode_steps):
                eng.step()
            best = min(best, (time.perf_counter() - start) / decode_steps)
        decode.append({"batch": batch, "ctx_tokens": batch * ctx, "seconds": best})
    return {"prefill": prefill, "decode": decode}


def fit(raw: dict) -> dict:
    """Least-squares fits of the two models (non-negative coefficients)."""
    pre = raw["prefill"]
    x = np.array(
        [[1.0, p["new"], p["new"] * (p["cached"] + p["new"] / 2)] for p in pre], dtype=float
    )
    y = np.array([p["seconds"] for p in pre])
    coef = _nnls(x, y)
    dec = raw["decode"]
    xd = np.array([[1.0, d["ctx_tokens"]] for d in dec], dtype=float)
    yd = np.array([d["seconds"] for d in dec])
    cd = _nnls(xd, yd)
    return {
        "prefill": {
            "overhead_s": float(coef[0]),
            "per_token_s": float(coef[1]),
            "per_pair_s": float(coef[2]),
            "max_error": _max_rel_error(x @ coef, y),
        },
        "decode": {
            "overhead_s": float(cd[0]),
            "per_ctx_token_s": float(cd[1]),
            "max_error": _max_rel_error(xd @ cd, yd),
        },
        "raw": raw,
    }


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares on relative errors with every coefficient >= 0 (a column whose
    coefficient comes out negative is dropped)."""
    active = list(range(x.shape[1]))
    w = 1.0 / np.maximum(y, 1e-9)
    while True:
        coef = np.zeros(x.shape[1])
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        coef[active] = sol
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            return coef
        active.remove(min(negative, key=lambda i: coef[i]))


def _max_rel_error(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.max(np.abs(pred - y) / np.maximum(y, 1e-9)))


FABRIC_KINDS = ("relay", "plain")


FABRIC_REPEATS = 3  # requests per point: one request's KV wait swung 4x between runs on a VM


def measure_fabric(
    prompts: tuple[int, ...] = FABRIC_PROMPTS,
    threads: int = 1,
    kind: str = "relay",
    repeats: int = FABRIC_REPEATS,
) -> list[dict]:
    """Requests through agent processes on loopback (``python -m agents loopback``), ``repeats``
    per prompt length (each with its own prompt and fresh agents); returns the points (prompt
    tokens, KV bytes, the median KV wait in seconds, and every sample's).

    ``relay``: p-rld-md through P, RLD and MD, the WAN to MD slow (50 Mbit/s, 30 ms) so that
    RLD, whose KV comes over the intra-datacenter fabric, decodes the answer's second token:
    the KV wait is P's two exports, the fabric transfer beside the WAN one, RLD's import and its
    first decode step. ``plain``: p-md with MD in P's datacenter (``--md-datacenter dc-a``): P's
    one export, the fabric transfer, MD's import and its first step."""
    if kind not in FABRIC_KINDS:
        raise ValueError(f"kind: must be one of {', '.join(FABRIC_KINDS)}, got {kind!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats: must be a positive integer, got {repeats!r}")
    points = []
    for n in prompts:
        samples = [_fabric_sample(kind, n, threads, seed) for seed in range(repeats)]
        waits = sorted(s["kv_wait_s"] for s in samples)
        points.append(
            {
                "prompt_tokens": n,
                "kv_bytes": samples[0]["kv_bytes"],
                "kv_wait_s": float(np.median(waits)),
                "kv_wait_samples_s": [s["kv_wait_s"] for s in samples],
            }
        )
    return points


def _fabric_sample(kind: str, n: int, threads: int, seed: int) -> dict:
    """One request of ``measure_fabric``'s kind with an ``n``-token prompt: its KV bytes over
    the intra-DC fabric and its KV wait."""
    decoder = "rld" if kind == "relay" else "md"
    route = (
        ["--pipeline", Pipeline.P_RLD_MD]
        if kind == "relay"
        else ["--pipeline", Pipeline.P_MD, "--md-datacenter", "dc-a"]
    )
    argv = [sys.executable, "-m", "agents", "loopback", *route,
            "--prompt-len", str(n), "--max-tokens", "2", "--wan-gbps", "0.05",
            "--wan-rtt-ms", "30", "--threads", str(threads), "--seed", str(seed),
            "--json"]  # fmt: skip
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"agents loopback failed: {done.stderr.strip()[-500:]}")
    out = json.loads(done.stdout)
    if (out.get("tokens_by_role") or {}).get(decoder) != 1:
        raise RuntimeError(
            f"the {kind} fabric point at {n} tokens was not decoded by {decoder}: {out}"
        )
    return {"kv_bytes": out["kv_bytes"]["intra_dc"], "kv_wait_s": out["kv_wait_s"]}


def fit_fabric(points: list[dict], decode: dict) -> dict:
    """The fabric model's constants from the handoff points: each KV wait less the decoder's
    first step (``decode``: the fitted step, overhead + c x the prompt's tokens, which the
    simulator charges on its own) is latency + bytes x 8 / (gbps x 1e9), fitted by least
    squares (latency >= 0; a non-positive slope means no measurable bandwidth limit)."""
    x = np.array([[1.0, p["kv_bytes"]] for p in points], dtype=float)
    step = [decode["overhead_s"] + decode["per_ctx_token_s"] * p["prompt_tokens"] for p in points]
    y = np.array([p["kv_wait_s"] - s for p, s in zip(points, step, strict=True)])
    coef = _nnls(x, np.maximum(y, 1e-6))
    per_byte = float(coef[1])
    return {
        "latency_ms": float(coef[0]) * 1000.0,
        "gbps": 8.0 / (per_byte * 1e9) if per_byte > 0 else 1e3,
        # The fixed part is the ends' work (export, import), so every KV handoff pays it, over
        # the WAN too (bench/pdd/sim.py: the link's handoff_ms).
        "wan_handoff": True,
        "max_error": _max_rel_error(x @ coef, np.maximum(y, 1e-6)),
        "points": points,
    }
