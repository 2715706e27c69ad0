"""Auto check (`ac`): one call that runs the fusion summary, the overflow analysis and, on
request, the vector compare with its summary and root cause, and says what to try next.
The result is plain data, serialisable to JSON (`to_dict`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .. import numerics
from ..dump import Workspace
from ..dump.workspace import Run
from .compare import COSINE_THRESHOLD, vector_compare, write_result
from .fusion import FusionReplayError, fired_passes
from .loss_scale import loss_scale_history
from .overflow import overflow_report
from .replay_op import ReplayOpError, replay_op
from .rootcause import root_cause
from .summary import summarize


@dataclass
class AutoCheck:
    npu_run: str
    golden_run: Optional[str]
    step: int
    fusion: Dict[str, int]                         # pass -> fused nodes
    overflows: List[dict]                          # in execution order, first first
    first_overflow: Optional[dict]
    loss_scale: Optional[dict] = None              # the run's history (loss_scale_history)
    under_threshold: List[dict] = field(default_factory=list)
    origin: Optional[dict] = None
    origin_replay: Optional[str] = None            # local / inherited / exact
    cancellations: List[str] = field(default_factory=list)   # ops whose divergence is noise
    result_file: Optional[str] = None              # the vector compare's CSV, if written

    @property
    def has_findings(self) -> bool:
        """An overflow, or an op under the threshold that is not cancellation noise."""
        return bool(self.overflows) or any(
            s["category"] != "cancellation" for s in self.under_threshold)
    advice: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def auto_check(ws: Workspace, npu_run: Optional[Run] = None, golden_run: Optional[Run] = None,
               step: Optional[int] = None, compare: bool = False,
               threshold: float = COSINE_THRESHOLD, limit: int = 3,
               write_csv: bool = False) -> AutoCheck:
    """With compare=True the vector compare runs too (written to temp/vector_compare when
    write_csv), its summary keeps `limit` ops (all when <= 0)."""
    npu_run = npu_run or ws.run("npu")
    complete = [s.step for s in npu_run.steps if s.complete]
    if step is None:
        step = complete[0] if complete else 0
    try:
        fusion = {p: len(nodes) for p, nodes in fired_passes(npu_run).items()}
    except FusionReplayError:
        fusion = {}
    report = overflow_report(ws, npu_run, step) if step in complete else None
    overflows = [_task(t) for t in (report.tasks if report else [])]
    first = _task(report.first) if report and report.first else None
    result = AutoCheck(npu_run.name, None, step, fusion, overflows, first)
    history = loss_scale_history(ws, npu_run)
    if history.steps:
        result.loss_scale = dataclasses.asdict(history)
    if compare:
        golden_run = golden_run or ws.run("cpu")
        result.golden_run = golden_run.name
        table = vector_compare(ws, npu_run, golden_run, step, threshold=threshold)
        if write_csv:
            result.result_file = write_result(ws, table)
        cause = root_cause(table, threshold)
        result.under_threshold = [dataclasses.asdict(s)
                                  for s in summarize(table, threshold, limit, cause=cause)]
        result.cancellations = sorted(cause.noise_ops)
        origin = cause.first_origin
        if origin is not None:
            result.origin = dataclasses.asdict(origin)
            try:
                result.origin_replay = replay_op(ws, npu_run, step, origin.op_name, golden_run).verdict
            except ReplayOpError as e:
                result.origin_replay = f"not replayed: {e}"
    result.advice = _advice(result)
    return result


def _task(t) -> dict:
    tensors = [{"io": r["io"], "index": int(r["index"]), "dtype": r["dtype"], "shape": r["shape"],
                "max": r["max"], "min": r["min"], "mean": r["mean"],
                "nan_count": int(r["nan_count"]),
                "inf_count": int(r["pos_inf_count"]) + int(r["neg_inf_count"])} for r in t.tensors]
    return {"op_name": t.op_name, "op_type": t.op_type, "task_id": t.task_id,
            "status": f"0x{t.status:x}", "status_bits": t.status_bits,
            "inputs_finite": t.inputs_finite, "tensors": tensors}


def _scales(history: Optional[dict]) -> set:
    """Every loss-scale value a run's history shows."""
    if not history or history["first_scale"] != history["first_scale"]:
        return set()
    return {history["first_scale"]} | {m[1] for m in history["moves"]}


def _advice(r: AutoCheck) -> str:
    o = r.origin
    if r.first_overflow is not None:
        op = r.first_overflow
        text = f"The first overflow is {op['op_name']} ({op['op_type']}, {', '.join(op['status_bits'])})"
        inputs = [t for t in op.get("tensors", []) if t["io"] == "input" and t["max"] == t["max"]]
        peak = max((max(abs(t["max"]), abs(t["min"])) for t in inputs), default=None)
        if peak is not None:
            text += f"; its inputs reach {peak:.6g}"
        text += ". "
        if peak is not None and peak > numerics.FP16_MAX and peak in _scales(r.loss_scale):
            return text + (f"That is the loss scale itself: {peak!r} does not fit in fp16, so "
                           f"each step overflows and is skipped until the dynamic manager has "
                           f"shrunk it below 65504. Start it lower (init_loss_scale 2**15 or "
                           f"less) and no step is lost.")
        if o is not None and o["op_name"] == op["op_name"] and o["pass_name"]:
            return text + (f"It is also where the divergence starts, fused by {o['pass_name']}. "
                           f"Confirm with the fusion-off replay (fo), then switch {o['pass_name']} off "
                           f"in fusion_switch.cfg, keep the op in fp32 (modify_mixlist black-list), or "
                           f"normalise what feeds it.")
        return text + ("Keep that op in fp32 (modify_mixlist black-list), or use dynamic loss "
                       "scaling if it is a gradient; the later overflows only carry it.")
    if o is not None:
        fused = f", fused by {o['pass_name']}" if o["pass_name"] else ""
        what = {"local": "its own numerics", "inherited": "error it inherited",
                "exact": "nothing measurable"}.get(r.origin_replay or "", "an undetermined cause")
        step = (f"Switch {o['pass_name']} off in fusion_switch.cfg and compare again, or run the "
                f"fusion-off replay (fo) to confirm it." if o["pass_name"] else
                "Keep this op in fp32 (modify_mixlist) and compare again.")
        return (f"The divergence starts at {o['op_name']} ({o['op_type']}{fused}); its single-op "
                f"replay points at {what}. {step}")
    if r.golden_run is not None and r.cancellations:
        return (f"Nothing overflowed, and the only ops under the threshold compute a result that "
                f"is zero up to rounding noise in both runs (cancellation, e.g. "
                f"{r.cancellations[0]}): precision looks sound.")
    if r.golden_run is not None:
        return "No op falls under the threshold and nothing overflowed: precision looks sound."
    return "Nothing overflowed. Dump the golden run too and add -c to compare every op."
