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

from typing import Dict, Optional

import numpy as np

from .. import numerics
from ..kernels.compare import (CHUNK, EPS, Totals, add_counts, block_pairs, float64, kl_excess,
                               range_kl, range_totals)


def _cosine(t: Totals) -> float:
    if t.xx == 0 and t.yy == 0:
        return 1.0
    if t.xx == 0 or t.yy == 0:
        t.reasons.append("npu tensor is all zero" if t.xx == 0 else "golden tensor is all zero")
        return float("nan")
    if t.abs_d_max == 0:            # identical: exactly 1, not 1 - 1 ulp of the rounding
        return 1.0
    return min(1.0, max(-1.0, t.xy / (np.sqrt(t.xx) * np.sqrt(t.yy))))


def _relative_euclidean(t: Totals) -> float:
    if t.yy == 0:
        return 0.0 if t.xx == 0 else float("nan")
    return float(np.sqrt(t.dd / t.yy))


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
    "RootMeanSquareError": (lambda t: float(np.sqrt(t.dd / t.n)), "sqrt(mean (x - y)^2)"),
    "MaxRelativeError": (_over_rel(lambda t: t.rel_max), "max |x - y| / |y| over |y| > eps"),
    "MeanRelativeError": (_over_rel(lambda t: t.rel_sum / t.rel_n), "mean |x - y| / |y| over |y| > eps"),
    "RatioRelError<0.001": (lambda t: t.within_1e3 / t.n, "share of elements with relative error < 1/1000"),
    "RatioRelError<0.005": (lambda t: t.within_5e3 / t.n, "share of elements with relative error < 5/1000"),
}


def empty_result() -> dict:
    out = {name: float("nan") for name in METRICS}
    out.update(NpuNanCount=0, NpuInfCount=0, GoldenNanCount=0, GoldenInfCount=0, NpuAtFp16Max=0,
               FlushedToZeroRatio=float("nan"), NpuNorm=float("nan"), GoldenNorm=float("nan"))
    return out


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
    out["NpuNorm"], out["GoldenNorm"] = float(np.sqrt(t.xx)), float(np.sqrt(t.yy))
    if not t.rel_n:
        reasons.append("golden tensor is all (near) zero: relative errors undefined")
    out["CompareFailReason"] = "; ".join(reasons + t.reasons)
    return out


SMALL = CHUNK          # pairs up to this many elements may be compared as a batch


def compare_many(pairs) -> list:
    """compare_tensors for many (npu, golden) pairs at once: the small, same-shape, all-finite
    ones are laid end to end and every sum, extreme and count is taken per segment in one
    numpy call each (one block per pair, as compare_tensors takes them; sums may differ from
    it in the last bits, their order being another); every other pair goes to
    compare_tensors. The per-call cost of numpy dominates small tensors: this is where the
    throughput on thousands of them comes from."""
    out: list = [None] * len(pairs)
    batch = []
    for k, (x, y) in enumerate(pairs):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape == y.shape and 0 < x.size <= SMALL:
            batch.append((k, x, y))
        else:
            out[k] = compare_tensors(x, y)
    if not batch:
        return out
    X = np.concatenate([float64(x.reshape(-1)) for _, x, _ in batch])
    Y = np.concatenate([float64(y.reshape(-1)) for _, _, y in batch])
    sizes = np.array([x.size for _, x, _ in batch])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    finite = np.add.reduceat((np.isfinite(X) & np.isfinite(Y)).astype(np.int64), starts) == sizes
    if not finite.all():                 # the rare pairs with inf/nan: the general path
        for j in np.flatnonzero(~finite):
            k, x, y = batch[j]
            out[k] = compare_tensors(x, y)
        keep = np.repeat(finite, sizes)
        X, Y = X[keep], Y[keep]
        batch = [b for b, f in zip(batch, finite) if f]
        sizes = sizes[finite]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    if not batch:
        return out

    def seg_sum(v):
        return np.add.reduceat(v, starts)

    def per_elem(v):
        return np.repeat(v, sizes)

    D = X - Y
    absD, absY = np.abs(D), np.abs(Y)
    mask = absY > EPS
    err = np.divide(absD, absY, out=absD.copy(), where=mask)
    rel = np.where(mask, err, 0.0)
    stats = {
        "xy": seg_sum(X * Y), "xx": seg_sum(X * X), "yy": seg_sum(Y * Y), "dd": seg_sum(D * D),
        "abs_d_sum": seg_sum(absD), "abs_d_max": np.maximum.reduceat(absD, starts),
        "rel_n": seg_sum(mask.astype(np.int64)), "rel_sum": seg_sum(rel),
        "rel_max": np.maximum.reduceat(rel, starts),
        "within_1e3": seg_sum((err < 1e-3).astype(np.int64)),
        "within_5e3": seg_sum((err < 5e-3).astype(np.int64)),
        "live": seg_sum((Y != 0).astype(np.int64)),
        "flushed": seg_sum(((Y != 0) & (X == 0)).astype(np.int64)),
        "at_max": seg_sum((np.abs(X) >= numerics.FP16_MAX).astype(np.int64)),
    }
    sides = {}
    for side, V in (("x", X), ("y", Y)):
        lo, hi = np.minimum.reduceat(V, starts), np.maximum.reduceat(V, starts)
        mean = seg_sum(V) / sizes
        centred = V - per_elem(mean)
        m2 = seg_sum(centred * centred)
        span = hi - lo
        unit = np.where(per_elem(span > 0), (V - per_elem(lo)) / per_elem(np.where(span > 0, span, 1.0)), V)
        sides[side] = (lo, hi, mean, m2, np.maximum(unit, EPS))
    P, Q = sides["x"][4], sides["y"][4]
    kl = (seg_sum(P), seg_sum(Q), seg_sum(kl_excess(P, Q)))
    for j, (k, _, _) in enumerate(batch):
        t = Totals()
        n = int(sizes[j])
        t.n = n
        for name in ("xy", "xx", "yy", "dd", "abs_d_sum", "abs_d_max", "rel_sum", "rel_max"):
            setattr(t, name, float(stats[name][j]))
        for name in ("rel_n", "within_1e3", "within_5e3", "live", "flushed"):
            setattr(t, name, int(stats[name][j]))
        t.counts["NpuAtFp16Max"] = int(stats["at_max"][j])
        for side in ("x", "y"):
            lo, hi, mean, m2, _ = sides[side]
            t.lo[side], t.hi[side] = float(lo[j]), float(hi[j])
            t.moments[side] = (n, float(mean[j]), float(m2[j]))
        t.set_kl((float(kl[0][j]), float(kl[1][j]), float(kl[2][j])))
        out[k] = finish(t)
    return out
