"""A prefill instance's load in the live view weighs its backlog of prompt positions, in the
simulator's unit (eight forwards' worth is full); decoders' load is their slots'."""

from __future__ import annotations

import pytest

from routing.live import PREFILL_BACKLOG_FORWARDS, _load
from routing.policy import PolicySettings


def _item(role: str, **load) -> dict:
    return {"role": role, "load": {"running": 2, "queued": 0, "max_running": 128} | load}


def test_a_prefill_with_seconds_of_prompts_queued_is_saturated_though_few_requests_wait():
    batch = 16384
    full = PREFILL_BACKLOG_FORWARDS * batch
    load, _ = _load(_item("prefill", backlog_tokens=full, batch_tokens=batch))
    assert load >= PolicySettings().saturated_load
    load, _ = _load(_item("prefill", backlog_tokens=full // 4, batch_tokens=batch))
    assert load == pytest.approx(0.25)


def test_slots_still_count_when_the_backlog_is_small_or_not_reported():
    assert _load(_item("prefill", backlog_tokens=10, batch_tokens=16384))[0] == 2 / 128
    assert _load(_item("prefill"))[0] == 2 / 128  # an older agent: slots only
    for bad in (
        {"backlog_tokens": "x", "batch_tokens": 1},
        {"backlog_tokens": 5, "batch_tokens": 0},
    ):
        assert _load(_item("prefill", **bad))[0] == 2 / 128


def test_a_decoder_s_load_is_its_slots_whatever_it_has_to_extend():
    load, _ = _load(_item("main_decode", backlog_tokens=10**6, batch_tokens=16384))
    assert load == 2 / 128
