"""Start agent processes on loopback and stop them (the loopback check and the tests): each in
its own process group, ready once it prints its `AGENT READY` line.

Agents started here share this host's cores with each other (and with whoever started them),
so each is told so: `--agents-per-host N` when the caller knows N, else passive OpenMP waiting
($BATON_OMP_WAIT_POLICY=passive unless the environment already chooses)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

_READY = re.compile(r"AGENT READY http=(\S+) kv=(\d+) wan=(\d+)")


@dataclass
class AgentProcess:
    args: list[str]
    name: str = "agent"
    # How many agents share this host's cores (passed as --agents-per-host unless args has it).
    agents_per_host: int | None = None
    proc: subprocess.Popen | None = None
    http: str = ""
    kv_port: int = 0
    wan_port: int = 0
    log_path: str = ""
    lines: list[str] = field(default_factory=list)

    def start(self, timeout_s: float = 120.0, env: dict[str, str] | None = None) -> AgentProcess:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        full_env.update(env or {})
        args = list(self.args)
        if self.agents_per_host is not None and "--agents-per-host" not in args:
            args += ["--agents-per-host", str(self.agents_per_host)]
        elif "--agents-per-host" not in args and "--omp-wait-policy" not in args:
            # Several agents on one host, however many: never spin-wait on shared cores.
            full_env.setdefault("BATON_OMP_WAIT_POLICY", "passive")
        # The agent keeps its own handle on the log; ours closes once it has started.
        with tempfile.NamedTemporaryFile(
            prefix=f"baton-{self.name}-", suffix=".log", delete=False
        ) as log:
            self.log_path = log.name
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "agents", "serve", *args],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,  # its own process group: killed as a whole
                env=full_env,
            )
        ready = threading.Event()

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                match = _READY.search(line)
                if match:
                    self.http = match.group(1)
                    self.kv_port, self.wan_port = int(match.group(2)), int(match.group(3))
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not ready.wait(0.1):
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"{self.name} not ready in {timeout_s} s; log {self.log_path}")
        if not self.http:
            code = self.proc.wait(timeout=10)
            raise RuntimeError(f"{self.name} exited ({code}) before ready: {self.log_text()}")
        return self

    def log_text(self) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def terminate(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (the agent drains, then exits); returns the exit code, or None if killed."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass

    def cleanup(self) -> None:
        self.kill()
        if self.log_path:
            try:
                os.unlink(self.log_path)
            except OSError:
                pass
