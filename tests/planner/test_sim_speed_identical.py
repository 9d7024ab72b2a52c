"""The simulator's speed work changed no result: short runs of every system and policy flag
give the per-request records they gave before it, bit for bit.

``GOLDEN`` was computed by this file's ``__main__`` on the simulator as of 14d0086 (before the
speed work): ``PYTHONPATH=<that tree> python tests/planner/test_sim_speed_identical.py``.
A change meant to alter results must say so and update it.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json

import numpy as np
import pytest

from planner.api import make_trace
from planner.events import EventLoop
from planner.fleet import fleet_from_dict
from planner.scenario import case_configs, deep_merge, load_scenario
from planner.sim import Simulator

SHORT = {"workload": {"duration_s": 150, "settle_s": 150}}

GOLDEN = {
    "in-dc-pd": "70d4e915f9a741d9",
    "cdc-pd": "f6394fa01c906655",
    "pdd": "b1ca57531d0933eb",
    "pdd-fifo-pool": "e1c7737987b4cb00",
    "pdd-landed-only": "a7f0c4956abf93c0",
    "pdd-pool-wait": "89175109c915cc91",
    "pdd-sees-in-flight": "b4f4ca0291f42334",
    "pdd-100rps-one-shot": "5315740204820c40",
    "cdc-pd-100rps-srpt": "39531db2493945c6",
    "pdd-two-md-datacenters": "2de4a201b7da6894",
    "p-rld": "d2cd49b153e332b4",
    "bathtub-pdd-open-loop": "c1f57c6b27aa7dda",
}


# RunRecord's fields as of 14d0086, in order.
FIELDS = (
    "arrival_s", "ttft_s", "finish_s", "wan_s", "wan_wait_s", "pipeline", "handoff",
    "rld_tokens", "md_tokens", "md_hit_tokens", "md_kv_at_s", "prefill_done_s", "first_kv_s",
    "first_start_s", "drawn_arrival_s", "input_tokens", "cached_tokens", "output_tokens",
    "series", "decisions", "prefill_busy_s", "pool_utilisation", "link_utilisation",
    "sim_end_s",
)  # fmt: skip


def record_digest(rec) -> str:
    """sha256 over every per-request array, the time series and the run's scalars."""
    h = hashlib.sha256()
    for name in (f.name for f in dataclasses.fields(rec)):
        if name not in FIELDS:
            continue  # added since (e.g. stopped_at_s): not part of the pinned record
        value = getattr(rec, name)
        if isinstance(value, np.ndarray):
            h.update(name.encode())
            h.update(np.ascontiguousarray(value).tobytes())
        elif isinstance(value, dict):
            h.update(json.dumps(value, sort_keys=True).encode())
        else:
            h.update(repr(value).encode())
    return h.hexdigest()[:16]


def configs() -> dict[str, dict]:
    ttft = case_configs(load_scenario("paper-ttft"))
    out = {name: deep_merge(ttft[name], SHORT) for name in list(GOLDEN)[:7]}
    busy = {"workload": {"rps": 100, "duration_s": 150, "settle_s": 150}}
    out["pdd-pool-wait"] = deep_merge(ttft["pdd-pool-wait"], busy)  # the pool fills
    out["pdd-100rps-one-shot"] = deep_merge(ttft["pdd"], {**busy, "fleet": {"handoff": "one-shot"}})
    out["cdc-pd-100rps-srpt"] = deep_merge(
        ttft["cdc-pd"], {**busy, "fleet": {"engine": {"prefill_order": "srpt"}}}
    )
    two = deep_merge(ttft["pdd"], SHORT)
    two["fleet"]["pools"] = copy.deepcopy(two["fleet"]["pools"]) + [
        {"role": "main_decode", "gpu": "GPU-B", "count": 8, "datacenter": "C"}
    ]
    two["fleet"]["links"]["C"] = dict(two["fleet"]["links"]["B"], rtt_ms=35, pool_size=40)
    out["pdd-two-md-datacenters"] = two
    out["p-rld"] = deep_merge(case_configs(load_scenario("p-rld-collapse"))["p-rld"], SHORT)
    out["bathtub-pdd-open-loop"] = deep_merge(
        case_configs(load_scenario("bathtub"))["pdd"],
        {"workload": {"duration_s": 200, "settle_s": 0, "hit_rate": {"mean": 0.45}}},
    )
    return out


def run(config: dict, check: bool = False):
    sim = Simulator(fleet_from_dict(config["fleet"]))
    if check:
        sim.check_decisions = True
    return sim.run(make_trace(config))


@pytest.mark.parametrize("name", list(GOLDEN))
def test_the_records_are_those_before_the_speed_work(name: str) -> None:
    assert record_digest(run(configs()[name])) == GOLDEN[name]


@pytest.mark.parametrize("name", ["pdd-two-md-datacenters", "in-dc-pd"])
def test_the_narrowed_snapshot_decides_as_the_full_one(name: str) -> None:
    # check_decisions also decides every request on the full snapshot and asserts the same.
    assert record_digest(run(configs()[name], check=True)) == GOLDEN[name]


def test_a_stream_event_goes_before_heap_events_at_its_time() -> None:
    # As if the stream had been scheduled first: on a tie in time it runs first.
    loop = EventLoop()
    seen: list[str] = []
    loop.at(1.0, seen.append, "heap@1")
    loop.at(0.5, seen.append, "heap@0.5")
    loop.at(3.0, seen.append, "heap@3")

    def arrive(name: str) -> None:
        seen.append(name)
        if name == "s@1a":
            loop.at(1.0, seen.append, "pushed@1")

    loop.run(until=2.0, stream=([0.0, 1.0, 1.0, 2.5], ["s@0", "s@1a", "s@1b", "s@2.5"], arrive))
    assert seen == ["s@0", "heap@0.5", "s@1a", "s@1b", "heap@1", "pushed@1"]
    assert loop.now == 2.0


if __name__ == "__main__":
    print(json.dumps({name: record_digest(run(cfg)) for name, cfg in configs().items()}, indent=1))
