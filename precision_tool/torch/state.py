"""A script's step run on the golden from the NPU's state: what decides drift for a script.

A graph run's step replays from its bundle; a script's step is the script's loop body,
which nothing here can call on its own. So the golden reruns the script, and where a step
to judge begins (after the step before it ended) every variable the NPU run's dump of
that step read, parameters, buffers and optimizer state by their names, is set to the
NPU's value, and a GradScaler's scale to the one the NPU's step used (after an update the
NPU's scaler skipped, the golden's scale is still the higher one). The step then runs on
the golden from the NPU's own state, with the same batch (the same seed), and is dumped. Several steps are judged in one rerun: each starts
from the NPU's state again, whatever the steps before it left. After the last one the
script ends (StateReplayed, which the runner takes as a clean exit): the steps after it
would start from state the script never had. Needs the NPU's values: a tensor dump of the
steps."""
from __future__ import annotations

import os
from typing import Dict, List, Tuple

import numpy as np

from ..dump import Workspace
from ..dump.workspace import in_row_shape
from ..errors import PrecisionToolError


class StateReplayed(BaseException):
    """The golden's step from the NPU's state is written: the script stops here (a
    BaseException, as SystemExit is, so that a script's `except Exception` lets it by)."""


class StateError(PrecisionToolError, ValueError):
    """An NPU state that cannot be read (no such run or step, a statistics dump)."""


def parse_state_from(spec: str) -> Tuple[str, Tuple[int, ...]]:
    """"<NPU run directory>:<step>[,<step>...]" -> (the directory, the steps in order)."""
    path, _, steps = str(spec).rpartition(":")
    numbers = steps.split(",")
    if not path or not all(n.isdigit() for n in numbers):
        raise StateError(f"state_from must be <NPU run directory>:<step>[,<step>...], "
                         f"got {spec!r}")
    return path, tuple(sorted({int(n) for n in numbers}))


def _state_rows(ws: Workspace, run, step: int):
    """The rows of the step's Variables in the NPU run's index; StateError where the index
    cannot be read or holds statistics only."""
    try:
        table = ws.index(run, step)
    except (PrecisionToolError, OSError) as e:
        raise StateError(f"the NPU state of step {step} cannot be read: {e}") from None
    rows = table[(table.op_type == "Variable") & (table.io == "output")]
    if len(rows) and not rows.file.astype(str).str.len().all():
        raise StateError(f"step {step} of {run.label} holds statistics only: its state has "
                         f"no values to start the golden from (dump it in tensor mode)")
    return rows


def _npu_run(run_dir: str, step: int):
    """(workspace, run) of the NPU run in run_dir; StateError where it cannot be opened."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(run_dir)))
    try:
        ws = Workspace(root)
        return ws, ws.resolve_run(run_dir, "npu")
    except (PrecisionToolError, OSError) as e:
        raise StateError(f"the NPU state of step {step} cannot be read: {e}") from None


def npu_state(run_dir: str, step: int) -> Dict[str, np.ndarray]:
    """The variables (name -> value) that the NPU run in run_dir read in `step`, as its
    dump holds them when the step read them first: the state the step started from."""
    ws, run = _npu_run(run_dir, step)
    rows = _state_rows(ws, run, step)
    try:
        return {str(r.op_name): in_row_shape(ws.load(run, step, str(r.file)), r.shape)
                for r in rows.itertuples()}
    except (PrecisionToolError, OSError, ValueError) as e:
        raise StateError(f"the NPU state of step {step} cannot be read: {e}") from None


def npu_loss_scale(run_dir: str, step: int):
    """The loss scale the NPU run's step used (its step history's), None where it has none
    (no loss scaler, or a history that cannot be read): a step after an update the NPU's
    scaler skipped and the golden's took starts from a scale the golden's never lowered."""
    try:
        ws, run = _npu_run(run_dir, step)
        history = ws.step_history(run)
        scale = history.loss_scale[history.step == step]
    except (PrecisionToolError, OSError, AttributeError, ValueError):
        return None
    return float(scale.iloc[0]) if len(scale) and scale.iloc[0] == scale.iloc[0] else None


def missing_state(ws: Workspace, run, step: int) -> str:
    """Why npu_state(run.path, step) would fail, found without reading a value: the step's
    index unreadable, statistics only, or a Variable's file not there ("" when every file
    is): a rerun that starts several steps from the NPU's state leaves such a step out
    rather than failing for all of them."""
    try:
        rows = _state_rows(ws, run, step)
    except StateError as e:
        return str(e)
    where = ws.step_path(run, step)
    for f in rows.file.astype(str):
        if not os.path.isfile(os.path.join(where, f)):
            return (f"the NPU state of step {step} cannot be read: tensor file "
                    f"{os.path.join(where, f)} is missing")
    return ""


def set_state(variables, values: Dict[str, np.ndarray]) -> Tuple[int, List[str]]:
    """Each live tensor of `variables` ((tensor, name) pairs) that `values` names set to
    that value in its own dtype; (how many were set, the names of values that matched no
    live tensor or not its size)."""
    import torch
    found = set()
    # (outside the debugger's function mode: setting the state is no call of the step)
    with torch.no_grad(), torch._C.DisableTorchFunction():
        for t, name in variables:
            value = values.get(name)
            if value is None or value.size != t.numel():
                continue
            source = torch.from_numpy(np.ascontiguousarray(value).reshape(tuple(t.shape)))
            t.copy_(source.to(t.dtype))
            found.add(name)
    return len(found), sorted(set(values) - found)
