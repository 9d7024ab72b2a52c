"""The gateway benchmark's measuring parts: the CPU meter reads this process's own CPU time,
and the stage counts say which path each request took."""

from __future__ import annotations

import os

from bench import gateway_overhead


def test_the_cpu_meter_charges_each_arm_its_own_cpu_time():
    meter = gateway_overhead.CpuMeter(os.getpid())

    def spin():
        total = 0
        for i in range(3_000_000):
            total += i
        return total

    meter.run("gateway", 2, spin)
    meter.run("direct", 2, lambda: None)
    summary = meter.summary()
    assert summary["control_plane_cpu_ms_per_request_gateway_arm"] > 0
    assert summary["gateway_cpu_ms_per_request"] == round(
        summary["control_plane_cpu_ms_per_request_gateway_arm"]
        - summary["control_plane_cpu_ms_per_request_direct_arm"],
        2,
    )
    assert meter.requests == {"gateway": 0, "direct": 0}  # summary starts the next phase


def test_stage_counts_say_how_many_requests_took_the_worker_path():
    timings = [{"django": 1.0, "admit": 0.2}, {"django": 1.0, "inline": 0.5, "resume": 3.0}]
    assert gateway_overhead.stage_counts(timings) == {
        "requests": 2,
        "django": 2,
        "admit": 1,
        "inline": 1,
        "resume": 1,
    }
