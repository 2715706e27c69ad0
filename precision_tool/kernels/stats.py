"""Tensor statistics: max, min, mean and L2 norm over the finite elements, and the counts of
nan, +inf and -inf. The numpy code here defines them; the C module's one pass per tensor
(GIL released) computes the same numbers where it runs (see kernels.native)."""
from __future__ import annotations

import numpy as np

from . import native
from .native import stats_kind  # noqa: F401  (a dtype's kind for the C statistics)

STAT_FIELDS = ("max", "min", "mean", "l2norm", "nan_count", "pos_inf_count", "neg_inf_count")


STATS_BLOCK = 1 << 20       # elements per block: a memory-mapped 2 GiB tensor is streamed


def tensor_stats(x: np.ndarray) -> dict:
    """max, min, mean and L2 norm over the finite elements (nan when there are none: an empty
    or all-inf/nan tensor), and the counts of nan, +inf and -inf; computed in float64, block
    by block (memory stays bounded whatever the size)."""
    a = np.asarray(x).reshape(-1)
    if a.size and native.enabled() and native.stats_kind(a):
        row = native.stats([a])[0]
        return dict(zip(STAT_FIELDS, [*row[:4].tolist(), *map(int, row[4:])]))
    nan = pos = neg = n = 0
    hi, lo, total, squares = -np.inf, np.inf, 0.0, 0.0
    for start in range(0, a.size, STATS_BLOCK):
        b = a[start:start + STATS_BLOCK]
        if b.dtype.kind == "b":
            b = b.astype(np.float64)
        elif b.dtype.kind not in "fiu":       # bfloat16 arrives as a void-kind numpy dtype
            b = b.astype(np.float32)
        if b.dtype.kind == "f" and not np.isfinite(b).all():
            nan += int(np.isnan(b).sum())
            pos += int(np.isposinf(b).sum())
            neg += int(np.isneginf(b).sum())
            b = b[np.isfinite(b)]
        if b.size == 0:
            continue
        f = b.astype(np.float64, copy=False)
        n += f.size
        hi, lo = max(hi, float(f.max())), min(lo, float(f.min()))
        total += float(f.sum())
        squares += float(np.dot(f, f))
    if n == 0:
        return {"max": np.nan, "min": np.nan, "mean": np.nan, "l2norm": np.nan,
                "nan_count": nan, "pos_inf_count": pos, "neg_inf_count": neg}
    return {"max": hi, "min": lo, "mean": total / n, "l2norm": float(np.sqrt(squares)),
            "nan_count": nan, "pos_inf_count": pos, "neg_inf_count": neg}


def stats_row(x: np.ndarray, row) -> None:
    """tensor_stats of x into row[:7] (STAT_FIELDS' order, counts as floats) and its size
    into row[7]: the C module's one pass where it takes the dtype. row: 8 float64, a numpy
    array or a memoryview."""
    if x.size and native.enabled() and native.stats_kind(x):
        native.stats([x], row[:7])
    else:
        stats = tensor_stats(x)
        np.asarray(row)[:7] = [stats[f] for f in STAT_FIELDS]
    row[7] = float(x.size)


def stats_table(arrays) -> np.ndarray:
    """tensor_stats of many tensors at once, a row per tensor ((n, 7) float64, STAT_FIELDS'
    order, the counts as floats): the C module's one pass per tensor, GIL released, where
    it runs and takes the dtype; tensor_stats for the others. Same values."""
    table = np.empty((len(arrays), 7))
    fast = native.enabled()
    one_pass = [k for k, a in enumerate(arrays) if fast and a.size and native.stats_kind(a)]
    if one_pass:
        table[one_pass] = native.stats([arrays[k] for k in one_pass])
    for k in sorted(set(range(len(arrays))) - set(one_pass)):
        stats = tensor_stats(arrays[k])
        table[k] = [stats[f] for f in STAT_FIELDS]
    return table


def batch_stats(arrays) -> dict:
    """stats_table as arrays by field (one entry per tensor; the counts as int64)."""
    table = stats_table(arrays)
    return {f: table[:, j].astype(np.int64) if f.endswith("_count") else table[:, j]
            for j, f in enumerate(STAT_FIELDS)}


def table_text(table: np.ndarray) -> list:
    """Per row of a statistics table (its first seven columns: STAT_FIELDS' order) its index
    fields: the floats with 17 significant digits (they read back exactly; repr's shortest
    digits cost as much to find, and the C module formats these without the GIL), the
    counts as ints."""
    rows = table[:, :7]
    if native.enabled():
        return native.stats_text(rows)
    return ["%.17g,%.17g,%.17g,%.17g,%d,%d,%d" % tuple(row) for row in rows.tolist()]


def stats_text(stats: dict) -> list:
    """table_text of batch_stats' result."""
    return table_text(np.column_stack([stats[f] for f in STAT_FIELDS]))


class SourceRows:
    """The statistics of a run's sources (its feeds and variables, the same arrays' kinds from
    run to run) into their rows of a table ((slots, 8) float64, stats_row's numbers): the C
    module takes them all in one call, their kinds worked out again only when an array is
    not of the kind it had; what it does not take (bfloat16, strided arrays, all of them
    without the C module) goes through stats_row."""

    def __init__(self, table: np.ndarray, rows: np.ndarray):
        self.table, self.rows = table, rows
        self._kinds, self._other = None, []

    def fill(self, arrays) -> None:
        if native.enabled():
            if self._kinds is None or not native.stats_rows(arrays, self._kinds, self.table,
                                                            self.rows):
                kinds = [native.stats_kind(a) for a in arrays]
                self._kinds = "".join("." if k in (None, "b") else k for k in kinds)
                self._other = [i for i, k in enumerate(self._kinds) if k == "."]
                if not native.stats_rows(arrays, self._kinds, self.table, self.rows):
                    self._kinds, self._other = None, range(len(arrays))     # a strided one
            others = self._other
        else:
            self._kinds, others = None, range(len(arrays))
        for i in others:
            stats_row(arrays[i], self.table[self.rows[i]])
