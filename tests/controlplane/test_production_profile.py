"""The production profile: check --deploy clean, a secret key that is never the fixed one,
secure cookies and HSTS; and, in every profile, a CSP on HTML pages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DATABASE_URL", "REDIS_URL", "DEBUG", "SECRET_KEY", "BATON_PROFILE"}
    }
    env.update({"BATON_VAR_DIR": str(tmp_path), "DJANGO_SETTINGS_MODULE": "controlplane.settings"})
    env.update(extra)
    return env


def _manage(tmp_path: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=_env(tmp_path, **extra),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _setting(tmp_path: Path, expr: str, **extra: str) -> str:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import django; django.setup(); from django.conf import settings; print({expr})",
        ],
        cwd=ROOT,
        env=_env(tmp_path, **extra),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


def test_check_deploy_is_clean_in_the_production_profile(tmp_path):
    done = _manage(tmp_path, "check", "--deploy", BATON_PROFILE="production")
    assert done.returncode == 0, done.stderr
    assert "no issues" in done.stdout + done.stderr
    assert "security.W" not in done.stdout + done.stderr


def test_the_development_profile_is_the_default_and_warns(tmp_path):
    done = _manage(tmp_path, "check", "--deploy")
    assert "security.W008" in done.stdout + done.stderr  # no HTTPS redirect on a laptop


def test_without_secret_key_one_is_generated_once_into_the_var_dir(tmp_path):
    first = _setting(tmp_path, "settings.SECRET_KEY")
    second = _setting(tmp_path, "settings.SECRET_KEY", BATON_PROFILE="production")
    assert first == second
    assert "insecure" not in first and len(first) >= 50
    key_file = tmp_path / "secret_key"
    assert key_file.read_text().strip() == first
    assert key_file.stat().st_mode & 0o777 == 0o600


def test_an_explicit_secret_key_wins_and_debug_alone_keeps_the_fixed_one(tmp_path):
    assert _setting(tmp_path, "settings.SECRET_KEY", SECRET_KEY="k" * 60) == "k" * 60
    assert "insecure" in _setting(tmp_path, "settings.SECRET_KEY", DEBUG="true")
    assert not (tmp_path / "secret_key").exists()


def test_production_turns_on_secure_cookies_hsts_and_closes_metrics_and_schema(tmp_path):
    got = _setting(
        tmp_path,
        "[settings.SESSION_COOKIE_SECURE, settings.CSRF_COOKIE_SECURE,"
        " settings.SECURE_SSL_REDIRECT, settings.SECURE_HSTS_SECONDS, settings.BATON_METRICS_OPEN,"
        " settings.SPECTACULAR_SETTINGS['SERVE_PERMISSIONS']]",
        BATON_PROFILE="production",
    )
    assert got == (
        "[True, True, True, 31536000, False, ['rest_framework.permissions.IsAuthenticated']]"
    )


@pytest.mark.parametrize(
    "env, message",
    [
        ({"BATON_PROFILE": "prod"}, "BATON_PROFILE='prod'"),
        ({"BATON_PROFILE": "production", "DEBUG": "true"}, "DEBUG=true is not allowed"),
    ],
)
def test_a_bad_profile_is_a_one_line_error(tmp_path, env, message):
    done = _manage(tmp_path, "check", **env)
    assert done.returncode != 0
    assert message in done.stderr.strip().splitlines()[-1]


@pytest.mark.django_db
def test_html_pages_carry_a_content_security_policy(client, django_user_model):
    user = django_user_model.objects.create_user("csp", password="pw-csp-123")
    client.force_login(user)
    response = client.get("/admin/login/")
    policy = response["Content-Security-Policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert "unsafe-eval" not in policy
    assert "Content-Security-Policy" not in client.get("/healthz")


@pytest.mark.django_db
def test_metrics_are_closed_without_a_token_when_not_open(client, settings):
    settings.BATON_METRICS_OPEN = False
    settings.BATON_METRICS_TOKEN = ""
    response = client.get("/metrics")
    assert response.status_code == 401
    assert b"BATON_METRICS_TOKEN" in response.content
    settings.BATON_METRICS_TOKEN = "s3cret-token"
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret-token").status_code == 200
