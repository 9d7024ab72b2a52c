"""The gateway benchmarks' measuring parts: the CPU meter reads this process's own CPU time,
the profile groups py-spy's raw stacks by what they are in."""

from __future__ import annotations

import os

from bench import gateway_overhead, gateway_profile


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


def test_the_profile_groups_stacks_by_the_first_matching_part(tmp_path):
    raw = tmp_path / "spy.txt"
    raw.write_text(
        "a (x.py:1);EpollSelector.select (selectors.py:468) 7\n"
        "t;BatchWriter._run (routing/gateway/workers.py:80);execute (sqlite3.py:1) 5\n"
        "m;handle (django/core/handlers/asgi.py:1);_handle (routing/gateway/views.py:9) 3\n"
        "m;ASGIHandler.send_response (django/core/handlers/asgi.py:338) 2\n"
        "q;something (else.py:1) 1\n"
        "not a sample line\n"
    )
    assert gateway_profile.group_samples(raw) == {
        "idle": 7,
        "record writer thread": 5,
        "gateway view and run": 3,
        "Django's ASGI handler": 2,
        "other": 1,
    }


def test_stage_counts_say_how_many_requests_took_the_worker_path():
    timings = [{"django": 1.0, "admit": 0.2}, {"django": 1.0, "inline": 0.5, "resume": 3.0}]
    assert gateway_overhead.stage_counts(timings) == {
        "requests": 2,
        "django": 2,
        "admit": 1,
        "inline": 1,
        "resume": 1,
    }
