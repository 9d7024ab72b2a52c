"""Probe: does another prefill order lighten in-DC PD's TTFT tail at the calibrated point?

One-off variants of ``planner.instances.PrefillInstance``, patched in for this probe only (the
simulator keeps its FIFO chunked prefill):

* ``fifo``: the simulator as committed;
* ``chunk-cap``: each request adds at most ``--cap`` new tokens to a pass and queued requests
  fill the rest of it (vLLM's ``long_prefill_token_threshold``);
* ``lpm``: the queued request with the longest cached prefix goes first (SGLang's ``lpm``;
  FIFO above 128 queued, a chunked request in progress keeps its turn);
* ``context-parallel``: a request with more than ``--cap`` new tokens is split into contiguous
  parts over up to four P (the least loaded ones) and is done when every part is;
* ``srpt``: the engine's own ``prefill_order`` "srpt" (fewest new tokens left first, chosen
  again at every chunk boundary), set in the scenario rather than patched in.

Runs ``paper-ttft``'s fleet as in-DC PD, CDC-PD and PDD at its calibrated rate and engines.

Usage:
    .venv/bin/python bench/planner/probe_prefill_orders.py [--order fifo chunk-cap lpm \
        context-parallel srpt] [--seeds 1 2] [--cap 4096] [--jobs 2]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import sys
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import planner.instances as instances  # noqa: E402
from planner.api import make_trace, run_case  # noqa: E402
from planner.scenario import case_configs, load_scenario  # noqa: E402

ORDERS = ("fifo", "chunk-cap", "lpm", "context-parallel", "srpt")
SYSTEMS = ("idc-pd", "cdc-pd", "pdd")
LPM_MAX_QUEUE = 128
CP_MAX_PARTS = 4

_fifo_start = instances.PrefillInstance._start_batch
_fifo_submit = instances.PrefillInstance.submit
_fifo_init = instances.PrefillInstance.__init__


def _chunk_cap_start(cap: int):
    def start(self) -> None:
        budget, tokens, flops, finished = self.engine.prefill_batch_tokens, 0, 0.0, []
        for item in itertools.islice(self.queue, 64):
            if tokens >= budget:
                break
            chunk = min(item[1], cap, budget - tokens)
            flops += self.model.prefill_flops(chunk, item[2])
            tokens += chunk
            item[1] -= chunk
            item[2] += chunk
            if item[1] == 0:
                finished.append(item)
        if finished:
            self.queue = deque(item for item in self.queue if item[1] > 0)
        seconds = instances.prefill_batch_time(flops, self.gpu, self.engine, tokens)
        self.busy, self.busy_s, self.passes = True, self.busy_s + seconds, self.passes + 1
        self.loop.at(self.loop.now + seconds, self._finish_batch, finished, tokens)

    return start


def _lpm_start(self) -> None:
    queue = self.queue
    current = getattr(self, "_chunking", None)
    if (current is None or current not in queue) and 1 < len(queue) <= LPM_MAX_QUEUE:
        best = max(range(len(queue)), key=lambda i: queue[i][2])
        if best:
            item = queue[best]
            del queue[best]
            queue.appendleft(item)
    self._chunking = queue[0] if queue[0][1] > self.engine.prefill_batch_tokens else None
    _fifo_start(self)


_peers: dict[int, list] = {}


def _registering_init(self, *args, **kwargs) -> None:
    _fifo_init(self, *args, **kwargs)
    _peers.setdefault(id(self.loop), []).append(self)


def _context_parallel_submit(cap: int):
    def submit(self, req, new_tokens, cached_tokens, done) -> None:
        if new_tokens <= cap:
            _fifo_submit(self, req, new_tokens, cached_tokens, done)
            return
        others = sorted(
            (p for p in _peers[id(self.loop)] if p is not self), key=lambda p: p.backlog_tokens
        )
        parts = min(CP_MAX_PARTS, max(2, new_tokens // cap))
        chosen = [self, *others[: parts - 1]]
        seg = new_tokens // len(chosen)
        left = [len(chosen)]

        def part_done(_req) -> None:
            left[0] -= 1
            if left[0] == 0:
                done(req)

        for j, p in enumerate(chosen):
            n = seg if j < len(chosen) - 1 else new_tokens - seg * (len(chosen) - 1)
            _fifo_submit(p, req, n, cached_tokens + seg * j, part_done)

    return submit


def _patch(order: str, cap: int) -> None:
    cls = instances.PrefillInstance
    cls._start_batch, cls.submit, cls.__init__ = _fifo_start, _fifo_submit, _fifo_init
    if order == "chunk-cap":
        cls._start_batch = _chunk_cap_start(cap)
    elif order == "lpm":
        cls._start_batch = _lpm_start
    elif order == "context-parallel":
        cls.__init__ = _registering_init
        cls.submit = _context_parallel_submit(cap)


def _base_config(scenario: str) -> dict:
    """The scenario's cdc-pd case (``paper-ttft`` or a file that includes it)."""
    try:
        cases = case_configs(load_scenario(scenario))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"probe_prefill_orders.py: --scenario: {exc}") from None
    if "cdc-pd" not in cases:
        raise SystemExit(f"probe_prefill_orders.py: --scenario {scenario}: no cdc-pd case")
    return copy.deepcopy(cases["cdc-pd"])


def _run(job: tuple[str, str, int, int, str]) -> tuple:
    order, system, seed, cap, scenario = job
    _patch(order, cap)
    config = _base_config(scenario)
    config["fleet"]["system"] = system
    config["workload"]["seed"] = seed
    if order == "srpt":
        config["fleet"]["engine"]["prefill_order"] = "srpt"
    try:
        ttft = run_case(system, config, "fleet").summary["ttft_s"]
    finally:
        _peers.clear()
        _patch("fifo", cap)
    return order, system, seed, ttft["p50"], ttft["p90"], ttft["p99"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--order", choices=ORDERS, nargs="+", default=list(ORDERS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--cap", type=int, default=4096, help="chunk cap / context-parallel split")
    ap.add_argument(
        "--scenario", default="paper-ttft",
        help="scenario whose cdc-pd case is run (default paper-ttft; the eighth and ninth passes "
        "ran bench/planner/sensitivity/ninth-pass-ttft.json's settings)",
    )  # fmt: skip
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    if args.cap < 1:
        ap.error("--cap: must be >= 1")
    base = _base_config(args.scenario)  # a bad scenario fails here, before any run
    for seed in args.seeds:
        config = copy.deepcopy(base)
        config["workload"]["seed"] = seed
        trace = make_trace(config)
        new = trace.input_tokens - trace.cached_tokens
        pct = {q: int(np.percentile(new, q)) for q in (50, 90, 95, 99)}
        print(
            f"seed {seed}: new tokens per request " + ", ".join(f"P{q} {v}" for q, v in pct.items())
        )
    jobs = [
        (o, s, seed, args.cap, args.scenario)
        for o in args.order
        for seed in args.seeds
        for s in SYSTEMS
    ]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        print(f"{'order':>16} {'system':>7} seed |    P50    P90    P99  (TTFT s)")
        for order, system, seed, p50, p90, p99 in pool.map(_run, jobs):
            print(f"{order:>16} {system:>7} {seed:>4} | {p50:>6.2f} {p90:>6.2f} {p99:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
