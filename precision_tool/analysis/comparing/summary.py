"""The vector-compare summary (`vcs`): the ops with a diverging output (verdicts.judge: under
the cosine threshold, a norm apart, clipped at 65504, flushed to zero, nan/inf...), one entry
per op with the cosines of its inputs and outputs and what decided, in execution order or by
cosine."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, List, Optional

import numpy as np

from ..diagnosis.rootcause import OpRows, RootCause, root_cause
from .verdicts import NONFINITE

if TYPE_CHECKING:
    from ...dump import Workspace
    from .result import Coverage

NO_EFFECT = "no effect"
GRADUAL = "gradual"
BENIGN = ("cancellation", NO_EFFECT, GRADUAL)        # the categories that are no finding


@dataclass
class OpSummary:
    op_name: str
    op_type: str
    order: int                     # position of the op's first row in execution order
    golden_ops: List[str]
    pass_name: str
    input_cosines: List[float] = field(default_factory=list)
    output_cosines: List[float] = field(default_factory=list)
    # compared by statistics only (a side dumped no tensor): no cosines; the relative
    # differences of the norms instead, in the same order
    statistics_only: bool = False
    input_norm_diffs: List[float] = field(default_factory=list)
    output_norm_diffs: List[float] = field(default_factory=list)
    # per output: what decided its verdict ("norm -94.1%; 32 at 65504"), "" where it passes
    output_reasons: List[str] = field(default_factory=list)
    # per output: why a metric is undefined or left elements out (CompareFailReason: "npu
    # tensor is all zero", "3 non-finite element(s) left out"), "" where nothing is
    output_notes: List[str] = field(default_factory=list)
    input_notes: List[str] = field(default_factory=list)    # why an input was not compared
    # "diverging"; "nonfinite": an output holds nan/inf the golden lacks;
    # "cancellation": the golden output is cancellation noise, or only carries it;
    # "carried": only variables read at the start of the step diverge among its inputs;
    # "no effect": its divergence reaches no output, loss or update (root cause);
    # "gradual": it crosses the threshold with what came in just under it (root cause)
    category: str = "diverging"
    # from root cause: origin, propagator, cancellation, carried, no effect or gradual
    role: str = ""

    @property
    def is_finding(self) -> bool:
        return self.category not in BENIGN

    @property
    def worst_output(self) -> float:
        finite = [c for c in self.output_cosines if c == c]
        return min(finite) if finite else float("nan")


def summarize(table, threshold=None, limit: int = 3,
              by_cosine: bool = False, cause: Optional[RootCause] = None,
              noise_last: bool = False) -> List[OpSummary]:
    """Ops with a diverging output under the criteria (`threshold`: verdicts.Criteria, or a
    cosine threshold); the first `limit`
    (all when limit <= 0), in execution order or, with by_cosine, worst first, and with
    noise_last the cancellation noise after the findings. Pass `cause` when the table's root
    cause is already at hand (computed with the same threshold). Only the ops returned are
    summarised: a 100,000-row table has thousands, and vcs shows a few."""
    t, cause = _rows_and_cause(table, threshold, cause)
    ops = list(zip(t.ops, _categories(t, cause)))  # the ops with a diverging output, in order
    if by_cosine:
        ops.sort(key=lambda oc: _worst_output(t, oc[0][1]))
    if noise_last:
        ops.sort(key=lambda oc: oc[1] in BENIGN)
    roles = {d.op_name: "origin" for d in cause.origins}
    roles.update({d.op_name: "propagator" for d in cause.propagators})
    roles.update({d.op_name: "cancellation" for d in cause.cancellations})
    roles.update({d.op_name: "carried" for d in cause.carried})
    roles.update({d.op_name: NO_EFFECT for d in cause.no_effect})
    roles.update({d.op_name: GRADUAL for d in cause.gradual})
    shown = ops if limit <= 0 else ops[:limit]
    t.reasons([i for (_, pos, _), _ in shown for i in _outputs(t, pos)])   # in one pass
    return [_summary(t, op, category, roles) for op, category in shown]


@dataclass
class VectorSummary:
    """What `vcs` says of one compare result: its file, the criteria, which runs and step it
    compares (None: the result has no record of it), why it is out of date (None: it is
    not), whether it was judged by statistics only, how many ops diverge, what the compare
    covered, the origin of the divergence and the ops shown."""
    file: str
    criteria: dict
    compares: Optional[str]
    stale: Optional[str]
    statistics_only: bool
    diverging_ops: int
    coverage: "Coverage"
    origin: Optional[str]
    ops: List[OpSummary]

    def to_dict(self) -> dict:
        return asdict(self)


def summarize_result(ws: "Workspace", path: str, criteria, limit: int = 3,
                     by_cosine: bool = False) -> VectorSummary:
    """The summary of the compare result at path (a vc CSV) under the criteria
    (verdicts.Criteria): its diverging ops, origin first (summarize, cancellation noise
    last), and whether it still describes the workspace (result.staleness)."""
    from .result import coverage, read_provenance, read_result, staleness
    table = read_result(path)
    provenance = read_provenance(path)
    cause = root_cause(table, criteria)
    ops = summarize(table, criteria, limit=limit, by_cosine=by_cosine, cause=cause,
                    noise_last=True)
    origin = cause.first_origin
    return VectorSummary(path, criteria.to_dict(),
                         provenance.describes() if provenance else None,
                         None if provenance is None else staleness(ws, provenance),
                         cause.rows.by_statistics, count_findings(table, criteria, cause),
                         coverage(table), origin.op_name if origin else None, ops)


def count_findings(table, threshold=None,
                   cause: Optional[RootCause] = None) -> int:
    """How many ops summarize would list as findings (all but cancellation noise)."""
    t, cause = _rows_and_cause(table, threshold, cause)
    return sum(c not in BENIGN for c in _categories(t, cause))


def _rows_and_cause(table, threshold, cause):
    """The table's rows and root cause (the cause's own rows when it has them)."""
    t = cause.rows if cause is not None and cause.rows is not None else OpRows(table, threshold)
    return t, cause if cause is not None else root_cause(table, threshold, rows=t)


def _outputs(t: OpRows, pos: list) -> list:
    return [i for i in pos if t.is_out[i]]


def _categories(t: OpRows, cause: RootCause) -> List[str]:
    """Per op of t.ops: "nonfinite" when an output holds nan/inf the golden lacks (whatever
    else), "cancellation" when it is noise, "no effect" when its divergence reaches nothing,
    "gradual" when it crosses with what came in, else "diverging". Made once per root cause
    (the summary and the count of findings both ask, over thousands of ops)."""
    if cause.categories is None or cause.rows is not t:
        noise, quiet, verdict, is_out = cause.noise_ops, cause.no_effect_ops, t.verdict, t.is_out
        gradual = cause.gradual_ops
        cause.categories = [
            NONFINITE if any(verdict[i] == NONFINITE for i in pos if is_out[i]) else
            "cancellation" if name in noise else NO_EFFECT if name in quiet else
            GRADUAL if name in gradual else "diverging"
            for name, pos, _ in t.ops]
    return cause.categories


def _worst_output(t: OpRows, pos: list) -> float:
    """The lowest finite output cosine (OpSummary.worst_output); -inf when none is, so that
    such ops sort first."""
    finite = [c for c in (t.cosine[i] for i in _outputs(t, pos)) if c == c]
    return min(finite) if finite else -np.inf


def _summary(t: OpRows, op: tuple, category: str, roles: dict) -> OpSummary:
    op_name, pos, order = op
    outputs = _outputs(t, pos)
    pass_name = t.pass_name[pos[0]]
    inputs = [i for i in pos if not t.is_out[i]]
    return OpSummary(
        op_name=op_name, op_type=t.op_type[pos[0]], order=order,
        golden_ops=sorted({g for g in (t.golden_op[i] for i in outputs) if isinstance(g, str) and g}),
        pass_name=pass_name if isinstance(pass_name, str) else "",
        input_cosines=[t.cosine[i] for i in inputs],
        output_cosines=[t.cosine[i] for i in outputs],
        category=category, role=roles.get(op_name, ""),
        statistics_only=all(t.stats_only[i] for i in outputs),
        input_norm_diffs=[float(t.norm_diff[i]) for i in inputs],
        output_norm_diffs=[float(t.norm_diff[i]) for i in outputs],
        output_reasons=t.reasons(outputs),
        output_notes=_notes(t, outputs), input_notes=_notes(t, inputs))


def _notes(t: OpRows, rows: list) -> list:
    return [t.fail_reason[i] if isinstance(t.fail_reason[i], str) else "" for i in rows]
