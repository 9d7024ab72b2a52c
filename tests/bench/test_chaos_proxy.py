"""The chaos harness's fault-injecting TCP proxy (bench/harness/proxy.py) against a local echo
server: pass forwards, reset gives the client an RST, blackhole leaves its reads waiting."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from bench.harness.proxy import FaultProxy, WanLink


@pytest.fixture
def echo():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield srv.getsockname()
    stop.set()
    srv.close()


@pytest.fixture
def proxy(echo):
    p = FaultProxy(echo).start()
    yield p
    p.stop()


def _client(proxy: FaultProxy, timeout: float = 5.0) -> socket.socket:
    c = socket.create_connection(proxy.address, timeout=timeout)
    c.sendall(b"hello")
    assert _recv_exactly(c, 5) == b"hello"
    return c


def _recv_exactly(c: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = c.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def test_pass_mode_forwards_bytes_both_ways(proxy):
    with _client(proxy) as c:
        payload = bytes(range(256)) * 1000
        c.sendall(payload)
        assert _recv_exactly(c, len(payload)) == payload


def test_reset_mode_gives_the_client_a_connection_reset(proxy):
    with _client(proxy) as c:
        proxy.set_mode("reset")
        with pytest.raises(ConnectionResetError):
            c.sendall(b"more")
            c.recv(10)
    # New connections are reset at once while the mode holds: the reset can reach the client
    # while it is still connecting, or at its first send or read (a loaded machine decides).
    with (
        pytest.raises(ConnectionResetError),
        socket.create_connection(proxy.address, timeout=5) as c2,
    ):
        c2.sendall(b"x")
        c2.recv(10)
    deadline = time.monotonic() + 5
    while proxy.resets < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proxy.resets == 2


def test_blackhole_mode_keeps_the_connection_open_and_the_read_times_out(proxy):
    with _client(proxy, timeout=0.5) as c:
        proxy.set_mode("blackhole")
        c.sendall(b"lost")  # the write succeeds: nothing says the link is gone
        with pytest.raises(TimeoutError):
            c.recv(10)
        assert proxy.dropped_bytes == 4
        # Healed: the connection that lost bytes is reset, a new one passes.
        proxy.set_mode("pass")
        c.settimeout(5)
        with pytest.raises(ConnectionResetError):
            c.recv(10)
    with _client(proxy):
        pass


def test_reset_all_resets_open_connections_and_later_ones_pass(proxy):
    with _client(proxy) as c:
        proxy.reset_all()
        with pytest.raises(ConnectionResetError):
            c.recv(10)
    with _client(proxy):
        pass


def test_an_armed_pattern_blackholes_the_whole_link(echo):
    a, b = FaultProxy(echo).start(), FaultProxy(echo).start()
    link = WanLink({"http": a, "wan": b})
    try:
        ca, cb = _client(a, timeout=0.5), _client(b, timeout=0.5)
        (trigger,) = link.arm(b".final", "blackhole", on="wan")
        cb.sendall(b"batch h1.final")
        assert trigger.event.wait(5) and trigger.fired_at is not None
        with pytest.raises(TimeoutError):
            cb.recv(10)  # the carrying chunk was dropped
        ca.sendall(b"ping")
        with pytest.raises(TimeoutError):
            ca.recv(10)  # the other proxy of the link went dark too
        assert a.mode == b.mode == "blackhole"
        ca.close()
        cb.close()
    finally:
        link.stop()
