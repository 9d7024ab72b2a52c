"""The admission journal (routing/gateway/journal.py): an admission is durable once its line
is appended; a process killed before the row was committed leaves a journal a later process
turns into an interrupted record, exactly once; a live process's journal is left alone."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from billing import services as billing
from billing.models import Tenant, UsageEntry
from pdd.policy import Decision
from routing.gateway import interrupted, records
from routing.gateway import journal as jr
from routing.models import Admission, RequestRecord

from .test_exactly_once_records import _records


def _entry(request_id: str, key) -> dict:
    decision = Decision("p-md", "one-shot", "1", None, "2", 0, 2, 0.01, "test")
    return records.admission_entry(
        request_id=request_id,
        api_key=key,
        model="baton-tiny",
        endpoint="completions",
        stream=True,
        prompt_tokens=7,
        decision=decision,
        policy_version=1,
        decision_inputs={},
    )


@pytest.fixture
def key(transactional_db):
    tenant = Tenant.objects.create(name="acme")
    made, _ = billing.api_key_create(tenant=tenant)
    return made


@pytest.fixture
def folder(tmp_path, settings):
    settings.BATON_JOURNAL_DIR = tmp_path / "journal"
    return tmp_path / "journal"


def _killed_writer(folder, entries: list[dict]) -> int:
    """A process that journals `entries` and is SIGKILLed right after: the pid it had."""
    code = (
        "import json, os, signal, sys\n"
        "from pathlib import Path\n"
        "from routing.gateway.journal import Journal\n"
        "j = Journal(Path(sys.argv[1]))\n"
        "for e in json.loads(sys.argv[2]):\n"
        "    j.append(e)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(folder), json.dumps(entries)],
        cwd=os.getcwd(),
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    (path,) = folder.glob("admissions-*.jsonl")
    return int(path.stem.rsplit("-", 1)[1])


def test_a_line_is_in_the_file_when_append_returns_and_goes_once_committed(tmp_path):
    j = jr.Journal(tmp_path)
    j.append({"request_id": "a"})
    j.append({"request_id": "b"})
    assert [e["request_id"] for e in jr.read_entries(j.path)] == ["a", "b"]
    j.committed(1)
    assert j.path.stat().st_size > 0  # "b" has no row yet
    j.committed(1)
    assert j.path.stat().st_size == 0  # every row committed: emptied
    j.append({"request_id": "c"})
    assert [e["request_id"] for e in jr.read_entries(j.path)] == ["c"]
    j.committed(1)
    j.close()
    assert not j.path.exists()


def test_a_live_processs_journal_is_not_recovered(tmp_path):
    j = jr.Journal(tmp_path)
    j.append({"request_id": "mine"})
    seen = []
    assert jr.recover(tmp_path, lambda owner, entries: seen.append(entries) or 0) == 0
    assert seen == [] and j.path.exists()
    j.committed(1)
    j.close()


def test_a_cut_short_last_line_is_skipped(tmp_path):
    path = tmp_path / jr.journal_name("h", 1)
    path.write_bytes(b'{"request_id":"a"}\n{"request_id":"b"')
    assert [e["request_id"] for e in jr.read_entries(path)] == ["a"]
    assert jr.owner_of(path) == "h:1"


def test_a_gateway_killed_before_the_row_commit_leaves_one_interrupted_record(key, folder):
    pid = _killed_writer(folder, [_entry("cmpl-journaled", key)])
    assert not Admission.objects.exists()  # the row never made it
    assert interrupted.finish_interrupted() == ["cmpl-journaled"]
    assert interrupted.finish_interrupted() == []
    assert _records("cmpl-journaled") == (1, 1, "interrupted")
    record = RequestRecord.objects.get(request_id="cmpl-journaled")
    assert f"{socket.gethostname()}:{pid}" in record.error
    usage = UsageEntry.objects.get(request_id="cmpl-journaled")
    assert usage.prompt_tokens == 7
    assert not list(folder.glob("*.jsonl"))  # recovered journals are deleted


def test_recovery_skips_admissions_that_have_a_row_or_a_record(key, folder):
    row = _entry("cmpl-has-row", key)
    recorded = _entry("cmpl-has-record", key)
    records.admission_open(
        request_id="cmpl-has-row",
        api_key=key,
        model="baton-tiny",
        endpoint="completions",
        stream=True,
        prompt_tokens=7,
        decision=Decision("p-md", "one-shot", "1", None, "2", 0, 2, 0.01, "test"),
        policy_version=1,
        decision_inputs={},
    )
    RequestRecord.objects.create(
        request_id="cmpl-has-record", tenant=key.tenant, model="baton-tiny", status="ok"
    )
    _killed_writer(folder, [row, recorded, _entry("cmpl-only-journal", key)])
    assert interrupted.recover_journals() == 1
    assert set(Admission.objects.values_list("request_id", flat=True)) == {
        "cmpl-has-row",
        "cmpl-only-journal",
    }
    assert interrupted.recover_journals() == 0


def test_a_served_request_journals_then_writes_its_row_in_a_batch(key, folder):
    import threading

    from routing.gateway.workers import record_writer

    # Hold the writer busy so the row cannot be committed before the journal is looked at.
    release, busy = threading.Event(), threading.Event()

    def hold() -> None:
        busy.set()
        release.wait(30)

    held = record_writer.submit(hold)
    assert busy.wait(30)
    future = records.admission_journaled(
        request_id="cmpl-served",
        api_key=key,
        model="baton-tiny",
        endpoint="completions",
        stream=True,
        prompt_tokens=7,
        decision=Decision("p-md", "one-shot", "1", None, "2", 0, 2, 0.01, "test"),
        policy_version=1,
        decision_inputs={},
    )
    journal = records.admission_journal()
    assert [e["request_id"] for e in jr.read_entries(journal.path)] == ["cmpl-served"]
    assert not Admission.objects.exists()  # durable in the journal only, so far
    release.set()
    held.result(timeout=30)
    future.result(timeout=30)
    assert Admission.objects.get(request_id="cmpl-served").owner == records.this_process()
    # Its row is committed: the line is not needed (the writer empties the file right after
    # it resolves the future).
    deadline = time.monotonic() + 30
    while journal.path.stat().st_size and time.monotonic() < deadline:
        time.sleep(0.01)
    assert journal.path.stat().st_size == 0
    journal.close()
