"""Management commands: the demo fleet loader and migrations being up to date."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command

from fleet.models import Datacenter, GPUType, Instance, Node, ServedModel, UnitPrice, WANLink

pytestmark = pytest.mark.django_db


def _counts() -> dict[str, int]:
    return {
        model.__name__: model.objects.count()
        for model in (Datacenter, GPUType, UnitPrice, WANLink, ServedModel, Node, Instance)
    }


def test_seed_demo_loads_two_datacenters_and_three_roles():
    call_command("seed_demo", stdout=StringIO())
    assert _counts() == {
        "Datacenter": 2,
        "GPUType": 2,
        "UnitPrice": 2,
        "WANLink": 1,
        "ServedModel": 1,
        "Node": 3,
        "Instance": 3,
    }
    roles = set(Instance.objects.values_list("role", flat=True))
    assert roles == {"prefill", "relay_decode", "main_decode"}
    md = Instance.objects.get(role="main_decode")
    assert md.node.datacenter.name == "dc-b"


def test_seed_demo_emulated_adds_a_two_datacenter_fleet_of_the_paper_model():
    call_command("seed_demo", stdout=StringIO())
    before = _counts()
    call_command("seed_demo", "--emulated", stdout=StringIO())
    after = _counts()
    assert after["Datacenter"] == before["Datacenter"] + 2
    assert after["Node"] == before["Node"] + 11  # 9 with an instance, 2 spare (the autopilot's)
    assert not Instance.objects.filter(node__hostname__contains="spare").exists()
    model = ServedModel.objects.get(name="paper-dsv4")
    assert model.emulated and not ServedModel.objects.get(name="baton-tiny").emulated
    emulated = Instance.objects.filter(served_model=model)
    by_role = {
        r: emulated.filter(role=r).count() for r in ("prefill", "relay_decode", "main_decode")
    }
    assert by_role == {"prefill": 4, "relay_decode": 2, "main_decode": 3}
    assert {i.node.gpu_type.model for i in emulated.filter(role="main_decode")} == {"gpu-b"}
    assert {i.node.datacenter.name for i in emulated.filter(role="prefill")} == {"emu-a"}
    assert WANLink.objects.filter(
        from_datacenter__name="emu-a", to_datacenter__name="emu-b"
    ).exists()
    out = StringIO()
    call_command("seed_demo", "--emulated", stdout=out)
    assert _counts() == after and "nothing to do" in out.getvalue()


def test_seed_demo_twice_changes_nothing():
    call_command("seed_demo", stdout=StringIO())
    before = _counts()
    out = StringIO()
    call_command("seed_demo", stdout=out)
    assert _counts() == before
    assert "nothing to do" in out.getvalue()


def test_migrations_are_up_to_date():
    out = StringIO()
    call_command("makemigrations", "--check", "--dry-run", stdout=out)
    assert "No changes detected" in out.getvalue()
