"""`python -m agents serve`: one agent process (HTTP API on uvicorn, KV fabric servers, engine
threads), optional control-plane registration, and drain-then-exit on SIGTERM / SIGINT.

It loads torch only with the first real (PyTorch) engine instance; agents/__main__.py sets
OMP_NUM_THREADS / OMP_WAIT_POLICY (settings.apply_thread_plan) before anything can, so OpenMP
reads them when it does. An agent of emulated instances only never loads torch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket

import uvicorn

from agents.node.agent import Agent
from agents.node.control import ControlPlaneLink
from agents.node.http_api import build_app
from agents.node.kv_events import KVEventPublisher
from agents.node.settings import (
    AgentSettings,
    apply_thread_plan,
    host_cores,
    resolve_thread_plan,
    split_host_port,
)
from pdd.dataplane import SERVER_IDLE_S

log = logging.getLogger(__name__)


def server_config(app) -> uvicorn.Config:
    """The agent's HTTP server: quiet, no lifespan or websockets, and idle connections kept
    open longer than its callers keep them (pdd/dataplane.py, SERVER_IDLE_S)."""
    return uvicorn.Config(
        app,
        log_level="warning",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=int(SERVER_IDLE_S),
        access_log=False,
        lifespan="off",
        ws="none",
    )


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the agent drains first, then stops it."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def advertised_url(settings: AgentSettings, port: int) -> str:
    if settings.advertise_url:
        return settings.advertise_url.rstrip("/")
    host, _ = split_host_port(settings.listen)
    if host in ("0.0.0.0", "::", ""):
        host = settings.node or socket.gethostname()
    return f"http://{host}:{port}"


async def serve(settings: AgentSettings) -> int:
    if settings.thread_plan is None:  # started in process, not by `python -m agents serve`
        flags = {
            "threads": settings.threads,
            "agents_per_host": settings.agents_per_host,
            "omp_wait_policy": settings.omp_wait_policy,
        }
        plan = resolve_thread_plan(flags, {}, os.environ, host_cores())
        settings.thread_plan = apply_thread_plan(plan)  # too late for OpenMP if torch is loaded
        settings.threads = plan.torch_threads
        log.warning(settings.thread_plan.line())
    # torch loads (and takes the plan's thread count) with the first real engine:
    # Instances._make_engine. An agent of emulated instances only never loads it.
    agent = Agent(settings)
    await agent.start()
    host, port = split_host_port(settings.listen)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound_port = sock.getsockname()[1]
    config = server_config(build_app(agent))
    server = _Server(config)
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    serve_task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serve_task.done():
        await asyncio.sleep(0.02)
    endpoint = advertised_url(settings, bound_port)
    intra, wan = agent.links.intra_server, agent.links.wan_server
    assert intra is not None and wan is not None  # started above
    # One line the launcher (tests, loopback) reads: where everything listens.
    print(f"AGENT READY http={endpoint} kv={intra.port} wan={wan.port}", flush=True)
    control = kv_events = None
    if settings.control_plane:
        link = ControlPlaneLink(agent, endpoint)
        control = asyncio.create_task(link.run())
        # The decode instances' prefix-cache changes, to the control plane's prefix index.
        kv_events = asyncio.create_task(KVEventPublisher(agent, link.base, link.headers).run())
    stop_wait = asyncio.create_task(stopping.wait())
    await asyncio.wait({serve_task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    clean = True
    if stopping.is_set():
        log.warning("signal received: draining (grace %.0f s)", settings.drain_grace_s)
        clean = await agent.instances.drain(settings.drain_grace_s)
        if not clean:
            log.warning(
                "%d requests still in flight after the grace period",
                agent.instances.active_requests,
            )
    server.should_exit = True
    with contextlib.suppress(Exception):
        await serve_task
    stop_wait.cancel()
    if kv_events is not None:
        kv_events.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await kv_events
    if control is not None:
        control.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await control
    await agent.close()
    return 0
