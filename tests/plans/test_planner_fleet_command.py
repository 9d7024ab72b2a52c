"""`manage.py planner_fleet` and `planner size --from-db`: the starting fleet is the database's
(GPU types, prices, the WAN link from the inventory; counts = nodes holding an instance of each
role). The planner imports no Django: its command line runs this command and reads its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from decimal import Decimal
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from fleet import services
from fleet.choices import InstanceRole
from fleet.models import Datacenter, GPUType, ServedModel, UnitPrice, WANLink
from planner import cli
from planner.size import Progress, size


@pytest.fixture
def db_fleet(db):
    a = Datacenter.objects.create(name="dc-a", region="city-a")
    b = Datacenter.objects.create(name="dc-b", region="city-b")
    gpu_a = GPUType.objects.create(vendor="generic", model="gpu-a", peak_bf16_tflops=989,
                                   memory_gib=80, memory_bandwidth_gbps=3350,
                                   interconnect_gbps=400)  # fmt: skip
    gpu_b = GPUType.objects.create(vendor="generic", model="gpu-b", peak_bf16_tflops=800,
                                   memory_gib=141, memory_bandwidth_gbps=7000,
                                   interconnect_gbps=450)  # fmt: skip
    model = ServedModel.objects.create(name="baton-tiny", source="baton-tiny", num_layers=4,
                                       kv_bytes_per_token=2048)  # fmt: skip
    WANLink.objects.create(from_datacenter=a, to_datacenter=b, bandwidth_gbps=20, rtt_ms=20)
    for gpu, dc, amount in ((gpu_a, a, "2.00"), (gpu_b, b, "2.50")):
        services.unit_price_save(
            price=UnitPrice(gpu_type=gpu, datacenter=dc, price_per_gpu_hour=Decimal(amount),
                            currency="USD",
                            effective_from=timezone.now() - timedelta(days=30))
        )  # fmt: skip
    nodes = []
    for host, dc, gpu in (("a-1", a, gpu_a), ("a-2", a, gpu_a), ("b-1", b, gpu_b)):
        node, _ = services.node_create(hostname=host, datacenter=dc, gpu_type=gpu, gpu_count=8)
        nodes.append(node)
    for role, node in (
        (InstanceRole.PREFILL, nodes[0]),
        (InstanceRole.PREFILL, nodes[1]),
        (InstanceRole.MAIN_DECODE, nodes[2]),
    ):
        services.instance_create(role=role, node=node, served_model=model, gpu_count=4)


@pytest.fixture
def in_process(monkeypatch):
    """The planner's `manage.py` runs in this process, so it reads the test database."""

    def manage(*args: str) -> subprocess.CompletedProcess[str]:
        out, err = StringIO(), StringIO()
        try:
            call_command(*args, stdout=out, stderr=err)
        except CommandError as exc:
            return subprocess.CompletedProcess(args, 1, out.getvalue(), f"CommandError: {exc}\n")
        return subprocess.CompletedProcess(args, 0, out.getvalue(), err.getvalue())

    monkeypatch.setattr(cli, "_manage", manage)


def test_the_database_fleet_is_the_starting_point(db_fleet) -> None:
    out = StringIO()
    call_command("planner_fleet", "tiny-size", stdout=out)
    fleet = json.loads(out.getvalue())
    counts = {(p["role"], p["gpu"], p["datacenter"]): p["count"] for p in fleet["pools"]}
    assert counts == {
        ("prefill", "generic/gpu-a", "dc-a"): 2,
        ("relay_decode", "generic/gpu-a", "dc-a"): 0,
        ("main_decode", "generic/gpu-b", "dc-b"): 1,
    }
    assert fleet["gpu_types"]["generic/gpu-a"]["unit_price"] == pytest.approx(16.0)
    assert fleet["links"]["dc-b"]["rtt_ms"] == 20
    out = size("tiny-size", fleet=fleet, workers=1, bcr_scan=[], band_pct=0, constants_pct=0,
               seeds=0, progress=Progress(enabled=False))  # fmt: skip
    assert out["start"] == {
        "prefill@dc-a:generic/gpu-a": 2,
        "relay_decode@dc-a:generic/gpu-a": 0,
        "main_decode@dc-b:generic/gpu-b": 1,
    }
    assert out["unit_prices"] == {"generic/gpu-a": 16.0, "generic/gpu-b": 20.0}
    best = out["cheapest"]
    assert best["found"] and best["at"]["met"]


def test_cli_size_from_db(db_fleet, in_process, capsys) -> None:
    code = cli.main(["size", "tiny-size", "--from-db", "--workers", "1", "--bcr-scan", "",
                     "--band", "0", "--constants", "0", "--seeds", "0",
                     "--progress", "off"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "unit prices: generic/gpu-a 16/h, generic/gpu-b 20/h" in out


def test_a_database_without_the_fleet_data_is_one_line_and_exit_2(db, in_process, capsys):
    with pytest.raises(CommandError, match="no WAN link in the database"):
        call_command("planner_fleet", "tiny-size", stdout=StringIO())
    assert cli.main(["size", "tiny-size", "--from-db", "--progress", "off"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: fleet: no WAN link in the database;"), err


def test_the_planner_runs_the_control_planes_command_line(tmp_path, monkeypatch):
    """For real: `planner size --from-db` runs `manage.py planner_fleet` in a child process,
    here on an empty embedded database of its own."""
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("BATON_VAR_DIR", str(tmp_path))
    manage = [sys.executable, str(cli.ROOT / "manage.py")]
    subprocess.run([*manage, "migrate", "-v0"], check=True, capture_output=True)
    done = subprocess.run(
        [sys.executable, "-m", "planner", "size", "tiny-size", "--from-db", "--progress", "off"],
        cwd=cli.ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: fleet: no WAN link in the database;"), done.stderr
