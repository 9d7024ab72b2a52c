"""Every request the gateway completed leaves exactly one record and one usage entry, even
when the client closes the connection right after the last byte (the openai client does) or
goes away while the record is being written."""

from __future__ import annotations

import asyncio
import time

import pytest

from billing import services as billing
from billing.models import Tenant, UsageEntry
from fleet.models import ServedModel
from pdd.policy import Decision
from pdd.tokenizer import ByteTokenizer
from routing.gateway import run as gw_run
from routing.gateway import views
from routing.gateway.parsing import GatewayRequest
from routing.models import RequestRecord

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def prepared(transactional_db, monkeypatch):
    tenant = Tenant.objects.create(name="acme")
    key, _ = billing.api_key_create(tenant=tenant)
    model = ServedModel.objects.create(
        name="baton-tiny", source="baton-tiny", num_layers=4, kv_bytes_per_token=4096
    )

    async def events(url, plan):
        for i, token in enumerate(b"hello"):
            yield {"type": "token", "index": i, "token_id": token, "role": "md"}
        yield {"type": "done", "finish_reason": "length", "stats": {"cached_tokens": 0}}

    monkeypatch.setattr(gw_run, "run_events", events)

    def make(request_id: str, *, stream: bool = True) -> views.Prepared:
        return views.Prepared(
            key=key,
            greq=GatewayRequest(
                endpoint="completions",
                model="baton-tiny",
                prompt_text="hi",
                max_tokens=5,
                temperature=0.0,
                top_p=1.0,
                stream=stream,
                include_usage=True,
                seed=None,
            ),
            model=model,
            tokenizer=ByteTokenizer(),
            prompt_ids=[104, 105],
            request_id=request_id,
            decision=Decision("p-md", "one-shot", "1", None, "2", 0, 2, 0.01, "test"),
            version=1,
            inputs={},
            url="http://agent/v1/pdd/generate",
            plan={},
            kind="completions",
            first_token_early=False,
            received_at=time.monotonic(),
        )

    return make


def _records(request_id: str) -> tuple[int, int, str]:
    rows = list(RequestRecord.objects.filter(request_id=request_id))
    usage = UsageEntry.objects.filter(request_id=request_id).count()
    return len(rows), usage, rows[0].status if rows else ""


def test_a_client_that_closes_right_after_done_leaves_one_record(prepared):
    async def client():
        stream = views.stream_body(prepared("cmpl-close"))
        async for chunk in stream:
            if chunk == b"data: [DONE]\n\n":
                break
        await stream.aclose()  # the connection closes after the last byte
        await views.drain_pending_records()

    asyncio.run(client())
    assert _records("cmpl-close") == (1, 1, "ok")


def test_a_client_gone_while_the_record_is_written_still_leaves_it(prepared, monkeypatch):
    from routing.gateway import records

    real = records.record_request

    def slow_record(**kwargs):
        time.sleep(0.3)  # the write is under way when the client disconnects
        return real(**kwargs)

    monkeypatch.setattr(records, "record_request", slow_record)

    async def client():
        task = asyncio.ensure_future(views._complete(prepared("cmpl-cancel", stream=False)))
        await asyncio.sleep(0.1)
        task.cancel()  # the ASGI handler cancels the response on http.disconnect
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await views.drain_pending_records() == 0

    asyncio.run(client())
    assert _records("cmpl-cancel") == (1, 1, "ok")


def test_a_stream_cancelled_mid_way_is_recorded_once_as_cancelled(prepared):
    async def client():
        stream = views.stream_body(prepared("cmpl-mid"))
        await stream.__anext__()  # the first chunk, then the client goes away
        await stream.aclose()
        await views.drain_pending_records()

    asyncio.run(client())
    count, usage, status = _records("cmpl-mid")
    assert (count, usage, status) == (1, 1, "cancelled")


def _admit(p: views.Prepared) -> None:
    """The admission row the gateway writes for `p` before calling any agent."""
    from routing.gateway.records import admission_open

    admission_open(
        request_id=p.request_id,
        api_key=p.key,
        model=p.model.name,
        endpoint=p.kind,
        stream=p.greq.stream,
        prompt_tokens=len(p.prompt_ids),
        decision=p.decision,
        policy_version=p.version,
        decision_inputs=p.inputs,
    )


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_finished_request_removes_its_admission(prepared):
    from routing.models import Admission

    p = prepared("cmpl-admitted")
    _admit(p)

    async def client():
        async for _ in views.stream_body(p):
            pass

    asyncio.run(client())
    assert not Admission.objects.exists()
    assert _records("cmpl-admitted") == (1, 1, "ok")


def test_a_request_left_by_a_killed_gateway_is_recorded_interrupted_once(prepared):
    import socket

    from routing.gateway.interrupted import finish_interrupted
    from routing.gateway.records import admission_progress
    from routing.models import Admission

    p = prepared("cmpl-killed")
    _admit(p)
    admission_progress(p.request_id, 3)
    # Still owned by this (live) process: nothing happens.
    assert finish_interrupted() == []
    # Its process was SIGKILLed: a later process finishes it.
    Admission.objects.update(owner=f"{socket.gethostname()}:{_dead_pid()}")
    assert finish_interrupted() == ["cmpl-killed"]
    assert finish_interrupted() == []
    assert _records("cmpl-killed") == (1, 1, "interrupted")
    record = RequestRecord.objects.get(request_id="cmpl-killed")
    assert record.completion_tokens == 3 and record.prompt_tokens == 2
    assert record.pipeline == "p-md"
    usage = UsageEntry.objects.get(request_id="cmpl-killed")
    assert (usage.prompt_tokens, usage.completion_tokens) == (2, 3)
    assert not Admission.objects.exists()


def test_an_admission_from_another_host_is_finished_only_when_stale(prepared):
    from datetime import timedelta

    from django.utils import timezone

    from routing.gateway.interrupted import finish_interrupted
    from routing.models import Admission

    p = prepared("cmpl-elsewhere", stream=False)
    _admit(p)
    Admission.objects.update(owner="other-host:1234")
    assert finish_interrupted() == []
    later = timezone.now() + timedelta(seconds=121)
    assert finish_interrupted(now=later) == ["cmpl-elsewhere"]


def _stand_in_prefill_agent(answers: dict[str, dict]):
    """A local HTTP server answering GET /v1/pdd/requests/{id} as a P agent does."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server hook
            rid = self.path.rsplit("/", 1)[-1]
            body = answers.get(rid)
            payload = json.dumps(body or {"error": "unknown"}).encode()
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_an_interrupted_request_bills_the_tokens_the_prefill_agent_streamed(prepared):
    """The dead process last saved 5 delivered tokens; P had streamed 9 of the migrated
    attempt, which began after 4: the record says 13, and usage bills 13."""
    import socket

    from routing.gateway.interrupted import finish_interrupted
    from routing.gateway.records import admission_attempt, admission_progress
    from routing.models import Admission

    answers = {"cmpl-sigkill-r1": {"request_id": "cmpl-sigkill-r1", "tokens": 9}}
    server = _stand_in_prefill_agent(answers)
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        p = prepared("cmpl-sigkill")
        _admit(p)
        admission_attempt(p.request_id, "cmpl-sigkill-r1", base, 4)
        admission_progress(p.request_id, 5)
        Admission.objects.update(owner=f"{socket.gethostname()}:{_dead_pid()}")
        assert finish_interrupted() == ["cmpl-sigkill"]
    finally:
        server.shutdown()
    record = RequestRecord.objects.get(request_id="cmpl-sigkill")
    assert record.status == "interrupted" and record.completion_tokens == 13
    assert "streamed 9 tokens" in record.error
    assert UsageEntry.objects.get(request_id="cmpl-sigkill").completion_tokens == 13


def test_an_interrupted_request_whose_prefill_agent_is_gone_bills_the_saved_count(prepared):
    import socket

    from routing.gateway.interrupted import finish_interrupted
    from routing.gateway.records import admission_attempt, admission_progress
    from routing.models import Admission

    server = _stand_in_prefill_agent({})
    base = f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()  # nothing listens there any more
    p = prepared("cmpl-nobody")
    _admit(p)
    admission_attempt(p.request_id, "cmpl-nobody", base, 0)
    admission_progress(p.request_id, 2)
    Admission.objects.update(owner=f"{socket.gethostname()}:{_dead_pid()}")
    assert finish_interrupted() == ["cmpl-nobody"]
    record = RequestRecord.objects.get(request_id="cmpl-nobody")
    assert record.completion_tokens == 2
    assert "could not be asked" in record.error
