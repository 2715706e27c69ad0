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


def is_cancellation(rows: pd.DataFrame, bad_out: pd.DataFrame) -> bool:
    """See the module doc; rows are one op's, bad_out its diverging outputs. Never for
    nan/inf outputs (those are real), other op types, or without the norms."""
    op_type = str(rows.OpType.iloc[0])
    if "GoldenNorm" not in rows or (bad_out.Verdict == "nan").any() or \
            op_type not in SUMS | PRODUCTS:
        return False
    norms = sorted(rows[rows.TensorIndex.str.contains(":input:", regex=False)].GoldenNorm.dropna(),
                   reverse=True)
    if not norms:
        return False
    bound = norms[0] if op_type in SUMS else float(np.prod(norms[:2]))
    tol = max(TOLERANCE.get(str(d), 1e-3) for d in rows.NpuDataType)
    return bool(bound > 0 and (bad_out.GoldenNorm <= tol * bound).all())


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

    @property
    def first_origin(self):
        return self.origins[0] if self.origins else None

    @property
    def noise_ops(self) -> Set[str]:
        return {d.op_name for d in self.cancellations}


def root_cause(table: pd.DataFrame, threshold: float = COSINE_THRESHOLD) -> RootCause:
    found = {"origin": [], "propagator": [], "cancellation": []}
    noise: Set[str] = set()          # golden tensors that hold cancellation noise
    ops = sorted(table.groupby("NPUDump", sort=False), key=lambda kv: kv[1].Index.min())
    for op_name, rows in ops:
        is_out = rows.TensorIndex.str.contains(":output:", regex=False)
        bad = diverging(rows, threshold)
        bad_out = rows[is_out & bad]
        if bad_out.empty:
            continue
        bad_in = rows[~is_out & bad]
        pass_name = rows.PassName.iloc[0]
        d = Divergence(op_name, str(rows.OpType.iloc[0]), int(rows.Index.min()),
                       pass_name if isinstance(pass_name, str) else "",
                       list(bad_out.TensorIndex), list(bad_in.TensorIndex))
        carries_noise = not bad_in.empty and "GoldenTensor" in rows and \
            set(bad_in.GoldenTensor) <= noise and (bad_out.Verdict != "nan").all()
        if carries_noise or (d.is_origin and is_cancellation(rows, bad_out)):
            kind = "cancellation"
            if "GoldenTensor" in rows:
                noise.update(bad_out.GoldenTensor)
        else:
            kind = "origin" if d.is_origin else "propagator"
        found[kind].append(d)
    return RootCause(found["origin"], found["propagator"], found["cancellation"])
