"""The vector-compare summary (`vcs`): the ops whose output cosine falls under the threshold
(or whose output became nan/inf), one entry per op with the cosines of its inputs and
outputs, in execution order or by cosine."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
import pandas as pd

from .compare import COSINE_THRESHOLD, diverging
from .rootcause import RootCause, root_cause


@dataclass
class OpSummary:
    op_name: str
    op_type: str
    order: int                     # position of the op's first row in execution order
    golden_ops: List[str]
    pass_name: str
    input_cosines: List[float] = field(default_factory=list)
    output_cosines: List[float] = field(default_factory=list)
    # "under threshold"; "nan": the output holds nan/inf the golden lacks; "cancellation":
    # the golden output is cancellation noise, or only carries it (see rootcause)
    category: str = "under threshold"
    role: str = ""          # from root cause: origin, propagator or cancellation

    @property
    def is_finding(self) -> bool:
        return self.category != "cancellation"

    @property
    def worst_output(self) -> float:
        finite = [c for c in self.output_cosines if c == c]
        return min(finite) if finite else float("nan")


def summarize(table: pd.DataFrame, threshold: float = COSINE_THRESHOLD, limit: int = 3,
              by_cosine: bool = False, cause: Optional[RootCause] = None) -> List[OpSummary]:
    """Ops with an output under the threshold or with the 'nan' verdict; the first `limit`
    (all when limit <= 0), in execution order or, with by_cosine, worst first. Pass `cause`
    when the table's root cause is already at hand."""
    found = []
    cause = cause if cause is not None else root_cause(table, threshold)
    roles = {d.op_name: "origin" for d in cause.origins}
    roles.update({d.op_name: "propagator" for d in cause.propagators})
    roles.update({d.op_name: "cancellation" for d in cause.cancellations})
    noise = cause.noise_ops
    for op_name, rows in table.groupby("NPUDump", sort=False):
        outputs = rows[rows.TensorIndex.str.contains(":output:", regex=False)]
        if outputs.empty:
            continue
        under = diverging(outputs, threshold)
        nan = (outputs.Verdict == "nan").any()
        if not under.any():
            continue
        inputs = rows[rows.TensorIndex.str.contains(":input:", regex=False)]
        found.append(OpSummary(
            op_name=op_name, op_type=str(rows.OpType.iloc[0]), order=int(rows.Index.min()),
            golden_ops=sorted({g for g in outputs.GroundTruth if isinstance(g, str) and g}),
            pass_name=str(rows.PassName.iloc[0]) if "PassName" in rows and isinstance(rows.PassName.iloc[0], str) else "",
            input_cosines=[float(c) for c in inputs.CosineSimilarity],
            output_cosines=[float(c) for c in outputs.CosineSimilarity],
            category="nan" if nan else "cancellation" if op_name in noise else "under threshold",
            role=roles.get(op_name, "")))
    if by_cosine:
        found.sort(key=lambda s: (s.worst_output if s.worst_output == s.worst_output else -np.inf))
    else:
        found.sort(key=lambda s: s.order)
    return found if limit <= 0 else found[:limit]
