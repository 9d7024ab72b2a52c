"""The throughput bench on a checkpoint folder: a random Llama written by the bench's own tool,
loaded in bfloat16 (what a GPU run uses; the figures themselves come from bench runs)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bench.engine import throughput  # noqa: E402
from bench.harness.checkpoint import main as write_checkpoint  # noqa: E402


def test_a_random_checkpoint_runs_through_the_throughput_bench_in_bfloat16(tmp_path) -> None:
    folder = tmp_path / "tiny-llama"
    assert write_checkpoint(["--shape", "tiny", "--out", str(folder)]) == 0
    assert write_checkpoint(["--shape", "tiny", "--out", str(folder)]) == 1  # not overwritten
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    result = throughput.main(
        ["--model", str(folder), "--dtype", "bfloat16", "--threads", "1", "--batches", "2",
         "--prompt-len", "32", "--decode-steps", "3", "--ks", "1", "8", "--context-len", "48",
         "--repeats", "1"]
    )  # fmt: skip
    assert result["dtype"] == "bfloat16" and result["device"] in ("cpu", "cuda")
    assert result["batches"]["2"]["decode"]["tokens"] == 6
    assert set(result["recompute"]) == {"1", "8"}


def test_a_missing_model_folder_is_a_usage_error(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        throughput.main(["--model", str(tmp_path / "nope")])
    assert exc.value.code == 2
    assert "unknown model" in capsys.readouterr().err
