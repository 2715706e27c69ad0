"""Two tensors element by element (`cp`): which elements are out of tolerance, which differ
most, allclose, and the metrics, by the same definitions as vector compare.

Elements, one rule: a pair of finite values is within tolerance when |left - right| <= atol +
rtol * |right| (numpy's allclose); the same non-finite value on both sides (nan and nan, inf
and inf of one sign) is equal; any other pair with a nan or an inf is out of tolerance. The
metrics (cosine, max |error|...) are compare_tensors', over the finite pairs, exactly what
vc shows for the same tensors; how many elements they left out is said beside them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

import numpy as np

from .metrics import compare_tensors

FORMULA = "|left - right| > atol + rtol * |right|, or nan/inf on one side only"


@dataclass
class PairItem:
    index: int
    left: float
    right: float
    abs_error: float


@dataclass
class PairResult:
    left: str
    right: str
    elements: int
    atol: float
    rtol: float
    metrics: dict                    # compare_tensors' row: the same numbers as vc's
    error_count: int                 # out of tolerance, non-finite mismatches included
    nonfinite_mismatch: int          # nan/inf on one side only (or inf against -inf)
    nonfinite_equal: int             # the same nan/inf on both sides
    error_items: List[PairItem] = field(default_factory=list)   # first out of tolerance
    top_items: List[PairItem] = field(default_factory=list)     # largest finite errors
    formula: str = FORMULA

    @property
    def allclose(self) -> bool:
        return self.error_count == 0

    @property
    def error_ratio(self) -> float:
        """Out of tolerance over all elements; 0 for empty tensors."""
        return self.error_count / self.elements if self.elements else 0.0

    @property
    def cosine(self) -> float:
        return self.metrics["CosineSimilarity"]

    @property
    def max_abs_error(self) -> float:
        return self.metrics["MaxAbsoluteError"]

    @property
    def note(self) -> str:
        """Why a metric is nan or left elements out (compare_tensors' reason)."""
        return self.metrics.get("CompareFailReason", "") or ""

    def to_dict(self) -> dict:
        from dataclasses import asdict
        out = asdict(self)
        out.update(allclose=self.allclose, error_ratio=self.error_ratio, cosine=self.cosine,
                   max_abs_error=self.max_abs_error, note=self.note)
        return out


def compare_pair(left: np.ndarray, right: np.ndarray, atol: float = 1e-3, rtol: float = 1e-3,
                 items: int = 10, left_label: str = "left", right_label: str = "right") -> PairResult:
    """Two tensors of the same number of elements (compared flat, in float64)."""
    if atol < 0 or rtol < 0:
        raise ValueError(f"tolerances must be 0 or more (atol {atol}, rtol {rtol})")
    a = np.asarray(left, np.float64).reshape(-1)
    b = np.asarray(right, np.float64).reshape(-1)
    if a.size != b.size:
        raise ValueError(f"{a.size} elements against {b.size}")
    metrics = compare_tensors(a, b)
    finite = np.isfinite(a) & np.isfinite(b)
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(a - b)
        same_special = ~finite & ((a == b) | (np.isnan(a) & np.isnan(b)))
        bad = np.where(finite, err > atol + rtol * np.abs(b), ~same_special)
    out_of_tol = np.flatnonzero(bad)[:items]
    finite_err = np.where(finite, err, -1.0)
    top = np.argsort(-finite_err, kind="stable")[:min(items, int(finite.sum()))]

    def item(i):
        return PairItem(int(i), float(a[i]), float(b[i]), float(err[i]))
    return PairResult(left_label, right_label, int(a.size), atol, rtol, metrics,
                      int(bad.sum()), int((~finite & ~same_special).sum()),
                      int(same_special.sum()), [item(i) for i in out_of_tol],
                      [item(i) for i in top])
