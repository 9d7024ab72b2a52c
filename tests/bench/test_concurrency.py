"""bench/concurrency.py: the closed-loop client and its checks against a real small fleet, and
the parsing of streams, aiperf's raw export and the request records on made-up input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import concurrency as cc


def sse(*chunks) -> list[tuple[float, str]]:
    return [
        (0.1 * (i + 1), c if isinstance(c, str) else json.dumps(c)) for i, c in enumerate(chunks)
    ]


def chunk(content=None, finish=None, usage=None, role=False) -> dict:
    delta = {"role": "assistant", "content": ""} if role else {}
    if content is not None:
        delta["content"] = content
    choices = [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"id": "chatcmpl-1", "choices": choices, "usage": usage}


USAGE = {"prompt_tokens": 30, "completion_tokens": 3, "total_tokens": 33}


def test_a_finished_stream_completes_with_its_figures():
    r = cc.parse_events(
        cc.Result(id="a", index=0, status=200),
        sse(
            chunk(role=True),
            chunk("x"),
            chunk("y"),
            chunk("z"),
            chunk(finish="length"),
            chunk(usage=USAGE),
            "[DONE]",
        ),
    )
    assert r.completed and r.failure() == ""
    assert (r.text, r.finish_reason, r.output_tokens) == ("xyz", "length", 3)
    assert r.ttft_s == pytest.approx(0.2) and r.latency_s == pytest.approx(0.7)
    assert r.itl_s == pytest.approx((0.7 - 0.2) / 2)


@pytest.mark.parametrize(
    ("events", "reason"),
    [
        (sse(chunk("x"), chunk(finish="stop"), chunk(usage=USAGE)), "without [DONE]"),
        (sse(chunk("x"), "[DONE]"), "without a finish_reason"),
        (
            sse(chunk("x"), {"error": {"code": "engine_full", "message": "full"}}, "[DONE]"),
            "error in stream engine_full",
        ),
    ],
)
def test_a_stream_that_did_not_finish_is_a_failure_that_says_why(events, reason):
    r = cc.parse_events(cc.Result(id="a", index=0, status=200), events)
    assert not r.completed
    assert reason in r.failure()


def aiperf_line(rid: str, prompt: str, status: int, responses: list, error=None) -> str:
    return json.dumps(
        {
            "metadata": {"x_request_id": rid, "request_start_ns": 5_000_000_000},
            "start_perf_ns": 1_000_000_000,
            "request_headers": {"X-Request-ID": rid},
            "status": status,
            "responses": responses,
            "payload": {"messages": [{"role": "user", "content": prompt}], "stream": True},
            "error": error,
        }
    )


def test_aiperf_raw_export_becomes_results(tmp_path):
    packets = [
        {
            "perf_ns": 1_000_000_000 + 100_000_000 * (i + 1),
            "packets": [{"name": "data", "value": v}],
        }
        for i, v in enumerate(
            [
                json.dumps(chunk(role=True)),
                json.dumps(chunk("ab")),
                json.dumps(chunk(finish="stop")),
                json.dumps(chunk(usage={**USAGE, "completion_tokens": 1})),
                "[DONE]",
            ]
        )
    ]
    body = json.dumps({"error": {"code": "overloaded", "message": "no room for 61 s"}})
    http_error = {"code": 503, "type": "Service Unavailable", "message": body}
    client_error = {"type": "ClientConnectorError", "message": "refused"}
    raw = tmp_path / "profile_export_raw.jsonl"
    raw.write_text(
        aiperf_line("id-1", "p1", 200, packets)
        + "\n"
        # aiperf 0.13 on a non-2xx answer: no responses, the body in its error's message.
        + aiperf_line("id-2", "p2", 503, [], http_error)
        + "\n"
        + aiperf_line("id-3", "p3", None, [], client_error)
        + "\n"
    )
    ok, refused, broken = cc.parse_aiperf_raw(raw, {"p1": 0, "p2": 1, "p3": 2})
    assert (ok.id, ok.index, ok.prompt, ok.text, ok.output_tokens) == ("id-1", 0, "p1", "ab", 1)
    assert ok.completed and ok.ttft_s == pytest.approx(0.2) and ok.start_s == 5.0
    assert (refused.id, refused.index, refused.completed) == ("id-2", 1, False)
    assert (refused.failure(), refused.error) == ("HTTP 503 overloaded", "no room for 61 s")
    assert not broken.completed and broken.failure() == "failed ClientConnectorError"
    figures = cc.level_figures([ok, refused, broken], wall_s=2.0)
    assert (figures["sent"], figures["completed"], figures["failed"]) == (3, 1, 2)
    assert figures["failures"]["HTTP 503 overloaded"] == {"count": 1, "example": "no room for 61 s"}


def test_records_are_counted_exactly_once_per_request_sent():
    def res(rid):
        return cc.parse_events(
            cc.Result(id=rid, index=0, status=200),
            sse(chunk("x"), chunk(finish="stop"), chunk(usage=USAGE), "[DONE]"),
        )

    def rec(rid, **kw):
        return {"client_request_id": rid, "status": "ok", "completion_tokens": 3, **kw}

    results = [res("a"), res("b"), res("c"), res("d")]
    rows = [rec("a"), rec("b"), rec("b"), rec("d", completion_tokens=2), rec("zz")]
    check = cc.check_records(results, rows)
    assert check["missing"] == ["c"] and check["duplicated"] == ["b"] and check["extra"] == ["zz"]
    assert check["exactly_once"] == 2 and len(check["token_mismatch"]) == 1 and not check["ok"]
    assert cc.check_records(results, [rec(i) for i in "abcd"])["ok"]


def test_the_fixed_scenario_fits_the_demo_model_and_is_seeded():
    s = cc.Scenario()
    assert s.is_fixed and [s.requests(c) for c in s.levels] == [48, 192, 768]
    texts = cc.prompts(s, 8)
    assert texts == cc.prompts(s, 8) and len(set(texts)) == len(texts) == 48
    assert all(s.prompt_chars[0] <= len(t) <= s.prompt_chars[1] and t.isascii() for t in texts)
    # seed_demo's baton-tiny: 4,096 tokens of context, one token a byte.
    assert s.prompt_chars[1] + cc.CHAT_TEMPLATE_BYTES + s.max_tokens <= 4096
    assert not cc.Scenario(levels=(8,), requests_per_level=16).is_fixed


@pytest.mark.slow
def test_closed_loop_at_concurrency_2_completes_exact_and_recorded_once(tmp_path):
    from bench.harness.testbed import start_cluster

    cluster = start_cluster()
    try:
        target = cc.Target(
            url=cluster.url,
            api_key=cluster.setup["key"],
            operator_token=cluster.operator_token,
            tenant="acme",
        )
        # The testbed's baton-tiny has 2,048 tokens of context: short prompts, short answers.
        scenario = cc.Scenario(
            levels=(2,),
            requests_per_level=6,
            prompt_chars=(300, 700),
            max_tokens=12,
            exact_sample=3,
        )
        level = cc.run_level(target, scenario, 2, tmp_path / "c2", client="openai", run_id="t")
        # The server's side of a failure (a 500's traceback), before stop() removes its log.
        log = (Path(cluster.tmp) / "web.log").read_text(errors="replace")
    finally:
        cluster.stop()
    tracebacks = log[log.find("Traceback") :][:6000] if "Traceback" in log else ""
    print(tracebacks)  # in full under "Captured stdout" (the assertion's text is cut short)
    assert (level["sent"], level["completed"], level["failed"]) == (6, 6, 0), (
        level["failures"],
        tracebacks,
    )
    assert level["records"]["ok"], level["records"]
    assert level["records"]["exactly_once"] == 6 and level["records"]["extra"] == []
    assert level["exact"]["ok"] and level["exact"]["checked"] == 3, level["exact"]
    assert level["ok"]
    assert all(line for line in (tmp_path / "c2" / "results.jsonl").read_text().splitlines())


def test_the_report_shows_goals_levels_and_failures():
    refused = cc.Result(id="b", index=1, status=503, code="overloaded", error="no room for 60 s")
    level = {
        "concurrency": 8,
        **cc.level_figures([refused], wall_s=1.0),
        "records": cc.check_records([refused], [{"client_request_id": "b", "status": "rejected"}]),
        "exact": {"checked": 0, "matched": 0, "mismatches": [], "errors": [], "ok": False},
    }
    summary = {
        "command": "python -m bench.concurrency --levels 8",
        "started": "2026-01-01T00:00:00Z",
        "commit": "abc",
        "machine": "x86_64, 2 cores",
        "client": "aiperf 0.13.0",
        "stack": "bench.demo",
        "scenario": {
            "model": "baton-tiny",
            "levels": [8],
            "requests": "1",
            "prompt_chars": [2500, 3900],
            "max_tokens": 128,
            "exact_sample": 8,
        },
        "goals": cc.goals([level]),
        "levels": [level],
        "raw": "var/bench-concurrency/x",
    }
    report = cc.render_report(summary)
    assert "| every request completed, 0 errors | **not met** |" in report
    assert "| records exactly once | **met** |" in report
    assert "1 x HTTP 503 overloaded (no room for 60 s)" in report
    assert "| 8 | 1 | 0 | 1 | - / - |" in report


def test_a_request_refused_at_admission_is_not_owed_a_record():
    limited = cc.Result(id="a", index=0, status=429, code="rate_limit_exceeded")
    queued_out = cc.Result(id="b", index=1, status=429, code="queue_full")
    check = cc.check_records([limited, queued_out], [])
    assert check["refused_unrecorded"] == ["a"] and check["missing"] == ["b"]
    assert not check["ok"]
    assert cc.check_records([limited], [])["ok"]
