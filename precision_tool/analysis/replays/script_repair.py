"""`fix` for a PyTorch script's run: the fewest calls kept in fp32 that make the dumped step
match the golden and keep the loss with the golden's at every step of the script.

A graph run replays its step from a bundle; a script's step is the script's own code, which
nothing here can call on its own (the loop body is not a function). So each candidate is a
rerun of the script (torch-run's way: same seed, same arguments, the NPU target only, the
dumped step dumped), which makes every trial its own proof: the rerun trains every step the
script trains, and its losses are held to the golden's step by step. The cost is one run of
the script per trial; the search keeps trials few.

Candidates come from the step's finding, as ac -c judges it: the APIs of the calls that
overflowed (first first), the APIs of the origins, then the origin's module (every call in
it). Each is tried alone; if none is enough, all of them together, then the set is cut down
one at a time while it still passes; if even that fails, every kernel in fp32 (force_fp32):
what passes then says precision is the cause but no cheaper fix was found. Needs no torch:
the reruns are child processes."""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional

from ...dump import Workspace
from ...dump.run import Run
from ...errors import WorkspaceError
from ...runtime.npu.fusion import PASSES
from ...fileio import jsonable, write_text_atomic
from ..autocheck import judge_step, own_from_npu_state, starts_drifted
from ..diagnosis.rootcause import call_name
from ..diagnosis.scale_history import calibration, loss_scale_history
from ..diagnosis.steps import check_steps
from .fusion_bisect import failing
from .script_rerun import ScriptRerunError, rerun_script

CONFIG_DIR = "config"
ALL_FP32 = "force_fp32"


class ScriptRepairError(ScriptRerunError):
    """A script's run that fix cannot rerun (not made by torch-run, no golden...)."""


@dataclass
class Trial:
    """One rerun of the script: what it kept in fp32 under which mode, the run it wrote
    (deleted once judged unless it is the fix's), what failed in the dumped step and the
    largest relative loss error against the golden's over every step (nan: no loss)."""
    keep_fp32: List[str]
    precision_mode: str
    run: str = ""
    failing: List[str] = field(default_factory=list)
    loss_error: float = math.nan
    drift_step: Optional[int] = None       # the first step whose loss leaves the tolerance
    error: str = ""                        # why the rerun did not finish

    @property
    def passed(self) -> bool:
        return not self.error and not self.failing and self.drift_step is None

    fusion_off: List[str] = field(default_factory=list)    # passes switched off
    # under force_fp32: the failing tensors still fp16 or bf16 (the script's own dtype)
    script_low: List[str] = field(default_factory=list)

    def describe(self) -> str:
        kept = ", ".join(self.keep_fp32)
        if self.precision_mode == ALL_FP32:
            return "every kernel in fp32 (force_fp32)"
        parts = ([f"keep {kept} in fp32"] if kept else []) + \
            ([f"switch {', '.join(self.fusion_off)} off"] if self.fusion_off else [])
        return " and ".join(parts) or "as it ran"


@dataclass
class ScriptRepair:
    npu_run: str
    golden_run: str
    step: int
    script: List[str]
    rtol: float
    before: List[str] = field(default_factory=list)      # what fails in the dumped step
    candidates: List[str] = field(default_factory=list)
    trials: List[Trial] = field(default_factory=list)
    fix: Optional[Trial] = None
    minimal: bool = False
    golden_losses: List[float] = field(default_factory=list)
    fixed_losses: List[float] = field(default_factory=list)
    config: dict = field(default_factory=dict)           # what torch-run --fix applies
    files: List[str] = field(default_factory=list)
    unsaved: Optional[str] = None
    contents: dict = field(default_factory=dict)
    healthy: bool = False
    notes: List[str] = field(default_factory=list)

    @property
    def verified(self) -> bool:
        return self.healthy or self.fix is not None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["verified"] = self.verified
        for t, src in zip(d["trials"], self.trials):
            t["passed"] = src.passed
        if d["fix"] is not None:
            d["fix"]["passed"] = True
        return jsonable(d)


FUSION = "fusion:"      # a candidate that switches a fusion pass off, not a call kept in fp32


def split_items(items: List[str]) -> tuple:
    """A trial's candidates as (calls kept in fp32, passes switched off)."""
    return ([i for i in items if not i.startswith(FUSION)],
            [i[len(FUSION):] for i in items if i.startswith(FUSION)])


def _api(op_name: str) -> str:
    """Torch.matmul.0.forward -> Torch.matmul."""
    parts = op_name.split(".")
    return ".".join(parts[:-2]) if len(parts) > 3 else op_name


def candidates(ws: Workspace, npu: Run, c, step: int) -> List[str]:
    """What to keep in fp32, most likely first: the APIs of the overflowing calls and of
    the origins, then of the calls that read what they made (an overflow's inf goes on into
    them: a softmax over the scores), then every other API the step computed in fp16 or
    bf16, in execution order, and last the first origin's module (every call in it). A
    module named by its class is a whole model (the outermost called): force_fp32 says that."""
    firsts = [t.op_name for t in c.tasks] + [call_name(o.op_name) for o in c.cause.origins]
    table = ws.index_table(npu, step)
    ops, io, tensors, dtypes = (table[k].tolist() for k in ("op_name", "io", "tensor", "dtype"))
    made = {f"{op}:" for op in firsts[:2]}
    readers = [op for op, side, t in zip(ops, io, tensors)
               if side == "input" and t.rpartition(":")[0] + ":" in made]
    low = [op for op, side, dt in zip(ops, io, dtypes)
           if side == "output" and dt in ("float16", "bfloat16")]
    # a fused kernel of those calls unfused first: it changes no dtype (the device's
    # fusion switch), where keeping calls in fp32 costs speed
    passes = dict(zip(ops, table["pass_name"].tolist())) if "pass_name" in table.columns \
        else {}
    unfuse = [FUSION + p for op in [*firsts, *readers]
              for p in str(passes.get(op) or "").split("+") if p]
    # not autograd's sums, the state, nor torch's own (GradScaler's Torch._amp_...)
    names = unfuse + [_api(op) for op in [*firsts, *readers, *low]
             if not op.startswith(("Autograd.", "Variable", "Torch._")) and
             ".grad_sum." not in op]
    first = c.cause.first_origin
    if first is not None:
        module = ws.call_sites(npu, step).get(call_name(first.op_name), {}).get("module", "")
        if module and not module[:1].isupper():
            names.append(module)
    return list(dict.fromkeys(n for n in names if n and n != "Variable"))


def _losses(ws: Workspace, run: Run) -> List[float]:
    return [float(x) for x in ws.step_history(run).loss]


def _drift(golden: List[float], fixed: List[float], rtol: float) -> Optional[int]:
    """The first step whose loss is off the golden's by more than rtol (relative), or not
    finite where the golden's is; None when every step holds."""
    for k, (g, f) in enumerate(zip(golden, fixed)):
        if math.isnan(g):
            continue
        if not math.isfinite(f) or abs(f - g) > rtol * max(abs(g), 1e-12):
            return k
    return None


class _Rerun:
    """Runs the script once per trial on the simulated NPU and judges the step."""

    def __init__(self, ws: Workspace, npu: Run, golden: Run, step: int, criteria, rtol: float,
                 progress: Callable[[str], None]):
        self.ws, self.npu, self.golden, self.step = ws, npu, golden, step
        self.criteria, self.rtol, self.progress = criteria, rtol, progress
        self.golden_losses = _losses(ws, golden)
        self.made: List[str] = []

    def __call__(self, items: List[str], mode: str) -> Trial:
        keep, off = split_items(items)
        trial = Trial(keep, mode, fusion_off=off)
        self.progress(f"rerunning the script: {trial.describe()}...")
        passes = self.npu.info.get("fusion_passes")
        changes = {} if not off else \
            {"fusion_passes": set(passes if passes is not None else PASSES) - set(off)}
        run, why, made = rerun_script(self.ws, self.npu, self.step, precision_mode=mode, keep_fp32=keep, **changes)
        self.made += made
        if run is None:
            trial.error = why
            return trial
        ws = self.ws.reopened()
        trial.run = run.label
        trial.failing = failing(ws, run, self.golden, self.step, self.criteria).names()
        if mode == ALL_FP32 and trial.failing:
            trial.script_low = _low_tensors(ws, run, self.step, trial.failing)
        fixed = _losses(ws, run)
        pairs = [(g, f) for g, f in zip(self.golden_losses, fixed) if not math.isnan(g)]
        if pairs:
            trial.loss_error = max(abs(f - g) / max(abs(g), 1e-12) for g, f in pairs)
        trial.drift_step = _drift(self.golden_losses, fixed, self.rtol)
        self.progress(f"  {'passes' if trial.passed else 'fails'}"
                      + (f": {'; '.join(trial.failing[:3])}" if trial.failing else "")
                      + (f"; the loss leaves the golden's at step {trial.drift_step}"
                         if trial.drift_step is not None else ""))
        return trial

    def clean(self, keep: Optional[str]) -> None:
        """Delete every rerun's run but the fix's."""
        import shutil
        for path in self.made:
            if keep is None or os.path.basename(os.path.normpath(path)) != keep.split("/")[-1]:
                shutil.rmtree(path, ignore_errors=True)


def _low_tensors(ws: Workspace, run: Run, step: int, tensors: List[str]) -> List[str]:
    """Those of the tensors (golden names) the run's step holds in fp16 or bf16."""
    t = ws.index(run, step)
    low = t[(t.io == "output") & t.dtype.isin(["float16", "bfloat16"])
            & t.tensor.isin(set(tensors))]
    return sorted(set(low.tensor), key=tensors.index)


def repair_script(ws: Workspace, npu: Run, golden: Run, step: Optional[int], criteria=None,
                  rtol: float = 0.02, budget: int = 12, write: bool = True,
                  progress: Callable[[str], None] = lambda s: None) -> ScriptRepair:
    """Find, by rerunning the script, the fewest calls kept in fp32 that make `step` pass as
    ac -c judges it and the loss hold to the golden's (rtol) at every step; write it to
    config/fix.json (torch-run --fix reads it)."""
    info = npu.info
    if not info.get("script"):
        raise ScriptRepairError(f"{npu.label} was not made by torch-run (its run.json names no "
                                f"script): fix reruns the script; run it with "
                                f"precision-tool torch-run")
    # the step asked for; else the first dumped step with a finding (as ac -c finds it)
    steps = check_steps(ws, npu, golden, step)
    c = None
    for step in steps:
        c = judge_step(ws, npu, golden, step, criteria)
        if c.any_findings:
            break
    result = ScriptRepair(npu.label, golden.label, step, list(info["script"]), rtol)
    if not c.any_findings:
        result.healthy = True
        result.notes.append("the dumped step has no finding as ac -c judges it: nothing to fix")
        return result
    result.before = failing(ws, npu, golden, step, criteria).names()
    progress(f"step {step}: {len(result.before)} tensor(s) or overflow(s) fail")
    if starts_drifted(c, npu, step):
        own, by = own_from_npu_state(ws, npu, golden, [step], criteria,
                                     on_progress=progress)[step][:2]
        if own == []:       # the step computes as the golden does from the NPU's state
            result.notes.append(
                f"step {step} starts from state that drifted off the golden's, and from the "
                f"NPU's own state it computes as the golden does ({by}): what fails is that "
                f"drift, which no setting of the step fixes (ac -c says more)")
            return result
    no_rerun = _calibration(ws, npu, c, step) or _script_made(ws, npu, golden, c)
    if no_rerun:
        result.notes.append(no_rerun)
        return result
    result.candidates = candidates(ws, npu, c, step)
    mode = info.get("precision_mode") or "allow_mix_precision"
    rerun = _Rerun(ws, npu, golden, step, criteria, rtol, progress)
    result.golden_losses = rerun.golden_losses
    if not any(math.isfinite(x) for x in rerun.golden_losses):
        result.notes.append(f"{golden.label} recorded no loss: the reruns are judged by the "
                            f"dumped step alone, not over the script's steps")

    def trial(keep, trial_mode=mode) -> Trial:
        t = rerun(keep, trial_mode)
        result.trials.append(t)
        if t.error and len(result.trials) == 1:      # it ran before: it cannot run here
            rerun.clean(None)
            raise ScriptRepairError(f"the rerun of {' '.join(result.script)} failed: {t.error}")
        return t

    found = _search(result.candidates, trial, budget, result)
    if found is None and len(result.trials) < budget:
        t = trial([], ALL_FP32)
        if t.passed:
            found = t
            result.notes.append("only every kernel in fp32 passes: precision is the cause, "
                                "but keeping the calls the finding names was not enough")
        elif t.script_low:
            head = (f"under force_fp32 {len(t.script_low)} failing tensor(s) are still fp16 "
                    f"or bf16, the first {t.script_low[0]}: ")
            if "autocast" in (golden.info.get("lifted_to_float32") or []):
                result.notes.append(
                    head + "the script's own autocast computes them so, which no device "
                    "setting changes; fix it in the script (the calls that fail outside "
                    "autocast: torch.autocast(..., enabled=False) around them, their inputs "
                    ".float())")
            else:
                result.notes.append(
                    head + "the script's own dtype (its .half() or .bfloat16() model, state "
                    "or casts), which no device setting changes; fix it in the script (fp32 "
                    "master weights: the model in float32, its compute cast down by "
                    "autocast)")
    if found is None and len(result.trials) >= budget:
        result.notes.append(f"the budget of {budget} reruns is spent (-b gives more)")
    rerun.clean(found.run if found is not None else None)
    if found is not None:
        result.fix = found
        fresh = ws.reopened()
        result.fixed_losses = _losses(fresh, fresh.run("npu", found.run.split("/")[-1]))
        result.config = {"precision_mode": found.precision_mode,
                         "keep_fp32": list(found.keep_fp32),
                         "fusion_off": list(found.fusion_off)}
        if write:
            try:
                result.files = write_fix(ws, result)
            except (WorkspaceError, OSError) as e:
                result.unsaved = str(e) if isinstance(e, WorkspaceError) else \
                    f"cannot write {e.filename or 'the fix'}: {e.strerror or e}"
    return result


def _calibration(ws: Workspace, npu: Run, c, step: int) -> str:
    """Why no rerun is made where the step's overflows are the script's GradScaler starting
    too high (every overflow in the backward, the step among the skips from the first
    observed step on, a later step without overflow): the scale is the script's own, which
    a fix here does not change, and calls kept in fp32 would only hide what it overflows.
    "" where the step is no such case."""
    if not c.tasks:
        return ""
    history = loss_scale_history(ws, npu)
    settled = calibration(history, step, [t.op_name for t in c.tasks])
    if settled is None:
        return ""
    skipped, clean, _ = settled
    again, scale, ran = history.held_after(clean)
    held = "held from there" if ran else "which no observed step after tried"
    return (f"step {step} overflows in the backward because the loss scale starts too high: "
            f"the script's scaler started at {history.scale_at(skipped[0]):.10g}, and "
            f"step(s) {', '.join(map(str, skipped + again))} skipped their update until it "
            f"came down to {scale:.10g} ({held}). Start it there (torch.amp.GradScaler("
            f"init_scale={scale:.10g})): fix changes no scaler of a script, and calls kept in "
            f"fp32 would only hide the overflow, so it made no rerun")


def _script_made(ws: Workspace, npu: Run, golden: Run, c) -> str:
    """Why no rerun is made where the step's first overflow is a value the script makes
    itself (the golden's outputs of that call hold the same inf/nan: T5's log of a zero
    distance) and, in saturation mode, the device's flag made the script's scaler skip
    updates the golden took: no call kept in fp32 stops the script making it. "" where the
    step is no such case."""
    if not c.tasks or npu.config.overflow_mode != "saturation":
        return ""
    golden_skips = set(loss_scale_history(ws, golden).skipped_steps)
    skipped = [s for s in loss_scale_history(ws, npu).skipped_steps if s not in golden_skips]
    first = c.tasks[0].op_name
    t = c.table
    if not skipped or "GoldenInfCount" not in t:
        return ""
    rows = t[(t["NPUDump"] == first) & t["TensorIndex"].astype(str).str.contains(":output:")]
    made = rows["NpuInfCount"].fillna(0) + rows["NpuNanCount"].fillna(0)
    held = rows["GoldenInfCount"].fillna(0) + rows["GoldenNanCount"].fillna(0)
    if rows.empty or not (made > 0).any() or not (made == held).all():
        return ""
    return (f"the first overflow, {first}, is a value the script makes itself (its golden "
            f"outputs hold the same {int(made.sum())} inf/nan), and in saturation mode the "
            f"device's status word flags it: the script's scaler skipped {len(skipped)} "
            f"update(s) that the golden took. No call kept in fp32 stops the script making "
            f"it, so it made no rerun: run in inf_nan mode (torch-run --overflow-mode "
            f"inf_nan), where the scaler checks the gradients, or keep the call from making "
            f"it")


def _search(cands: List[str], trial: Callable, budget: int,
            result: ScriptRepair) -> Optional[Trial]:
    """The shortest passing prefix of the candidates (in the finding's order), by bisection
    over its length once all of them pass, then cut down one at a time while it passes:
    about log2(n) + k reruns for k calls that must stay in fp32."""
    if not cands:
        return None
    whole = trial(cands)
    if not whole.passed:
        return None
    found, lo, hi = whole, 1, len(cands)
    while lo < hi and len(result.trials) < budget:
        mid = (lo + hi) // 2
        t = trial(cands[:mid])
        if t.passed:
            found, hi = t, mid
        else:
            lo = mid + 1
    keep = _items(found)
    # the prefix's last is needed (the prefix one shorter fails); the others may not be
    for name in keep[:-1]:
        if len(result.trials) >= budget:
            return found
        t = trial([k for k in keep if k != name])
        if t.passed:
            keep, found = _items(t), t
    result.minimal = lo >= hi
    return found


def _items(trial: Trial) -> List[str]:
    return [FUSION + p for p in trial.fusion_off] + list(trial.keep_fp32)


def write_fix(ws: Workspace, result: ScriptRepair) -> List[str]:
    """config/fix.json where results go: the config torch-run --fix applies, and the
    report."""
    path = os.path.join(ws.results_dir(CONFIG_DIR), "fix.json")
    report = dict(result.to_dict(), front_end="pytorch", files=[path],
                  written=time.strftime("%Y-%m-%d %H:%M:%S"))
    text = json.dumps(report, indent=1) + "\n"
    result.contents = {"fix.json": text}
    write_text_atomic(path, text)
    return [path]
