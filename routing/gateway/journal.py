"""The admission journal: an accepted request is made durable by one append to a file of this
process's own, not by a database commit on the request's path; the admission row follows in
the record writer's next batch (many requests, one commit).

Each gateway process appends one JSON line per admission to
``<BATON_JOURNAL_DIR>/admissions-<host>-<pid>.jsonl`` and holds an exclusive ``flock`` on it
while it lives. ``os.write`` returns once the line is in the kernel, so the line survives the
process dying at any instant (SIGKILL, a crash, the OOM killer); the lock goes with the
process. ``recover`` (a gateway's start-up and the periodic ``routing.finish_interrupted``)
takes the lock of every journal whose owner is gone and writes an admission row, owned by the
dead process, for each line that has neither an admission row nor a record yet;
``finish_interrupted`` then records those requests as ``interrupted``, billing what the prefill
agent says it streamed. So every accepted request still ends with exactly one record and one
usage line, without a commit before its first agent call.

The file is emptied whenever every admission in it has its row committed, so it stays small.
What it does not cover: the machine itself losing power before the kernel wrote the page
(the lines are not fsync'ed), and a host that never runs a gateway again (its journals are
read only on that host)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "admissions-"


def journal_name(host: str, pid: int) -> str:
    return f"{PREFIX}{host}-{pid}.jsonl"


class Journal:
    """This process's journal: ``append`` (durable on return), ``committed`` (rows written)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._pid: int | None = None
        self._pending = 0  # lines whose admission row is not committed yet

    @property
    def path(self) -> Path:
        return self.directory / journal_name(socket.gethostname(), os.getpid())

    def _open(self) -> int:
        if self._fd is not None and self._pid == os.getpid():
            return self._fd
        # First use in this process (or a fork's child: its parent's lock is not its own).
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._fd, self._pid, self._pending = fd, os.getpid(), 0
        return fd

    def append(self, entry: dict[str, Any]) -> None:
        """One line, in the kernel when this returns."""
        line = (json.dumps(entry, separators=(",", ":"), default=str) + "\n").encode()
        with self._lock:
            fd = self._open()
            written = os.write(fd, line)
            while written < len(line):  # a regular file takes it whole; be safe anyway
                written += os.write(fd, line[written:])
            self._pending += 1

    def committed(self, count: int) -> None:
        """``count`` appended admissions have their rows committed; when none is left, empty
        the file (under the lock, so no append can fall between the check and the cut)."""
        with self._lock:
            self._pending = max(0, self._pending - count)
            if self._pending == 0 and self._fd is not None and self._pid == os.getpid():
                os.ftruncate(self._fd, 0)

    def close(self) -> None:
        """A process's orderly end: the file goes if every row is committed, else it stays for
        ``recover``."""
        with self._lock:
            if self._fd is not None and self._pid == os.getpid():
                if self._pending == 0:
                    self.path.unlink(missing_ok=True)
                os.close(self._fd)
            self._fd = self._pid = None
            self._pending = 0


def orphaned(directory: Path) -> Iterable[tuple[Path, int]]:
    """Journals in ``directory`` whose owner is gone, each with its lock now held by the
    caller (the fd, to close after the file is dealt with)."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for path in sorted(directory.glob(f"{PREFIX}*.jsonl")):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue  # recovered meanwhile by another process
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # its owner lives (this process included)
            continue
        yield path, fd


def read_entries(path: Path) -> list[dict[str, Any]]:
    entries = []
    for number, raw in enumerate(path.read_bytes().splitlines(), 1):
        if not raw.strip():
            continue
        try:
            entry = json.loads(raw)
        except ValueError:
            log.warning("%s line %d is not JSON (cut short?); skipped", path, number)
            continue
        if isinstance(entry, dict) and entry.get("request_id"):
            entries.append(entry)
    return entries


def owner_of(path: Path) -> str:
    """``host:pid`` of the process that wrote the journal, from its name."""
    stem = path.name[len(PREFIX) : -len(".jsonl")]
    host, _, pid = stem.rpartition("-")
    return f"{host}:{pid}"


def recover(directory: Path, restore: Callable[[str, list[dict[str, Any]]], int]) -> int:
    """Hand every orphaned journal's entries to ``restore(owner, entries)`` (which writes the
    missing admission rows and commits), then delete the journal. Returns the rows restored."""
    restored = 0
    for path, fd in orphaned(directory):
        try:
            entries = read_entries(path)
            if entries:
                restored += restore(owner_of(path), entries)
            path.unlink(missing_ok=True)
        except Exception:  # noqa: BLE001 - keep the file for the next try
            log.exception("could not recover the admission journal %s", path)
        finally:
            os.close(fd)
    return restored
