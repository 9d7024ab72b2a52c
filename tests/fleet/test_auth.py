"""Who may do what: operators write, viewers read, strangers nothing."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from rest_framework.test import APIClient

from fleet.models import Datacenter

pytestmark = pytest.mark.django_db

COLLECTIONS = [
    "datacenters",
    "gpu-types",
    "unit-prices",
    "wan-links",
    "models",
    "nodes",
    "instances",
]


@pytest.mark.parametrize("collection", COLLECTIONS)
def test_anonymous_requests_are_401(anonymous, collection):
    assert anonymous.get(f"/api/v1/{collection}/").status_code == 401


@pytest.mark.parametrize("collection", COLLECTIONS)
def test_viewer_can_list_every_collection(viewer, collection):
    assert viewer.get(f"/api/v1/{collection}/").status_code == 200


def test_viewer_can_read_topology(viewer):
    assert viewer.get("/api/v1/topology/").status_code == 200


def test_viewer_cannot_create(viewer):
    response = viewer.post("/api/v1/datacenters/", {"name": "dc-z", "region": "r"})
    assert response.status_code == 403
    assert Datacenter.objects.count() == 0


def test_viewer_cannot_update_or_delete(viewer, dc_a):
    assert (
        viewer.patch(f"/api/v1/datacenters/{dc_a.id}/", {"region": "elsewhere"}).status_code == 403
    )
    assert viewer.delete(f"/api/v1/datacenters/{dc_a.id}/").status_code == 403
    dc_a.refresh_from_db()
    assert dc_a.region == "city-a"


def test_viewer_cannot_run_actions(viewer, prefill_a):
    assert viewer.post(f"/api/v1/instances/{prefill_a.id}/drain/").status_code == 403
    assert viewer.post(f"/api/v1/nodes/{prefill_a.node_id}/rotate-token/").status_code == 403


def test_bad_token_is_401(db):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token not-a-real-token")
    assert client.get("/api/v1/datacenters/").status_code == 401


def test_agent_token_is_not_an_operator_credential(node_a):
    from fleet import services

    token = services.node_rotate_token(node=node_a)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    assert client.get("/api/v1/nodes/").status_code == 401


def test_baton_user_command_prints_a_working_operator_token(capsys):
    call_command("baton_user", "ops", "--role", "operator")
    token = capsys.readouterr().out.strip()
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    assert client.post("/api/v1/datacenters/", {"name": "dc-q", "region": "r"}).status_code == 201


def test_baton_user_command_demotes_to_viewer(capsys):
    call_command("baton_user", "ops", "--role", "operator")
    call_command("baton_user", "ops", "--role", "viewer")
    token = capsys.readouterr().out.split()[-1]
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    assert client.post("/api/v1/datacenters/", {"name": "dc-q", "region": "r"}).status_code == 403


def test_drf_create_token_prints_a_token(capsys):
    from django.contrib.auth.models import User

    User.objects.create_user("carol")
    call_command("drf_create_token", "carol")
    assert "Generated token" in capsys.readouterr().out
