"""`make demo`'s own robustness: what it waits for and names, its port check, its stopping."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench import demo

ROOT = Path(__file__).resolve().parents[2]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


NODES = {1: "a-prefill-1", 2: "a-relay-1", 3: "b-decode-1", 4: "sh-gpu-01", 5: "wh-gpu-01"}


def row(id_, node, role, state):
    return {"id": id_, "node": node, "role": role, "actual_state": state}


def test_pending_ignores_instances_off_the_demo_nodes():
    # docs/api.md's walkthrough adds instances on nodes no agent serves: never the demo's wait.
    rows = [
        row(1, 1, "prefill", "running"),
        row(2, 2, "relay_decode", "running"),
        row(3, 3, "main_decode", "running"),
        row(4, 4, "prefill", "pending"),
        row(5, 5, "main_decode", "unavailable"),
    ]
    assert demo.pending_instances(rows, NODES, demo.AGENT_PORTS) == []


def test_pending_names_each_instance_still_waited_for():
    rows = [
        row(1, 1, "prefill", "running"),
        row(2, 2, "relay_decode", "starting"),
        row(4, 4, "prefill", "pending"),
    ]
    assert demo.pending_instances(rows, NODES, demo.AGENT_PORTS) == [
        "relay_decode #2 on a-relay-1 (starting)",
        "an instance on b-decode-1 (none exists)",
    ]


def test_wait_until_timeout_names_what_is_pending(capsys):
    clock = FakeClock()
    with pytest.raises(SystemExit) as exc:
        demo.wait_until(
            lambda: ["main_decode #3 on b-decode-1 (starting)"],
            240,
            "the demo fleet's instances",
            clock=clock,
            sleep=clock.sleep,
        )
    message = str(exc.value)
    assert "timed out after 240 s" in message
    assert "still waiting for: main_decode #3 on b-decode-1 (starting)" in message
    assert clock.now == pytest.approx(240, abs=1)
    # Progress lines name it too, every 30 s, before the timeout.
    assert capsys.readouterr().out.count("still waiting for: main_decode #3") >= 7


def test_wait_until_returns_once_nothing_is_pending_and_survives_errors():
    clock = FakeClock()
    answers = iter([ConnectionError("refused"), ["prefill #1 on a-prefill-1 (starting)"], []])

    def pending():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    demo.wait_until(pending, 240, "the fleet", clock=clock, sleep=clock.sleep)
    assert clock.now == pytest.approx(1.0)


def test_wait_until_timeout_names_the_last_error():
    clock = FakeClock()

    def pending():
        raise ConnectionError("connection refused")

    with pytest.raises(SystemExit, match="ConnectionError: connection refused"):
        demo.wait_until(pending, 5, "the control plane", clock=clock, sleep=clock.sleep)


def test_port_check_sees_a_listener():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert demo.port_in_use("127.0.0.1", port)
        with pytest.raises(SystemExit, match=f"port {port} on 127.0.0.1 is in use"):
            demo.check_ports_free("127.0.0.1", [port])


def test_port_check_tolerates_time_wait():
    # A server that closed an accepted connection first leaves its port in TIME-WAIT, as a
    # stopped demo does; a restart within the minute must still find the port free.
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server side closes first: its end goes to TIME-WAIT
    time.sleep(0.05)
    client.close()
    server.close()
    time.sleep(0.05)
    # Without SO_REUSEADDR the bind fails exactly as the old check did ...
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))
    # ... with it (as uvicorn and the agents bind) the port is free.
    assert not demo.port_in_use("127.0.0.1", port)
    demo.check_ports_free("127.0.0.1", [port])


RUNNER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from bench.demo import Children
    STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    with Children(grace_s=float(sys.argv[2])) as kids:
        try:
            a = kids.spawn([sys.executable, "-c", "import time; time.sleep(600)"])
            b = kids.spawn([sys.executable, "-c", STUBBORN])
            time.sleep(0.5)  # let the stubborn child install its handler
            print(a.pid, b.pid, flush=True)
            time.sleep(600)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
    """
)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].startswith("Z")
    except FileNotFoundError:
        return True


def _wait_gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(_gone(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


def _start(tmp_path: Path, argv: list[str]) -> tuple[subprocess.Popen, list[int]]:
    # Its own process group, as a terminal's foreground job: a Ctrl-C is SIGINT to the group.
    # A foreground job takes Ctrl-C even when this suite runs in the background (where the
    # shell starts it with SIGINT ignored, and a child would inherit that).
    proc = subprocess.Popen(
        argv,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    pids = [int(p) for p in line.split()]
    assert len(pids) == 2, line
    return proc, pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_stops_every_child(tmp_path):
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    proc, pids = _start(tmp_path, [sys.executable, str(script), str(ROOT), "2"])
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=20)
        # The child that ignores SIGTERM is SIGKILLed after the grace period.
        assert _wait_gone(pids)
    finally:
        for pid in [*pids, proc.pid]:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_through_make_and_a_second_one_hurry(tmp_path):
    # `make demo`'s shape: make runs the runner; a Ctrl-C reaches both. A second Ctrl-C
    # while the children stop must not abandon them: it SIGKILLs them at once instead.
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    (tmp_path / "Makefile").write_text(f"demo:\n\t{sys.executable} {script} {ROOT} 60\n")
    proc, pids = _start(tmp_path, ["make", "-s", "demo"])
    try:
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(1.0)
        assert not _gone(pids[1])  # ignoring SIGTERM, inside its 60-s grace period
        started = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=20)
        assert _wait_gone(pids)
        assert time.monotonic() - started < 15
    finally:
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
