"""The WAN path benchmark's figures (bench/wan_path/run.py), checked without a process."""

from __future__ import annotations

from bench.wan_path import run as w


def _row(ids, logprobs, wan=2048 * 4096, **stats):
    return {"ids": ids, "logprobs": logprobs, "error": None,
            "stats": {"kv_bytes": {"wan": wan}, **stats}}  # fmt: skip


def test_agreement_counts_equal_tokens_and_the_logprob_error_before_the_first_miss():
    refs = [{"ids": [1, 2, 3, 4], "logprobs": [-0.1, -0.2, -0.3, -0.4]}] * 2
    rows = [
        _row([1, 2, 3, 4], [-0.1, -0.25, -0.3, -0.4]),  # identical, error 0.05 at index 1
        _row([1, 2, 9, 4], [-0.1, -0.2, -5.0, -0.9]),  # parts at index 2: nothing after counts
    ]
    got = w.agreement(rows, refs)
    assert (got["tokens_equal"], got["tokens"]) == (7, 8)
    assert (got["requests_identical"], got["requests"]) == (1, 2)
    assert abs(got["max_logprob_error"] - 0.05) < 1e-12


def test_the_summary_takes_medians_per_prompt_token_and_counts_failures():
    rows = [
        _row([1], [0.0], wan=2048 * 1024, prefill_s=0.2, ttft_s=1.0, kv_wait_s=0.5),
        _row([1], [0.0], wan=2048 * 1024, prefill_s=0.4, ttft_s=2.0, kv_wait_s=0.7),
        {"ids": [], "logprobs": [], "error": "boom", "stats": {}},
    ]
    s = w.summarise(rows)
    assert s["ok"] == 2 and s["failed"] == 1 and s["errors"] == ["boom"]
    assert s["bytes_per_token"] == 1024
    assert (s["prefill_s"], s["ttft_s"], s["kv_wait_s"]) == (0.30000000000000004, 1.5, 0.6)
    assert s["pieces"] is None


def test_the_report_has_a_row_per_configuration():
    entry = {
        "format": "int8",
        "streamed": True,
        "summary": w.summarise([_row([1], [0.0], kv_stream_pieces=9)]),
        "agreement": w.agreement([_row([1], [0.0])], [{"ids": [1], "logprobs": [0.0]}]),
    }
    text = w.render({"started": "now", "machine": {"cpus": 2}, "commit": "abc", "wall_s": 60,
                     "models": {"baton-tiny": {"int8, streamed": entry}}})  # fmt: skip
    assert "## baton-tiny" in text and "| int8 | yes | 4096 |" in text and "| 9 |" in text


def test_unknown_models_are_refused_naming_the_flag(capsys):
    assert w.main(["--models", "gpt9", "--out", "/tmp/wan-path-test"]) == 2
    assert "--models" in capsys.readouterr().err


def test_the_paper_scale_arm_runs_emulated_engines_on_the_papers_link_alone(capsys):
    p = w._args("prefill", "dc-a", w.EMULATED, "--link", f"dc-b={w.LINK}")
    md = w._args("main_decode", "dc-b", w.EMULATED, "--link", f"dc-a={w.LINK}")
    assert p[p.index("--link") + 1] == "dc-b=20:20:76" and "--kv-scale" in p
    assert '"GPU-A"' in p[p.index("--gpu") + 1] and '"GPU-B"' in md[md.index("--gpu") + 1]
    assert "--max-batch-tokens" not in p  # the profile's own prefill batch
    # Its own report: with the real-engine models it is refused.
    assert w.main(["--models", "baton-tiny,emulated", "--out", "/tmp/wan-path-test"]) == 2
    assert "emulated alone" in capsys.readouterr().err
