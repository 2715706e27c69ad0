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

from .compare import COSINE_THRESHOLD, TOLERANCE, diverging

SUMS = frozenset({"Add", "AddV2", "Sub", "AddN", "BiasAdd", "BiasAddGrad", "ReduceSum",
                  "ReduceMean", "SumToLike", "FusedEltwise"})
PRODUCTS = frozenset({"Mul", "MatMul", "MatMulV2", "BatchMatMul", "BatchMatMulV2", "Conv2D",
                      "Conv2DBackpropInput", "Conv2DBackpropFilter"})


class OpRows:
    """A result table's columns as numpy arrays, its divergence evaluated once for every row,
    and the row positions of each op that has a diverging output, in execution order: what
    root cause and the summary walk (per-op pandas selections made a 100,000-row table take
    minutes)."""

    def __init__(self, table: pd.DataFrame, threshold: float):
        def col(name, default):
            return table[name].to_numpy() if name in table else np.full(len(table), default, object)
        self.name = table.NPUDump.to_numpy()
        self.tensor = table.TensorIndex.astype(str).to_numpy()
        self.is_out = table.TensorIndex.astype(str).str.contains(":output:", regex=False).to_numpy()
        self.bad = diverging(table, threshold).to_numpy(dtype=bool)
        self.verdict = table.Verdict.to_numpy()
        self.order = table.Index.to_numpy()
        self.op_type = table.OpType.astype(str).to_numpy()
        self.pass_name = col("PassName", "")
        self.golden_op = col("GroundTruth", "")
        self.has_golden = "GoldenTensor" in table
        self.golden_tensor = col("GoldenTensor", None)
        self.golden_norm = table.GoldenNorm.to_numpy(dtype=float) if "GoldenNorm" in table else None
        self.dtype = col("NpuDataType", "")
        self.cosine = table.CosineSimilarity.to_numpy(dtype=float)
        groups = table.groupby("NPUDump", sort=False).indices if len(table) else {}
        bad_ops = set(self.name[self.bad & self.is_out])
        ordered = bool(np.all(np.diff(self.order) >= 0)) if len(table) else True
        self.first = ((lambda pos: int(self.order[pos[0]])) if ordered else
                      (lambda pos: int(self.order[pos].min())))    # an op's execution order
        self.ops = sorted(((n, groups[n]) for n in bad_ops), key=lambda kv: self.first(kv[1]))


def is_cancellation(t: OpRows, rows: np.ndarray, bad_out: np.ndarray) -> bool:
    """See the module doc; rows are one op's positions, bad_out its diverging outputs'. Never
    for nan/inf outputs (those are real), other op types, or without the norms."""
    op_type = t.op_type[rows[0]]
    if t.golden_norm is None or (t.verdict[bad_out] == "nan").any() or \
            op_type not in SUMS | PRODUCTS:
        return False
    inputs = rows[~t.is_out[rows]]
    norms = sorted((v for v in t.golden_norm[inputs] if v == v), reverse=True)
    if not norms:
        return False
    bound = norms[0] if op_type in SUMS else float(np.prod(norms[:2]))
    tol = max(TOLERANCE.get(str(d), 1e-3) for d in t.dtype[rows])
    return bool(bound > 0 and (t.golden_norm[bad_out] <= tol * bound).all())


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
    for op_name, pos in t.ops:
        out = t.is_out[pos]
        bad = t.bad[pos]
        bad_out, bad_in = pos[out & bad], pos[~out & bad]
        pass_name = t.pass_name[pos[0]]
        d = Divergence(op_name, t.op_type[pos[0]], t.first(pos),
                       pass_name if isinstance(pass_name, str) else "",
                       list(t.tensor[bad_out]), list(t.tensor[bad_in]))
        carries_noise = len(bad_in) > 0 and t.has_golden and \
            set(t.golden_tensor[bad_in]) <= noise and (t.verdict[bad_out] != "nan").all()
        if carries_noise or (d.is_origin and is_cancellation(t, pos, bad_out)):
            kind = "cancellation"
            if t.has_golden:
                noise.update(t.golden_tensor[bad_out])
        else:
            kind = "origin" if d.is_origin else "propagator"
        found[kind].append(d)
    return RootCause(found["origin"], found["propagator"], found["cancellation"], rows=t)
