"""The record writer's batch forms write the same rows as one write at a time: a batch of
finished requests leaves, per request, one record, one decision, one usage line and no
admission; a request id recorded before, or twice in the batch, is written once."""

from __future__ import annotations

import pytest

from billing import services as billing
from billing.models import Tenant, UsageEntry
from pdd.policy import Decision
from routing.gateway import records
from routing.models import Admission, RequestRecord, RoutingDecision

pytestmark = pytest.mark.django_db(transaction=True)

DECISION = Decision("p-md", "one-shot", "1", None, "2", 0, 2, 0.01, "test")


@pytest.fixture
def key():
    tenant = Tenant.objects.create(name="acme")
    return billing.api_key_create(tenant=tenant)[0]


def _admission(key, request_id: str) -> dict:
    entry = records.admission_entry(
        request_id=request_id,
        api_key=key,
        model="baton-tiny",
        endpoint="completions",
        stream=True,
        prompt_tokens=40,
        decision=DECISION,
        policy_version=3,
        decision_inputs={"mds": 1},
    )
    return {"entry": entry, "owner": "host:1"}


def _write(key, request_id: str, status: str = "ok", completion: int = 16) -> dict:
    return {
        "request_id": request_id,
        "api_key": key,
        "model": "baton-tiny",
        "endpoint": "completions",
        "stream": True,
        "decision": DECISION,
        "policy_version": 3,
        "decision_inputs": {"mds": 1},
        "outcome": records.Outcome(
            status=status, prompt_tokens=40, cached_tokens=8, completion_tokens=completion
        ),
        "client_request_id": "",
    }


def _rows(request_id: str) -> tuple:
    record = RequestRecord.objects.get(request_id=request_id)
    decision = RoutingDecision.objects.get(request=record)
    usage = UsageEntry.objects.filter(request_id=request_id).values_list(
        "prompt_tokens", "cached_tokens", "completion_tokens"
    )
    fields = ("status", "pipeline", "prompt_tokens", "cached_tokens", "completion_tokens")
    return (
        tuple(getattr(record, f) for f in fields),
        (decision.policy_version, decision.pipeline, decision.inputs),
        list(usage),
        Admission.objects.filter(request_id=request_id).exists(),
    )


def test_a_batch_writes_what_one_at_a_time_writes(key):
    records.admission_rows([_admission(key, f"b{i}") for i in range(3)])
    for i in range(3):
        records.admission_row(**_admission(key, f"s{i}"))
    assert Admission.objects.count() == 6
    batch = records.record_requests([_write(key, f"b{i}") for i in range(3)])
    assert [r.request_id for r in batch] == ["b0", "b1", "b2"]
    for i in range(3):
        records.record_request(**_write(key, f"s{i}"))
    for i in range(3):
        assert _rows(f"b{i}") == _rows(f"s{i}")
        assert _rows(f"b{i}")[3] is False  # the admission is gone
    assert RequestRecord.objects.count() == 6 and UsageEntry.objects.count() == 6


def test_a_request_recorded_before_or_twice_in_a_batch_is_written_once(key):
    first = records.record_request(**_write(key, "r1", completion=5))
    out = records.record_requests(
        [_write(key, "r1", completion=99), _write(key, "r2"), _write(key, "r2", completion=7)]
    )
    assert out[0].pk == first.pk and out[0].completion_tokens == 5
    assert out[1].pk == out[2].pk
    assert RequestRecord.objects.count() == 2
    assert UsageEntry.objects.get(request_id="r2").completion_tokens == 16
    assert UsageEntry.objects.count() == 2


def test_a_failed_request_in_a_batch_gets_its_record_but_no_usage_line(key):
    records.record_requests([_write(key, "ok1"), _write(key, "err1", status="error")])
    assert RequestRecord.objects.get(request_id="err1").status == "error"
    assert list(UsageEntry.objects.values_list("request_id", flat=True)) == ["ok1"]


def test_the_gateways_writer_runs_records_in_batches(key):
    import concurrent.futures

    from routing.gateway.workers import record_writer

    futures = [concurrent.futures.Future() for _ in range(4)]
    batch = [(records.admission_row, _admission(key, f"w{i}"), futures[i]) for i in range(2)]
    batch += [(records.record_request, _write(key, f"w{i}"), futures[2 + i]) for i in range(2)]
    record_writer._write(batch)
    assert [f.result(0).request_id for f in futures] == ["w0", "w1", "w0", "w1"]
    assert not Admission.objects.exists()
    assert UsageEntry.objects.count() == 2


def test_a_record_says_whether_its_model_is_emulated(key):
    from fleet.models import ServedModel
    from routing.gateway.caches import served_models

    ServedModel.objects.create(
        name="paper-dsv4", source="profile:paper-dsv4", num_layers=61, kv_bytes_per_token=4400
    )
    ServedModel.objects.create(
        name="baton-tiny", source="baton-tiny", num_layers=4, kv_bytes_per_token=4096
    )
    served_models.clear()
    emulated = {**_write(key, "e1"), "model": "paper-dsv4"}
    records.record_requests([emulated, _write(key, "t1")])
    records.record_request(**{**_write(key, "e2"), "model": "paper-dsv4"})
    got = dict(RequestRecord.objects.values_list("request_id", "emulated"))
    assert got == {"e1": True, "t1": False, "e2": True}
