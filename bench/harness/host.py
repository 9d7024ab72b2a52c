"""The host a benchmark runs on: free ports, a process's CPU seconds, the machine's busy time,
its CPU model and the commit checked out."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def port_in_use(host: str, port: int) -> bool:
    """Whether something holds `host:port` the way a server would need it.

    The probe sets SO_REUSEADDR, as uvicorn and the agents do when they bind, so a port whose
    last connections are still in TIME-WAIT (a demo stopped a minute ago) counts as free; a
    socket listening on it does not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux /proc), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of every core so far (/proc/stat)."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def cpu_model() -> str | None:
    """The first CPU's model name (/proc/cpuinfo), None if unknown."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def git_commit() -> str | None:
    """The short hash of the commit checked out, None outside a git checkout."""
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    return out.stdout.strip() or None
