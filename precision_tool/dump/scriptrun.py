"""A training script run in a child process with dump settings in its environment: its exit
code and the runs its dumps wrote (each front-end names its run in the runner's file, see
runwriter). What the script runners and fix's reruns of a PyTorch script share."""
from __future__ import annotations

import os
import subprocess
import tempfile
from typing import List, Mapping, Optional, Sequence, Tuple

from . import layout


def runs_written(path: str) -> List[str]:
    """The run directories the script's dumps named in the runner's file, in order, once."""
    try:
        with open(path, encoding="utf-8") as f:
            return list(dict.fromkeys(line.strip() for line in f if line.strip()))
    except OSError:
        return []


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
        return rc, runs_written(runs_file)
    finally:
        os.unlink(runs_file)
