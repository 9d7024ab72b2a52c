"""The dashboard socket: refuses anonymous users, pushes history then a snapshot every second,
and forwards fleet changes; the per-process loop stops with the last socket."""

from __future__ import annotations

from asgiref.sync import async_to_sync, sync_to_async
from channels.testing.websocket import WebsocketCommunicator
from django.contrib.auth.models import User

from controlplane.asgi import application
from frontend.consumers import DashboardConsumer, broadcaster


def test_anonymous_dashboard_socket_is_refused_with_4401(db):
    async def scenario():
        comm = WebsocketCommunicator(
            application,
            "/ws/dashboard/",
            headers=[(b"host", b"localhost"), (b"origin", b"http://localhost")],
        )
        connected, code = await comm.connect()
        await comm.disconnect()
        return connected, code

    assert async_to_sync(scenario)() == (False, 4401)
    assert not broadcaster.running


def test_logged_in_socket_gets_history_then_snapshots_with_new_traffic(
    fleet, aggregator, django_capture_on_commit_callbacks
):
    from fleet import services
    from frontend.telemetry import observe

    user = User.objects.create_user("watcher")

    def drain():
        with django_capture_on_commit_callbacks(execute=True):
            services.instance_set_desired_state(
                instance=fleet["relay"], desired_state="drained", actor="test"
            )

    async def scenario():
        comm = WebsocketCommunicator(DashboardConsumer.as_asgi(), "/ws/dashboard/")
        comm.scope["user"] = user
        connected, _ = await comm.connect()
        assert connected
        hello = await comm.receive_json_from(timeout=10)
        history = await comm.receive_json_from(timeout=30)
        first = await comm.receive_json_from(timeout=30)
        await sync_to_async(observe)(
            {"model": "baton-tiny", "pipeline": "p-md", "status": "ok", "ttft_s": 0.5}
        )
        second = await comm.receive_json_from(timeout=30)
        await sync_to_async(drain)()
        change = await comm.receive_json_from(timeout=30)
        while change["type"] != "fleet_change":
            change = await comm.receive_json_from(timeout=30)
        running_while_open = broadcaster.running
        await comm.disconnect()
        return hello, history, first, second, change, running_while_open

    hello, history, first, second, change, running = async_to_sync(scenario)()
    assert hello["type"] == "hello"
    assert history["type"] == "history" and len(history["points"]) == 300
    assert first["type"] == "snapshot" and set(first["windows"]) == {"1m", "5m", "1h"}
    assert first["windows"]["1m"]["requests"] == 0
    assert first["queue"]["waiting"] == 0 and first["queue"]["at_prefill"] == 0
    assert second["windows"]["1m"]["requests"] == 1
    assert {i["id"] for i in second["fleet"]["instances"]} == {
        fleet[k].pk for k in ("prefill", "relay", "main")
    }
    assert change["change"]["type"] == "instance" and change["change"]["id"] == fleet["relay"].pk
    assert running is True
    assert not broadcaster.running


def test_the_snapshot_carries_the_gateway_s_overload_queue(monkeypatch):
    """Waiting for room, on the dashboard: at the gateway (an engine was full) and in a prefill
    engine's queue, with the mean wait and the timeouts of both."""
    from frontend.telemetry.snapshot import overload_queue
    from routing.gateway import overload as overload_module

    queue = overload_module.OverloadQueue()
    queue.stats.waiting, queue.stats.queued_total, queue.stats.wait_seconds_total = 2, 4, 6.0
    queue.queued_at_prefill(True)
    queue.stats.timed_out_total = 1
    queue.prefill_queue_timeout(301.0)
    monkeypatch.setattr(overload_module, "overload", queue)
    assert overload_queue() == {
        "waiting": 2,
        "at_prefill": 1,
        "queued_total": 4,
        "mean_wait_s": 1.5,
        "timed_out_total": 2,
        "refused_total": 0,
    }
