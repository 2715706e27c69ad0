"""Compare totals: one pass over a pair of flat tensors gathers every sum, extreme and count
the metrics of analysis.comparing.metrics are made of (Totals), and the sums of the KL divergence of
their min-max normalised pdfs (kl_sums). The numpy code here defines them, block by block;
the C module computes the same totals in parts of PART elements on several threads where it
runs (span_totals and span_kl decide), summed in an order that does not depend on the thread
count."""
from __future__ import annotations

import math
from typing import List, Optional

import numpy as np

from .. import numerics
from . import native


EPS = float(np.finfo(np.float32).eps)


CHUNK = 1 << 16        # elements per block: the block's float64 temporaries stay in cache


class Totals:
    """What the metrics need, accumulated block by block over the finite pairs (float64):
    sums for the dot products, norms, errors and ratios, Chan's combination for the
    standard deviations, the ranges the KL pass needs, and the counts of both sides.
    Tensors are read once for everything but KL, which reads them a second time unless its
    ranges were known beforehand and the C pass took its sums too (early_kl). Totals of
    two ranges of a tensor merge into the totals of both, so ranges may be read anywhere."""

    def __init__(self):
        self.counts = {"NpuNanCount": 0, "NpuInfCount": 0, "GoldenNanCount": 0,
                       "GoldenInfCount": 0, "NpuAtFp16Max": 0}
        self.live = self.flushed = self.left_out = 0
        self.n = 0
        self.xy = self.xx = self.yy = self.dd = 0.0
        self.abs_d_sum = self.abs_d_max = 0.0
        self.rel_n, self.rel_sum, self.rel_max = 0, 0.0, 0.0
        self.within_1e3 = self.within_5e3 = 0
        self.moments = {"x": (0, 0.0, 0.0), "y": (0, 0.0, 0.0)}      # (n, mean, M2)
        self.lo = {"x": np.inf, "y": np.inf}
        self.hi = {"x": -np.inf, "y": -np.inf}
        self.kl = float("nan")
        # KL sums taken in the same pass with ranges known beforehand (the dump index's min
        # and max): valid only if the ranges the pass found are those same ranges
        self.kl_hint, self.kl_early = None, None
        self.empty = True         # nothing read into these totals yet
        self.reasons: list = []

    @classmethod
    def from_native(cls, v: "native.PassTotals", hint=None) -> "Totals":
        """The totals of one C pass."""
        t = cls.__new__(cls)      # every field set here: __init__'s would be overwritten
        t.empty = False
        t.counts = {"NpuNanCount": int(v.x_nan), "NpuInfCount": int(v.x_inf),
                    "GoldenNanCount": int(v.y_nan), "GoldenInfCount": int(v.y_inf),
                    "NpuAtFp16Max": int(v.x_at_fp16_max)}
        t.live, t.flushed, t.left_out, t.n = int(v.live), int(v.flushed), int(v.left_out), int(v.n)
        t.xy, t.xx, t.yy, t.dd = v.xy, v.xx, v.yy, v.dd
        t.abs_d_sum, t.abs_d_max = v.abs_d_sum, v.abs_d_max
        t.rel_n, t.rel_sum, t.rel_max = int(v.rel_n), v.rel_sum, v.rel_max
        t.within_1e3, t.within_5e3 = int(v.within_1e3), int(v.within_5e3)
        t.lo, t.hi = {"x": v.lo_x, "y": v.lo_y}, {"x": v.hi_x, "y": v.hi_y}
        t.moments = ({"x": (t.n, v.mean_x, v.m2_x), "y": (t.n, v.mean_y, v.m2_y)} if t.n else
                     {"x": (0, 0.0, 0.0), "y": (0, 0.0, 0.0)})
        t.kl = float("nan")
        t.kl_hint, t.kl_early = (None, None) if hint is None else \
            (tuple(hint), (v.kl_p, v.kl_q, v.kl_excess))
        t.reasons = []
        return t

    def early_kl(self):
        """The KL sums of the first pass when its ranges were the right ones, else None."""
        return self.kl_early if self.kl_hint is not None and self.kl_hint == self.ranges() else None

    def add_block(self, xb: np.ndarray, yb: np.ndarray):
        """A block of both tensors as read (float64): counts first, then the finite pairs."""
        self.empty = False
        add_counts(self.counts, "Npu", xb)
        add_counts(self.counts, "Golden", yb)
        live_y = yb != 0
        self.live += int(live_y.sum())
        self.flushed += int((live_y & (xb == 0)).sum())
        finite = np.isfinite(xb) & np.isfinite(yb)
        if not finite.all():
            self.left_out += int((~finite).sum())
            xb, yb = xb[finite], yb[finite]
        self.add(xb, yb)

    def merge(self, o: "Totals") -> "Totals":
        if self.empty:
            self.kl_hint, self.kl_early = o.kl_hint, o.kl_early
        elif self.kl_hint is not None and self.kl_hint == o.kl_hint:
            self.kl_early = add_kl_sums(self.kl_early, o.kl_early)
        else:                     # a range read without the same hint: KL needs its own pass
            self.kl_hint = self.kl_early = None
        self.empty = self.empty and o.empty
        for k in self.counts:
            self.counts[k] += o.counts[k]
        for k in ("live", "flushed", "left_out", "n", "xy", "xx", "yy", "dd", "abs_d_sum",
                  "rel_n", "rel_sum", "within_1e3", "within_5e3"):
            setattr(self, k, getattr(self, k) + getattr(o, k))
        self.abs_d_max = max(self.abs_d_max, o.abs_d_max)
        self.rel_max = max(self.rel_max, o.rel_max)
        for side in ("x", "y"):
            self.lo[side] = min(self.lo[side], o.lo[side])
            self.hi[side] = max(self.hi[side], o.hi[side])
            if o.moments[side][0]:
                self.moments[side] = (o.moments[side] if not self.moments[side][0] else
                                      _chan(self.moments[side], o.moments[side]))
        return self

    def add(self, x: np.ndarray, y: np.ndarray):
        n = x.size
        if n == 0:
            return
        d = x - y
        self.n += n
        self.xy += float(_dot(x, y))
        self.xx += float(_dot(x, x))
        self.yy += float(_dot(y, y))
        self.dd += float(_dot(d, d))
        abs_d = np.abs(d, out=d)
        self.abs_d_sum += float(abs_d.sum())
        self.abs_d_max = max(self.abs_d_max, float(abs_d.max()))
        abs_y = np.abs(y)
        mask = abs_y > EPS
        # relative error where |y| > eps, absolute elsewhere (the ratios' definition)
        err = np.divide(abs_d, abs_y, out=abs_d.copy(), where=mask)
        k = int(np.count_nonzero(mask))
        if k:
            rel = err[mask]
            self.rel_n += k
            self.rel_sum += float(rel.sum())
            self.rel_max = max(self.rel_max, float(rel.max()))
        self.within_1e3 += int(np.count_nonzero(err < 1e-3))
        self.within_5e3 += int(np.count_nonzero(err < 5e-3))
        for side, v in (("x", x), ("y", y)):
            self.lo[side] = min(self.lo[side], float(v.min()))
            self.hi[side] = max(self.hi[side], float(v.max()))
            mean = float(v.mean())
            centred = v - mean
            m2 = float(_dot(centred, centred))
            self.moments[side] = (n, mean, m2) if not self.moments[side][0] else \
                _chan(self.moments[side], (n, mean, m2))

    def ranges(self) -> tuple:
        """(lo_x, hi_x, lo_y, hi_y): what the KL pass needs of the whole tensors."""
        return self.lo["x"], self.hi["x"], self.lo["y"], self.hi["y"]

    def set_kl(self, sums) -> None:
        """msaccucmp's KL, sum P log(P / Q) with P = p / Sp and Q = q / Sq, from kl_sums'
        (Sp, Sq, E), E = sum (p log(p / q) - (p - q)): KL = E / Sp - psi((Sq - Sp) / Sp).
        Both parts are of the second order in p - q; the textbook sum / Sp - log Sp + log Sq
        subtracts first-order quantities of size 1e-4 and logs of size 16 to leave 1e-8, and
        kept only 3 to 7 digits of the KL of close tensors. KL is never negative (Gibbs): a
        rounding below zero is reported as 0."""
        sp, sq, e = sums
        self.kl = max(e / sp - _psi_of(sq, sp), 0.0) if self.n else float("nan")

    def std(self, side) -> float:
        n, _, m2 = self.moments[side]
        return sqrt(m2 / n) if n else float("nan")


def sqrt(v: float) -> float:
    """np.sqrt of a Python float (nan below zero, nan and inf kept) at math.sqrt's cost: the
    metrics of thousands of small pairs take a few each."""
    return math.sqrt(v) if v >= 0 else float("nan")


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """sum(a * b) without BLAS: BLAS threads its dot, and threads of several compare workers
    on the same cores slowed two workers down to below one; einsum's loop is single-threaded
    and its result does not depend on how many threads a BLAS would use."""
    return np.einsum("i,i->", a, b)


def _unit(v, lo, hi):
    """Min-max normalised, floored at eps (msaccucmp's pdf before normalisation)."""
    v = (v - lo) / (hi - lo) if hi > lo else v
    return np.maximum(v, EPS)


KL_SERIES = 1.0 / 64      # |p / q - 1| under which KL's terms use a series (as the C loops)


def kl_excess(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """p log(p / q) - (p - q) >= 0 per element, KL's term less its first order (set_kl). With
    d = (p - q) / q it is (p - q) d phi(d): where |d| < KL_SERIES the series phi (as many
    terms as the largest |d| needs) and p - q exact make it good to a few ulps; elsewhere
    (few elements: those near a side's minimum) the log less p - q, which cancels at most
    log2(2 / |d|) < 7 bits."""
    diff = p - q
    d = diff / q
    widest = float(np.abs(d).max()) if d.size else 0.0
    far = None
    if widest >= KL_SERIES:
        far = np.flatnonzero(np.abs(d) >= KL_SERIES)
        np.clip(d, -KL_SERIES, KL_SERIES, out=d)     # the series runs on all; far is redone
        widest = KL_SERIES
    out = _phi(d, widest)
    out *= d
    out *= diff
    if far is not None:
        pf, qf = p[far], q[far]
        df = (pf - qf) / qf
        # log1p: an ulp of the log, where the log of the rounded ratio would be off by an ulp
        # of the ratio (64 of the log's at d = 1/64); under 1/2 the ratio itself is exact
        # enough and 1 + d might round to 0
        with np.errstate(divide="ignore", invalid="ignore"):
            out[far] = pf * np.where(df > -0.5, np.log1p(df), np.log(pf / qf)) - (pf - qf)
    return out


def _phi(d: np.ndarray, widest: float) -> np.ndarray:
    """sum over k >= 2 of (-1)^k d^(k - 2) / (k (k - 1)), to the last k whose term can reach
    2^-56 of the first where |d| <= widest (k = 10 at |d| = 1/64, 6 at 1e-3: the numpy loop
    costs a pass per term)."""
    last = 2
    while last < 10 and 2 * widest ** (last - 1) / ((last + 1) * last) >= 2.0 ** -56:
        last += 1
    out = np.full_like(d, (-1.0) ** last / (last * (last - 1)))
    for k in range(last - 1, 1, -1):
        out *= d
        out += (-1.0) ** k / (k * (k - 1))
    return out


def _psi_of(sq: float, sp: float) -> float:
    """psi((Sq - Sp) / Sp). Where Sq is under half of Sp, u's rounding matters: a side of
    float32 maxima (Sp about 1e41) against an ordinary one rounds u to -1, whose log1p is
    -inf (math raised a domain error there); the logs of the sums themselves are exact
    enough so far from u = 0. nan or inf sums give nan."""
    if not (math.isfinite(sq) and math.isfinite(sp)) or sp <= 0:
        return float("nan")
    u = (sq - sp) / sp
    if u > -0.5:
        return _psi(u)
    return u - (math.log(sq) - math.log(sp)) if sq > 0 else float("inf")


def _psi(u: float) -> float:
    """u - log1p(u) for u > -1, without its cancellation where u is small: the series
    u^2/2 - u^3/3 + ... to u^11 where |u| < 1/64 (the next term is under 2^-58 of the first)."""
    if abs(u) >= KL_SERIES:
        return u - math.log1p(u)
    r = 0.0
    for k in range(11, 1, -1):
        r = r * u + (-1.0) ** k / k
    return r * u * u


def kl_sums(x_blocks_and_y_blocks, ranges) -> tuple:
    """(Sp, Sq, E) over the finite pairs of some blocks, E the sum of kl_excess; sums of
    several ranges add up."""
    lo_x, hi_x, lo_y, hi_y = ranges
    sp = sq = e = 0.0
    for xb, yb in x_blocks_and_y_blocks:
        finite = np.isfinite(xb) & np.isfinite(yb)
        if not finite.all():
            xb, yb = xb[finite], yb[finite]
        p, q = _unit(xb, lo_x, hi_x), _unit(yb, lo_y, hi_y)
        sp += float(p.sum())
        sq += float(q.sum())
        e += float(kl_excess(p, q).sum())
    return sp, sq, e


def add_kl_sums(a: tuple, b: tuple) -> tuple:
    return tuple(u + v for u, v in zip(a, b))


def _chan(a, b):
    """Combine (n, mean, M2) of two blocks (Chan et al.): exact, no cancellation."""
    na, ma, m2a = a
    nb, mb, m2b = b
    n = na + nb
    delta = mb - ma
    return n, ma + delta * nb / n, m2a + m2b + delta * delta * na * nb / n


def _one_pass(xs, ys) -> bool:
    return native.enabled() and bool(native.kind(xs)) and bool(native.kind(ys))


def range_totals(xs: np.ndarray, ys: np.ndarray, start: int = 0,
                 stop: Optional[int] = None, ranges=None) -> Totals:
    """The totals of xs[start:stop] against ys[start:stop] (flat arrays). With `ranges`,
    the expected (lo_x, hi_x, lo_y, hi_y) of the finite pairs of the whole tensors, the
    C pass takes KL's sums at the same time (Totals.early_kl tells if they hold)."""
    return span_totals(xs, ys, [(start, xs.size if stop is None else stop)], ranges)[0]


def span_totals(xs: np.ndarray, ys: np.ndarray, spans, ranges=None) -> List[Totals]:
    """range_totals of each (start, stop) of spans, their parts sharing the threads: a
    tensor's spans in one call keep both cores busy to the end, where one call per span
    would wait for its last part each time."""
    if _one_pass(xs, ys):
        out = []
        for results in _in_parts(lambda a, b: native.compare(xs, ys, a, b, ranges), spans):
            t = Totals()
            for part in results:
                t.merge(Totals.from_native(part, ranges))
            out.append(t)
        return out
    out = []
    for start, stop in spans:
        t = Totals()
        for xb, yb in block_pairs(xs, ys, start, stop):
            t.add_block(xb, yb)
        out.append(t)
    return out


def batch_totals(pairs) -> List[Totals]:
    """The totals of each pair (flat arrays of one size) with KL's sums set for the ranges
    its pass found: range_totals, then range_kl where a pair has finite elements. Small
    tensors pay the cost of a call more than that of their elements: the pairs whose kinds
    the C module takes go in one call; the others (integer labels, masks) one by one."""
    c = native.enabled()
    here = [k for k, (x, y) in enumerate(pairs) if c and native.kind(x) and native.kind(y)]
    out: List[Optional[Totals]] = [None] * len(pairs)
    for k, v in zip(here, native.compare_batch([pairs[k] for k in here]) if here else ()):
        out[k] = Totals.from_native(v)
        if out[k].n:
            out[k].set_kl((v.kl_p, v.kl_q, v.kl_excess))
    for k, (x, y) in enumerate(pairs):
        if out[k] is None:
            out[k] = range_totals(x, y)
            if out[k].n:
                out[k].set_kl(range_kl(x, y, 0, x.size, out[k].ranges()))
    return out


def range_kl(xs: np.ndarray, ys: np.ndarray, start: int, stop: int, ranges) -> tuple:
    """KL's sums over xs[start:stop] against ys[start:stop] for the whole tensors' ranges."""
    return span_kl(xs, ys, [(start, stop)], ranges)[0]


def span_kl(xs: np.ndarray, ys: np.ndarray, spans, ranges) -> List[tuple]:
    """range_kl of each (start, stop) of spans, their parts sharing the threads."""
    if _one_pass(xs, ys):
        out = []
        for results in _in_parts(lambda a, b: native.kl(xs, ys, a, b, ranges), spans):
            sums = (0.0, 0.0, 0.0)
            for part in results:
                sums = add_kl_sums(sums, part)
            out.append(sums)
        return out
    return [kl_sums(block_pairs(xs, ys, start, stop), ranges) for start, stop in spans]


PART = 1 << 20       # elements per C call: the unit of work of the threads


def _in_parts(job, spans) -> List[list]:
    """job(a, b) over each (start, stop) of spans in parts of PART elements, on
    native.threads() threads (the C loops release the GIL): per span its parts' results,
    in order. The parts and the order of their merge do not depend on the number of
    threads, nor on which spans share a call, so neither do the sums."""
    parts = [[(a, min(a + PART, stop)) for a in range(start, stop, PART)] or [(start, stop)]
             for start, stop in spans]
    flat = [ab for span in parts for ab in span]
    workers = min(native.threads(), len(flat))
    if workers == 1:
        results = [job(a, b) for a, b in flat]
    else:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(workers) as pool:
            results = list(pool.map(lambda ab: job(*ab), flat))
    out, k = [], 0
    for span in parts:
        out.append(results[k:k + len(span)])
        k += len(span)
    return out


def block_pairs(xs: np.ndarray, ys: np.ndarray, start: int = 0, stop: Optional[int] = None):
    stop = xs.size if stop is None else stop
    for k in range(start, stop, CHUNK):
        end = min(k + CHUNK, stop)
        yield float64(xs[k:end]), float64(ys[k:end])


def float64(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind not in "fiub":          # bfloat16 and other extension floats
        a = a.astype(np.float32)
    return a.astype(np.float64, copy=False)


def add_counts(out: dict, side: str, block: np.ndarray):
    """Add a block's nan and inf counts (and, for the NPU, values at or beyond the fp16 max)."""
    out[f"{side}NanCount"] += int(np.isnan(block).sum())
    out[f"{side}InfCount"] += int(np.isinf(block).sum())
    if side == "Npu":
        out["NpuAtFp16Max"] += int((np.abs(block) >= numerics.FP16_MAX).sum())
