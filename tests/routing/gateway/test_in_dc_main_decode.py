"""In-DC PD: an MD in the prefill datacenter is reached over that datacenter's own fabric (its
GPUs' interconnect), not a WAN link, so the live view routes P-MD inside one datacenter."""

from __future__ import annotations

import pytest

from fleet.choices import InstanceRole
from fleet.models import Datacenter, GPUType, Instance, ServedModel
from pdd.policy import LinkStatus, PolicySettings, RequestInfo, decide
from routing.live import IN_DC_RTT_MS, build_live_view


@pytest.fixture
def in_dc_fleet(transactional_db, running_instance):
    model = ServedModel.objects.create(
        name="baton-tiny", source="baton-tiny", num_layers=4, kv_bytes_per_token=4096
    )
    a = Datacenter.objects.create(name="dc-a", region="city-a")
    gpu = GPUType.objects.create(
        vendor="g",
        model="gpu",
        peak_bf16_tflops=989,
        memory_gib=80,
        memory_bandwidth_gbps=3350,
        interconnect_gbps=400,
    )
    for role in (InstanceRole.PREFILL, InstanceRole.MAIN_DECODE):
        running_instance(role, a, gpu, model)
    return model


def test_an_md_in_the_prefill_datacenter_is_reachable_over_the_fabric(in_dc_fleet):
    view = build_live_view("baton-tiny")
    link = view.snapshot.wan_links["dc-a"]
    assert link.bandwidth_gbps == 400
    assert link.rtt_ms == IN_DC_RTT_MS
    assert link.status == LinkStatus.UP
    decision = decide(
        RequestInfo(prompt_tokens=1_000, max_tokens=16),
        view.snapshot,
        PolicySettings(wan_time_threshold_s=0.25, kv_bytes_per_token=4096),
    )
    # 1,000 tokens of KV (4 MB) take ~0.1 ms on 400 Gbit/s: straight to MD, no relay.
    assert decision.pipeline == "p-md"
    assert decision.main_id == str(Instance.objects.get(role=InstanceRole.MAIN_DECODE).pk)
