"""The fleet REST API: create, list, filter, update, delete, and 400s that name the field."""

from __future__ import annotations

import pytest

from fleet.models import Datacenter, FleetEvent, GPUType, Instance, Node, UnitPrice, WANLink

pytestmark = pytest.mark.django_db

GPU = {
    "vendor": "generic",
    "model": "gpu-a",
    "peak_bf16_tflops": 989,
    "memory_gib": 80,
    "memory_bandwidth_gbps": 3350,
    "interconnect_gbps": 400,
}


def test_operator_provisions_a_two_datacenter_fleet(operator):
    dc_a = operator.post("/api/v1/datacenters/", {"name": "dc-a", "region": "city-a"}).json()
    dc_b = operator.post("/api/v1/datacenters/", {"name": "dc-b", "region": "city-b"}).json()
    gpu = operator.post("/api/v1/gpu-types/", GPU).json()
    price = operator.post(
        "/api/v1/unit-prices/",
        {
            "gpu_type": gpu["id"],
            "datacenter": dc_a["id"],
            "price_per_gpu_hour": "2.00",
            "effective_from": "2026-01-01T00:00:00Z",
        },
    )
    assert price.status_code == 201, price.json()
    link = operator.post(
        "/api/v1/wan-links/",
        {
            "from_datacenter": dc_a["id"],
            "to_datacenter": dc_b["id"],
            "bandwidth_gbps": 20,
            "rtt_ms": 30,
        },
    )
    assert link.status_code == 201, link.json()
    model = operator.post(
        "/api/v1/models/",
        {"name": "baton-tiny", "source": "baton-tiny", "num_layers": 4, "kv_bytes_per_token": 2048},
    )
    assert model.status_code == 201, model.json()
    node = operator.post(
        "/api/v1/nodes/",
        {"hostname": "a-1", "datacenter": dc_a["id"], "gpu_type": gpu["id"], "gpu_count": 8},
    )
    assert node.status_code == 201, node.json()
    assert node.json()["agent_token"].startswith("bnt_")
    assert node.json()["status"] == "pending"
    p = operator.post(
        "/api/v1/instances/",
        {
            "role": "prefill",
            "node": node.json()["id"],
            "served_model": model.json()["id"],
            "gpu_count": 4,
        },
    )
    assert p.status_code == 201, p.json()
    assert p.json()["desired_state"] == "running"
    assert p.json()["actual_state"] == "pending"
    assert p.json()["datacenter"] == dc_a["id"]
    rld = operator.post(
        "/api/v1/instances/",
        {
            "role": "relay_decode",
            "node": node.json()["id"],
            "served_model": model.json()["id"],
            "gpu_count": 4,
        },
    )
    assert rld.status_code == 201, rld.json()
    topo = operator.get("/api/v1/topology/").json()
    assert topo["datacenters"][0]["instances"] == {
        "prefill": 1,
        "relay_decode": 1,
        "main_decode": 0,
    }
    assert topo["links"][0]["from"] == "dc-a"


def test_agent_token_is_only_in_the_create_response(operator, dc_a, gpu_a):
    created = operator.post(
        "/api/v1/nodes/",
        {"hostname": "a-9", "datacenter": dc_a.id, "gpu_type": gpu_a.id, "gpu_count": 1},
    ).json()
    fetched = operator.get(f"/api/v1/nodes/{created['id']}/").json()
    assert "agent_token" not in fetched
    assert fetched["agent_token_prefix"] == created["agent_token"].split("_")[1]
    assert created["agent_token"] not in str(Node.objects.values().get(pk=created["id"]))


def test_rotate_token_returns_a_new_token(operator, node_a):
    old_prefix = node_a.agent_token_prefix
    response = operator.post(f"/api/v1/nodes/{node_a.id}/rotate-token/")
    assert response.status_code == 200
    assert response.json()["agent_token"].split("_")[1] != old_prefix


def test_list_is_paginated(operator):
    for i in range(7):
        Datacenter.objects.create(name=f"dc-{i}", region="r")
    page = operator.get("/api/v1/datacenters/?page_size=3").json()
    assert page["count"] == 7
    assert len(page["results"]) == 3
    assert page["next"].endswith("page=2&page_size=3")


def test_instances_filter_by_role_and_datacenter(operator, prefill_a, node_b, tiny_model):
    from fleet import services

    md = services.instance_create(
        role="main_decode", node=node_b, served_model=tiny_model, gpu_count=2
    )
    by_role = operator.get("/api/v1/instances/?role=main_decode").json()
    assert [i["id"] for i in by_role["results"]] == [md.id]
    by_dc = operator.get(f"/api/v1/instances/?datacenter={prefill_a.node.datacenter_id}").json()
    assert [i["id"] for i in by_dc["results"]] == [prefill_a.id]


def test_unit_prices_filter_by_effective_time(operator, price_a):
    inside = operator.get("/api/v1/unit-prices/?effective_at=2026-03-01T00:00:00Z").json()
    outside = operator.get("/api/v1/unit-prices/?effective_at=2027-03-01T00:00:00Z").json()
    assert [p["id"] for p in inside["results"]] == [price_a.id]
    assert outside["results"] == []


def test_gpu_types_filter_by_memory_bandwidth(operator, gpu_a, gpu_b):
    result = operator.get("/api/v1/gpu-types/?memory_bandwidth_gbps__gte=5000").json()
    assert [g["model"] for g in result["results"]] == ["gpu-b"]


def test_update_a_link_with_patch(operator, link_ab):
    response = operator.patch(
        f"/api/v1/wan-links/{link_ab.id}/", {"bandwidth_gbps": 100, "status": "degraded"}
    )
    assert response.status_code == 200
    link_ab.refresh_from_db()
    assert (link_ab.bandwidth_gbps, link_ab.status) == (100.0, "degraded")


def test_drain_and_start_actions_set_desired_state(operator, prefill_a):
    drained = operator.post(f"/api/v1/instances/{prefill_a.id}/drain/")
    assert drained.status_code == 200
    assert drained.json()["desired_state"] == "drained"
    started = operator.post(f"/api/v1/instances/{prefill_a.id}/start/")
    assert started.json()["desired_state"] == "running"
    events = operator.get(f"/api/v1/instances/{prefill_a.id}/events/").json()
    assert [e["kind"] for e in events["results"]] == [
        "instance.updated",
        "instance.updated",
        "instance.created",
    ]


def test_actual_state_cannot_be_set_by_an_operator(operator, prefill_a):
    response = operator.patch(f"/api/v1/instances/{prefill_a.id}/", {"actual_state": "running"})
    assert response.status_code == 200
    prefill_a.refresh_from_db()
    assert prefill_a.actual_state == "pending"


def test_delete_an_unused_gpu_type(operator, gpu_b):
    assert operator.delete(f"/api/v1/gpu-types/{gpu_b.id}/").status_code == 204
    assert not GPUType.objects.filter(pk=gpu_b.id).exists()


def test_delete_a_datacenter_in_use_is_a_400_and_keeps_everything(operator, node_a):
    response = operator.delete(f"/api/v1/datacenters/{node_a.datacenter_id}/")
    assert response.status_code == 400
    assert "Node" in response.json()["detail"]
    assert Datacenter.objects.filter(pk=node_a.datacenter_id).exists()


def test_delete_an_instance_records_an_event(operator, prefill_a):
    assert operator.delete(f"/api/v1/instances/{prefill_a.id}/").status_code == 204
    assert FleetEvent.objects.filter(kind="instance.deleted", node=prefill_a.node).exists()


# --- every validation rule answers 400 naming the field, and saves nothing ------------------


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({**GPU, "peak_bf16_tflops": 0}, "peak_bf16_tflops"),
        ({**GPU, "memory_gib": -1}, "memory_gib"),
        ({**GPU, "memory_bandwidth_gbps": "fast"}, "memory_bandwidth_gbps"),
        ({**GPU, "interconnect_gbps": None}, "interconnect_gbps"),
        ({k: v for k, v in GPU.items() if k != "vendor"}, "vendor"),
    ],
)
def test_gpu_type_bad_numbers_are_400(operator, payload, field):
    response = operator.post("/api/v1/gpu-types/", payload)
    assert response.status_code == 400
    assert field in response.json()
    assert GPUType.objects.count() == 0


def test_duplicate_gpu_type_is_400(operator, gpu_a):
    response = operator.post("/api/v1/gpu-types/", GPU)
    assert response.status_code == 400
    assert "non_field_errors" in response.json()


def test_datacenter_bad_name_is_400(operator):
    response = operator.post("/api/v1/datacenters/", {"name": "DC A!", "region": "x"})
    assert response.status_code == 400
    assert "name" in response.json()


def test_overlapping_unit_price_is_400(operator, price_a):
    response = operator.post(
        "/api/v1/unit-prices/",
        {
            "gpu_type": price_a.gpu_type_id,
            "datacenter": price_a.datacenter_id,
            "price_per_gpu_hour": "2.50",
            "effective_from": "2026-03-01T00:00:00Z",
        },
    )
    assert response.status_code == 400
    assert "Overlaps the existing price" in response.json()["effective_from"][0]
    assert UnitPrice.objects.count() == 1


def test_overlapping_unit_price_by_update_is_400(operator, price_a, gpu_a, dc_a):
    later = operator.post(
        "/api/v1/unit-prices/",
        {
            "gpu_type": gpu_a.id,
            "datacenter": dc_a.id,
            "price_per_gpu_hour": "1",
            "effective_from": "2026-08-01T00:00:00Z",
        },
    ).json()
    response = operator.patch(
        f"/api/v1/unit-prices/{later['id']}/", {"effective_from": "2026-05-01T00:00:00Z"}
    )
    assert response.status_code == 400
    assert "effective_from" in response.json()


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"price_per_gpu_hour": "0"}, "price_per_gpu_hour"),
        ({"price_per_gpu_hour": "-3"}, "price_per_gpu_hour"),
        ({"currency": "XXX"}, "currency"),
        ({"effective_to": "2025-01-01T00:00:00Z"}, "effective_to"),
    ],
)
def test_bad_unit_price_fields_are_400(operator, gpu_a, dc_a, changes, field):
    payload = {
        "gpu_type": gpu_a.id,
        "datacenter": dc_a.id,
        "price_per_gpu_hour": "2",
        "effective_from": "2026-01-01T00:00:00Z",
        **changes,
    }
    response = operator.post("/api/v1/unit-prices/", payload)
    assert response.status_code == 400
    assert field in response.json()


def test_wan_link_to_itself_is_400(operator, dc_a):
    response = operator.post(
        "/api/v1/wan-links/",
        {"from_datacenter": dc_a.id, "to_datacenter": dc_a.id, "bandwidth_gbps": 10, "rtt_ms": 5},
    )
    assert response.status_code == 400
    assert "to_datacenter" in response.json()
    assert WANLink.objects.count() == 0


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"bandwidth_gbps": 0}, "bandwidth_gbps"),
        ({"rtt_ms": -1}, "rtt_ms"),
        ({"status": "broken"}, "status"),
        ({"connection_pool_size": 0}, "connection_pool_size"),
        ({"monthly_cost": "-5"}, "monthly_cost"),
    ],
)
def test_bad_wan_link_fields_are_400(operator, dc_a, dc_b, changes, field):
    payload = {
        "from_datacenter": dc_a.id,
        "to_datacenter": dc_b.id,
        "bandwidth_gbps": 10,
        "rtt_ms": 5,
        **changes,
    }
    response = operator.post("/api/v1/wan-links/", payload)
    assert response.status_code == 400
    assert field in response.json()


def test_duplicate_wan_link_is_400(operator, link_ab):
    response = operator.post(
        "/api/v1/wan-links/",
        {
            "from_datacenter": link_ab.from_datacenter_id,
            "to_datacenter": link_ab.to_datacenter_id,
            "bandwidth_gbps": 1,
            "rtt_ms": 1,
        },
    )
    assert response.status_code == 400


def test_served_model_zero_kv_bytes_is_400(operator):
    response = operator.post(
        "/api/v1/models/", {"name": "m", "source": "m", "num_layers": 2, "kv_bytes_per_token": 0}
    )
    assert response.status_code == 400
    assert "kv_bytes_per_token" in response.json()


def test_a_served_model_with_a_profile_source_is_emulated(operator):
    response = operator.post(
        "/api/v1/models/",
        {
            "name": "paper",
            "source": "profile:paper-dsv4",
            "num_layers": 61,
            "kv_bytes_per_token": 4400,
        },
    )
    assert response.status_code == 201, response.json()
    assert response.json()["emulated"] is True
    tiny = operator.post(
        "/api/v1/models/",
        {"name": "t", "source": "baton-tiny", "num_layers": 4, "kv_bytes_per_token": 4096},
    )
    assert tiny.json()["emulated"] is False


@pytest.mark.parametrize(
    ("changes", "field", "reason"),
    [
        ({"source": "profile:nope"}, "source", "names no profile"),
        ({"kv_bytes_per_token": 4096}, "kv_bytes_per_token", "must be 4400"),
    ],
)
def test_a_bad_profile_served_model_is_400_naming_the_field(operator, changes, field, reason):
    body = {"name": "paper", "source": "profile:paper-dsv4", "num_layers": 61}
    response = operator.post("/api/v1/models/", {**body, "kv_bytes_per_token": 4400, **changes})
    assert response.status_code == 400
    assert reason in str(response.json()[field])


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"gpu_count": 0}, "gpu_count"),
        ({"hostname": "bad host!"}, "hostname"),
        ({"agent_endpoint": "not a url"}, "agent_endpoint"),
    ],
)
def test_bad_node_fields_are_400(operator, dc_a, gpu_a, changes, field):
    payload = {
        "hostname": "n-1",
        "datacenter": dc_a.id,
        "gpu_type": gpu_a.id,
        "gpu_count": 2,
        **changes,
    }
    response = operator.post("/api/v1/nodes/", payload)
    assert response.status_code == 400
    assert field in response.json()
    assert Node.objects.count() == 0


def test_node_shrink_below_allocation_is_400(operator, prefill_a):
    response = operator.patch(f"/api/v1/nodes/{prefill_a.node_id}/", {"gpu_count": 1})
    assert response.status_code == 400
    assert "gpu_count" in response.json()


def test_instance_over_free_gpus_is_400(operator, prefill_a, tiny_model):
    response = operator.post(
        "/api/v1/instances/",
        {
            "role": "main_decode",
            "node": prefill_a.node_id,
            "served_model": tiny_model.id,
            "gpu_count": 5,
        },
    )
    assert response.status_code == 400
    assert "gpu_count" in response.json()
    assert Instance.objects.count() == 1


def test_relay_without_prefill_in_datacenter_is_400(operator, node_b, tiny_model):
    response = operator.post(
        "/api/v1/instances/",
        {"role": "relay_decode", "node": node_b.id, "served_model": tiny_model.id, "gpu_count": 1},
    )
    assert response.status_code == 400
    assert "role" in response.json()
    assert Instance.objects.count() == 0


def test_unknown_role_is_400(operator, node_a, tiny_model):
    response = operator.post(
        "/api/v1/instances/",
        {"role": "decoder", "node": node_a.id, "served_model": tiny_model.id, "gpu_count": 1},
    )
    assert response.status_code == 400
    assert "role" in response.json()


def test_deleting_last_prefill_with_relays_is_400(operator, prefill_a, tiny_model):
    operator.post(
        "/api/v1/instances/",
        {
            "role": "relay_decode",
            "node": prefill_a.node_id,
            "served_model": tiny_model.id,
            "gpu_count": 1,
        },
    )
    response = operator.delete(f"/api/v1/instances/{prefill_a.id}/")
    assert response.status_code == 400
    assert "role" in response.json()
    assert Instance.objects.filter(pk=prefill_a.id).exists()


def test_malformed_json_is_400(operator):
    response = operator.generic(
        "POST", "/api/v1/datacenters/", "{bad", content_type="application/json"
    )
    assert response.status_code == 400
    assert "JSON parse error" in response.json()["detail"]


def test_unknown_filter_value_is_400(operator):
    response = operator.get("/api/v1/instances/?role=banana")
    assert response.status_code == 400
    assert "role" in response.json()


def test_schema_and_docs_are_served(operator):
    schema = operator.get("/api/schema/?format=json")
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    for collection in [
        "datacenters",
        "gpu-types",
        "unit-prices",
        "wan-links",
        "models",
        "nodes",
        "instances",
    ]:
        assert f"/api/v1/{collection}/" in paths
    assert "/api/v1/topology/" in paths
    docs = operator.get("/api/docs/")
    assert docs.status_code == 200
    assert b"swagger" in docs.content.lower()
