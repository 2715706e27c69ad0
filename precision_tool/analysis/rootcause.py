"""Root cause: in execution order, the origin of a divergence is the first op whose inputs
match the golden and whose outputs do not; ops downstream whose inputs already diverged are
propagators (DESIGN §6).

Cancellation is neither. An op whose exact result is zero up to rounding noise diverges in
cosine without anything being wrong: attention's key-bias gradient is zero in exact
arithmetic, so both runs hold noise and their cosine is meaningless. The test, from the norm
inequalities: a sum's output is bounded by its largest input, a product's by the product of
its two largest inputs; when the golden output is no larger than the op's tolerance times
that bound, the output is cancellation noise. Ops whose only diverging inputs are such noise
(Adam turning the noisy gradient into full-size steps) are listed with the cancellations:
neither is a lead to follow.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Set

import numpy as np
import pandas as pd

from .compare import COSINE_THRESHOLD, TOLERANCE, diverging, statistics_only

SUMS = frozenset({"Add", "AddV2", "Sub", "AddN", "BiasAdd", "BiasAddGrad", "ReduceSum",
                  "ReduceMean", "SumToLike", "FusedEltwise"})
PRODUCTS = frozenset({"Mul", "MatMul", "MatMulV2", "BatchMatMul", "BatchMatMulV2", "Conv2D",
                      "Conv2DBackpropInput", "Conv2DBackpropFilter"})


class OpRows:
    """A result table's columns as Python lists, its divergence evaluated once for every row,
    and, in execution order, each op that has a diverging output as (name, row positions,
    execution order): what root cause and the summary walk, op by op (per-op pandas or numpy
    selections cost microseconds each, and a 100,000-row table has thousands of such ops)."""

    def __init__(self, table: pd.DataFrame, threshold: float):
        n = len(table)

        def col(name, default):
            return table[name].tolist() if name in table else [default] * n
        self.tensor = table.TensorIndex.astype(str).tolist()
        self.is_out = [":output:" in s for s in self.tensor]
        bad = diverging(table, threshold).to_numpy(dtype=bool)
        self.bad = bad.tolist()
        self.verdict = table.Verdict.tolist()
        self.op_type = table.OpType.astype(str).tolist()
        self.pass_name = col("PassName", "")
        self.golden_op = col("GroundTruth", "")
        self.has_golden = "GoldenTensor" in table
        self.golden_tensor = col("GoldenTensor", None)
        self.golden_norm = table.GoldenNorm.to_numpy(dtype=float).tolist() \
            if "GoldenNorm" in table else None
        self.dtype = col("NpuDataType", "")
        self.cosine = table.CosineSimilarity.to_numpy(dtype=float).tolist()
        # rows compared by their statistics only (a side dumped no tensor): no cosine
        self.stats_only = statistics_only(col("CompareFailReason", ""))
        self.norm_diff = col("NormRelativeDiff", float("nan"))
        self.ops = _diverging_ops(table.NPUDump.to_numpy(), table.Index.to_numpy(),
                                  bad & np.array(self.is_out, dtype=bool))


def _diverging_ops(names: np.ndarray, order: np.ndarray, bad_out: np.ndarray) -> list:
    """(name, row positions, execution order of its first row) of each op with a row in
    bad_out, sorted by that order; an op's rows in table order."""
    codes, uniques = pd.factorize(names, use_na_sentinel=False)   # a nan name too
    wanted = np.zeros(len(uniques), dtype=bool)
    wanted[codes[bad_out]] = True
    rows = np.flatnonzero(wanted[codes])
    rows = rows[np.argsort(codes[rows], kind="stable")]       # grouped by op, in table order
    starts = np.flatnonzero(np.r_[True, np.diff(codes[rows]) != 0])
    first = np.minimum.reduceat(order[rows], starts) if len(rows) else order[:0]
    groups = np.split(rows, starts[1:]) if len(rows) else []
    return [(uniques[codes[g[0]]], g.tolist(), f)
            for f, g in sorted(zip(first.tolist(), groups), key=lambda fg: fg[0])]


def is_cancellation(t: OpRows, rows: list, bad_out: list) -> bool:
    """See the module doc; rows are one op's positions, bad_out its diverging outputs'. Never
    for nan/inf outputs (those are real), other op types, or without the norms."""
    op_type = t.op_type[rows[0]]
    if t.golden_norm is None or any(t.verdict[i] == "nan" for i in bad_out) or \
            op_type not in SUMS | PRODUCTS:
        return False
    norms = sorted((v for v in (t.golden_norm[i] for i in rows if not t.is_out[i]) if v == v),
                   reverse=True)
    if not norms:
        return False
    bound = norms[0] if op_type in SUMS else norms[0] * (norms[1] if len(norms) > 1 else 1.0)
    tol = max(TOLERANCE.get(str(t.dtype[i]), 1e-3) for i in rows)
    return bound > 0 and all(t.golden_norm[i] <= tol * bound for i in bad_out)


@dataclass
class Divergence:
    op_name: str
    op_type: str
    order: int
    pass_name: str
    bad_outputs: List[str]
    bad_inputs: List[str] = field(default_factory=list)

    @property
    def is_origin(self) -> bool:
        return not self.bad_inputs


@dataclass
class RootCause:
    origins: List[Divergence]
    propagators: List[Divergence]
    cancellations: List[Divergence] = field(default_factory=list)   # and what only carries them
    rows: "OpRows" = field(default=None, repr=False, compare=False)   # what it was computed from

    @property
    def first_origin(self):
        return self.origins[0] if self.origins else None

    @property
    def noise_ops(self) -> Set[str]:
        return {d.op_name for d in self.cancellations}


def root_cause(table: pd.DataFrame, threshold: float = COSINE_THRESHOLD,
               rows: "OpRows" = None) -> RootCause:
    t = rows if rows is not None else OpRows(table, threshold)
    found = {"origin": [], "propagator": [], "cancellation": []}
    noise: Set[str] = set()          # golden tensors that hold cancellation noise
    for op_name, pos, order in t.ops:
        bad_out = [i for i in pos if t.bad[i] and t.is_out[i]]
        bad_in = [i for i in pos if t.bad[i] and not t.is_out[i]]
        pass_name = t.pass_name[pos[0]]
        d = Divergence(op_name, t.op_type[pos[0]], order,
                       pass_name if isinstance(pass_name, str) else "",
                       [t.tensor[i] for i in bad_out], [t.tensor[i] for i in bad_in])
        carries_noise = bool(bad_in) and t.has_golden and \
            all(t.golden_tensor[i] in noise for i in bad_in) and \
            all(t.verdict[i] != "nan" for i in bad_out)
        if carries_noise or (d.is_origin and is_cancellation(t, pos, bad_out)):
            kind = "cancellation"
            if t.has_golden:
                noise.update(t.golden_tensor[i] for i in bad_out)
        else:
            kind = "origin" if d.is_origin else "propagator"
        found[kind].append(d)
    return RootCause(found["origin"], found["propagator"], found["cancellation"], rows=t)
