"""Percentiles over runs where some requests never got a first token (inf)."""

from __future__ import annotations

import math
import warnings

import numpy as np

from planner.metrics import percentiles


def test_a_percentile_leaning_on_a_never_served_request_is_inf_without_warnings() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's inf - inf interpolation warning would raise
        out = percentiles(np.array([1.0, 2.0, np.inf]), (50, 60, 99))
    assert out["p50"] == 2.0
    assert math.isinf(out["p60"]) and math.isinf(out["p99"])
    assert out["mean"] == 1.5  # over finite values
    assert out["n"] == 3


def test_all_never_served_and_nothing_at_all() -> None:
    assert math.isinf(percentiles(np.array([np.inf, np.inf]))["p50"])
    empty = percentiles(np.array([np.nan]))
    assert math.isnan(empty["p90"]) and empty["n"] == 0


def test_finite_values_are_plain_numpy_percentiles() -> None:
    values = np.arange(1.0, 101.0)
    out = percentiles(values)
    assert out["p50"] == np.percentile(values, 50)
    assert out["p99"] == np.percentile(values, 99)
