"""Lost updates: what each update op changed, against what the golden's changed.

A weight of 0.25 held in bf16 has an ulp of 2^-9: a step of 1e-4 rounds away, and the value
the update writes equals the value it read. Compared as values, such a weight matches the
golden's to three digits step after step while the model stops learning, so the effect of an
update is its change: new minus old, in the variable's own dtype on each side. An update
loses its step where the golden's change is non-zero but under an ulp of the NPU's weight
and the NPU's change is exactly zero. It is a finding by its effect: when the energy lost
(the share of the golden change's sum of squares) brings the cosine of the two changes under
the criteria's (lost > 1 - cosine^2, 3.96% at 0.98), as vc judges any tensor; many tiny
steps lost (weights whose gradient is near zero) are not. The share of elements that did
not move is reported with it. A
larger golden step the NPU did not take was lost before the update (a flushed gradient, a
step skipped on overflow): that is the compare's finding, not a rounding loss. So is any
stall of a variable the NPU holds as finely as the golden does (an fp32 Adam moment on both
sides): the same rounding stalls it on both, and where only the NPU's stalled, what it
added differed (a gradient's rounding noise), which is no loss of the update's own.

The tensors are the update op's dumped input (the variable it read) and output (what it
wrote), on both sides. A statistics-only step has none: its index rows still show an update
lost whole (the same statistics before and after), never a partial loss, and the check says
how many updates it saw only so.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

from ...dump import Workspace
from ...dump.workspace import Run
from ...errors import GraphError, PrecisionToolError
from ...graph import dtypes
from ...ops import registry
from ..comparing.verdicts import Criteria


@dataclass
class LostUpdate:
    op_name: str                 # the update op
    variable: str                # the tensor it overwrites (the golden's name)
    dtype: str                   # the variable's dtype on the NPU
    moved: int                   # elements the golden's update changed
    stalled: int                 # of those, the ones the NPU's update left unchanged
    energy: float                # the share of the golden change's sum of squares lost
    # seen in the index's statistics only: unchanged on the NPU, changed in the golden (moved
    # and stalled are then the variable's size: how many the golden moved is not known)
    by_statistics: bool = False

    @property
    def share(self) -> float:
        return self.stalled / self.moved if self.moved else 0.0


@dataclass
class UpdateCheck:
    lost: List[LostUpdate] = field(default_factory=list)   # over the criteria, worst first
    checked: int = 0                                       # updated variables compared
    by_statistics: int = 0         # of those, by their statistics (only a whole loss shows)
    unseen: List[str] = field(default_factory=list)        # updates with nothing to read

    @property
    def partial(self) -> bool:
        """Whether some update could not be checked element by element."""
        return bool(self.by_statistics or self.unseen)

    def to_dict(self) -> dict:
        return {"checked": self.checked, "by_statistics": self.by_statistics,
                "unseen": self.unseen[:5],
                "unseen_count": len(self.unseen),
                "lost": [dict(op_name=u.op_name, variable=u.variable, dtype=u.dtype,
                              moved=u.moved, stalled=u.stalled, share=u.share,
                              energy=u.energy, by_statistics=u.by_statistics)
                         for u in self.lost]}


STATS = ("max", "min", "mean", "l2norm")


def _rows(index) -> dict:
    """(op name, io, index) -> (file, dtype, tensor, shape, statistics) of a step's index (a
    table.Table: the workspace's own, read once, no DataFrame made)."""
    cols = [index[c].tolist() for c in ("op_name", "io", "index", "file", "dtype", "tensor",
                                        "shape")]
    stats = list(zip(*(index[c].tolist() for c in STATS)))
    return {(op, io, int(k)): (f, dt, t, shape, st)
            for (op, io, k, f, dt, t, shape), st in zip(zip(*cols), stats)}


def check_updates(ws: Workspace, npu_run: Run, golden_run: Run, step: int, criteria=None,
                  skip=frozenset()) -> UpdateCheck:
    """Every update op of the step dumped on both sides (skip: ops whose divergence is
    noise, e.g. an update from a gradient that is zero up to rounding). Where a side dumped
    statistics only, an update is checked by them: unchanged statistics where the golden's
    changed are an update lost whole; a partial loss does not show (by_statistics counts
    those updates, so that the answer can say so)."""
    criteria = Criteria.of(criteria)
    index = ws.index_table(npu_run, step)
    types = dict(zip(index["op_name"].tolist(), index["op_type"].tolist()))
    npu, golden = _rows(index), _rows(ws.index_table(golden_run, step))
    out = UpdateCheck()
    ops = {}
    for (op, io, k) in npu:
        if io == "output":
            continue
        updates = registry.updated_inputs(types.get(op, ""))
        if updates and k in updates and op not in skip and \
                (registry.REGISTRY.get(types.get(op, "")) is not None or
                 _writes_state(npu[(op, io, k)][2], types, npu)):
            ops.setdefault(op, []).append((k, list(updates).index(k)))
    for op, pairs in ops.items():
        for k, j in pairs:
            ends = [side.get((op, io, n)) for side in (npu, golden)
                    for io, n in (("input", k), ("output", j))]
            if any(e is None for e in ends):
                out.unseen.append(op)
                continue
            if not all(e[0] for e in ends):
                lost = _lost_by_statistics(op, *ends)
                out.by_statistics += 1
            else:
                try:
                    old, new = (ws.load(npu_run, step, e[0], e[3]) for e in ends[:2])
                    g_old, g_new = (ws.load(golden_run, step, e[0], e[3]) for e in ends[2:])
                except (PrecisionToolError, OSError, ValueError):
                    out.unseen.append(op)
                    continue
                if old.shape != new.shape or g_old.shape != g_new.shape or \
                        old.size != g_old.size:
                    out.unseen.append(op)
                    continue
                lost = _lost(op, ends[0][2], ends[0][1], old, new, g_old, g_new,
                             golden_dtype=ends[2][1])
            out.checked += 1
            if lost is not None and lost.energy > 1.0 - criteria.cosine ** 2:
                out.lost.append(lost)
    out.lost.sort(key=lambda u: -u.share)
    return out


def _writes_state(tensor: str, types: dict, rows: dict, depth: int = 0) -> bool:
    """Whether what a script's in-place call (Tensor.add_, a type no registry entry has:
    a graph's update ops always update variables) overwrites is state: a Variable, or what an in-place call left in
    one (AdamW's param.mul_ before param.addcdiv_): an in-place call on a temporary (Adam's
    denom.add_(eps)) updates nothing that lasts."""
    producer = tensor.rpartition(":")[0]
    op_type = types.get(producer, "")
    if op_type == "Variable":
        return True
    if depth > 64 or not registry.updated_inputs(op_type):
        return False
    before = rows.get((producer, "input", 0))
    return before is not None and _writes_state(before[2], types, rows, depth + 1)


def _coarser(dtype: str, golden_dtype: str) -> bool:
    """Whether a float dtype holds fewer significant bits than the golden's (an unknown or
    non-float name: True, the update is looked at)."""
    try:
        a, b = (np.finfo(dtypes.to_numpy(str(d))).nmant for d in (dtype, golden_dtype))
    except (GraphError, TypeError, ValueError):
        return True
    return a < b


def _lost_by_statistics(op, old, new, g_old, g_new) -> Optional[LostUpdate]:
    """An update lost whole, as the index rows show it: the NPU's variable has the same
    statistics before and after, the golden's do not (nan statistics decide nothing)."""
    def same(a, b):
        return all(x == y for x, y in zip(a[4], b[4]))
    known = all(v == v for e in (old, new, g_old, g_new) for v in e[4])
    if not _coarser(old[1], g_old[1]) or not known or not same(old, new) or same(g_old, g_new):
        return None
    n = int(np.prod([int(d) for d in str(old[3]).split()])) if str(old[3]).strip() else 1
    return LostUpdate(op, old[2], str(old[1]), n, n, 1.0, by_statistics=True)


def _lost(op, variable, dtype, old, new, g_old, g_new,
          golden_dtype: Optional[str] = None) -> Optional[LostUpdate]:
    """Where the golden moved by less than an ulp of the NPU's weight and the NPU did not
    move (changes as each side stored them: a variable in bf16 holds bf16 numbers, so new -
    old is its real change). A golden step of an ulp or more that the NPU did not take was
    lost before the update (a gradient flushed to zero, a step skipped on overflow): the
    compare of those tensors says so, and it is no rounding loss of the update's own.
    Nor is anything where the NPU's dtype is not coarser than the golden's (None)."""
    if golden_dtype is not None and not _coarser(dtype, golden_dtype):
        return None
    old = np.asarray(old).ravel()
    change = np.asarray(new, np.float64).ravel() - old.astype(np.float64)
    g_change = np.asarray(g_new, np.float64).ravel() - np.asarray(g_old, np.float64).ravel()
    finite = np.isfinite(change) & np.isfinite(g_change)
    moved = finite & (g_change != 0)
    if not moved.any():
        return None               # the golden did not move it either (a skipped step)
    try:                          # the ulp of the weight in the dtype the NPU holds it in
        held = old.astype(dtypes.to_numpy(dtype))
    except (GraphError, TypeError, ValueError):
        held = old
    with np.errstate(invalid="ignore"):
        ulp = np.abs(np.spacing(held)).astype(np.float64) if dtypes.category(held.dtype) == \
            "float" else np.zeros(old.shape)
    stalled = moved & (change == 0) & (np.abs(g_change) < ulp)
    energy = float(np.dot(g_change[stalled], g_change[stalled]) /
                   np.dot(g_change[moved], g_change[moved]))
    return LostUpdate(op, variable, str(dtype), int(moved.sum()), int(stalled.sum()), energy)
