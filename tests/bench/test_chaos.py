"""The chaos harness's pure parts: token accounting and the report (no processes)."""

from __future__ import annotations

from bench.chaos.accounting import count_tokens, max_gap, record_counts, summarise_fault
from bench.chaos.report import render


def test_an_exact_stream_counts_nothing_lost_or_duplicated():
    c = count_tokens([1, 2, 3, 4], [1, 2, 3, 4])
    assert c.exact and (c.lost, c.duplicated, c.wrong) == (0, 0, 0)


def test_a_gap_in_the_stream_is_lost_tokens():
    c = count_tokens([1, 2, 3, 4, 5, 6], [1, 2, 5, 6])
    assert not c.exact
    assert (c.lost, c.duplicated, c.wrong, c.matched) == (2, 0, 0, 4)


def test_a_resent_stretch_is_duplicated_not_lost():
    # A migration that re-sends tokens 3..4 after the user already had them.
    c = count_tokens([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 3, 4, 5, 6])
    assert (c.lost, c.duplicated, c.wrong) == (0, 2, 0)


def test_a_truncated_stream_loses_its_tail():
    c = count_tokens([10, 11, 12, 13, 14], [10, 11])
    assert (c.lost, c.duplicated, c.wrong, c.received) == (3, 0, 0, 2)


def test_foreign_tokens_are_wrong_not_duplicated():
    c = count_tokens([1, 2, 3], [1, 2, 9, 8, 3])
    assert (c.lost, c.duplicated, c.wrong) == (0, 0, 2)


def test_a_run_partly_repeating_counts_its_repeat_as_duplicated():
    c = count_tokens([1, 2, 3, 4], [1, 2, 3, 2, 3, 7, 4])
    assert (c.lost, c.duplicated, c.wrong) == (0, 2, 1)


def test_an_empty_stream_loses_everything():
    c = count_tokens([1, 2, 3], [])
    assert (c.lost, c.duplicated, c.wrong, c.received) == (3, 0, 0, 0)


def test_max_gap():
    assert max_gap([]) is None and max_gap([1.0]) is None
    assert max_gap([0.0, 0.1, 2.1, 2.2]) == 2.0


def test_record_counts_missing_double_and_unknown_ids():
    out = record_counts(["a", "b", "c", None], {"a": 1, "b": 2})
    assert out == {"missing_records": 2, "double_records": 1}


def _request(correct, lost=0, dup=0, err="", gap=None, migrations=0):
    return {
        "correct": correct,
        "error": err,
        "max_gap_s": gap,
        "tokens": {"lost": lost, "duplicated": dup, "wrong": 0},
        "record": {"migrations": migrations},
    }


FAKE = {
    "command": "make chaos",
    "date": "2026-12-02 02:00 UTC",
    "git_rev": "abc1234",
    "host": "x86_64, 2 cores",
    "duration_s": 600.0,
    "rule": ["- a fixed rule"],
    "faults": [
        {
            "name": "md-kill-after-handoff",
            "title": "MD SIGKILL",
            "expect": "migration",
            "row": summarise_fault(
                [
                    {
                        "requests": [_request(True, gap=0.5, migrations=1)],
                        "recovery_s": 1.0,
                        "missing_records": 0,
                        "double_records": 0,
                    },
                    {
                        "requests": [_request(False, lost=7, err="SSE error: boom", gap=3.0)],
                        "recovery_s": 3.0,
                        "missing_records": 1,
                        "double_records": 0,
                    },
                ]
            ),
            "trial_lines": ["r0: 1/1 correct", "r1: 0/1 correct | error: boom"],
            "notes": [],
        }
    ],
    "skipped": ["trial 6: not in the scenario"],
    "findings": ["md-kill-after-handoff: 1 of 2 requests did not finish correct"],
}


def test_summarise_fault_adds_up_requests_and_spreads_recovery():
    row = FAKE["faults"][0]["row"]
    assert row["trials"] == 2 and row["requests"] == 2
    assert row["finished_correct"] == 1 and row["lost_tokens"] == 7 and row["errors"] == 1
    assert row["missing_records"] == 1 and row["migrations"] == 1
    assert row["recovery_s"] == {"min": 1.0, "median": 3.0, "max": 3.0}
    assert row["max_gap_s"]["max"] == 3.0


def test_report_renders_the_command_date_table_and_findings():
    text = render(FAKE)
    assert "`make chaos`" in text and "2026-12-02 02:00 UTC" in text
    row = next(line for line in text.splitlines() if line.startswith("| md-kill-after-handoff"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # fault, trials, requests, correct, lost, dup, wrong, errors, missing, double, migrations
    assert cells[:11] == ["md-kill-after-handoff", "2", "2", "1", "7", "0", "0", "1", "1", "0", "1"]
    assert cells[11] == "3.00 (1.00-3.00)"
    assert "## Findings" in text and "did not finish correct" in text
    assert "## Not run" in text and "- a fixed rule" in text
