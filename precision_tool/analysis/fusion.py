"""Fusion-off replay and pass bisection (DESIGN §6).

Rerun a dumped step from its replay bundle on the simulated NPU with fusion switched off
(all of it, or per a switch), into the next npu/debug_<k>; compare each run with the golden.
A run is *worse* than the fusion-off baseline when golden tensors fail in it that do not
fail without fusion (tensors that fail either way — noise the golden itself holds — say
nothing about fusion). Bisection over the passes that fired then names the pass(es) whose
fusion makes the run worse, in about ceil(log2 P) + 2 replays.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Set

from .. import hooks
from ..dump import Workspace, load_bundle, replay
from ..dump.workspace import Run
from ..errors import PrecisionToolError
from ..fileio import load_json
from ..runtime.npu.fusion import GRAPH, PASSES, UB
from .compare import COSINE_THRESHOLD, diverging, vector_compare


class FusionReplayError(PrecisionToolError, ValueError):
    """A fusion-off replay that cannot run (no bundle for the step, no golden run...)."""


def switch_for(passes_on: Set[str]) -> dict:
    """fusion_switch.cfg content with exactly `passes_on` switched on."""
    return {"Switch": {kind: dict([("ALL", "off")] + [(p, "on") for p, d in PASSES.items()
                                                      if d.kind == kind and p in passes_on])
                       for kind in (GRAPH, UB)}}


def replay_with_passes(ws: Workspace, npu_run: Run, step: int, passes_on: Set[str]) -> Run:
    """Rerun the step's bundle on the NPU with only `passes_on` fused, dumped into the next
    debug_<k>; returns that run."""
    bundle_path = os.path.join(npu_run.path, "replay", str(step))
    if not os.path.isdir(bundle_path):
        raise FusionReplayError(f"{npu_run.name} has no replay bundle for step {step} "
                                f"(dump the step with the 'dump' action)")
    bundle = load_bundle(bundle_path)
    config = bundle.config(fusion_switch=switch_for(passes_on))
    config = hooks.session_dump_config(config, action="dump", dump_step=str(step),
                                       data_dir=ws.root, replay_of=f"{npu_run.target}/{npu_run.name}")
    sess, _ = replay(bundle, "npu", config)
    sess.close()
    fresh = Workspace(ws.root)
    return fresh.runs("npu")[-1]


def failing(ws: Workspace, run: Run, golden: Run, step: int, threshold: float) -> Set[str]:
    """Golden tensors whose NPU counterpart fails in this run."""
    table = vector_compare(ws, run, golden, step, threshold=threshold)
    return set(table[diverging(table, threshold)].GoldenTensor)


@dataclass
class FusionVerdict:
    fusion_to_blame: bool
    fired: List[str]                      # passes that fused something in the original run
    culprits: List[str] = field(default_factory=list)
    fused_nodes: Dict[str, List[str]] = field(default_factory=dict)
    new_failures: List[str] = field(default_factory=list)   # failing only with fusion
    replays: int = 0
    runs: List[str] = field(default_factory=list)


def fired_passes(npu_run: Run) -> Dict[str, List[str]]:
    """Pass -> fused nodes, for the passes that fused something (fusion_result.json)."""
    result = load_json(os.path.join(npu_run.path, "fusion_result.json"), FusionReplayError,
                       "fusion result")
    fired = {}
    for graph in result.values():
        for kind in ("graph_fusion", "ub_fusion"):
            for name, counts in graph.get(kind, {}).items():
                if counts.get("effect_times", 0) > 0:
                    fired[name] = list(counts.get("fused_nodes", []))
    return fired


def bisect_fusion(ws: Workspace, npu_run: Run, golden: Run, step: int,
                  threshold: float = COSINE_THRESHOLD) -> FusionVerdict:
    """Is fusion to blame for the step's divergence, and which pass?"""
    fired = fired_passes(npu_run)
    names = [p for p in PASSES if p in fired]          # the compiler's order
    replays = 0
    runs = []

    def run_with(on: Set[str]) -> Set[str]:
        nonlocal replays
        replays += 1
        r = replay_with_passes(ws, npu_run, step, on)
        runs.append(r.name)
        return failing(Workspace(ws.root), r, golden, step, threshold)

    baseline = run_with(set())
    original = run_with(set(names))          # the same step replayed, fusion as it was
    new = original - baseline
    verdict = FusionVerdict(bool(new), names, new_failures=sorted(new))
    if new:
        culprits = _bisect(names, lambda on: bool(run_with(set(on)) - baseline))
        verdict.culprits = culprits
        verdict.fused_nodes = {p: fired[p] for p in culprits}
    verdict.replays, verdict.runs = replays, runs
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
