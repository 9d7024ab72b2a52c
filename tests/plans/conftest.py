"""Fixtures for the plan-run tests: the fleet tests' small two-datacenter fleet."""

from tests.fleet.conftest import (  # noqa: F401
    dc_a,
    dc_b,
    gpu_a,
    gpu_b,
    link_ab,
    node_a,
    node_b,
    prefill_a,
    price_a,
    tiny_model,
)
