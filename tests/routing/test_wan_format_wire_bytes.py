"""A WAN link's KV format (WANLink.kv_format) as the policy and the simulator count it: the
bytes a transfer puts on the wire are the format's (pdd/kv_formats.py), relative to the KV
dtype the prefill instances report, so an int8 link's transfers are estimated at half the
time of a bfloat16 fleet's own."""

from __future__ import annotations

import pytest

from fleet.choices import InstanceRole
from fleet.models import Datacenter, GPUType, ServedModel, WANLink
from pdd.kv_formats import BYTES_PER_VALUE, KV_FORMATS, wire_factor
from pdd.policy import PolicySettings, WanLinkState, estimate_wan_s
from planner.wan import WanLinkSpec
from routing.live import build_live_view


def test_each_format_costs_its_bytes_relative_to_the_engines_own():
    assert wire_factor("int8", "bfloat16") == pytest.approx(0.5 * (1 + 1 / 256))
    assert wire_factor("int8", "float32") == pytest.approx(0.25 * (1 + 1 / 256))
    assert wire_factor("float32", "bfloat16") == 2.0
    assert wire_factor("", "float32") == wire_factor(None, "float16") == 1.0
    assert wire_factor("bfloat16", "bfloat16") == 1.0
    assert set(BYTES_PER_VALUE) == set(KV_FORMATS)
    with pytest.raises(ValueError, match="unknown KV format 'int4'.*int8"):
        wire_factor("int4", "float32")


def test_the_policy_estimate_scales_only_the_bytes_by_the_wire_factor():
    settings = PolicySettings(kv_bytes_per_token=4_400)
    own = WanLinkState(bandwidth_gbps=8.0, rtt_ms=20.0)
    int8 = WanLinkState(bandwidth_gbps=8.0, rtt_ms=20.0, wire_factor=0.5)
    bytes_s = 10_000 * 4_400 / 1e9  # 8 Gbit/s is 1 GB/s
    assert estimate_wan_s(10_000, own, settings) == pytest.approx(0.020 + bytes_s)
    assert estimate_wan_s(10_000, int8, settings) == pytest.approx(0.020 + bytes_s / 2)


def test_the_simulators_link_takes_a_format_and_refuses_an_unknown_one():
    assert WanLinkSpec().wire_factor == 1.0
    assert WanLinkSpec(kv_format="int8").wire_factor == pytest.approx(0.5 * (1 + 1 / 256))
    with pytest.raises(ValueError, match="kv_format: must be empty or one of .*'int4'"):
        WanLinkSpec(kv_format="int4")


@pytest.fixture
def two_dc_fleet(transactional_db, running_instance):
    """P in dc-a and MD in dc-b (each reporting ``kv`` as given), the link between them in
    int8."""
    model = ServedModel.objects.create(
        name="paper", source="paper-dsv4", num_layers=4, kv_bytes_per_token=4400
    )
    a = Datacenter.objects.create(name="dc-a", region="city-a")
    b = Datacenter.objects.create(name="dc-b", region="city-b")
    gpu = GPUType.objects.create(
        vendor="g", model="gpu", peak_bf16_tflops=989, memory_gib=80,
        memory_bandwidth_gbps=3350, interconnect_gbps=400,
    )  # fmt: skip
    link = WANLink.objects.create(
        from_datacenter=a, to_datacenter=b, bandwidth_gbps=20, rtt_ms=20, kv_format="int8"
    )

    def fleet(kv: dict) -> None:
        running_instance(InstanceRole.PREFILL, a, gpu, model, kv=kv)
        running_instance(InstanceRole.MAIN_DECODE, b, gpu, model, kv=kv)

    return fleet, link


def test_the_live_view_gives_the_link_its_formats_wire_factor(two_dc_fleet):
    fleet, _ = two_dc_fleet
    fleet({"dtype": "bfloat16"})
    link = build_live_view("paper").snapshot.wan_links["dc-b"]
    assert link.wire_factor == pytest.approx(0.5 * (1 + 1 / 256))


def test_an_unknown_sender_dtype_counts_every_byte(two_dc_fleet):
    fleet, _ = two_dc_fleet
    fleet({})  # no dtype reported
    assert build_live_view("paper").snapshot.wan_links["dc-b"].wire_factor == 1.0


def test_a_link_in_the_engines_own_format_counts_every_byte(two_dc_fleet):
    fleet, link = two_dc_fleet
    link.kv_format = ""
    link.save()
    fleet({"dtype": "bfloat16"})
    assert build_live_view("paper").snapshot.wan_links["dc-b"].wire_factor == 1.0
