"""The GPU probe's arithmetic and its quick CPU run (the figures themselves come from a GPU)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from bench.planner.gpu_probe import (  # noqa: E402
    QUICK,
    Experts,
    fit_half_tokens,
    local_counts,
    main,
    planner_curve,
)


def test_fit_recovers_the_half_point_of_a_known_curve() -> None:
    points = [(t, 0.7 * t / (t + 8192)) for t in (512, 1024, 2048, 4096, 8192, 16384, 32768)]
    fit = fit_half_tokens(points)
    assert fit["half_tokens"] == 8192
    assert fit["e_inf"] == pytest.approx(0.7, rel=1e-6)
    assert fit["worst_rel_error"] < 1e-9


def test_planner_curve_is_one_at_a_full_pass_and_halves_toward_small_ones() -> None:
    assert planner_curve(16384, 4096) == pytest.approx(1.0)
    assert planner_curve(4096, 4096) == pytest.approx(0.625)  # (16K+4K)/16K * 1/2


def test_uniform_routing_gives_each_chip_its_share_of_the_pairs() -> None:
    gen = torch.Generator().manual_seed(3)
    counts = local_counts(4096, QUICK, "cpu", gen)
    assert counts.shape == (QUICK.local_experts,)
    # each token picks topk of the experts; this chip holds 1/ep of them
    expected = 4096 * QUICK.topk / QUICK.ep
    assert abs(int(counts.sum()) - expected) < 0.1 * expected


def test_grouped_and_looped_experts_agree() -> None:
    experts = Experts(QUICK, "cpu", torch.float32)
    counts = [5, 0, 3, 7] + [1] * (QUICK.local_experts - 4)
    x = torch.randn(sum(counts), QUICK.hidden)
    ref = experts.loop(x, counts)
    assert torch.isfinite(ref).all()
    if experts.grouped_ok is None:
        offs = torch.tensor(counts).cumsum(0).to(torch.int32)
        got = experts.grouped(x, offs)
        assert ((got - ref).norm() / ref.norm()).item() < 1e-4


def test_quick_run_writes_every_section(tmp_path, capsys) -> None:
    out = tmp_path / "probe.json"
    assert main(["--quick", "--device", "cpu", "--reps", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("ceilings", "prefill_moe", "prefill_dense", "prefill_linear", "decode", "extend"):
        assert result[key], key
    assert result["prefill_linear_fit"]["half_tokens"] > 0
    for row in result["decode"]:
        assert row["step_s"] > 0 and row["kv_bytes"] > 0 and row["weight_bytes"] > 0
        assert row["attention_kernel"] in ("bmm", "sdpa")
    assert out.with_suffix(".txt").read_text().startswith("device cpu")
    assert "decode step" in capsys.readouterr().out


def test_full_shapes_refuse_a_cpu_with_one_line(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--device", "cpu"])
    assert "need a GPU" in str(exc.value)


def test_bad_reps_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--quick", "--reps", "0"])
    assert exc.value.code == 2


def test_float8_rows_round_trip_within_e4m3_precision() -> None:
    from bench.planner.gpu_probe import to_fp8_rows

    x = torch.randn(16, 256) * torch.logspace(-3, 3, 16)[:, None]  # rows of very different size
    q, scale = to_fp8_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (16,)
    err = (q.float() * scale[:, None] - x).norm(dim=1) / x.norm(dim=1)
    assert (err < 0.05).all()


def test_fp8_groups_are_padded_to_the_kernel_alignment() -> None:
    from bench.planner.gpu_probe import padded_offsets

    padded, offs = padded_offsets([3, 0, 17, 16], 16, "cpu")
    assert padded == [16, 0, 32, 16]
    assert offs.tolist() == [16, 16, 48, 64] and offs.dtype == torch.int32


def test_fp8_is_skipped_with_a_reason_off_the_gpu() -> None:
    from bench.planner.gpu_probe import Timer, measure_prefill_moe_fp8

    experts = Experts(QUICK, "cpu", torch.float32)
    cpu = torch.device("cpu")
    got = measure_prefill_moe_fp8(Timer(cpu, 1, 0), QUICK, experts, cpu, [256], None)
    assert got == {"skipped": "float8 grouped GEMM needs CUDA"}


def test_an_extend_attends_like_that_many_single_token_decodes_of_one_request() -> None:
    from bench.planner.gpu_probe import DecodeLayer

    torch.manual_seed(0)
    layer = DecodeLayer(QUICK, Experts(QUICK, "cpu", torch.float32), "cpu", torch.float32)
    kv = torch.randn(1, 40, QUICK.latent)
    x = torch.randn(3, QUICK.hidden)
    together = layer.attention(x, kv, tokens=3)
    one_by_one = layer.attention(x, kv.expand(3, -1, -1).contiguous())
    assert together.shape == (3, QUICK.hidden)
    assert torch.allclose(together, one_by_one, rtol=1e-4, atol=1e-5)


def test_only_extend_runs_the_ceilings_and_the_extend_alone(tmp_path) -> None:
    out = tmp_path / "extend.json"
    assert (
        main(["--quick", "--device", "cpu", "--reps", "1", "--only", "extend", "--out", str(out)])
        == 0
    )
    result = json.loads(out.read_text())
    assert "decode" not in result and "prefill_moe" not in result
    (row,) = result["extend"]
    assert row["extend_tokens"] == 100 and row["steps"] > 0
    assert "extend of 100 tokens" in out.with_suffix(".txt").read_text()
