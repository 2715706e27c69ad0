"""Tensor comparison metrics: msaccucmp's set plus our error ratios and counts.

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

from typing import Dict, Optional

import numpy as np

from ...kernels.totals import (CHUNK, Totals, add_counts, batch_totals, block_pairs, range_kl,
                               range_totals, sqrt)


def _cosine(t: Totals) -> float:
    if t.xx == 0 and t.yy == 0:
        return 1.0
    if t.xx == 0 or t.yy == 0:
        t.reasons.append("npu tensor is all zero" if t.xx == 0 else "golden tensor is all zero")
        return float("nan")
    if t.abs_d_max == 0:            # identical: exactly 1, not 1 - 1 ulp of the rounding
        return 1.0
    return min(1.0, max(-1.0, t.xy / (sqrt(t.xx) * sqrt(t.yy))))


def _relative_euclidean(t: Totals) -> float:
    if t.yy == 0:
        return 0.0 if t.xx == 0 else float("nan")
    return sqrt(t.dd / t.yy)


def _over_rel(value):
    return lambda t: float(value(t)) if t.rel_n else float("nan")


# name -> (function of the totals, what it is). Order is the CSV's column order.
METRICS: Dict[str, tuple] = {
    "CosineSimilarity": (_cosine, "x.y / (|x| |y|)"),
    "MaxAbsoluteError": (lambda t: t.abs_d_max, "max |x - y|"),
    "AccumulatedRelativeError": (_over_rel(lambda t: t.rel_sum), "sum |x - y| / |y| over |y| > eps"),
    "RelativeEuclideanDistance": (_relative_euclidean, "sqrt(sum (x - y)^2 / sum y^2)"),
    "KullbackLeiblerDivergence": (lambda t: t.kl, "sum P log(P / Q) of the min-max normalised pdfs"),
    "StandardDeviation": (lambda t: t.std("x"), "std of x (golden: GoldenStandardDeviation)"),
    "GoldenStandardDeviation": (lambda t: t.std("y"), "std of y"),
    "MeanAbsoluteError": (lambda t: t.abs_d_sum / t.n, "mean |x - y|"),
    "RootMeanSquareError": (lambda t: sqrt(t.dd / t.n), "sqrt(mean (x - y)^2)"),
    "MaxRelativeError": (_over_rel(lambda t: t.rel_max), "max |x - y| / |y| over |y| > eps"),
    "MeanRelativeError": (_over_rel(lambda t: t.rel_sum / t.rel_n), "mean |x - y| / |y| over |y| > eps"),
    "RatioRelError<0.001": (lambda t: t.within_1e3 / t.n, "share of elements with relative error < 1/1000"),
    "RatioRelError<0.005": (lambda t: t.within_5e3 / t.n, "share of elements with relative error < 5/1000"),
}


_EMPTY = {**{name: float("nan") for name in METRICS}, "NpuNanCount": 0, "NpuInfCount": 0,
          "GoldenNanCount": 0, "GoldenInfCount": 0, "NpuAtFp16Max": 0,
          "FlushedToZeroRatio": float("nan"), "NpuNorm": float("nan"), "GoldenNorm": float("nan")}


def empty_result() -> dict:
    """A result row before anything is compared: every metric nan, every count 0."""
    return dict(_EMPTY)


def compare_tensors(npu, golden, ranges=None) -> dict:
    """Every metric of METRICS plus the counts, for one pair; never raises on data. The
    arrays are read block by block (a memory-mapped dump is streamed, never loaded whole):
    once, and a second time for KL unless `ranges` (what the dump index says are the min and
    max of both sides: lo_x, hi_x, lo_y, hi_y) turn out right."""
    x = np.asarray(npu)
    y = np.asarray(golden)
    out = empty_result()
    if x.shape != y.shape:
        for side, a in (("Npu", x), ("Golden", y)):
            for block, _ in block_pairs(a.reshape(-1), a.reshape(-1)):
                add_counts(out, side, block)
        out["CompareFailReason"] = (f"shape mismatch: npu {list(x.shape)} vs golden "
                                    f"{list(y.shape)}")
        return out
    if x.size == 0:
        out.update({name: 0.0 for name in METRICS}, CosineSimilarity=1.0, NpuNorm=0.0, GoldenNorm=0.0,
                   **{"RatioRelError<0.001": 1.0, "RatioRelError<0.005": 1.0},
                   CompareFailReason="empty tensors")
        return out
    xs, ys = x.reshape(-1), y.reshape(-1)
    t = range_totals(xs, ys, ranges=ranges)
    if t.n:
        t.set_kl(t.early_kl() or range_kl(xs, ys, 0, xs.size, t.ranges()))
    return finish(t, out)


def finish(t: Totals, out: Optional[dict] = None) -> dict:
    """The result row of compare_tensors from the totals of every range (KL set)."""
    if out is None:
        out = empty_result()
    out.update(t.counts)
    out["FlushedToZeroRatio"] = t.flushed / t.live if t.live else float("nan")
    reasons = [f"{t.left_out} non-finite element(s) left out"] if t.left_out else []
    if t.n == 0:
        out["CompareFailReason"] = "; ".join(reasons + ["no finite element to compare"])
        return out
    for name, (fn, _) in METRICS.items():
        out[name] = float(fn(t))
    out["NpuNorm"], out["GoldenNorm"] = sqrt(t.xx), sqrt(t.yy)
    if not t.rel_n:
        reasons.append("golden tensor is all (near) zero: relative errors undefined")
    out["CompareFailReason"] = "; ".join(reasons + t.reasons)
    return out


SMALL = CHUNK          # pairs up to this many elements are compared in one batch


def compare_many(pairs) -> list:
    """compare_tensors for many (npu, golden) pairs: the small, same-shape, non-empty ones
    through kernels.totals.batch_totals (one C call for them all where the module takes
    their kinds: on thousands of small tensors the cost of a call is what counts), every
    other pair through compare_tensors. The same numbers either way."""
    out: list = [None] * len(pairs)
    batch = []
    for k, (x, y) in enumerate(pairs):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape == y.shape and 0 < x.size <= SMALL:
            batch.append((k, x.reshape(-1), y.reshape(-1)))
        else:
            out[k] = compare_tensors(x, y)
    for (k, _, _), t in zip(batch, batch_totals([(x, y) for _, x, y in batch])):
        out[k] = finish(t)
    return out
