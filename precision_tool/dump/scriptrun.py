"""A training script run in a child process with dump settings in its environment: its exit
code and the runs its dumps wrote (each front-end names its run in the runner's file, see
runwriter). What the script runners and fix's reruns of a PyTorch script share."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from typing import List, Mapping, Optional, Sequence, Tuple

from ..fileio import write_text_atomic
from . import layout
from .runwriter import run_json


def runs_written(path: str) -> List[str]:
    """The run directories the script's dumps named in the runner's file, in order, once."""
    try:
        with open(path, encoding="utf-8") as f:
            return list(dict.fromkeys(line.strip() for line in f if line.strip()))
    except OSError:
        return []


def record_killed(run_dir: str, signum: int) -> None:
    """run.json of a run whose script a signal killed (SIGKILL: nothing in the script could
    say so) records it as the script's failure, in the step after the last it observed."""
    path = os.path.join(run_dir, "run.json")
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        return                  # no run to record it in: readers say what they cannot read
    if not isinstance(info, dict) or info.get("script_failed"):
        return
    try:
        with open(os.path.join(run_dir, layout.HISTORY_FILE), encoding="utf-8") as f:
            steps = [int(s) for s in (line.split(",", 1)[0] for line in f.read().splitlines()[1:])
                     if s.isdigit()]
    except OSError:
        steps = []
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    info["script_failed"] = {"step": max(steps) + 1 if steps else 0,
                             "error": f"killed by {name}"}
    try:
        write_text_atomic(path, run_json(info))
    except OSError:
        pass                    # the answer then says less; the run is as it was


def run_dumping(root: str, settings: Mapping[str, Optional[str]], command: Sequence[str],
                stdout=None, stderr=None, cwd: Optional[str] = None) -> Tuple[int, List[str]]:
    """Run `command` with `settings` (variable -> value; None left unset) and the workspace
    at root in its environment: (its exit code, the run directories it wrote, in order).
    OSError when the command cannot be started."""
    env = dict(os.environ)
    env.update({k: v for k, v in settings.items() if v is not None})
    env[layout.ENV_ROOT] = root
    fd, runs_file = tempfile.mkstemp(prefix="precision-tool-runs-", suffix=".txt")
    os.close(fd)
    env[layout.ENV_RUNS_FILE] = runs_file
    try:
        rc = subprocess.call(list(command), env=env, stdout=stdout, stderr=stderr, cwd=cwd)
        runs = runs_written(runs_file)
        if rc < 0:
            for run_dir in runs:
                record_killed(run_dir, -rc)
        return rc, runs
    finally:
        os.unlink(runs_file)
