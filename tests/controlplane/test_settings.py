"""Settings come from the environment: embedded defaults, or PostgreSQL and Redis when set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, django
from django.conf import settings
django.setup()
print(json.dumps({
    "engine": settings.DATABASES["default"]["ENGINE"],
    "pool": settings.DATABASES["default"].get("OPTIONS", {}).get("pool"),
    "conn_max_age": settings.DATABASES["default"]["CONN_MAX_AGE"],
    "name": str(settings.DATABASES["default"]["NAME"]),
    "atomic": settings.DATABASES["default"]["ATOMIC_REQUESTS"],
    "layer": settings.CHANNEL_LAYERS["default"]["BACKEND"],
    "broker": settings.CELERY_BROKER_URL,
    "eager": settings.CELERY_TASK_ALWAYS_EAGER,
    "debug": settings.DEBUG,
    "hosts": settings.ALLOWED_HOSTS,
}))
"""


def _settings_with(env: dict[str, str], tmp_path: Path) -> dict:
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DATABASE_URL", "REDIS_URL", "DEBUG", "ALLOWED_HOSTS"}
        and not k.startswith("BATON_DB_POOL_")
    }
    base.update({"DJANGO_SETTINGS_MODULE": "controlplane.settings", "BATON_VAR_DIR": str(tmp_path)})
    base.update(env)
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env=base,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_embedded_defaults_use_sqlite_in_memory_layer_and_eager_tasks(tmp_path):
    got = _settings_with({}, tmp_path)
    assert got["engine"] == "django.db.backends.sqlite3"
    assert got["name"] == str(tmp_path / "baton.sqlite3")
    assert got["atomic"] is True
    assert got["layer"] == "channels.layers.InMemoryChannelLayer"
    assert got["broker"] == "memory://localhost/"
    assert got["eager"] is True
    assert got["debug"] is False


def test_database_and_redis_urls_switch_to_real_services(tmp_path):
    got = _settings_with(
        {
            "DATABASE_URL": "postgresql://postgres@127.0.0.1:5432/test",
            "REDIS_URL": "redis://127.0.0.1:6379/0",
            "DEBUG": "true",
            "ALLOWED_HOSTS": "baton.example, api.example",
        },
        tmp_path,
    )
    assert got["engine"] == "django.db.backends.postgresql"
    assert got["name"] == "test"
    assert got["layer"] == "channels_redis.core.RedisChannelLayer"
    assert got["broker"] == "redis://127.0.0.1:6379/0"
    assert got["eager"] is False
    assert got["debug"] is True
    assert got["hosts"] == ["baton.example", "api.example"]
    # Connections from a bounded pool, which needs CONN_MAX_AGE = 0.
    assert got["pool"] == {"min_size": 1, "max_size": 20, "timeout": 10.0}
    assert got["conn_max_age"] == 0


def test_the_connection_pool_is_sized_from_the_environment_or_turned_off(tmp_path):
    url = {"DATABASE_URL": "postgresql://postgres@127.0.0.1:5432/test"}
    got = _settings_with(
        url
        | {"BATON_DB_POOL_MAX": "8", "BATON_DB_POOL_MIN": "0", "BATON_DB_POOL_TIMEOUT_S": "2.5"},
        tmp_path,
    )
    assert got["pool"] == {"min_size": 0, "max_size": 8, "timeout": 2.5}
    got = _settings_with(url | {"BATON_DB_POOL_MAX": "0"}, tmp_path)
    assert got["pool"] is None and got["conn_max_age"] == 60
    assert _settings_with({}, tmp_path)["pool"] is None  # SQLite: no pool
    with pytest.raises(subprocess.CalledProcessError) as err:
        _settings_with(url | {"BATON_DB_POOL_MAX": "4", "BATON_DB_POOL_MIN": "5"}, tmp_path)
    assert "BATON_DB_POOL_MIN=5 / BATON_DB_POOL_MAX=4" in err.value.stderr


def test_a_bad_boolean_is_a_one_line_configuration_error(tmp_path):
    with pytest.raises(subprocess.CalledProcessError) as err:
        _settings_with({"DEBUG": "maybe"}, tmp_path)
    assert "DEBUG='maybe' is not a boolean" in err.value.stderr


def test_control_plane_imports_without_torch(tmp_path):
    # Neither torch nor the agents' package: tests/test_layers.py checks the imports; this, what
    # loading the web process, its URLs and /metrics really pulls in.
    code = (
        "import sys, django; django.setup();"
        "import controlplane.asgi, controlplane.urls, fleet.api.views, frontend.metrics;"
        "print(any(m == n or m.startswith(n + '.') for m in sys.modules for n in "
        "('torch', 'agents')))"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "BATON_VAR_DIR": str(tmp_path),
    }
    env.pop("DATABASE_URL", None)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_a_too_short_data_plane_token_refuses_to_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL"}} | {
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "BATON_VAR_DIR": str(tmp_path),
        "BATON_DATA_TOKEN": "short",
    }
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode != 0
    assert "BATON_DATA_TOKEN must be at least 16 characters" in out.stderr
