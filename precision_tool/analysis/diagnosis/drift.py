"""Drift: two runs that part over many steps while no step of the NPU's computes wrongly.

Each step of a training starts from the state the step before left. Rounding that the
criteria pass at every step still moves the NPU's weights off the golden's, a little each
step, and a training's own dynamics can amplify that (a large learning rate: two fp32 runs
that sum in another order part too). Then a late step diverges from the golden run with no
op to blame: its inputs, the state, already differ. What decides it is a replay of that step
from the NPU's own state (its replay bundle) on both executors: if the NPU's step then
matches the golden's, the step is sound and the divergence is the state's, accumulated.

Two views of it: `state_drift` follows each variable's distance from the golden's (the
relative Euclidean distance of what the step read) over the dumped steps, and `loss_gap`
sets the two runs' losses side by side from their step histories, which cover every step
observed, dumped or not.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import numpy as np
import pandas as pd

from ...dump import Workspace
from ...dump.workspace import Run


@dataclass
class LossGap:
    """The two runs' losses at the steps both observed (from their step histories)."""
    steps: int                           # steps with a loss in both
    first_off: Optional[int] = None      # the first step whose loss differs beyond the tolerance
    worst_step: Optional[int] = None
    worst: float = 0.0                   # the largest relative difference
    last_step: Optional[int] = None
    last: float = 0.0                    # the relative difference at the last common step

    def to_dict(self) -> dict:
        return asdict(self)


def loss_gap(ws: Workspace, npu_run: Run, golden_run: Run, tolerance: float) -> LossGap:
    """Where the NPU's loss leaves the golden's by more than `tolerance` (relative to the
    golden's loss; a golden loss of 0 takes the absolute difference)."""
    a, b = ws.step_history(npu_run), ws.step_history(golden_run)
    both = a[["step", "loss"]].merge(b[["step", "loss"]], on="step", suffixes=("_npu", "_golden"))
    both = both.dropna()
    out = LossGap(len(both))
    if both.empty:
        return out
    x, y = both.loss_npu.to_numpy(np.float64), both.loss_golden.to_numpy(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(y != 0, np.abs(x - y) / np.abs(y), np.abs(x - y))
    rel = np.where(np.isfinite(x) == np.isfinite(y), np.nan_to_num(rel, nan=0.0), np.inf)
    steps = both.step.to_numpy()
    off = np.flatnonzero(rel > tolerance)
    k = int(np.argmax(rel))
    out.first_off = int(steps[off[0]]) if off.size else None
    out.worst_step, out.worst = int(steps[k]), float(rel[k])
    out.last_step, out.last = int(steps[-1]), float(rel[-1])
    return out


@dataclass
class StateDrift:
    """How far each variable the step read is from the golden's, step by step."""
    step: int
    # the variables furthest from the golden's at `step`, worst first: name, its distance
    # there, and at each dumped step before it
    variables: List[dict] = field(default_factory=list)


def state_distances(table: pd.DataFrame) -> Dict[str, float]:
    """Each variable's relative Euclidean distance from the golden's as a step read it (the
    largest over the ops that read it; rows without a number left out)."""
    if "GoldenOpType" not in table or table.empty:
        return {}
    reads = table[(table.GoldenOpType.astype(str) == "Variable") &
                  table.TensorIndex.astype(str).str.contains(":input:")]
    dist = pd.to_numeric(reads.RelativeEuclideanDistance, errors="coerce")
    grouped = dist.groupby(reads.GoldenTensor.astype(str)).max().dropna()
    return {str(k): float(v) for k, v in grouped.items()}


def state_drift(tables: Dict[int, pd.DataFrame], step: int, shown: int = 3) -> StateDrift:
    """The variables furthest from the golden's when `step` starts, with their distance at
    each earlier step compared (tables: compare tables by step)."""
    out = StateDrift(step)
    now = state_distances(tables[step])
    history = {s: state_distances(t) for s, t in sorted(tables.items()) if s < step}
    for name, d in sorted(now.items(), key=lambda kv: -kv[1])[:shown]:
        before = {s: h[name] for s, h in history.items() if name in h}
        out.variables.append({"variable": name, "distance": d, "before": _spread(before)})
    return out


def _spread(series: Dict[int, float], most: int = 10) -> Dict[int, float]:
    """At most `most` points of a series by step, evenly spread, the first and last kept."""
    steps = sorted(series)
    if len(steps) <= most:
        return series
    keep = {steps[round(i * (len(steps) - 1) / (most - 1))] for i in range(most)}
    return {s: series[s] for s in steps if s in keep}
