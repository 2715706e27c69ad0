"""Tensor comparison metrics: msaccucmp's set plus the error ratios and counts of DESIGN §6.

x is the NPU tensor, y the golden one; everything is computed in float64, over the elements
where both are finite (the non-finite ones are counted on each side and named in the
reason). Every edge case has a defined result:

- shapes differ (element counts differ, or the same count in another shape): every metric
  is nan and CompareFailReason says so: never a silent zero-pad or reshape;
- empty tensors of one shape: equal (cosine 1, errors 0, ratios 1), reason "empty tensors";
- both norms zero: cosine 1; exactly one zero: cosine nan, reason names the side; identical
  tensors: exactly 1; otherwise clamped to [-1, 1] against rounding;
- golden all zero: relative errors over an empty set are nan, with the reason; relative
  Euclidean distance is 0 when x is zero too, nan otherwise (msaccucmp reports 0 there);
- relative errors skip elements with |y| <= float32 eps, as msaccucmp does;
- the 1/1000 and 5/1000 ratios measure |x - y| / |y| where |y| > eps and |x - y| elsewhere;
- NpuNorm and GoldenNorm are the L2 norms over the compared elements (0 for empty tensors,
  nan when nothing was compared): root cause uses them to tell cancellation from error.
"""
from __future__ import annotations

from typing import Callable, Dict

import numpy as np

from .. import numerics

EPS = float(np.finfo(np.float32).eps)


class _Pair:
    """The quantities several metrics share, computed once per tensor pair."""

    def __init__(self, x: np.ndarray, y: np.ndarray):
        self.x, self.y = x, y
        self.d = x - y
        self.abs_d = np.abs(self.d)
        self.abs_y = np.abs(y)
        self.rel_mask = self.abs_y > EPS
        self.xx = float(np.dot(x, x))
        self.yy = float(np.dot(y, y))
        self.reasons = []

    @property
    def rel(self) -> np.ndarray:
        return self.abs_d[self.rel_mask] / self.abs_y[self.rel_mask]


def _cosine(p: _Pair) -> float:
    if p.xx == 0 and p.yy == 0:
        return 1.0
    if p.xx == 0 or p.yy == 0:
        p.reasons.append("npu tensor is all zero" if p.xx == 0 else "golden tensor is all zero")
        return float("nan")
    if not p.abs_d.any():           # identical: exactly 1, not 1 - 1 ulp of the rounding
        return 1.0
    cos = float(np.dot(p.x, p.y) / (np.sqrt(p.xx) * np.sqrt(p.yy)))
    return min(1.0, max(-1.0, cos))


def _relative_euclidean(p: _Pair) -> float:
    if p.yy == 0:
        return 0.0 if p.xx == 0 else float("nan")
    return float(np.sqrt(np.dot(p.d, p.d) / p.yy))


def _accumulated_relative(p: _Pair) -> float:
    return float(p.rel.sum()) if p.rel_mask.any() else float("nan")


def _max_relative(p: _Pair) -> float:
    return float(p.rel.max()) if p.rel_mask.any() else float("nan")


def _mean_relative(p: _Pair) -> float:
    return float(p.rel.mean()) if p.rel_mask.any() else float("nan")


def _kl(p: _Pair) -> float:
    """msaccucmp's: min-max normalise each side, floor at eps, make pdfs, sum P log(P/Q)."""
    def pdf(v):
        lo, hi = v.min(), v.max()
        v = (v - lo) / (hi - lo) if hi > lo else v
        v = np.maximum(v, EPS)
        return v / v.sum()
    P, Q = pdf(p.x), pdf(p.y)
    return float(np.sum(P * np.log(P / Q)))


def _within(limit: float) -> Callable[[_Pair], float]:
    def ratio(p: _Pair) -> float:
        err = np.where(p.rel_mask, p.abs_d / np.where(p.rel_mask, p.abs_y, 1.0), p.abs_d)
        return float(np.mean(err < limit))
    return ratio


# name -> (function of the finite pair, what it is). Order is the CSV's column order.
METRICS: Dict[str, tuple] = {
    "CosineSimilarity": (_cosine, "x.y / (|x| |y|)"),
    "MaxAbsoluteError": (lambda p: float(p.abs_d.max()), "max |x - y|"),
    "AccumulatedRelativeError": (_accumulated_relative, "sum |x - y| / |y| over |y| > eps"),
    "RelativeEuclideanDistance": (_relative_euclidean, "sqrt(sum (x - y)^2 / sum y^2)"),
    "KullbackLeiblerDivergence": (_kl, "sum P log(P / Q) of the min-max normalised pdfs"),
    "StandardDeviation": (lambda p: float(np.std(p.x)), "std of x (golden: GoldenStandardDeviation)"),
    "GoldenStandardDeviation": (lambda p: float(np.std(p.y)), "std of y"),
    "MeanAbsoluteError": (lambda p: float(p.abs_d.mean()), "mean |x - y|"),
    "RootMeanSquareError": (lambda p: float(np.sqrt(np.mean(p.d * p.d))), "sqrt(mean (x - y)^2)"),
    "MaxRelativeError": (_max_relative, "max |x - y| / |y| over |y| > eps"),
    "MeanRelativeError": (_mean_relative, "mean |x - y| / |y| over |y| > eps"),
    "RatioRelError<0.001": (_within(1e-3), "share of elements with relative error < 1/1000"),
    "RatioRelError<0.005": (_within(5e-3), "share of elements with relative error < 5/1000"),
}


def compare_tensors(npu, golden) -> dict:
    """Every metric of METRICS plus the counts, for one pair; never raises on data."""
    x = np.asarray(npu)
    y = np.asarray(golden)
    out = {name: float("nan") for name in METRICS}
    counts = {}
    for side, a in (("Npu", x), ("Golden", y)):
        af = _float64(a)
        counts[f"{side}NanCount"] = int(np.isnan(af).sum())
        counts[f"{side}InfCount"] = int(np.isinf(af).sum())
    out.update(counts)
    out["NpuAtFp16Max"] = int((np.abs(_float64(x)) >= numerics.FP16_MAX).sum())
    out["FlushedToZeroRatio"] = float("nan")
    out["NpuNorm"] = out["GoldenNorm"] = float("nan")
    if x.shape != y.shape:
        out["CompareFailReason"] = (f"shape mismatch: npu {list(x.shape)} vs golden "
                                    f"{list(y.shape)}")
        return out
    if x.size == 0:
        out.update({name: 0.0 for name in METRICS}, CosineSimilarity=1.0, NpuNorm=0.0, GoldenNorm=0.0,
                   **{"RatioRelError<0.001": 1.0, "RatioRelError<0.005": 1.0},
                   CompareFailReason="empty tensors")
        return out
    xf, yf = _float64(x).reshape(-1), _float64(y).reshape(-1)
    live_y = yf != 0
    out["FlushedToZeroRatio"] = (float(np.mean(xf[live_y] == 0)) if live_y.any() else float("nan"))
    finite = np.isfinite(xf) & np.isfinite(yf)
    reasons = []
    if not finite.all():
        reasons.append(f"{int((~finite).sum())} non-finite element(s) left out")
        xf, yf = xf[finite], yf[finite]
    if xf.size == 0:
        out["CompareFailReason"] = "; ".join(reasons + ["no finite element to compare"])
        return out
    pair = _Pair(xf, yf)
    for name, (fn, _) in METRICS.items():
        out[name] = fn(pair)
    out["NpuNorm"], out["GoldenNorm"] = float(np.sqrt(pair.xx)), float(np.sqrt(pair.yy))
    if not pair.rel_mask.any():
        reasons.append("golden tensor is all (near) zero: relative errors undefined")
    out["CompareFailReason"] = "; ".join(reasons + pair.reasons)
    return out


def _float64(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind not in "fiub":          # bfloat16 and other extension floats
        a = a.astype(np.float32)
    return a.astype(np.float64, copy=False)
