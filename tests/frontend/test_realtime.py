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
    assert second["windows"]["1m"]["requests"] == 1
    assert {i["id"] for i in second["fleet"]["instances"]} == {
        fleet[k].pk for k in ("prefill", "relay", "main")
    }
    assert change["change"]["type"] == "instance" and change["change"]["id"] == fleet["relay"].pk
    assert running is True
    assert not broadcaster.running
