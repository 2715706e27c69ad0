"""Fusion-off replay and pass bisection.

Rerun a dumped step from its replay bundle on the simulated NPU with fusion switched off
(all of it, or per a switch), into the next npu/debug_<k>; compare each run with the golden.
A run is *worse* than the fusion-off baseline when golden tensors fail in it that do not
fail without fusion, or a kernel overflows that has no counterpart overflowing without
fusion (tensors that fail either way — noise the golden itself holds — say nothing about
fusion). Bisection over the passes that fired then names the pass(es) whose
fusion makes the run worse, in about ceil(log2 P) + 2 replays.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Set

import pandas as pd

from ...dump import hooks
from ...dump import Workspace
from ...dump.bundle import load_bundle, replay
from ...dump.workspace import Run
from ...errors import PrecisionToolError
from ...graph import split_tensor_name
from ...runtime.npu.fusion import PASSES, switch_for
from ..autocheck import judge_step
from ..comparing.mapping import TensorMap
from ..comparing.verdicts import DIVERGING


class FusionReplayError(PrecisionToolError, ValueError):
    """A fusion-off replay that cannot run (no bundle for the step, no golden run...)."""


def replay_with_passes(ws: Workspace, npu_run: Run, step: int, passes_on: Set[str]) -> Run:
    """Rerun the step's bundle on the NPU with only `passes_on` fused, dumped into the next
    debug_<k>; returns that run (the one this replay wrote, whatever else writes into the
    workspace meanwhile). A PyTorch script's run has no bundle: the script is rerun."""
    if npu_run.info.get("front_end") == "pytorch":
        from .script_rerun import rerun_script
        run, why, made = rerun_script(ws, npu_run, step, fusion_passes=set(passes_on))
        if run is None:
            for path in made:
                shutil.rmtree(path, ignore_errors=True)
            raise FusionReplayError(f"the rerun of {npu_run.label}'s script failed: {why}")
        return run
    bundle = load_bundle(ws.bundle_path(npu_run, step))
    config = bundle.config(fusion_switch=switch_for(passes_on))
    config = hooks.session_dump_config(config, action="dump", dump_step=str(step),
                                       data_dir=ws.results_dir(), replay_of=npu_run.label,
                                       first_free=ws.first_free("npu"))
    sess, _ = replay(bundle, "npu", config)
    sess.close()
    (run_dir,) = hooks.dump_dirs(sess)
    return ws.reopened().run("npu", os.path.basename(run_dir))


@dataclass
class Failures:
    """What goes wrong in a replayed step: the golden tensors whose NPU counterpart diverges,
    and each overflow a kernel made from finite inputs, as the original ops it stands for (a
    fused kernel's overflow and the unfused graph's are the same overflow when the kernel
    absorbed the op that overflowed: the one-pass variance's x*x and the unfused Square).
    `overflows` are the findings; `all_overflows` every one, effect or not, so that a fused
    run's overflow is new only where the unfused run overflowed in none of its ops."""
    diverging: Set[str] = field(default_factory=set)
    overflows: List[frozenset] = field(default_factory=list)
    all_overflows: List[frozenset] = field(default_factory=list)

    def beyond(self, baseline: "Failures") -> "Failures":
        """What fails here and not in the baseline."""
        return Failures(self.diverging - baseline.diverging,
                        [o for o in self.overflows
                         if not any(o & b for b in baseline.all_overflows)])

    def __bool__(self):
        return bool(self.diverging or self.overflows)

    def names(self) -> List[str]:
        return sorted(self.diverging) + [f"overflow in {', '.join(sorted(o))}" for o in self.overflows]


def failing(ws: Workspace, run: Run, golden: Run, step: int, criteria=None) -> Failures:
    """What fails in this run's step: diverging tensors (verdicts) and overflows, judged as
    ac -c judges a step: a step with no finding there (its divergence noise or without
    effect, its overflows without effect) fails in nothing, though its overflows are kept
    to compare the fused run's with."""
    c = judge_step(ws, run, golden, step, criteria)
    tmap = TensorMap(ws.compiled_graph(run))
    every = [_overflow_ops(tmap, task.op_name) for task in c.tasks if task.is_producer]
    if not c.any_findings:
        return Failures(all_overflows=every)
    table = c.table
    # cancellation noise (and what only carries it) diverges with or without fusion alike,
    # by chance: it is no failure of either; nor is what has no effect
    noise = c.cause.benign_ops
    # (by the ops root cause walked, its rows the table's: a list kernel's lanes are ops)
    ops = pd.Series(c.cause.rows.op_name, index=table.index)
    bad = table.Verdict.isin(DIVERGING) & ~ops.isin(noise)
    return Failures(set(table[bad].GoldenTensor), [] if c.quiet_overflows else every, every)


def _overflow_ops(tmap: TensorMap, op_name: str) -> frozenset:
    """The original ops an overflowing kernel stands for: a fused kernel's every absorbed op,
    an inserted Cast's producer, any other op itself."""
    ops = {split_tensor_name(t)[0] for t in tmap.stands_for(op_name)}
    return frozenset(ops | set(tmap.original_ops(op_name)))


@dataclass
class FusionVerdict:
    fusion_to_blame: bool
    fired: List[str]                      # passes that fused something in the original run
    culprits: List[str] = field(default_factory=list)
    fused_nodes: Dict[str, List[str]] = field(default_factory=dict)
    new_failures: List[str] = field(default_factory=list)   # failing only with fusion
    unfused_failures: List[str] = field(default_factory=list)   # failing with every pass off
    replays: int = 0
    runs: List[str] = field(default_factory=list)        # every replay, in order
    # the replays left on disk: the fusion-off baseline (what `vc -lt` compares), or all of
    # them when asked (the bisection's others are deleted once judged: megabytes each)
    kept: List[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def fired_passes(ws: Workspace, npu_run: Run) -> Dict[str, List[str]]:
    """Pass -> fused nodes, for the passes that fused something (fusion_result.json)."""
    fired = ws.fusion_result(npu_run)
    if fired is None:
        raise FusionReplayError(f"{npu_run.label} has no fusion_result.json: which passes "
                                f"fired is not known")
    return fired


def bisect_fusion(ws: Workspace, npu_run: Run, golden: Run, step: int,
                  threshold=None, keep_replays: bool = False) -> FusionVerdict:
    """Is fusion to blame for the step's divergence or its overflow, and which pass? The
    replay with every pass off stays a run of the workspace; the others are deleted once
    judged, unless keep_replays."""
    fired = fired_passes(ws, npu_run)
    # the run's files are read as every command reads them: a broken compiled graph is an
    # input error here too, although the replays run from the bundle's own graph
    ws.compiled_graph(npu_run)
    names = [p for p in PASSES if p in fired]          # the compiler's order
    replays = 0
    runs: List[Run] = []

    def run_with(on: Set[str]) -> Failures:
        nonlocal replays
        replays += 1
        r = replay_with_passes(ws, npu_run, step, on)
        runs.append(r)
        return failing(ws.reopened(), r, golden, step, threshold)

    baseline = run_with(set())
    original = run_with(set(names))          # the same step replayed, fusion as it was
    new = original.beyond(baseline)
    verdict = FusionVerdict(bool(new), names, new_failures=new.names(),
                            unfused_failures=baseline.names())
    if new:
        culprits = _bisect(names, lambda on: bool(run_with(set(on)).beyond(baseline)))
        verdict.culprits = culprits
        verdict.fused_nodes = {p: fired[p] for p in culprits}
    verdict.replays, verdict.runs = replays, [r.name for r in runs]
    kept = runs if keep_replays else runs[:1]
    for r in runs[len(kept):]:
        shutil.rmtree(r.path, ignore_errors=True)
    verdict.kept = [r.name for r in kept]
    return verdict


def _bisect(candidates: List[str], worse) -> List[str]:
    """The passes among `candidates` that make the run worse: halve the set while one half
    alone reproduces it; when neither half does alone, the passes act together and both
    halves are searched."""
    if len(candidates) == 1:
        return list(candidates)
    half = len(candidates) // 2
    left, right = candidates[:half], candidates[half:]
    if worse(left):
        return _bisect(left, worse)
    if worse(right):
        return _bisect(right, worse)
    return _bisect(left, lambda on: worse(on + right)) + _bisect(right, lambda on: worse(on + left))
