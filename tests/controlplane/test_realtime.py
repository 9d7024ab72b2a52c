"""Websockets and Celery: the ASGI entry's socket route, pushes on fleet changes, the task app."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.testing.websocket import WebsocketCommunicator
from django.contrib.auth.models import User

from bench.harness.celery_worker import start_worker, stop_worker
from controlplane.asgi import application
from fleet.consumers import FleetConsumer

ROOT = Path(__file__).resolve().parents[2]


def test_anonymous_websocket_is_refused_with_4401(db):
    async def scenario():
        comm = WebsocketCommunicator(
            application,
            "/ws/fleet/",
            headers=[(b"host", b"localhost"), (b"origin", b"http://localhost")],
        )
        connected, code = await comm.connect()
        await comm.disconnect()
        return connected, code

    assert async_to_sync(scenario)() == (False, 4401)


def test_fleet_socket_receives_instance_changes(db, django_capture_on_commit_callbacks):
    from fleet import services
    from fleet.models import Datacenter, GPUType, ServedModel

    user = User.objects.create_user("watcher")
    dc = Datacenter.objects.create(name="dc-a", region="r")
    gpu = GPUType.objects.create(
        vendor="v",
        model="m",
        peak_bf16_tflops=1,
        memory_gib=1,
        memory_bandwidth_gbps=1,
        interconnect_gbps=1,
    )
    model = ServedModel.objects.create(name="m", source="m", num_layers=1, kv_bytes_per_token=1)
    node, _ = services.node_create(hostname="n", datacenter=dc, gpu_type=gpu, gpu_count=2)

    def create_instance() -> int:
        with django_capture_on_commit_callbacks(execute=True):
            return services.instance_create(
                role="prefill", node=node, served_model=model, gpu_count=1
            ).pk

    async def scenario():
        comm = WebsocketCommunicator(FleetConsumer.as_asgi(), "/ws/fleet/")
        comm.scope["user"] = user
        connected, _ = await comm.connect()
        assert connected
        hello = await comm.receive_json_from(timeout=5)
        instance_id = await sync_to_async(create_instance)()
        pushed = await comm.receive_json_from(timeout=5)
        await comm.disconnect()
        return hello, instance_id, pushed

    hello, instance_id, pushed = async_to_sync(scenario)()
    assert hello == {"type": "hello", "group": "fleet"}
    assert pushed == {
        "type": "instance",
        "event": "created",
        "id": instance_id,
        "role": "prefill",
        "node": node.pk,
        "desired_state": "running",
        "actual_state": "pending",
    }


def test_celery_runs_tasks_in_process_when_eager():
    from controlplane.celery import app
    from controlplane.tasks import ping

    # The embedded default turns this on (see test_settings); force it for a Redis-backed run.
    previous = app.conf.task_always_eager
    app.conf.update(task_always_eager=True)
    try:
        assert ping.delay("hello").get(timeout=5) == "hello"
    finally:
        app.conf.update(task_always_eager=previous)


@pytest.mark.redis
def test_redis_channel_layer_delivers_group_messages():
    from channels_redis.core import RedisChannelLayer

    layer = RedisChannelLayer(
        hosts=[os.environ["REDIS_URL"]], prefix=f"test-{uuid.uuid4().hex[:8]}"
    )

    async def scenario():
        channel = await layer.new_channel()
        await layer.group_add("fleet", channel)
        await layer.group_send("fleet", {"type": "push", "payload": {"n": 1}})
        message = await layer.receive(channel)
        await layer.group_discard("fleet", channel)
        await layer.flush()
        return message

    assert async_to_sync(scenario)() == {"type": "push", "payload": {"n": 1}}


@pytest.mark.redis
def test_celery_worker_consumes_tasks_from_redis(tmp_path):
    queue = f"test-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "BATON_VAR_DIR": str(tmp_path),
        "CELERY_TASK_ALWAYS_EAGER": "false",
    }
    worker = start_worker(env, queue)
    try:
        code = (
            "import django; django.setup();"
            "from controlplane.tasks import ping;"
            f"print(ping.apply_async(args=['via-redis'], queue='{queue}').get(timeout=90))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "via-redis"
    finally:
        stop_worker(worker)
