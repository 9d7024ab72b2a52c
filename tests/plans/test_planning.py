"""Capacity planning over the database fleet: inputs from rows, plan runs, the API, the command."""

from __future__ import annotations

import json
from datetime import timedelta
from decimal import Decimal
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from fleet import services
from fleet.choices import LinkStatus, PlanRunStatus
from fleet.models import Datacenter, UnitPrice, WANLink
from plans import services as planning
from plans.models import PlanRun
from plans.tasks import plan_execute

ONE = {"prefill_counts": [2], "relay_counts": [1], "main_counts": [1]}
# tiny-plan warms up for 20 s; 40 s of load keeps one combination well under a second.
SHORT_S = 40.0
TOO_MANY = {"prefill_counts": list(range(1, 9)), "main_counts": list(range(1, 10))}


def _price(gpu, dc, amount, *, start_days=-30, end_days=None, currency="USD") -> UnitPrice:
    now = timezone.now()
    return services.unit_price_save(
        price=UnitPrice(
            gpu_type=gpu,
            datacenter=dc,
            price_per_gpu_hour=Decimal(amount),
            currency=currency,
            effective_from=now + timedelta(days=start_days),
            effective_to=None if end_days is None else now + timedelta(days=end_days),
        )
    )


@pytest.fixture
def priced_fleet(dc_a, dc_b, gpu_a, gpu_b, link_ab, node_a):
    """gpu-a at 2.00/GPU-h in dc-a (8-GPU node), gpu-b at 2.50/GPU-h in dc-b (4-GPU nodes)."""
    services.node_create(hostname="b-1", datacenter=dc_b, gpu_type=gpu_b, gpu_count=4)
    services.node_create(hostname="b-2", datacenter=dc_b, gpu_type=gpu_b, gpu_count=4)
    return {
        "price_a": _price(gpu_a, dc_a, "2.00"),
        "price_b": _price(gpu_b, dc_b, "2.50"),
        "link": link_ab,
    }


def _inputs(**kw):
    return planning.plan_inputs_from_fleet(**{**ONE, **kw})


# --- inputs from the database ----------------------------------------------------------------


def test_gpu_types_become_planner_nodes_in_planner_units(priced_fleet):
    gpu_types = _inputs()["fleet_spec"]["gpu_types"]
    a, b = gpu_types["generic/gpu-a"], gpu_types["generic/gpu-b"]
    assert a["peak_tflops"] == pytest.approx(989 * 8)
    assert a["mem_gb"] == pytest.approx(80 * 1.073741824 * 8)
    assert a["mem_bw_tbps"] == pytest.approx(26.8)  # 3350 GB/s x 8
    assert a["interconnect_gbps"] == pytest.approx(400 * 8 * 8)  # GB/s -> Gbit/s, x 8 GPUs
    assert a["unit_price"] == pytest.approx(16.0)  # 2.00 x 8 GPUs
    assert b["peak_tflops"] == pytest.approx(800 * 4)  # gpu-b nodes hold 4 GPUs
    assert b["mem_bw_tbps"] == pytest.approx(28.0)
    assert b["unit_price"] == pytest.approx(10.0)


def test_a_gpu_type_without_nodes_is_sized_at_eight_gpus(dc_a, dc_b, gpu_a, gpu_b, link_ab):
    _price(gpu_a, dc_a, "2.00")
    _price(gpu_b, dc_b, "2.50")
    inputs = _inputs()
    assert inputs["gpus_per_node"] == {"prefill": 8, "relay_decode": 8, "main_decode": 8}
    assert inputs["fleet_spec"]["gpu_types"]["generic/gpu-b"]["unit_price"] == pytest.approx(20.0)


def test_only_the_price_in_force_now_is_used(priced_fleet, gpu_a, dc_a, price_a):
    # price_a (2.00, ended 2026-07-01) is history; a future price is not yet in force.
    priced_fleet["price_a"].effective_to = timezone.now() - timedelta(days=1)
    priced_fleet["price_a"].save()
    _price(gpu_a, dc_a, "3.00", start_days=-1, end_days=10)
    _price(gpu_a, dc_a, "9.00", start_days=10)
    gpu = _inputs()["fleet_spec"]["gpu_types"]["generic/gpu-a"]
    assert gpu["unit_price"] == pytest.approx(24.0)


def test_the_wan_link_places_the_pools_and_sets_the_link(priced_fleet):
    link = priced_fleet["link"]
    link.connection_pool_size = 32
    link.save()
    inputs = _inputs()
    spec = inputs["fleet_spec"]["links"]["dc-b"]
    assert (spec["bandwidth_gbps"], spec["rtt_ms"], spec["pool_size"]) == (20, 30, 32)
    assert spec["tcp_window_kb"] == 562.5  # per-connection window from the scenario
    assert [(p["role"], p["datacenter"], p["gpu"]) for p in inputs["search_space"]["pools"]] == [
        ("prefill", "dc-a", "generic/gpu-a"),
        ("relay_decode", "dc-a", "generic/gpu-a"),
        ("main_decode", "dc-b", "generic/gpu-b"),
    ]
    assert inputs["fleet_spec"]["system"] == "pdd"


def test_model_workload_and_sla_come_from_the_scenario(priced_fleet):
    inputs = _inputs(duration_s=SHORT_S)
    assert inputs["fleet_spec"]["model"]["active_params_b"] == 37
    assert inputs["sla"]["ttft_p90_s"] == 10
    assert inputs["workload_spec"]["duration_s"] == SHORT_S
    assert inputs["search_space"]["iters"] == 4
    assert any("scenario 'tiny-plan'" in note for note in inputs["notes"])


def test_the_first_link_that_is_up_is_used_and_the_choice_is_noted(priced_fleet, gpu_a, dc_a):
    priced_fleet["link"].status = LinkStatus.DOWN
    priced_fleet["link"].save()
    dc_c = Datacenter.objects.create(name="dc-c", region="city-c")
    _price(gpu_a, dc_c, "1.50")
    WANLink.objects.create(from_datacenter=dc_a, to_datacenter=dc_c, bandwidth_gbps=40, rtt_ms=10)
    inputs = _inputs()
    assert list(inputs["fleet_spec"]["links"]) == ["dc-c"]
    assert "2 WAN links; planning over dc-a -> dc-c, the first that is up" in inputs["notes"]


def test_counts_are_sorted_and_repeats_dropped(priced_fleet):
    assert _inputs(prefill_counts=[4, 2, 4])["search_space"]["pools"][0]["counts"] == [2, 4]


# --- missing or bad input -------------------------------------------------------------------


def test_no_wan_link_is_an_error_naming_it(dc_a, gpu_a):
    _price(gpu_a, dc_a, "2.00")
    with pytest.raises(ValueError, match="no WAN link in the database"):
        _inputs()


def test_no_price_in_the_main_decode_datacenter_is_an_error_naming_it(dc_a, gpu_a, link_ab):
    _price(gpu_a, dc_a, "2.00")
    with pytest.raises(planning.PlanInputError) as err:
        _inputs()
    assert err.value.field == "fleet"
    assert "no GPU type has a unit price in force in datacenter dc-b" in err.value.message


def test_prices_in_two_currencies_are_an_error(dc_a, dc_b, gpu_a, gpu_b, link_ab):
    _price(gpu_a, dc_a, "2.00")
    _price(gpu_b, dc_b, "2.50", currency="EUR")
    with pytest.raises(ValueError, match="BCR needs one currency"):
        _inputs()


@pytest.mark.parametrize(
    ("kw", "field", "text"),
    [
        ({"scenario": "nope"}, "scenario", "unknown scenario 'nope'"),
        ({"scenario": "paper-microbench"}, "scenario", "unknown scenario"),  # a transfer one
        ({"scenario": "../tiny-plan.json"}, "scenario", "unknown scenario"),
        ({"relay_counts": []}, "relay_counts", "needs at least one node count"),
        ({"main_counts": [1001]}, "main_counts", "0..1000"),
        ({"prefill_counts": [-1]}, "prefill_counts", "0..1000"),
        ({"prefill_counts": [0]}, "prefill_counts", "at least one node"),
        (TOO_MANY, "counts", "8 x 1 x 9 = 72 combinations"),
        ({"duration_s": 10}, "duration_s", "longer than the warmup"),
    ],
)
def test_bad_input_is_an_error_naming_the_field(priced_fleet, kw, field, text):
    with pytest.raises(planning.PlanInputError) as err:
        _inputs(**kw)
    assert err.value.field == field
    assert text in err.value.message


# --- plan runs and the task ------------------------------------------------------------------


@pytest.fixture
def queued_run(priced_fleet, django_user_model):
    user = django_user_model.objects.create_user("planner-user")
    return planning.plan_run_create(**ONE, top=3, created_by=user, duration_s=SHORT_S)


def test_a_created_run_is_queued_with_its_inputs_and_total(queued_run):
    assert queued_run.status == PlanRunStatus.QUEUED
    assert queued_run.progress_total == 1
    assert queued_run.inputs["prefill_counts"] == [2]
    assert queued_run.created_by.username == "planner-user"


@pytest.fixture
def eager_celery():
    """Run queued tasks in-process, as the embedded default does, even on a Redis-backed run."""
    from controlplane.celery import app

    previous = app.conf.task_always_eager
    app.conf.update(task_always_eager=True)
    yield
    app.conf.update(task_always_eager=previous)


def test_a_created_run_is_enqueued_after_commit(
    priced_fleet, eager_celery, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        run = planning.plan_run_create(**ONE, duration_s=SHORT_S)
    assert len(callbacks) == 1
    run.refresh_from_db()
    assert run.status == PlanRunStatus.DONE  # tasks run in-process on the embedded defaults


def test_executing_a_run_stores_the_best_results(queued_run):
    run = planning.plan_run_execute(plan_run_id=queued_run.pk)
    assert run.status == PlanRunStatus.DONE, run.error
    assert (run.progress_done, run.progress_total) == (1, 1)
    assert run.started_at and run.finished_at and run.error == ""
    [best] = run.results
    assert best["nodes"] == {"prefill": 2, "relay_decode": 1, "main_decode": 1}
    assert best["gpus"] == {"prefill": 16, "relay_decode": 8, "main_decode": 4}
    assert best["cost_per_hour"] == pytest.approx(3 * 16.0 + 10.0)
    assert best["goodput_rps"] > 0
    assert best["bcr"] == pytest.approx(best["goodput_rps"] / best["cost_per_hour"])


def test_the_task_is_idempotent(queued_run):
    assert plan_execute(queued_run.pk) == PlanRunStatus.DONE
    first = PlanRun.objects.get(pk=queued_run.pk)
    assert plan_execute(queued_run.pk) == PlanRunStatus.DONE
    again = PlanRun.objects.get(pk=queued_run.pk)
    assert (again.started_at, again.finished_at, again.results) == (
        first.started_at,
        first.finished_at,
        first.results,
    )


def test_a_run_already_running_is_left_alone(queued_run):
    PlanRun.objects.filter(pk=queued_run.pk).update(status=PlanRunStatus.RUNNING)
    run = planning.plan_run_execute(plan_run_id=queued_run.pk)
    assert run.status == PlanRunStatus.RUNNING and run.results == [] and run.started_at is None


def test_a_planner_error_fails_the_run_with_its_reason(queued_run):
    inputs = {**queued_run.inputs, "sla": {"ttft_p90_s": -1}}
    PlanRun.objects.filter(pk=queued_run.pk).update(inputs=inputs)
    run = planning.plan_run_execute(plan_run_id=queued_run.pk)
    assert run.status == PlanRunStatus.FAILED
    assert run.error.startswith("ValueError: sla.ttft_p90_s")
    assert run.finished_at is not None


def test_the_task_on_a_deleted_run_does_nothing(db):
    assert plan_execute(12345) == "missing"


# --- REST -----------------------------------------------------------------------------------

BODY = {"scenario": "tiny-plan", **ONE, "top": 2}


def test_an_operator_posts_a_plan_and_gets_the_queued_run(operator, priced_fleet):
    response = operator.post("/api/v1/plans/", BODY, format="json")
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["status"] == "queued"
    assert (body["prefill_counts"], body["main_counts"], body["top"]) == ([2], [1], 2)
    assert body["created_by"] == "olivia" and body["currency"] == "USD"
    assert PlanRun.objects.get(pk=body["id"]).inputs["search_space"]["pools"][2]["counts"] == [1]


def test_a_posted_plan_runs_after_commit(
    operator, priced_fleet, eager_celery, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        created = operator.post("/api/v1/plans/", BODY, format="json").json()
    # 120 s of the scenario's load here: still one combination.
    detail = operator.get(f"/api/v1/plans/{created['id']}/").json()
    assert detail["status"] == "done", detail["error"]
    assert detail["results"][0]["nodes"]["main_decode"] == 1
    assert detail["inputs"]["fleet_spec"]["links"]["dc-b"]["rtt_ms"] == 30


def test_a_viewer_may_list_and_read_plans_but_not_post(viewer, queued_run):
    assert viewer.post("/api/v1/plans/", BODY, format="json").status_code == 403
    listed = viewer.get("/api/v1/plans/").json()
    assert [r["id"] for r in listed["results"]] == [queued_run.pk]
    assert "inputs" not in listed["results"][0]
    assert viewer.get(f"/api/v1/plans/{queued_run.pk}/").json()["status"] == "queued"


def test_anonymous_requests_are_refused(anonymous):
    assert anonymous.get("/api/v1/plans/").status_code == 401


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"scenario": "nope"}, "scenario"),
        ({"prefill_counts": []}, "prefill_counts"),
        ({"relay_counts": [1001]}, "relay_counts"),
        ({"main_counts": [-1]}, "main_counts"),
        ({"main_counts": "2"}, "main_counts"),
        (TOO_MANY, "counts"),
        ({"top": 0}, "top"),
    ],
)
def test_bad_plan_requests_are_400s_naming_the_field(operator, priced_fleet, change, field):
    response = operator.post("/api/v1/plans/", {**BODY, **change}, format="json")
    assert response.status_code == 400
    assert list(response.json()) == [field]
    assert not PlanRun.objects.exists()


def test_a_plan_over_missing_fleet_data_is_a_400(operator, dc_a, gpu_a):
    _price(gpu_a, dc_a, "2.00")
    response = operator.post("/api/v1/plans/", BODY, format="json")
    assert response.status_code == 400
    assert "no WAN link" in response.json()["fleet"][0]


# --- the command ----------------------------------------------------------------------------


def test_the_command_prints_a_table_of_the_best_plans(priced_fleet):
    out = StringIO()
    call_command(
        "plan", "--prefill", "2", "--relay", "1", "--main", "1", "--duration", "40", stdout=out
    )
    text = out.getvalue()
    assert "  P in dc-a: generic/gpu-a, 8 GPUs/node, 16.00 USD/node-h, trying 2 nodes" in text
    assert " MD in dc-b: generic/gpu-b, 4 GPUs/node, 10.00 USD/node-h, trying 1 nodes" in text
    assert "goodput req/s" in text and "cost USD/h" in text and "BCR" in text
    row = next(line for line in text.splitlines() if line.startswith(" 1 "))
    assert row.split()[1:6] == ["2", "1", "1", row.split()[4], "58.00"]


def test_the_command_prints_json(priced_fleet):
    out = StringIO()
    call_command(
        "plan", "--prefill", "2", "--relay", "0", "--main", "1", "--duration", "40", "--json",
        stdout=out,
    )  # fmt: skip
    data = json.loads(out.getvalue())
    assert data["currency"] == "USD"
    assert data["results"][0]["nodes"] == {"prefill": 2, "relay_decode": 0, "main_decode": 1}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prefill", "two"], "--prefill: expected comma-separated whole numbers, got 'two'"),
        (["--main", "1001"], "--main: counts must be whole numbers 0..1000, got 1001"),
        (["--scenario", "nope"], "--scenario: unknown scenario 'nope'"),
        (["--top", "0"], "--top: must be 1..20, got 0"),
    ],
)
def test_bad_command_input_is_one_line(priced_fleet, args, message):
    with pytest.raises(CommandError) as err:
        call_command("plan", *args, stdout=StringIO())
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_the_command_says_what_fleet_data_is_missing(db):
    with pytest.raises(CommandError, match="fleet: no WAN link in the database"):
        call_command("plan", stdout=StringIO())
