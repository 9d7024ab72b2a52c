"""Engine step times on this machine, measured in-process before any live run (one thread,
passive waiting, as the agents run), and fitted to the two linear models the simulator uses:

* prefill of ``new`` tokens on top of ``cached`` ones: overhead + a x new + b x new x
  (cached + new / 2) (the linear layers, and causal attention over the context);
* one decode step of a batch holding ``ctx`` context tokens in all: overhead + c x ctx.
"""

from __future__ import annotations

import os
import time

import numpy as np

PREFILL_POINTS = ((64, 0), (256, 0), (600, 0), (1000, 0), (1600, 0), (96, 1000), (200, 1500))
DECODE_POINTS = ((1, 200), (1, 1400), (4, 400), (4, 1200), (8, 1000), (16, 600))
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
