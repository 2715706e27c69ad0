"""`train`: a dumped step rerun from its replay bundle on the NPU, the golden or both, with
an action (dump it again, check it for overflow, dump it with every fusion pass off), into
new runs of the workspace (beside it when it cannot be written) marked as replays of the
original."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional, Sequence

from ...dump import hooks
from ...dump.bundle import load_bundle, replay
from ...dump.workspace import Run, Workspace, WorkspaceError
from ...runtime.config import SessionConfig
from ..diagnosis.overflow import overflow_report

ACTIONS = ("dump", "overflow", "fusion_off")


@dataclass
class Rerun:
    """What a rerun wrote: the step, the runs (labels, in the order of the targets), and
    for an overflow check of the NPU its overflowing kernels and the first of them."""
    step: int
    runs: List[str]
    overflow: Optional[dict] = None

    def to_dict(self) -> dict:
        return asdict(self)


def rerun_step(ws: Workspace, npu: Run, step: Optional[int] = None,
               targets: Sequence[str] = ("npu", "cpu"), action: str = "dump",
               progress: Optional[Callable[[str], None]] = None) -> Rerun:
    """Rerun `step` of the NPU run (default: its first with a replay bundle) on each target
    under the action; fusion_off switches fusion off on the NPU (the golden just dumps)."""
    say = progress or (lambda text: None)
    if action not in ACTIONS:
        raise WorkspaceError(f"a rerun's action is one of {', '.join(ACTIONS)}, not {action!r}")
    if step is None:
        if not npu.bundles:
            raise WorkspaceError(f"{npu.label} has no replay bundle (dump a step with the dump "
                                 f"action first)")
        step = npu.bundles[0]
    bundle = load_bundle(ws.bundle_path(npu, step))
    made = {}                          # target -> the run the replay wrote
    for target in targets:
        act = action
        if action == "fusion_off":     # fusion only exists on the NPU: the golden just dumps
            act = "dump|fusion_off" if target == "npu" else "dump"
        base = bundle.config() if target == "npu" else SessionConfig()
        cfg = hooks.session_dump_config(base, action=act, dump_step=str(step),
                                        data_dir=ws.results_dir(), replay_of=npu.label,
                                        first_free=ws.first_free(target))
        say(f"replaying step {step} on the {target} ({act})...")
        sess, _ = replay(bundle, target, cfg)
        sess.close()
        (run_dir,) = hooks.dump_dirs(sess)      # this replay's run, not the newest on disk
        made[target] = ws.reopened().run(target, os.path.basename(run_dir))
    result = Rerun(step, [r.label for r in made.values()])
    if action == "overflow" and "npu" in made:
        run = made["npu"]
        if step not in [s.step for s in run.steps]:    # a check writes only steps that overflowed
            result.overflow = {"kernels": 0, "first": None}
        else:
            report = overflow_report(ws.reopened(), run, step)
            result.overflow = {"kernels": len(report.tasks),
                               "first": report.first.op_name if report.first else None}
    return result
