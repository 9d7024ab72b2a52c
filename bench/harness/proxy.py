"""A fault-injecting TCP proxy for the chaos harness: put on the dc-a <-> dc-b path (the
testbed's `wan_proxy=True`: MD's HTTP API and its WAN KV fabric are advertised at proxies),
it forwards bytes, resets connections, or black-holes them.

Modes (`set_mode`, or `arm` to switch when a byte pattern passes):

- `pass`: forward both ways.
- `reset`: every open connection is closed on both sides with an RST (SO_LINGER 0, no FIN), and
  so is every new one at once.
- `blackhole`: sockets stay open, nothing is forwarded; bytes arriving from either side are
  read and dropped (the sender's writes succeed, its reads wait), as on a link that silently
  stops delivering. Back to `pass`, a connection that dropped bytes has a hole in its byte
  stream and cannot continue: it is reset then; one that dropped nothing carries on.

`WanLink` groups the proxies of one link (a fault on the link hits all of them at once).
Each proxy runs its own asyncio loop in a daemon thread; every method is thread-safe."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

MODES = ("pass", "reset", "blackhole")
# What a trigger may do: a mode, or "reset-once" (reset the open connections, mode unchanged).
ACTIONS = (*MODES, "reset-once")
_LINGER_RST = struct.pack("ii", 1, 0)


@dataclass(eq=False)
class _Conn:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter | None = None
    dropped: int = 0  # bytes black-holed on this connection
    tasks: list[asyncio.Task] = field(default_factory=list)


@dataclass
class _Trigger:
    pattern: bytes
    mode: str
    direction: str  # "up" (client -> server), "down" or "any"
    fired_at: float | None = None
    event: threading.Event = field(default_factory=threading.Event)


def _rst(writer: asyncio.StreamWriter | None) -> None:
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    except OSError:
        pass
    writer.transport.abort()


class FaultProxy:
    def __init__(self, target: tuple[str, int], *, host: str = "127.0.0.1", port: int = 0,
                 name: str = "proxy") -> None:  # fmt: skip
        self.target = target
        self.host = host
        self.port = port
        self.name = name
        self.mode = "pass"
        self.link: WanLink | None = None
        self.resets = 0  # connections reset
        self.dropped_bytes = 0
        self.connections_total = 0
        self._conns: set[_Conn] = set()
        self._triggers: list[_Trigger] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._accept, self.host, self.port)
                )
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:  # bind failure: report to start()
                failure.append(exc)
                started.set()
                return
            started.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name=f"fault-{self.name}", daemon=True)
        self._thread.start()
        started.wait(10)
        if failure:
            raise failure[0]
        return self

    def stop(self) -> None:
        if self._loop is None:
            return

        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for conn in list(self._conns):
                _rst(conn.client)
                _rst(conn.server)

        self._call(close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(5)

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    # -- faults (thread-safe) ----------------------------------------------------------------

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self._call(lambda: self._apply(mode))

    def reset_all(self) -> None:
        """Reset every open connection once; new connections pass (mode unchanged)."""
        self._call(self._reset_open)

    def arm(self, pattern: bytes, mode: str, direction: str = "up") -> _Trigger:
        """Switch to `mode` (the whole link's, when on a WanLink) the moment `pattern` passes
        in `direction` (the chunk that carries it then meets the new mode: dropped when
        black-holed, not forwarded when reset). Returns the trigger: its
        `event` is set and `fired_at` (wall clock) filled when it fires."""
        if mode not in ACTIONS:
            raise ValueError(f"mode must be one of {ACTIONS}, got {mode!r}")
        trigger = _Trigger(pattern, mode, direction)
        self._call(lambda: self._triggers.append(trigger))
        return trigger

    def disarm(self) -> None:
        self._call(self._triggers.clear)

    # -- internals (on the proxy's loop) -----------------------------------------------------

    def _call(self, fn) -> None:
        """Run fn (plain or async) on the proxy's loop and wait for it."""
        assert self._loop is not None, "start() first"

        async def wrapper() -> None:
            out = fn()
            if asyncio.iscoroutine(out):
                await out

        if threading.current_thread() is self._thread:
            raise RuntimeError("called from the proxy's own loop")
        asyncio.run_coroutine_threadsafe(wrapper(), self._loop).result(10)

    def _apply(self, mode: str) -> None:
        if mode == "reset-once":
            self._reset_open()
            return
        previous, self.mode = self.mode, mode
        if mode == "reset":
            self._reset_open()
        elif mode == "pass" and previous == "blackhole":
            for conn in list(self._conns):
                if conn.dropped:
                    self._reset(conn)

    def _reset_open(self) -> None:
        for conn in list(self._conns):
            self._reset(conn)

    def _reset(self, conn: _Conn) -> None:
        if conn in self._conns:
            self._conns.discard(conn)
            self.resets += 1
        _rst(conn.client)
        _rst(conn.server)
        for task in conn.tasks:
            task.cancel()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(client=writer)
        self.connections_total += 1
        if self.mode == "reset":
            self.resets += 1
            _rst(writer)
            return
        self._conns.add(conn)
        try:
            up_reader, conn.server = await asyncio.open_connection(*self.target)
        except OSError:
            self._reset(conn)
            return
        if conn not in self._conns:  # reset while connecting
            _rst(conn.server)
            return
        loop = asyncio.get_running_loop()
        conn.tasks = [
            loop.create_task(self._pump(conn, reader, conn.server, "up")),
            loop.create_task(self._pump(conn, up_reader, writer, "down")),
        ]

    async def _pump(self, conn: _Conn, src: asyncio.StreamReader,
                    dst: asyncio.StreamWriter, direction: str) -> None:  # fmt: skip
        try:
            while True:
                data = await src.read(65536)
                if not data:
                    break
                for trigger in self._triggers:
                    if trigger.direction in (direction, "any") and trigger.pattern in data:
                        self._triggers.remove(trigger)
                        trigger.fired_at = time.time()
                        if self.link is not None:
                            self.link._apply_from(self, trigger.mode)
                        else:
                            self._apply(trigger.mode)
                        trigger.event.set()
                        break
                if conn not in self._conns:
                    return
                if self.mode == "blackhole":
                    conn.dropped += len(data)
                    self.dropped_bytes += len(data)
                    continue
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            self._reset(conn)
            return
        except asyncio.CancelledError:
            return
        # EOF from src: half-close towards dst (what a TCP peer's FIN means), unless the
        # connection is black-holed (then the FIN is dropped as well).
        if self.mode == "blackhole" or conn not in self._conns:
            return
        try:
            if dst.can_write_eof():
                dst.write_eof()
        except OSError:
            pass
        if all(t.done() or t is asyncio.current_task() for t in conn.tasks):
            self._conns.discard(conn)
            for w in (conn.client, conn.server):
                if w is not None:
                    w.close()


class WanLink:
    """The proxies that together carry one datacenter pair's traffic: a mode change or a
    trigger firing on one applies to all."""

    def __init__(self, proxies: dict[str, FaultProxy]) -> None:
        self.proxies = proxies
        self.mode = "pass"
        self.changed_at: float | None = None
        for p in proxies.values():
            p.link = self

    def set_mode(self, mode: str) -> None:
        self.mode, self.changed_at = mode, time.time()
        for p in self.proxies.values():
            p.set_mode(mode)

    def reset_all(self) -> None:
        self.changed_at = time.time()
        for p in self.proxies.values():
            p.reset_all()

    def arm(self, pattern: bytes, mode: str, direction: str = "up",
            on: str | None = None) -> list[_Trigger]:  # fmt: skip
        """Arm the trigger on proxy `on` (every proxy when None)."""
        names = [on] if on else list(self.proxies)
        return [self.proxies[n].arm(pattern, mode, direction) for n in names]

    def disarm(self) -> None:
        for p in self.proxies.values():
            p.disarm()

    def stats(self) -> dict:
        return {
            n: {
                "resets": p.resets,
                "dropped_bytes": p.dropped_bytes,
                "connections": p.connections_total,
                "mode": p.mode,
            }  # fmt: skip
            for n, p in self.proxies.items()
        }

    def _apply_from(self, origin: FaultProxy, mode: str) -> None:
        """A trigger fired on origin's loop: apply there at once, on the others' loops next."""
        self.changed_at = time.time()
        if mode != "reset-once":
            self.mode = mode
        for p in self.proxies.values():
            if p is origin:
                p._apply(mode)
            else:
                p._loop.call_soon_threadsafe(p._apply, mode)

    def stop(self) -> None:
        for p in self.proxies.values():
            p.stop()
