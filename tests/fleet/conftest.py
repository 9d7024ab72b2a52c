"""Fixtures for the fleet tests: a small two-datacenter fleet (API clients per role: the
suite-wide operator, viewer and anonymous fixtures of tests/conftest.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest

from fleet import services
from fleet.choices import InstanceRole
from fleet.models import Datacenter, GPUType, ServedModel, UnitPrice, WANLink


@pytest.fixture
def dc_a(db) -> Datacenter:
    return Datacenter.objects.create(name="dc-a", region="city-a")


@pytest.fixture
def dc_b(db) -> Datacenter:
    return Datacenter.objects.create(name="dc-b", region="city-b")


@pytest.fixture
def gpu_a(db) -> GPUType:
    return GPUType.objects.create(
        vendor="generic",
        model="gpu-a",
        peak_bf16_tflops=989,
        memory_gib=80,
        memory_bandwidth_gbps=3350,
        interconnect_gbps=400,
    )


@pytest.fixture
def gpu_b(db) -> GPUType:
    return GPUType.objects.create(
        vendor="generic",
        model="gpu-b",
        peak_bf16_tflops=800,
        memory_gib=141,
        memory_bandwidth_gbps=7000,
        interconnect_gbps=450,
    )


@pytest.fixture
def tiny_model(db) -> ServedModel:
    return ServedModel.objects.create(
        name="baton-tiny", source="baton-tiny", num_layers=4, kv_bytes_per_token=2048
    )


@pytest.fixture
def node_a(dc_a, gpu_a):
    node, _ = services.node_create(hostname="a-1", datacenter=dc_a, gpu_type=gpu_a, gpu_count=8)
    return node


@pytest.fixture
def node_b(dc_b, gpu_b):
    node, _ = services.node_create(hostname="b-1", datacenter=dc_b, gpu_type=gpu_b, gpu_count=8)
    return node


@pytest.fixture
def prefill_a(node_a, tiny_model):
    return services.instance_create(
        role=InstanceRole.PREFILL, node=node_a, served_model=tiny_model, gpu_count=4
    )


@pytest.fixture
def link_ab(dc_a, dc_b) -> WANLink:
    return WANLink.objects.create(
        from_datacenter=dc_a, to_datacenter=dc_b, bandwidth_gbps=20, rtt_ms=30
    )


@pytest.fixture
def price_a(gpu_a, dc_a) -> UnitPrice:
    return services.unit_price_save(
        price=UnitPrice(
            gpu_type=gpu_a,
            datacenter=dc_a,
            price_per_gpu_hour=Decimal("2.00"),
            effective_from=datetime(2026, 1, 1, tzinfo=UTC),
            effective_to=datetime(2026, 7, 1, tzinfo=UTC),
        )
    )
