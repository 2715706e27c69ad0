"""Comparison metrics against hand-computed float64 values, and every edge case."""
import math

import numpy as np
import pytest

from precision_tool.analysis import METRICS, compare_tensors
from precision_tool.kernels import totals as kcompare

import refs

X = np.array([1.0, 2.0, 3.0, -4.0], np.float32)       # "NPU"
Y = np.array([1.0, 2.5, 3.0, -3.0], np.float32)       # "golden"


@pytest.fixture(autouse=True, params=["one C pass", "numpy"])
def path(request, monkeypatch):
    """Every test here runs on both implementations of the metrics."""
    if request.param == "numpy":
        monkeypatch.setenv("PRECISION_TOOL_NUMPY_ONLY", "1")
    return request.param


def test_each_metric_against_a_hand_computed_value():
    m = compare_tensors(X, Y)
    dot, nx, ny = 1 + 5 + 9 + 12, math.sqrt(1 + 4 + 9 + 16), math.sqrt(1 + 6.25 + 9 + 9)
    assert m["CosineSimilarity"] == pytest.approx(dot / (nx * ny), rel=1e-15, abs=0)
    assert m["MaxAbsoluteError"] == 1.0
    rel = [0.0, 0.5 / 2.5, 0.0, 1.0 / 3.0]
    assert m["AccumulatedRelativeError"] == pytest.approx(sum(rel), rel=1e-15, abs=0)
    assert m["MaxRelativeError"] == pytest.approx(1 / 3, rel=1e-15, abs=0)
    assert m["MeanRelativeError"] == pytest.approx(sum(rel) / 4, rel=1e-15, abs=0)
    assert m["RelativeEuclideanDistance"] == pytest.approx(math.sqrt(1.25 / 25.25), rel=1e-15, abs=0)
    assert m["MeanAbsoluteError"] == pytest.approx(1.5 / 4, rel=1e-15, abs=0)
    assert m["RootMeanSquareError"] == pytest.approx(math.sqrt(1.25 / 4), rel=1e-15, abs=0)
    mx = sum(X.astype(float)) / 4
    assert m["StandardDeviation"] == pytest.approx(math.sqrt(sum((v - mx) ** 2 for v in X.astype(float)) / 4))
    assert m["RatioRelError<0.001"] == 0.5 and m["RatioRelError<0.005"] == 0.5
    # KL of the min-max normalised pdfs, by hand
    def pdf(v):
        v = (v - min(v)) / (max(v) - min(v))
        v = [max(e, float(np.finfo(np.float32).eps)) for e in v]
        return [e / sum(v) for e in v]
    P, Q = pdf(list(X.astype(float))), pdf(list(Y.astype(float)))
    assert m["KullbackLeiblerDivergence"] == pytest.approx(sum(p * math.log(p / q) for p, q in zip(P, Q)))
    assert m["CompareFailReason"] == "" and m["NpuNanCount"] == 0 and m["FlushedToZeroRatio"] == 0
    assert m["NpuNorm"] == pytest.approx(nx, rel=1e-15, abs=0) and m["GoldenNorm"] == pytest.approx(ny, rel=1e-15, abs=0)


def test_golden_against_itself_is_perfect():
    y = np.random.default_rng(0).normal(size=(7, 5)).astype(np.float32)
    m = compare_tensors(y, y)
    assert m["CosineSimilarity"] == 1.0          # exactly, whatever the rounding of the dot
    for name in ("MaxAbsoluteError", "AccumulatedRelativeError", "RelativeEuclideanDistance",
                 "MeanAbsoluteError", "RootMeanSquareError", "MaxRelativeError"):
        assert m[name] == 0.0
    assert abs(m["KullbackLeiblerDivergence"]) < 1e-15
    assert m["RatioRelError<0.001"] == 1.0


def test_kl_of_close_tensors_keeps_its_digits():
    """The KL of tensors 1e-5 apart is ~5e-11, made of terms of the second order in p - q:
    against an extended-precision reference over the same p and q (min 0 and max 1 on both
    sides make p = x and q = y exactly) it holds 12 digits. The textbook sum / Sp - log Sp +
    log Sq kept 4 here."""
    rng = np.random.default_rng(7)
    y = rng.uniform(0.0, 1.0, 1 << 16).astype(np.float32)
    x = np.clip(y * (1 + rng.normal(scale=1e-5, size=y.size)), 0.0, 1.0).astype(np.float32)
    for v in (x, y):
        v[:2] = 0.0, 1.0
    eps = float(np.finfo(np.float32).eps)
    want = refs.kl_divergence(np.maximum(x.astype(float), eps), np.maximum(y.astype(float), eps))
    assert 1e-11 < want < 1e-10
    assert compare_tensors(x, y)["KullbackLeiblerDivergence"] == pytest.approx(want, rel=1e-12, abs=0)
    # a scaled copy is the same pdf once normalised: KL 0, where the terms cancel exactly
    assert compare_tensors(2 * y, y)["KullbackLeiblerDivergence"] == pytest.approx(0.0, abs=1e-16)


def test_kl_terms_either_side_of_the_series_in_numpy():
    """numpy's excess terms against an extended-precision reference where p / q - 1 is just
    under 1/64 (the series' last term counts) and just over (the log: log1p of d keeps an ulp
    of the log where the log of the rounded ratio lost 6 bits of it)."""
    if np.finfo(np.longdouble).eps >= np.finfo(np.float64).eps:
        pytest.skip("no extended precision long double here for the reference")
    x = np.random.default_rng(6).uniform(0.1, 1.0, 4096)
    for ratio in (1.0155, 1.0158, 0.9842, 0.984, 3.0, 0.2):
        y = x / ratio
        want = refs.kl_excess(x.astype(np.longdouble), y.astype(np.longdouble))
        got = kcompare.kl_excess(x, y)
        assert float(got.sum()) == pytest.approx(float(want.sum()), rel=1e-14, abs=0), ratio
        np.testing.assert_allclose(got, want.astype(np.float64), rtol=1e-12, atol=0)


def test_zero_norms():
    z = np.zeros(4, np.float32)
    both = compare_tensors(z, z)
    assert both["CosineSimilarity"] == 1.0 and both["RelativeEuclideanDistance"] == 0.0
    assert math.isnan(both["MaxRelativeError"]) and "all (near) zero" in both["CompareFailReason"]
    npu_zero = compare_tensors(z, Y)
    assert math.isnan(npu_zero["CosineSimilarity"]) and "npu tensor is all zero" in npu_zero["CompareFailReason"]
    assert npu_zero["FlushedToZeroRatio"] == 1.0
    golden_zero = compare_tensors(X, z)
    assert math.isnan(golden_zero["CosineSimilarity"]) and math.isnan(golden_zero["RelativeEuclideanDistance"])
    assert "golden tensor is all zero" in golden_zero["CompareFailReason"]


def test_empty_and_scalar_tensors():
    e = compare_tensors(np.zeros((0, 3)), np.zeros((0, 3)))
    assert e["CosineSimilarity"] == 1.0 and e["MaxAbsoluteError"] == 0.0
    assert e["CompareFailReason"] == "empty tensors" and e["GoldenNorm"] == 0.0
    s = compare_tensors(np.float32(2.0), np.float32(-2.0))
    assert s["CosineSimilarity"] == -1.0 and s["MaxAbsoluteError"] == 4.0
    assert s["MaxRelativeError"] == 2.0


def test_shape_mismatch_is_an_error_row_never_a_pad():
    m = compare_tensors(np.ones((2, 3)), np.ones((3, 2)))
    assert all(math.isnan(m[name]) for name in METRICS)
    assert m["CompareFailReason"] == "shape mismatch: npu [2, 3] vs golden [3, 2]"
    m = compare_tensors(np.ones(5), np.ones(6))
    assert "shape mismatch" in m["CompareFailReason"]


def test_nan_and_inf_on_either_side_are_counted_and_left_out():
    x = np.array([1.0, np.nan, 3.0, np.inf, 65504.0], np.float32)
    y = np.array([1.0, 2.0, np.inf, 4.0, 70000.0], np.float32)
    m = compare_tensors(x, y)
    assert (m["NpuNanCount"], m["NpuInfCount"], m["GoldenNanCount"], m["GoldenInfCount"]) == (1, 1, 0, 1)
    assert m["NpuAtFp16Max"] == 2            # 65504 and inf: at or beyond the fp16 maximum
    assert "3 non-finite element(s) left out" in m["CompareFailReason"]
    assert m["MaxAbsoluteError"] == pytest.approx(70000.0 - 65504.0)
    assert m["NpuNorm"] == pytest.approx(math.sqrt(1 + 65504.0 ** 2))    # finite pairs only
    all_bad = compare_tensors(np.array([np.nan]), np.array([1.0]))
    assert "no finite element" in all_bad["CompareFailReason"] and math.isnan(all_bad["CosineSimilarity"])


def test_dtypes_are_compared_in_float64():
    x = np.array([1.0, 2.0], np.float16)
    y = np.array([1.0, 2.0001], np.float64)
    m = compare_tensors(x, y)
    assert m["MaxAbsoluteError"] == pytest.approx(1e-4, rel=1e-6, abs=0)
    import ml_dtypes
    b = compare_tensors(np.array([1.5], ml_dtypes.bfloat16), np.array([1.5], np.float32))
    assert b["MaxAbsoluteError"] == 0.0


def test_flushed_to_zero_share_counts_only_live_golden_elements():
    x = np.array([0.0, 0.0, 1e-8, 0.0], np.float32)
    y = np.array([1e-8, 0.0, 1e-8, 2e-8], np.float32)
    assert compare_tensors(x, y)["FlushedToZeroRatio"] == pytest.approx(2 / 3)


def test_blockwise_metrics_match_whole_array_float64_formulas():
    """Tensors spanning several blocks, with a large common offset (std by Chan's combination
    must not cancel), non-finite elements and near-zero goldens: every metric equals the
    textbook float64 formula applied to the whole finite arrays at once."""
    from precision_tool.kernels.totals import CHUNK, EPS
    rng = np.random.default_rng(5)
    n = 3 * CHUNK + 123
    y = (1e4 + rng.normal(size=n)).astype(np.float32)
    y[::97] = 0.0
    x = (y + rng.normal(scale=1e-2, size=n)).astype(np.float32)
    x[5], y[7], x[CHUNK + 1] = np.nan, np.inf, -np.inf
    m = compare_tensors(x, y)
    keep = np.isfinite(x) & np.isfinite(y)
    xf, yf = x[keep].astype(np.float64), y[keep].astype(np.float64)
    d = xf - yf
    mask = np.abs(yf) > EPS
    rel = np.abs(d[mask]) / np.abs(yf[mask])
    err = np.where(np.abs(yf) > EPS, np.abs(d) / np.where(mask, np.abs(yf), 1), np.abs(d))
    want = {
        "CosineSimilarity": xf @ yf / np.linalg.norm(xf) / np.linalg.norm(yf),
        "MaxAbsoluteError": np.abs(d).max(), "MeanAbsoluteError": np.abs(d).mean(),
        "RootMeanSquareError": np.sqrt(np.mean(d * d)),
        "RelativeEuclideanDistance": np.linalg.norm(d) / np.linalg.norm(yf),
        "AccumulatedRelativeError": rel.sum(), "MaxRelativeError": rel.max(),
        "MeanRelativeError": rel.mean(), "StandardDeviation": np.std(xf),
        "GoldenStandardDeviation": np.std(yf),
        "RatioRelError<0.001": np.mean(err < 1e-3), "RatioRelError<0.005": np.mean(err < 5e-3),
        "NpuNorm": np.linalg.norm(xf), "GoldenNorm": np.linalg.norm(yf),
    }
    for name, value in want.items():
        assert m[name] == pytest.approx(value, rel=1e-9, abs=0), name
    def pdf(v):
        v = np.maximum((v - v.min()) / (v.max() - v.min()), EPS)
        return v / v.sum()
    P, Q = pdf(xf), pdf(yf)
    assert m["KullbackLeiblerDivergence"] == pytest.approx(np.sum(P * np.log(P / Q)), rel=1e-6, abs=1e-12)
    assert (m["NpuNanCount"], m["NpuInfCount"], m["GoldenInfCount"]) == (1, 1, 1)
    assert "3 non-finite element(s) left out" in m["CompareFailReason"]
