"""Fixtures of the telemetry and UI tests: a fresh in-process aggregator and a small fleet."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "browser: drives headless Chromium against a real uvicorn server"
    )


@pytest.fixture
def aggregator():
    """A fresh in-process aggregator installed as the process's own for the test."""
    from frontend.telemetry import set_aggregator
    from frontend.telemetry.aggregator import Aggregator
    from frontend.telemetry.service import sla_cache_clear, sla_for
    from frontend.telemetry.store import LocalStore

    sla_cache_clear()
    agg = Aggregator(LocalStore(), sla_for=sla_for)
    set_aggregator(agg)
    yield agg
    set_aggregator(None, rebuilt=False)


@pytest.fixture
def fleet(db):
    """dc-a (gpu-a at 2.00/GPU-h) -> dc-b (gpu-b at 2.50/GPU-h); P, RLD on dc-a, MD on dc-b."""
    from fleet import services
    from fleet.models import Datacenter, GPUType, ServedModel, UnitPrice, WANLink

    a = Datacenter.objects.create(name="dc-a", region="city-a")
    b = Datacenter.objects.create(name="dc-b", region="city-b")
    gpu_a = GPUType.objects.create(
        vendor="g",
        model="gpu-a",
        peak_bf16_tflops=989,
        memory_gib=80,
        memory_bandwidth_gbps=3350,
        interconnect_gbps=400,
    )
    gpu_b = GPUType.objects.create(
        vendor="g",
        model="gpu-b",
        peak_bf16_tflops=800,
        memory_gib=141,
        memory_bandwidth_gbps=7000,
        interconnect_gbps=450,
    )
    start = datetime(2026, 1, 1, tzinfo=UTC)
    UnitPrice.objects.create(
        gpu_type=gpu_a, datacenter=a, price_per_gpu_hour=Decimal("2.00"), effective_from=start
    )
    UnitPrice.objects.create(
        gpu_type=gpu_b, datacenter=b, price_per_gpu_hour=Decimal("2.50"), effective_from=start
    )
    link = WANLink.objects.create(from_datacenter=a, to_datacenter=b, bandwidth_gbps=20, rtt_ms=30)
    model = ServedModel.objects.create(
        name="baton-tiny", source="baton-tiny", num_layers=4, kv_bytes_per_token=2048
    )
    pa, _ = services.node_create(hostname="a-prefill-1", datacenter=a, gpu_type=gpu_a, gpu_count=8)
    ra, _ = services.node_create(hostname="a-relay-1", datacenter=a, gpu_type=gpu_a, gpu_count=8)
    mb, _ = services.node_create(hostname="b-decode-1", datacenter=b, gpu_type=gpu_b, gpu_count=8)
    p = services.instance_create(role="prefill", node=pa, served_model=model, gpu_count=8)
    r = services.instance_create(role="relay_decode", node=ra, served_model=model, gpu_count=4)
    m = services.instance_create(role="main_decode", node=mb, served_model=model, gpu_count=8)
    return {"link": link, "prefill": p, "relay": r, "main": m, "model": model}
