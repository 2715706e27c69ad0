"""Overflow analysis of an NPU dump: the overflowing tasks in execution order, their status
decoded, and the first overflow — the first task whose inputs are finite and whose status or
outputs show an overflow. Later overflowing tasks whose inputs already held inf/nan only
carried it (propagators); in saturation mode only the status word shows an overflow at all.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import List, Optional


from ... import numerics
from ...dump import Workspace
from ...dump.workspace import Run
from ...fileio import load_json
from ...errors import PrecisionToolError


class OverflowRecordError(PrecisionToolError, ValueError):
    """An Opdebug record that cannot be read."""


@dataclass
class OverflowTask:
    op_name: str
    op_type: str
    task_id: int
    stream_id: int
    timestamp: int
    status: int
    status_bits: List[str]
    step: int
    inputs_finite: bool = True        # from the dumped inputs' statistics
    outputs_nonfinite: int = 0        # nan + inf elements in its outputs
    tensors: List[dict] = field(default_factory=list)

    @property
    def is_producer(self) -> bool:
        """It made the overflow itself (its inputs were finite)."""
        return self.inputs_finite


@dataclass
class OverflowReport:
    step: int
    tasks: List[OverflowTask]

    @property
    def first(self) -> Optional[OverflowTask]:
        return next((t for t in self.tasks if t.is_producer), None)

    @property
    def propagators(self) -> List[OverflowTask]:
        return [t for t in self.tasks if not t.is_producer]


def overflow_report(ws: Workspace, run: Run, step: int) -> OverflowReport:
    """Read the step's Opdebug records and index; tasks ordered by task id (execution order)."""
    path = ws.step_path(run, step)
    table = ws.index(run, step)
    tasks = []
    for name in sorted(os.listdir(path)):
        if not name.startswith("Opdebug.Node_OpDebug."):
            continue
        rec = load_json(os.path.join(path, name), OverflowRecordError, "overflow record")
        try:
            task = OverflowTask(rec["op_name"], rec["op_type"], int(rec["task_id"]),
                                int(rec["stream_id"]), int(rec["timestamp"]), int(rec["status"]),
                                numerics.decode_status(int(rec["status"])), int(rec.get("step", step)))
        except (KeyError, TypeError, ValueError) as e:
            raise OverflowRecordError(f"overflow record {name} is incomplete: {e}") from None
        rows = table[(table["op_name"] == task.op_name) & (table["task_id"] == task.task_id)]
        bad = rows["nan_count"] + rows["pos_inf_count"] + rows["neg_inf_count"]
        task.inputs_finite = bool((bad[rows["io"] == "input"] == 0).all())
        task.outputs_nonfinite = int(bad[rows["io"] == "output"].sum())
        task.tensors = rows.to_dict("records")
        tasks.append(task)
    tasks.sort(key=lambda t: t.task_id)
    return OverflowReport(step, tasks)


@dataclass
class DumpedRun:
    """A run a script's dump wrote (the script runner's summary): its label and directory,
    its whole and partial steps, the kernels that overflowed in them, why its dump stopped."""
    run: str
    path: str
    steps: List[int]
    interrupted: List[int]
    overflowing_kernels: int
    dump_stopped: Optional[dict]


@dataclass
class ScriptDumps:
    """What a script run under a dump runner (npu-dump, npu-overflow, cpu-dump) wrote."""
    action: str
    runs: List[DumpedRun]

    @property
    def overflowing_kernels(self) -> int:
        return sum(r.overflowing_kernels for r in self.runs)

    @property
    def stopped(self) -> List[str]:
        """The runs whose dump stopped before the script's end (a write failure)."""
        return [r.run for r in self.runs if r.dump_stopped]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["overflowing_kernels"] = self.overflowing_kernels
        return out


def script_dumps(action: str, run_dirs: List[str]) -> ScriptDumps:
    """The runs at run_dirs (each <workspace>/<target>/debug_<k>), read from their own
    workspaces, with their overflowing kernels."""
    runs = []
    for path in run_dirs:
        parent, name = os.path.split(path)
        ws = Workspace(os.path.dirname(parent))
        run = ws.run(os.path.basename(parent), name)
        kernels = sum(len(overflow_report(ws, run, s).tasks) for s in run.complete_steps)
        runs.append(DumpedRun(run.label, path, run.complete_steps, run.interrupted, kernels,
                              run.info.get("dump_stopped")))
    return ScriptDumps(action, runs)
