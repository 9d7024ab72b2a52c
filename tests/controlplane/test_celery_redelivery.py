"""A task whose worker is killed mid-run is delivered again and completes once (acks_late, a
visibility timeout above the time limit, reject on worker lost). The kill is the chaos
harness's own trial (bench/chaos/celery_trial.py), run here on CI's Redis."""

from __future__ import annotations

import os

import pytest

from bench.chaos.celery_trial import celery_worker_kill


@pytest.mark.redis
def test_a_task_of_a_killed_worker_is_redelivered_and_completes_once():
    trial = celery_worker_kill(os.environ["REDIS_URL"], 0)
    assert "error" not in trial, trial.get("error")
    assert trial["done_before_restart"] == 0  # killed mid-run: it had not completed
    assert trial["result"] == "chaos-0"
    assert trial["deliveries"] == 2  # delivered again after the kill
    assert trial["completions"] == 1  # and completed once
