"""`check` on a PyTorch script's run: the checks a script's dumped steps answer without a
replay (a script's step is the script's own loop body: nothing here can replay it), from the
golden run's dumps and, for where the NPU computes in fp16, the NPU run's index.

What stands for a graph's parts: the feeds are the float tensors the forward pass reads
beside what derives from the weights (the data, wherever the script made it), the variables are the step's
`Variable` ops (parameters, buffers and optimizer state as the debugger names them), the
trainable ones those that are neither optimizer state (`<param>.exp_avg`) nor a norm's
running statistics, the golden steps the run's consecutive dumped steps. The checks that
read a graph's structure or replay it (labels against a loss op, constants, BatchNorm's
mode, determinism) are not run, and the report says so."""
from __future__ import annotations

import math
from functools import cached_property
from typing import Dict, List, Optional, Sequence

import numpy as np

from ...dump import Workspace, layout
from ...dump.workspace import Run
from ...kernels import STAT_FIELDS
from .checks import (CHECKS, ERROR, FP16_MAX, INNER_LIMITS, LOW, SCALED_MODES, WARNING,
                     CheckError, CheckReport, FeedFigures, Finding, _f, _finding, feed_nonfinite,
                     feed_range, never_changed, update_too_large, weight_scale)

# what a script's dumped steps answer; the others read a graph or replay a step
SCRIPT_CHECKS = ("data.nonfinite", "data.fp16_range", "hyperparameter.learning_rate",
                 "hyperparameter.loss_scale", "init.scale", "graph.never_updated",
                 "graph.fp16_range")
# Variables that are not trained weights: optimizer state (named `<param>.<key>` by the
# debugger) and a norm layer's running statistics
_NOT_TRAINED = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "step",
                "square_avg", "acc_delta", "sum", "running_mean", "running_var",
                "num_batches_tracked")
_FLOATS = ("float16", "bfloat16", "float32", "float64")
# a torch-run call's fusion pass -> the fused kernel whose inner step has a limit
_FUSED_KERNEL = {"SoftmaxFusionPass": "SoftmaxV2", "LayerNormFusionPass": "LayerNorm"}


def is_script_run(run: Run) -> bool:
    return run.info.get("front_end") == "pytorch" and not run.bundles


def script_runs(ws: Workspace, run: Run) -> tuple:
    """(golden, npu or None) for a script's run: an NPU run's golden is its own rank's, else
    the newest golden script run; a golden run's NPU run the newest NPU script run."""
    def newest(target):
        made = [r for r in ws.runs(target) if r.info.get("front_end") == "pytorch"
                and not r.info.get("replay_of") and r.complete_steps]
        return made[-1] if made else None
    if run.kind == layout.REFERENCE:
        return run, newest("npu")
    golden = ws.reference_for(run) or newest("cpu")
    if golden is None:
        raise CheckError(f"{run.label} has no golden run beside it to check the script's data "
                         f"and weights with: torch-run --target golden (or both)")
    return golden, run


def run_script_checks(ws: Workspace, run: Run, step: Optional[int] = None,
                      precision_mode: Optional[str] = None,
                      only: Sequence[str] = ()) -> CheckReport:
    golden, npu = script_runs(ws, run)
    steps = sorted(golden.complete_steps)
    if not steps:
        raise CheckError(f"{golden.label} has no complete dumped step")
    step = steps[0] if step is None else ws.resolve_step(golden, step)
    # the consecutive dumped steps from `step`: the golden steps the update checks see
    run_of = [step]
    while run_of[-1] + 1 in steps:
        run_of.append(run_of[-1] + 1)
    mode = precision_mode or (npu.info.get("precision_mode") if npu is not None else None) \
        or "allow_mix_precision"
    report = CheckReport(run.label, step, len(run_of), mode)
    ctx = _ScriptContext(ws, golden, npu, run_of, mode)
    checks = {"data.nonfinite": lambda: [f for n, v in ctx.feeds.items()
                                         for f in feed_nonfinite(n, v)],
              "data.fp16_range": lambda: [f for n, v in ctx.feeds.items()
                                          for f in feed_range(n, v)],
              "hyperparameter.learning_rate": lambda: update_too_large(
                  ctx.trainable, ctx.states, run_of) if len(ctx.states) > 1 else [],
              "hyperparameter.loss_scale": ctx.loss_scale,
              "init.scale": ctx.init_scale,
              "graph.never_updated": lambda: [f for v in ctx.trainable
                                              for f in never_changed(v, ctx.states)],
              "graph.fp16_range": ctx.fp16_range}
    for name in CHECKS:
        if only and name not in only or name not in checks:
            continue
        report.checks.append(name)
        report.findings.extend(checks[name]())
    order = {ERROR: 0, WARNING: 1, "info": 2}
    report.findings.sort(key=lambda f: order[f.severity])
    skipped = [n for n in CHECKS if n not in checks and (not only or n in only)]
    if skipped:
        report.notes.append(f"a script's run has no graph to read nor a step to replay: not "
                            f"run: {', '.join(skipped)}")
    if len(run_of) < 2:
        report.notes.append(f"{golden.label} has no step {step + 1} dumped: the update size "
                            f"and weights never updated need consecutive steps (torch-run "
                            f"--dump-step all)")
    if npu is None:
        report.notes.append("no NPU run of the script: where it computes in fp16 is not "
                            "known (torch-run --target npu)")
    if ctx.undumped:
        report.notes.append(f"{golden.label} dumped statistics only: the feeds were checked "
                            f"by their statistics, but {ctx.undumped} weight and optimizer "
                            f"value(s) were not dumped, so the update size, the "
                            f"initialisation and weights never updated went unchecked "
                            f"(torch-run --dump-mode tensor)")
    return report


def _elements(shape) -> int:
    """The element count of an index row's shape ("8 16"; "" is a scalar's)."""
    return math.prod(int(d) for d in str(shape).split())


def _stats_of_mask(elements: int, stats) -> bool:
    """_is_mask from a statistics dump's numbers: no nan, and either every finite element
    is 0 beside infinities of one sign (0 and -inf), or the finite ones span [m, 0] or
    [0, m] with a sum of squares of exactly |m| times the sum of magnitudes, which only
    values all 0 or m reach (0 and finfo.min, 0 and 1)."""
    if stats["nan_count"] or stats["pos_inf_count"] and stats["neg_inf_count"]:
        return False
    hi, lo = float(stats["max"]), float(stats["min"])
    finite = elements - int(stats["pos_inf_count"] + stats["neg_inf_count"])
    if not finite:
        return False
    if hi == 0 and lo == 0:
        return True
    if stats["pos_inf_count"] or stats["neg_inf_count"] or not (hi == 0 or lo == 0):
        return False
    m = lo if hi == 0 else hi
    squares, total = float(stats["l2norm"]) ** 2, float(stats["mean"]) * finite
    return math.isclose(squares, m * total, rel_tol=1e-6)


def _is_mask(value: np.ndarray) -> bool:
    """At most two distinct values, one of them 0 and none nan (0 and -inf, 0 and
    finfo.min, 0 and 1)."""
    flat = np.asarray(value).ravel()
    if not flat.size or flat.size > 1 << 24:
        return False
    distinct = np.unique(flat)
    return distinct.size <= 2 and bool((distinct == 0).any()) and \
        not np.isnan(distinct.astype(np.float64)).any()


class _ScriptContext:
    def __init__(self, ws: Workspace, golden: Run, npu: Optional[Run], steps: List[int],
                 mode: str):
        self.ws, self.golden, self.npu, self.steps, self.mode = ws, golden, npu, steps, mode
        self.undumped = 0

    def _load(self, step: int, row) -> Optional[np.ndarray]:
        if not isinstance(row.file, str) or not row.file:
            self.undumped += 1
            return None
        return self.ws.load(self.golden, step, row.file, row.shape)

    def _variables(self, step: int) -> Dict[str, np.ndarray]:
        t = self.ws.index(self.golden, step)
        rows = t[(t.op_type == "Variable") & (t.io == "output")]
        out = {}
        for row in rows.itertuples():
            value = self._load(step, row)
            if value is not None:
                out[row.op_name] = value
        return out

    @cached_property
    def feeds(self) -> Dict[str, FeedFigures]:
        """The data: float tensors the forward pass reads beside what the weights feed. A
        tensor derives from the weights when a Variable is among its ancestors in the step;
        a feed is one that does not, read by a call that also reads one that does, before
        the step's first backward (the optimizer's own numbers are not data). What the
        script made in the step (a batch a DataLoader stacks, `torch.randn` at its top under
        torch-run, `x / 255`) counts as it is read, not as it was made; a mask (at most two
        values, one of them 0: an attention mask of 0 and -inf) and a single number are
        not data. A statistics dump's feeds are checked by their index rows' numbers."""
        step = self.steps[0]
        t = self.ws.index(self.golden, step)
        derived = set(t.tensor[(t.op_type == "Variable") & (t.io == "output")])
        reads: Dict[str, str] = {}              # feed tensor -> the first call reading it
        files: Dict[str, object] = {}
        for op, rows in t[t.op_type != "Variable"].groupby("op_name", sort=False):
            if op.endswith(".backward"):
                break
            ins = rows[rows.io == "input"]
            if not ins.tensor.isin(derived).any():
                continue
            derived.update(rows.tensor[rows.io == "output"])
            for row in ins.itertuples():
                # one number is a constant (GradScaler's scale, a temperature), not data
                if row.tensor not in derived and row.dtype in _FLOATS and \
                        _elements(row.shape) > 1:
                    reads.setdefault(row.tensor, op)
                    files.setdefault(row.tensor, row)
        out, seen = {}, set()
        for tensor, op in reads.items():
            row = files[tensor]
            if isinstance(row.file, str) and row.file:
                if row.file in seen:
                    continue
                seen.add(row.file)
                value = self._load(step, row)
                figures = None if value is None or _is_mask(value) else FeedFigures.of(value)
            else:          # a statistics dump: the index's statistics are the figures
                stats = {k: getattr(row, k) for k in STAT_FIELDS}
                elements = _elements(row.shape)
                figures = None if _stats_of_mask(elements, stats) else \
                    FeedFigures.from_stats(elements, stats)
            if figures is not None:
                mine = tensor.startswith(f"{op}.input:")     # made before the step
                out[tensor if mine else f"{tensor} (read by {op})"] = figures
        return out

    @cached_property
    def states(self) -> List[Dict[str, np.ndarray]]:
        """The Variables at the start of each step."""
        return [self._variables(s) for s in self.steps]

    @cached_property
    def trainable(self) -> List[str]:
        first = self.states[0]
        return [v for v in first if v.rsplit(".", 1)[-1] not in _NOT_TRAINED and
                np.asarray(first[v]).dtype.kind == "f" and all(v in s for s in self.states)]

    def init_scale(self) -> List[Finding]:
        t = self.ws.index(self.golden, self.steps[0])
        # embedding tables are looked up, not multiplied: their scale is a choice
        reads = t[(t.io == "input") & t.op_name.str.startswith("Functional.embedding.")]
        tables = set(reads.tensor.str.rsplit(":", n=1).str[0])
        out = []
        for var in self.trainable:
            w = np.asarray(self.states[0][var], np.float64)
            if w.ndim >= 2 and w.size:       # torch's layout: (out, in, ...): fan-in after dim 0
                out += weight_scale(var, w, int(np.prod(w.shape[1:])), var in tables)
        if self.steps[0]:
            for f in out:
                f.message += f" (at step {self.steps[0]}, not the initialisation)"
        return out

    def fp16_range(self) -> List[Finding]:
        """Golden values beyond 65504 where the NPU run computed in fp16/bf16 (the index's
        statistics: nothing loaded), and a fused kernel's input beyond its inner step's
        limit."""
        if self.npu is None or self.steps[0] not in self.npu.complete_steps:
            return []
        step = self.steps[0]
        n, g = self.ws.index(self.npu, step), self.ws.index(self.golden, step)
        peaks = dict(zip(g.tensor, np.maximum(g["max"].abs(), g["min"].abs())))
        out, seen = [], set()
        low = n[n.dtype.isin(LOW)]
        for row in low.itertuples():
            peak = peaks.get(row.tensor, math.nan)
            if row.io != "output" or row.op_name in seen or not peak > FP16_MAX:
                continue
            seen.add(row.op_name)
            out.append(_finding("graph.fp16_range", ERROR,
                                f"{row.op_name} reaches {peak:.6g} in the golden run; the NPU "
                                f"computes it in {row.dtype}, whose maximum is 65504",
                                {"op": row.op_name, "output": row.tensor, "max_abs": _f(peak)},
                                f"keep {row.op_name.rsplit('.', 2)[0]} in fp32 (torch-run "
                                f"--keep-fp32), or scale what feeds it"))
        for row in low[low.io == "input"].itertuples():
            kernel = next((_FUSED_KERNEL[p] for p in str(row.pass_name or "").split("+")
                           if p in _FUSED_KERNEL), None)
            peak = peaks.get(row.tensor, math.nan)
            if kernel is None or row.op_name in seen or row.index != 0:
                continue
            bound, what = INNER_LIMITS[kernel]
            if peak > bound:
                seen.add(row.op_name)
                out.append(_finding(
                    "graph.fp16_range", ERROR,
                    f"{row.op_name} runs in the fused fp16 kernel {kernel}, which {what}; its "
                    f"input {row.tensor} reaches {peak:.6g} in the golden run",
                    {"op": row.op_name, "kernel": kernel, "input": row.tensor,
                     "max_abs": _f(peak), "limit": _f(bound)},
                    f"normalise or scale what feeds it, switch {row.pass_name} off "
                    f"(torch-run --fusion-switch), or keep it in fp32 (--keep-fp32)"))
        return out

    def loss_scale(self) -> List[Finding]:
        """Gradients the NPU computes in fp16 with no loss scaling (no GradScaler)."""
        if self.npu is None or self.mode not in SCALED_MODES or \
                self.steps[0] not in self.npu.complete_steps:
            return []
        history = self.ws.step_history(self.npu)
        scale = history.get("loss_scale")
        if scale is not None and scale.notna().any():
            return []
        t = self.ws.index(self.npu, self.steps[0])
        grads = t[(t.io == "output") & t.op_name.str.endswith(".backward")]
        if not grads.dtype.isin(LOW).any():
            return []
        return [_finding("hyperparameter.loss_scale", WARNING,
                         f"{self.mode} computes gradients in fp16 ({int(grads.dtype.isin(LOW).sum())} "
                         f"backward outputs) and the script scales no loss: gradients below "
                         f"6e-8 flush to zero", {"precision_mode": self.mode},
                         "scale the loss: torch.amp.GradScaler (scaler.scale(loss).backward(), "
                         "scaler.step(optimizer), scaler.update())")]
