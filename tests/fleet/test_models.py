"""Model and service rules of the fleet, independent of the API."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from fleet import services
from fleet.choices import InstanceRole
from fleet.models import Datacenter, FleetEvent, GPUType, UnitPrice, WANLink

pytestmark = pytest.mark.django_db


def utc(year: int, month: int, day: int = 1) -> datetime:
    return datetime(year, month, day, tzinfo=UTC)


def test_datacenter_rdma_domain_defaults_to_its_name():
    dc = Datacenter.objects.create(name="dc-x", region="somewhere")
    assert dc.rdma_domain == "dc-x"


@pytest.mark.parametrize(
    "field", ["peak_bf16_tflops", "memory_gib", "memory_bandwidth_gbps", "interconnect_gbps"]
)
def test_gpu_type_rejects_non_positive_numbers(field):
    values = dict(
        vendor="v",
        model="m",
        peak_bf16_tflops=1,
        memory_gib=1,
        memory_bandwidth_gbps=1,
        interconnect_gbps=1,
    )
    values[field] = 0
    with pytest.raises(ValidationError) as err:
        GPUType(**values).full_clean()
    assert field in err.value.message_dict


def test_gpu_type_database_constraint_rejects_zero_compute():
    with pytest.raises(IntegrityError), transaction.atomic():
        GPUType.objects.create(
            vendor="v",
            model="m",
            peak_bf16_tflops=0,
            memory_gib=1,
            memory_bandwidth_gbps=1,
            interconnect_gbps=1,
        )


def test_unit_price_overlapping_range_for_same_pair_is_rejected(price_a, gpu_a, dc_a):
    clash = UnitPrice(
        gpu_type=gpu_a,
        datacenter=dc_a,
        price_per_gpu_hour=Decimal("3"),
        effective_from=utc(2026, 6),
        effective_to=None,
    )
    with pytest.raises(ValidationError) as err:
        services.unit_price_save(price=clash)
    assert "effective_from" in err.value.message_dict
    assert UnitPrice.objects.count() == 1


def test_unit_price_adjacent_range_is_accepted(price_a, gpu_a, dc_a):
    services.unit_price_save(
        price=UnitPrice(
            gpu_type=gpu_a,
            datacenter=dc_a,
            price_per_gpu_hour=Decimal("1.8"),
            effective_from=utc(2026, 7),
        )
    )
    assert UnitPrice.objects.count() == 2


def test_unit_price_same_range_in_other_datacenter_is_accepted(price_a, gpu_a, dc_b):
    services.unit_price_save(
        price=UnitPrice(
            gpu_type=gpu_a,
            datacenter=dc_b,
            price_per_gpu_hour=Decimal("2.2"),
            effective_from=utc(2026, 1),
        )
    )
    assert UnitPrice.objects.filter(gpu_type=gpu_a).count() == 2


def test_open_ended_price_blocks_any_later_start(gpu_a, dc_a):
    services.unit_price_save(
        price=UnitPrice(
            gpu_type=gpu_a, datacenter=dc_a, price_per_gpu_hour=1, effective_from=utc(2026, 1)
        )
    )
    with pytest.raises(ValidationError):
        services.unit_price_save(
            price=UnitPrice(
                gpu_type=gpu_a, datacenter=dc_a, price_per_gpu_hour=1, effective_from=utc(2030, 1)
            )
        )


def test_unit_price_end_before_start_is_rejected(gpu_a, dc_a):
    with pytest.raises(ValidationError) as err:
        services.unit_price_save(
            price=UnitPrice(
                gpu_type=gpu_a,
                datacenter=dc_a,
                price_per_gpu_hour=1,
                effective_from=utc(2026, 5),
                effective_to=utc(2026, 4),
            )
        )
    assert "effective_to" in err.value.message_dict


def test_unit_price_effective_at_finds_the_price_in_force(price_a, gpu_a, dc_a):
    assert list(UnitPrice.objects.effective_at(utc(2026, 3))) == [price_a]
    assert list(UnitPrice.objects.effective_at(utc(2026, 7))) == []


def test_wan_link_between_a_datacenter_and_itself_is_rejected(dc_a):
    with pytest.raises(ValidationError) as err:
        WANLink(from_datacenter=dc_a, to_datacenter=dc_a, bandwidth_gbps=10, rtt_ms=5).full_clean()
    assert "to_datacenter" in err.value.message_dict


def test_wan_link_self_loop_is_also_a_database_constraint(dc_a):
    with pytest.raises(IntegrityError), transaction.atomic():
        WANLink.objects.create(from_datacenter=dc_a, to_datacenter=dc_a, bandwidth_gbps=1, rtt_ms=1)


def test_node_token_is_shown_once_and_stored_hashed(dc_a, gpu_a):
    node, token = services.node_create(hostname="n-1", datacenter=dc_a, gpu_type=gpu_a, gpu_count=2)
    assert token.startswith(f"bnt_{node.agent_token_prefix}_")
    assert token not in node.agent_token_hash
    assert len(node.agent_token_hash) == 64
    assert services.node_authenticate_token(token) == node


def test_node_token_authentication_rejects_wrong_and_rotated_tokens(node_a):
    assert services.node_authenticate_token("bnt_nothing_here") is None
    assert services.node_authenticate_token("garbage") is None
    new_token = services.node_rotate_token(node=node_a)
    assert services.node_authenticate_token(new_token) == node_a
    forged = new_token[:-4] + "AAAA"
    assert services.node_authenticate_token(forged) is None


def test_instance_cannot_take_more_gpus_than_node_has_free(node_a, tiny_model):
    services.instance_create(
        role=InstanceRole.PREFILL, node=node_a, served_model=tiny_model, gpu_count=6
    )
    with pytest.raises(ValidationError) as err:
        services.instance_create(
            role=InstanceRole.PREFILL, node=node_a, served_model=tiny_model, gpu_count=3
        )
    assert "gpu_count" in err.value.message_dict
    assert "2 free GPU(s) of 8" in err.value.message_dict["gpu_count"][0]


def test_instance_resize_counts_its_own_gpus_as_free(prefill_a):
    updated = services.instance_update(instance=prefill_a, gpu_count=8)
    assert updated.gpu_count == 8


def test_relay_decode_needs_prefill_of_same_model_in_same_datacenter(
    node_a, node_b, tiny_model, prefill_a
):
    with pytest.raises(ValidationError) as err:
        services.instance_create(
            role=InstanceRole.RELAY_DECODE, node=node_b, served_model=tiny_model, gpu_count=1
        )
    assert "role" in err.value.message_dict
    relay = services.instance_create(
        role=InstanceRole.RELAY_DECODE, node=node_a, served_model=tiny_model, gpu_count=1
    )
    assert relay.node.datacenter == prefill_a.node.datacenter


def test_relay_decode_for_another_model_is_rejected(node_a, prefill_a):
    from fleet.models import ServedModel

    other = ServedModel.objects.create(
        name="other", source="/m", num_layers=2, kv_bytes_per_token=8
    )
    with pytest.raises(ValidationError):
        services.instance_create(
            role=InstanceRole.RELAY_DECODE, node=node_a, served_model=other, gpu_count=1
        )


def test_last_prefill_cannot_be_deleted_while_relays_depend_on_it(node_a, tiny_model, prefill_a):
    services.instance_create(
        role=InstanceRole.RELAY_DECODE, node=node_a, served_model=tiny_model, gpu_count=1
    )
    with pytest.raises(ValidationError):
        services.instance_delete(instance=prefill_a)
    with pytest.raises(ValidationError):
        services.instance_update(instance=prefill_a, role=InstanceRole.MAIN_DECODE)


def test_node_cannot_shrink_below_allocated_gpus(node_a, prefill_a):
    with pytest.raises(ValidationError) as err:
        services.node_update(node=node_a, gpu_count=2)
    assert "gpu_count" in err.value.message_dict


def test_instance_changes_are_recorded_as_events(prefill_a):
    services.instance_set_desired_state(instance=prefill_a, desired_state="drained", actor="olivia")
    kinds = list(FleetEvent.objects.filter(instance=prefill_a).values_list("kind", flat=True))
    assert kinds == ["instance.updated", "instance.created"]
    latest = FleetEvent.objects.filter(instance=prefill_a).first()
    assert latest.actor == "olivia"
    assert latest.data == {"previous": {"desired_state": "running"}}


def test_topology_counts_instances_per_role(prefill_a, node_b, tiny_model, link_ab):
    services.instance_create(
        role=InstanceRole.MAIN_DECODE, node=node_b, served_model=tiny_model, gpu_count=8
    )
    topo = services.topology_snapshot()
    by_name = {dc["name"]: dc for dc in topo["datacenters"]}
    assert by_name["dc-a"]["instances"] == {"prefill": 1, "relay_decode": 0, "main_decode": 0}
    assert by_name["dc-b"]["instances"] == {"prefill": 0, "relay_decode": 0, "main_decode": 1}
    assert by_name["dc-a"]["gpus"] == 8
    assert topo["links"] == [
        {
            "id": link_ab.id,
            "from": "dc-a",
            "to": "dc-b",
            "bandwidth_gbps": 20.0,
            "rtt_ms": 30.0,
            "connection_pool_size": 16,
            "status": "up",
        }
    ]
