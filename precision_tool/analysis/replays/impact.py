"""Which diverging op matters: the what-if replay of a step with one op's NPU outputs replaced
by the golden's.

The first op to diverge in execution order need not be what hurts: a bias gradient off by
1e-7 that nothing downstream feels starts a divergence all the same. For each candidate, the
step is replayed on the simulated NPU from its replay bundle with that op's outputs replaced
by the golden values (rounded to the op's output dtype: the best its kernel could do) and
the rest of the step computed from them; the golden reference is the same bundle replayed on
the golden executor, so both start from the NPU's own state. What the step produces is
measured against it: the fetched outputs (the loss) and the step's update of every variable
(new value less old: the step's contribution, not the weights it started from). A candidate's
impact is the share of that error its substitution removes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from ...dump import Workspace, load_bundle
from ...dump.workspace import Run
from ...errors import PrecisionToolError
from ... import numerics
from ...graph import dtypes, split_tensor_name
from ...runtime import Session, SessionConfig
from ..comparing.mapping import TensorMap


@dataclass
class StepError:
    """How far a replayed NPU step is from the golden replay of the same bundle."""
    output: float          # the largest relative error of a fetched float output (the loss)
    update: float          # relative error of all variables' updates taken together

    @property
    def total(self) -> float:
        return self.output + self.update


@dataclass
class Impact:
    op_name: str
    error: StepError               # with this op's outputs replaced by the golden's
    removed: float                 # share of the baseline's error that goes away (<= 1)


@dataclass
class ImpactRanking:
    baseline: StepError                        # the step replayed as it ran
    impacts: List[Impact] = field(default_factory=list)   # most removed first
    skipped: Dict[str, str] = field(default_factory=dict)  # op -> why it was not tried

    def of(self, op_name: str) -> Optional[Impact]:
        return next((i for i in self.impacts if i.op_name == op_name), None)


def _red(x: np.ndarray, y: np.ndarray) -> float:
    """Relative Euclidean distance, nan/inf counted as a full error."""
    x, y = np.asarray(x, np.float64).ravel(), np.asarray(y, np.float64).ravel()
    if x.size == 0:
        return 0.0
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        return 0.0 if np.array_equal(x, y, equal_nan=True) else 1.0
    ny = float(np.sqrt(np.dot(y, y)))
    d = float(np.sqrt(np.dot(x - y, x - y)))
    return d / ny if ny > 0 else (0.0 if d == 0 else 1.0)


def _run(sess: Session, bundle, extra=(), substitute=None):
    """The bundle's step on a session (compiled once, its variables loaded from the bundle
    anew each time): (fetched values by name, variables before, after)."""
    bundle.start(sess)
    before = sess.variables()
    fetched = bundle.run_step(sess, extra, substitute)
    return fetched, before, sess.variables()


def _error(npu, golden) -> StepError:
    values, before, after = npu
    g_values, g_before, g_after = golden
    outputs = [_red(values[k], g_values[k]) for k in values
               if np.asarray(values[k]).dtype.kind == "f" and k in g_values]
    names = sorted(after)
    update = _red(np.concatenate([np.ravel(after[n] - before[n]) for n in names] or [np.zeros(0)]),
                  np.concatenate([np.ravel(g_after[n] - g_before[n]) for n in names] or [np.zeros(0)]))
    return StepError(max(outputs, default=0.0), update)


def rank_by_impact(ws: Workspace, npu_run: Run, golden_run: Run, step: int,
                   candidates: List[str], limit: int = 8) -> ImpactRanking:
    """Replay the step once as it ran and once per candidate op (compiled NPU names, the
    first `limit`) with its outputs replaced by the golden's. Raises PrecisionToolError when
    the step has no replay bundle."""
    bundle = load_bundle(ws.bundle_path(npu_run, step))
    tmap = TensorMap(ws.compiled_graph(npu_run))
    wanted = {}                         # op -> {output: golden tensor}
    ranking_skipped = {}
    for op in candidates[:limit]:
        node = tmap.node(op)
        outs = {k: tmap.golden_tensor(f"{op}:{k}") for k in range(len(node.outputs))} \
            if node else {}
        outs = {k: g for k, g in outs.items() if g and _in_graph(bundle.graph, g)}
        if outs:
            wanted[op] = outs
        else:
            ranking_skipped[op] = "no golden tensor stands for its outputs"
    golden_cfg = SessionConfig(golden_dtype=golden_run.info.get("golden_dtype", "float32"))
    extra = sorted({g for outs in wanted.values() for g in outs.values()})
    golden = _run(bundle.session("cpu", golden_cfg), bundle, extra)
    npu = bundle.session("npu")
    baseline = _error(_run(npu, bundle), golden)
    ranking = ImpactRanking(baseline, skipped=ranking_skipped)
    for op, outs in wanted.items():
        unfit = _unfit(tmap.node(op), {k: golden[0][g] for k, g in outs.items()})
        if unfit:          # the substitution would hand on what the NPU made: it says nothing
            ranking.skipped[op] = unfit
            continue
        try:
            err = _error(_run(npu, bundle, substitute={
                op: {k: golden[0][g] for k, g in outs.items()}}), golden)
        except PrecisionToolError as e:
            ranking.skipped[op] = str(e)
            continue
        removed = 1.0 - err.total / baseline.total if baseline.total > 0 else 0.0
        ranking.impacts.append(Impact(op, err, removed))
    ranking.impacts.sort(key=lambda i: -i.removed)
    return ranking


def _unfit(node, values: Dict[int, np.ndarray]) -> str:
    """Why an op's golden outputs cannot be handed on in its own dtypes ("" when they can):
    rounded to them, they overflow to inf or 65504, or flush to zero, so the substitution
    is the NPU's own result and can neither clear nor acquit the op."""
    for k, value in values.items():
        dtype = node.outputs[k].get("dtype", "float32")
        if dtype not in ("float16", "bfloat16"):
            continue
        exact = np.asarray(value, np.float64)
        with np.errstate(invalid="ignore", over="ignore"):    # what the cast loses is the point
            rounded = exact.astype(dtypes.to_numpy(dtype)).astype(np.float64)
            lost = (~np.isfinite(rounded) & np.isfinite(exact)) | \
                (np.abs(rounded) >= numerics.FP16_MAX) & (np.abs(exact) > numerics.FP16_MAX) | \
                (rounded == 0) & (exact != 0)
        if lost.any():
            return (f"its golden output {k} does not fit {dtype} ({int(lost.sum())} of "
                    f"{lost.size} values overflow or flush to zero): handed on in that dtype it "
                    f"would be what the NPU made")
    return ""


def _in_graph(graph, tensor: str) -> bool:
    return split_tensor_name(tensor)[0] in graph
