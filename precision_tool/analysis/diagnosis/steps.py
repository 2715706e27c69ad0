"""Across steps: which dumped steps to look at, and where divergence carried in with the
state (weights, optimizer moments, the loss scale) was first written.

A step starts from the variables the step before left. At step k > 0 the NPU's variables may
already differ from the golden's, and then the first diverging op of step k is no origin: the
divergence came in with the state (root cause's "carried"). It was written by an update op
of an earlier step: the one whose output for that variable first diverged while its own
start value did not. `trace_state` walks the dumped steps back from k to find it, and where
the steps in between were not dumped, says which to dump.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

import pandas as pd

from ...dump import Workspace
from ...dump.workspace import Run, WorkspaceError
from ...ops import registry
from ..comparing.compare import vector_compare
from .rootcause import OpRows, root_cause


def common_steps(npu_run: Run, golden_run: Run) -> List[int]:
    """The steps dumped whole in both runs, in order."""
    return sorted(set(npu_run.complete_steps) & set(golden_run.complete_steps))


def check_steps(ws: Workspace, npu_run: Run, golden_run: Run, step: Optional[int]) -> List[int]:
    """The steps a compare of the two runs looks at: the one asked for (dumped in both, or
    an error naming which runs have it), else every step both dumped."""
    if step is not None:
        ws.resolve_step(npu_run, step)
        ws.resolve_step(golden_run, step)
        return [step]
    steps = common_steps(npu_run, golden_run)
    if not steps:
        raise WorkspaceError(f"{npu_run.label} and {golden_run.label} have no step dumped in both "
                             f"(NPU: {npu_run.complete_steps}, golden: {golden_run.complete_steps})")
    return steps


def _state_rows(t: OpRows) -> Dict[str, dict]:
    """Per variable (golden tensor name): whether its value at the start of the step
    diverges ("start": True/False, from the rows that read it) and whether the value the
    step's updates left in it diverges ("written", with the writers whose output diverges).
    A graph's variable has one update op; a script's may have a chain of in-place calls
    (AdamW's param.mul_ then param.addcdiv_): the value left is the last one's, each reading
    the one before at the position it overwrites."""
    out: Dict[str, dict] = {}
    updates_of: Dict[str, tuple] = {}
    by_tensor = {tensor: i for i, tensor in enumerate(t.tensor)}
    # golden tensor -> (op, the row of what it wrote there) for each read at an overwritten
    # position: one per version of a variable
    overwritten: Dict[str, tuple] = {}
    for i, tensor in enumerate(t.tensor):
        op_type = t.op_type[i]
        if op_type not in updates_of:
            updates_of[op_type] = tuple(registry.updated_inputs(op_type))
        updates = updates_of[op_type]
        if not updates or t.is_out[i]:
            continue
        op, _, pos = tensor.rpartition(":input:")
        if pos.isdigit() and int(pos) in updates:
            written = by_tensor.get(f"{op}:output:{updates.index(int(pos))}")
            overwritten.setdefault(str(t.golden_tensor[i]), (op, written))
    for i in range(len(t.tensor)):
        if not t.state[i]:
            continue
        var = str(t.golden_tensor[i])
        entry = out.setdefault(var, {"start": False, "written": False, "writers": []})
        entry["start"] = entry["start"] or t.bad[i]
        if entry.get("followed"):
            continue
        entry["followed"] = True
        current, last, seen = var, None, set()
        while current in overwritten and current not in seen:
            seen.add(current)
            op, written = overwritten[current]
            if written is None:
                break
            last = written
            if t.bad[written]:
                entry["writers"].append(op)
            current = str(t.golden_tensor[written])
        entry["written"] = last is not None and bool(t.bad[last])
    for entry in out.values():
        entry.pop("followed", None)
    return out


@dataclass
class StateTrace:
    """Where diverging state came from (see the module doc)."""
    step: int                               # the step whose start state diverges
    variables: List[str]                    # those variables (golden names)
    written_at: Optional[int] = None        # the dumped step whose update first wrote one
    writers: List[str] = field(default_factory=list)     # its update ops
    missing: Optional[List[int]] = None     # the first and last step to dump, where it was
                                            # written in steps that were not dumped
    looked_at: List[int] = field(default_factory=list)   # the earlier steps compared
    # every writer was cancellation noise in its step (an update from a gradient that is
    # zero up to rounding) or gradual (rounding grown layer by layer, rootcause's Gradual),
    # or only carried what came in diverging, without effect, in a step with no finding (a
    # momentum buffer that took a gradual gradient): the state carries noise, no finding
    writers_noise: bool = False

    def dump_command(self) -> Optional[str]:
        if self.missing is None:
            return None
        a, b = self.missing
        steps = str(a) if a == b else f"{a}-{b}"
        return (f'precision-tool npu-dump --dump-step "{steps}" -- <your training command>, '
                f'and cpu-dump likewise')


def trace_state(ws: Workspace, npu_run: Run, golden_run: Run, step: int, variables: List[str],
                criteria=None, tables: Optional[Dict[int, pd.DataFrame]] = None) -> StateTrace:
    """Follow diverging variables back from `step` through the dumped steps before it.
    tables: compare tables already made, by step (made here where missing)."""
    trace = StateTrace(step, sorted(variables))
    wanted: Set[str] = set(variables)
    later = step
    for j in sorted((s for s in common_steps(npu_run, golden_run) if s < step), reverse=True):
        table = (tables or {}).get(j)
        if table is None:
            table = vector_compare(ws, npu_run, golden_run, j, threshold=criteria)
        trace.looked_at.append(j)
        rows = OpRows(table, criteria)
        state = _state_rows(rows)
        started = {v for v in wanted if state.get(v, {}).get("start")}
        wrote = {v for v in wanted if state.get(v, {}).get("written")}
        if started:                      # already wrong when step j began: further back
            wanted, later = started, j
            continue
        if wrote:                        # step j wrote it; the steps after j kept it
            trace.written_at = j
            trace.writers = sorted({w for v in wrote for w in state[v]["writers"]})
            cause = root_cause(table, rows=rows)
            # so does an update that only carried on what came in diverging and changed
            # nothing in its step (a momentum buffer that took a gradual gradient), where
            # that step has no finding
            quiet = {d.op_name for d in cause.no_effect if not d.is_origin} \
                if not cause.origins else set()
            trace.writers_noise = set(trace.writers) <= \
                cause.noise_ops | cause.gradual_ops | quiet
            return trace
        # right at the start and at the end of step j: it went wrong in the steps after j
        trace.missing = [j + 1, later - 1] if later - 1 >= j + 1 else None
        return trace
    # already wrong at the start of the earliest dumped step: written before it
    trace.missing = [0, later - 1] if later > 0 else None
    return trace
