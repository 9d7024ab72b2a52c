"""The generate stream's events as typed records: what the agents write parses back to the
same record, malformed fields are refused, unknown types pass as OtherEvent."""

from __future__ import annotations

import json

import pytest

from agents.node.wire import error_event, token_event
from pdd.events import DoneEvent, ErrorEvent, OtherEvent, TokenEvent, parse_event
from pdd.stats import DoneStats


def test_the_agents_token_event_parses_back():
    from agents.engine import TokenLogprob

    plain = parse_event(json.loads(json.dumps(token_event(3, 104, "md"))))
    assert plain == TokenEvent(index=3, token_id=104, role="md")
    lp = TokenLogprob(logprob=-0.25, top=((104, -0.25), (7, -1.5)))
    rich = parse_event(json.loads(json.dumps(token_event(0, 104, "rld", lp))))
    assert rich == TokenEvent(0, 104, "rld", -0.25, ((104, -0.25), (7, -1.5)))
    assert TokenEvent.from_json(rich.to_json()) == rich


def test_done_and_error_events_round_trip():
    done = DoneEvent("length", DoneStats(pipeline="p-md", ttft_s=0.5, cached_tokens=64))
    assert parse_event(json.loads(json.dumps(done.to_json()))) == done
    assert done.hit_length and not DoneEvent("stop").hit_length
    assert parse_event(error_event("MD gone")) == ErrorEvent("MD gone")


@pytest.mark.parametrize(
    "raw",
    [
        {"type": "token", "index": "0", "token_id": 1},
        {"type": "token", "index": 0},
        {"type": "token", "index": True, "token_id": 1},
        {"no": "type"},
        [1, 2],
    ],
)
def test_a_malformed_event_is_a_value_error(raw):
    with pytest.raises(ValueError):
        parse_event(raw)


def test_an_unknown_event_type_passes_as_other():
    event = parse_event({"type": "progress", "pct": 50})
    assert isinstance(event, OtherEvent) and event.type == "progress"


def test_mds_handoff_events_are_typed_and_parsed():
    from pdd.events import ExtendedEvent, ReadyEvent, parse_event

    ready = ReadyEvent(cached_tokens=32, received_tokens=96, slot_wait_s=0.01234567)
    assert ready.to_json() == {"type": "ready", "cached_tokens": 32, "received_tokens": 96,
                               "slot_wait_s": 0.0123}  # fmt: skip
    assert parse_event(ready.to_json()) == ReadyEvent(32, 96, 0.0123)
    assert parse_event({"type": "ready", "slot_wait_s": -1}) == ReadyEvent()
    assert parse_event({"type": "extended", "upto": 9}) == ExtendedEvent(9)
    with pytest.raises(ValueError, match="upto"):
        parse_event({"type": "extended"})
