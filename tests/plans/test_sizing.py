"""Sizing runs (``planner size`` as a long job): create, execute, the task and the REST API."""

from __future__ import annotations

import pytest

from fleet.choices import PlanRunStatus
from plans import sizing
from plans.models import SizingRun
from plans.tasks import sizing_execute
from tests.plans.test_planning import eager_celery, priced_fleet  # noqa: F401

URL = "/api/v1/plans/sizing/"
BODY = {"scenario": "tiny-size", "rps": 5, "p90": 10, "p99": 15}


@pytest.fixture(scope="module")
def tiny_answer():
    """planner.size on tiny-size once (a few seconds): what every executed run must store."""
    from planner.size import size

    return size("tiny-size", 5.0, sla={"ttft_p90_s": 10, "ttft_p99_s": 15}, workers=1)


def test_a_created_run_is_queued_with_its_checked_inputs(db, django_user_model):
    user = django_user_model.objects.create_user("sizer")
    run = sizing.sizing_run_create(scenario="tiny-size", rps=5, p90=10, created_by=user)
    assert run.status == PlanRunStatus.QUEUED
    assert (run.rps, run.p90, run.p99, run.start_from_db) == (5.0, 10.0, None, False)
    assert run.inputs["sla"] == {"ttft_p90_s": 10.0} and run.inputs["fleet"] is None
    assert run.created_by == user


def test_a_run_that_cannot_be_queued_is_failed_saying_why(db, monkeypatch):
    from plans import services

    def broker_down(task, *args, on_error=None):
        on_error(ConnectionError("broker down"))

    monkeypatch.setattr(services, "enqueue_after_commit", broker_down)
    run = sizing.sizing_run_create(scenario="tiny-size", rps=5, p90=10)
    run.refresh_from_db()
    assert run.status == PlanRunStatus.FAILED and run.finished_at is not None
    assert run.error == "could not queue the sizing run: ConnectionError: broker down"


def test_executing_a_run_stores_the_answer_and_its_progress(db, tiny_answer):
    run = sizing.sizing_run_create(**{k: v for k, v in BODY.items()})
    run = sizing.sizing_run_execute(sizing_run_id=run.pk)
    assert run.status == PlanRunStatus.DONE, run.error
    assert run.started_at and run.finished_at and run.error == ""
    assert run.progress_total == run.result["runs"] == run.progress_done > 0
    assert run.progress_note == "done"
    cheapest = run.result["cheapest"]
    assert cheapest["found"] and cheapest["counts"] == tiny_answer["cheapest"]["counts"]
    assert cheapest["cost_per_hour"] == pytest.approx(tiny_answer["cheapest"]["cost_per_hour"])
    assert run.result["max_bcr"]["best"]["counts"] == tiny_answer["max_bcr"]["best"]["counts"]
    assert run.result["unit_prices"] == {"GPU-A": 1.0, "GPU-B": 1.25}


def test_the_task_is_idempotent_and_ignores_a_deleted_run(db):
    run = sizing.sizing_run_create(scenario="tiny-size")
    SizingRun.objects.filter(pk=run.pk).update(status=PlanRunStatus.RUNNING)
    assert sizing_execute(run.pk) == PlanRunStatus.RUNNING  # not queued: left alone
    assert SizingRun.objects.get(pk=run.pk).result == {}
    assert sizing_execute(12345) == "missing"


def test_a_planner_error_fails_the_run_with_its_reason(db):
    run = sizing.sizing_run_create(scenario="tiny-size")
    SizingRun.objects.filter(pk=run.pk).update(inputs={**run.inputs, "sla": {"ttft_p90_s": -1}})
    run = sizing.sizing_run_execute(sizing_run_id=run.pk)
    assert run.status == PlanRunStatus.FAILED
    assert "ttft_p90_s" in run.error and run.finished_at is not None


def test_from_db_starts_from_the_fleet_in_the_database(priced_fleet):  # noqa: F811
    run = sizing.sizing_run_create(scenario="tiny-size", from_db=True)
    fleet = run.inputs["fleet"]
    assert [p["role"] for p in fleet["pools"]] == ["prefill", "relay_decode", "main_decode"]
    assert all(p["count"] >= 0 for p in fleet["pools"])
    assert "dc-b" in fleet["links"]
    assert "database" in run.inputs["notes"][0]
    run = sizing.sizing_run_execute(sizing_run_id=run.pk)
    assert run.status == PlanRunStatus.DONE, run.error
    # A unit is a node: gpu-a 8 GPUs x 2.00, gpu-b 4 GPUs x 2.50 per GPU-hour.
    assert run.result["unit_prices"] == {"generic/gpu-a": 16.0, "generic/gpu-b": 10.0}
    assert set(run.result["cheapest"]["counts"]) == {
        "prefill@dc-a:generic/gpu-a",
        "relay_decode@dc-a:generic/gpu-a",
        "main_decode@dc-b:generic/gpu-b",
    }


# --- REST -------------------------------------------------------------------------------------


def test_an_operator_posts_a_run_that_runs_after_commit(
    operator,
    eager_celery,  # noqa: F811
    django_capture_on_commit_callbacks,
    tiny_answer,
):
    with django_capture_on_commit_callbacks(execute=True):
        created = operator.post(URL, BODY, format="json")
    assert created.status_code == 201, created.json()
    body = created.json()
    assert body["status"] == "queued" and body["created_by"] == "olivia"
    assert (body["rps"], body["p90"], body["p99"], body["from_db"]) == (5.0, 10.0, 15.0, False)
    detail = operator.get(f"{URL}{body['id']}/").json()
    assert detail["status"] == "done", detail["error"]
    assert detail["progress_done"] == detail["progress_total"] > 0
    cheapest = detail["cheapest"]
    assert cheapest["found"] is True
    assert cheapest["counts"] == tiny_answer["cheapest"]["counts"]
    assert set(cheapest) >= {"cost_per_hour", "at", "one_fewer", "binding", "local_minimum"}
    assert "band" not in cheapest
    assert set(detail["band"]) >= {"rate", "rule"}
    best = detail["max_bcr"]["best"]
    assert set(best) >= {"counts", "goodput_rps", "cost_per_hour", "bcr"}
    assert best["bcr"] == pytest.approx(best["goodput_rps"] / best["cost_per_hour"])
    assert detail["unit_prices"] == {"GPU-A": 1.0, "GPU-B": 1.25}
    assert detail["sla"]["ttft_p90_s"] == 10 and detail["sla"]["ttft_p99_s"] == 15
    assert detail["result"]["runs"] == detail["progress_total"]


def test_the_defaults_are_the_tiny_scenario_and_its_own_rate_and_sla(operator):
    body = operator.post(URL, {}, format="json").json()
    assert body["scenario"] == "tiny-size"
    assert (body["rps"], body["p90"], body["p99"], body["from_db"]) == (None, None, None, False)
    assert body["cheapest"] is None and body["band"] is None


def test_a_viewer_may_list_and_read_runs_but_not_post(viewer, db):
    run = sizing.sizing_run_create(scenario="tiny-size")
    assert viewer.post(URL, BODY, format="json").status_code == 403
    listed = viewer.get(URL).json()
    assert [r["id"] for r in listed["results"]] == [run.pk]
    assert "result" not in listed["results"][0]
    assert viewer.get(f"{URL}{run.pk}/").json()["status"] == "queued"


def test_anonymous_requests_are_refused(anonymous):
    assert anonymous.get(URL).status_code == 401
    assert anonymous.post(URL, BODY, format="json").status_code == 401


def test_plan_runs_keep_their_own_routes(viewer, db):
    assert viewer.get("/api/v1/plans/").json()["results"] == []
    assert viewer.get("/api/v1/plans/sizing/").status_code == 200


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"scenario": "nope"}, "scenario"),
        ({"scenario": "paper-microbench"}, "scenario"),
        ({"rps": 0}, "rps"),
        ({"rps": -3}, "rps"),
        ({"rps": "fast"}, "rps"),
        ({"rps": 1e9}, "rps"),
        ({"p90": 0}, "p90"),
        ({"p99": "soon"}, "p99"),
        ({"p99": 1e6}, "p99"),
        ({"from_db": "maybe"}, "from_db"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(operator, db, change, field):
    response = operator.post(URL, {**BODY, **change}, format="json")
    assert response.status_code == 400, response.json()
    assert list(response.json()) == [field]
    assert not SizingRun.objects.exists()


def test_from_db_without_fleet_data_is_a_400_naming_the_fleet(operator, db):
    response = operator.post(URL, {**BODY, "from_db": True}, format="json")
    assert response.status_code == 400
    assert "no WAN link" in response.json()["fleet"][0]
    assert not SizingRun.objects.exists()


def test_the_schema_documents_the_sizing_api(viewer):
    schema = viewer.get("/api/schema/", HTTP_ACCEPT="application/json").json()
    post = schema["paths"]["/api/v1/plans/sizing/"]["post"]
    ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    request = schema["components"]["schemas"][ref.rsplit("/", 1)[-1]]
    assert set(request["properties"]) == {"scenario", "rps", "p90", "p99", "from_db"}
    assert "/api/v1/plans/sizing/{id}/" in schema["paths"]
    run = schema["components"]["schemas"]["SizingRun"]["properties"]
    assert {"cheapest", "max_bcr", "band", "progress_done", "progress_total"} <= set(run)
