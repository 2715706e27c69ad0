"""Another tool's dump made a run of the workspace, by reference: <target>/debug_<k>/run.json
records where the dump is (source), which of its ranks the run is (rank) and what the dump
says it is (format, task, level, framework); nothing is copied (such dumps run to
terabytes). Each rank of a dump is a run of its own. Importing the same rank of the same dump
as the same target again gives the run made the first time."""
from __future__ import annotations

import os
from typing import List

from ..errors import WorkspaceError
from ..fileio import write_text_atomic
from . import layout
from .formats import msprobe
from .run import Run
from .runwriter import run_json
from ..version import __version__

FORMAT = "msprobe"


def import_dump(ws, path: str, target: layout.Target) -> List[Run]:
    """Every rank of the msprobe dump at `path` (its root, a step<N> directory or a rank's)
    as a run of `target`, in rank order: the runs already made for it, else new ones
    written into the workspace's results directory. An error in one line where path is no
    msprobe dump, or a dump in which no step was written whole."""
    if not os.path.isdir(path):
        raise WorkspaceError(f"no directory {path}")
    ranks = msprobe.ranks_of(path)
    if not ranks:
        raise WorkspaceError(f"{path} is not an msprobe dump (no step<N>/rank<R>/ or "
                             f"step<N>/proc<PID>/ directories under it)")
    source = _dump_root(path)
    whole = {rank: [s for s, d in steps.items() if msprobe.claims(d)]
             for rank, steps in ranks.items()}
    if not any(whole.values()):
        raise WorkspaceError(f"the msprobe dump {source} holds no whole step: no dump.json in "
                             f"any of its rank directories (was the dump cut off, or did "
                             f"the debugger never stop()?)")
    parent = ws.results_dir(target.name)       # made first: a new workspace lists nothing
    runs = []
    for rank, steps in ranks.items():
        runs.append(_existing(ws, source, rank, target)
                    or _write(ws, parent, source, rank, steps, target))
    return runs


def _dump_root(path: str) -> str:
    """The dump's root directory, whichever of its directories path names."""
    path = os.path.realpath(path)
    base = os.path.basename(path)
    if msprobe.RANK_DIR.fullmatch(base):
        return os.path.dirname(os.path.dirname(path))
    if msprobe.STEP_DIR.fullmatch(base) and not any(
            msprobe.STEP_DIR.fullmatch(d) for d in os.listdir(path)):
        return os.path.dirname(path)
    return path


def _existing(ws, source: str, rank: str, target: layout.Target):
    for run in ws.runs(target.name):
        if run.info.get("source") == source and run.info.get("rank") == rank:
            return run
    return None


def _write(ws, parent: str, source: str, rank: str, steps: dict, target: layout.Target) -> Run:
    first = next((d for _, d in sorted(steps.items()) if msprobe.claims(d)), None)
    described = msprobe.describe(first) if first else {}
    info = {"writer": FORMAT, "format": FORMAT, "imported_by": f"precision_tool {__version__}",
            "target": target.name, "kind": target.kind, "source": source, "rank": rank,
            "rank_number": msprobe.rank_number(rank), **described}
    if described.get("framework") == "pytorch":      # its calls are PyTorch's APIs
        info["front_end"] = "pytorch"
    try:
        run_dir = layout.next_debug_dir(parent, None, ws.first_free(target.name))
        write_text_atomic(os.path.join(run_dir, "run.json"), run_json(info))
    except OSError as e:
        raise WorkspaceError(f"cannot import {source} into {parent}: {e.strerror or e}") from None
    ws.relist()                 # the caller's index now lists the new run
    return ws.resolve_run(run_dir, target.name)


def summary(run: Run) -> dict:
    """What `import` says of a run it made or found."""
    info = run.info
    return {"run": run.label, "source": info.get("source"), "rank": info.get("rank"),
            "format": info.get("format"), "task": info.get("task"), "level": info.get("level"),
            "framework": info.get("framework"), "steps": run.complete_steps,
            "partial_steps": run.interrupted}
