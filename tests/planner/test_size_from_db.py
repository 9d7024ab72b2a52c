"""`planner size --from-db` without Django in the planner: the command line runs the control
plane's `manage.py planner_fleet SCENARIO` and starts from the JSON fleet it prints
(tests/plans/test_planner_fleet_command.py runs it against a database)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from planner import cli


def _child(monkeypatch, returncode: int, stdout: str = "", stderr: str = "") -> list[list[str]]:
    calls: list[list[str]] = []

    def run(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, returncode, stdout, stderr)

    monkeypatch.setattr(cli.subprocess, "run", run)
    return calls


def test_the_fleet_is_read_from_the_control_planes_command(monkeypatch) -> None:
    fleet = {"system": "pdd", "pools": [{"role": "prefill", "count": 2}]}
    calls = _child(monkeypatch, 0, stdout=json.dumps(fleet) + "\n")
    assert cli._db_fleet("tiny-size") == fleet
    assert calls == [[sys.executable, str(cli.ROOT / "manage.py"), "planner_fleet", "tiny-size"]]


def test_a_refusal_is_a_value_error_with_its_message(monkeypatch) -> None:
    _child(monkeypatch, 1, stderr="CommandError: fleet: no WAN link in the database\n")
    with pytest.raises(ValueError, match=r"^fleet: no WAN link in the database$"):
        cli._db_fleet("tiny-size")


def test_any_other_failure_shows_the_childs_story(monkeypatch, capsys) -> None:
    story = "Traceback (most recent call last):\n  ...\nOperationalError: no such table\n"
    _child(monkeypatch, 1, stderr=story)
    assert cli.main(["size", "tiny-size", "--from-db", "--progress", "off"]) == 2
    err = capsys.readouterr().err
    assert err == story + "error: OperationalError: no such table\n"
