"""Root cause: in execution order, the origin of a divergence is the first op whose inputs
match the golden and whose outputs do not; ops downstream whose inputs already diverged are
propagators (DESIGN §6)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

import pandas as pd

from .compare import COSINE_THRESHOLD


def _bad(rows: pd.DataFrame, threshold: float) -> pd.Series:
    """Rows that diverge: cosine under the threshold, or nan/inf the golden lacks. Rows with
    nothing to compare against (NPU-only) or a defined-equal nan cosine do not count."""
    return (rows.CosineSimilarity < threshold) | (rows.Verdict == "nan") | \
           ((rows.Verdict == "fail") & rows.CosineSimilarity.isna())


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

    @property
    def first_origin(self):
        return self.origins[0] if self.origins else None


def root_cause(table: pd.DataFrame, threshold: float = COSINE_THRESHOLD) -> RootCause:
    origins, propagators = [], []
    for op_name, rows in table.groupby("NPUDump", sort=False):
        is_out = rows.TensorIndex.str.contains(":output:", regex=False)
        bad = _bad(rows, threshold)
        bad_out = rows[is_out & bad]
        if bad_out.empty:
            continue
        d = Divergence(op_name, str(rows.OpType.iloc[0]), int(rows.Index.min()),
                       str(rows.PassName.iloc[0]) if isinstance(rows.PassName.iloc[0], str) else "",
                       list(bad_out.TensorIndex), list(rows[~is_out & bad].TensorIndex))
        (origins if d.is_origin else propagators).append(d)
    origins.sort(key=lambda d: d.order)
    propagators.sort(key=lambda d: d.order)
    return RootCause(origins, propagators)
