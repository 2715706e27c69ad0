"""What a workspace holds on disk, and what `clean` may delete: the runs replays wrote
(`fo`, `train`: each a directory npu/debug_<k> whose run.json names the run it replays),
compare results older than the newest few (temp/vector_compare/<timestamp>/) and the partial
steps a killed or stopped dump left (hidden .<step>.partial directories, never read).
Original runs' whole steps are never candidates."""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict, dataclass
from typing import List, Optional

from . import layout
from .workspace import Workspace

RESULTS_DIR = os.path.join("temp", "vector_compare")
PARTIAL_QUIET = 60.0        # seconds a partial step must have been left alone to be deleted


@dataclass
class Doomed:
    path: str
    bytes: int
    why: str


def size_of(path: str) -> int:
    """Bytes of the files below path (links not followed)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def _newest_change(path: str) -> float:
    """The newest modification time below path (the directory's own included)."""
    newest = os.lstat(path).st_mtime
    for dirpath, dirnames, files in os.walk(path):
        for name in dirnames + files:
            try:
                newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime)
            except OSError:
                pass
    return newest


def plan_clean(ws: Workspace, replays: bool = True, results: bool = True,
               keep: int = 1, partial: bool = True, now: Optional[float] = None) -> List[Doomed]:
    """What clean would delete, in the places that can be written (the workspace, the
    results directory): every replay run (replays), every compare result but the newest
    `keep` over both places (results), and every partial step a dump left (partial), but one
    changed in the last PARTIAL_QUIET seconds: a dump may be writing it now."""
    doomed = []
    now = time.time() if now is None else now
    deletable = lambda path: layout.writable(os.path.dirname(path))     # noqa: E731
    runs = ws.runs()
    if replays:
        for run in runs:
            if run.info.get("replay_of") and deletable(run.path):
                doomed.append(Doomed(run.path, size_of(run.path),
                                     f"{run.label}: a replay of {run.info['replay_of']}"))
    if partial:
        replaying = {d.path for d in doomed}
        for run in runs:
            # an imported dump is another tool's, read where it is: never changed here
            if run.path in replaying or run.info.get("source"):
                continue
            for path in run.partials:
                if deletable(path) and now - _newest_change(path) >= PARTIAL_QUIET:
                    doomed.append(Doomed(path, size_of(path),
                                         f"{run.label}: a partial step ({run.why_partial})"))
    if results:
        stamps = []
        for place in ws.places:
            parent = os.path.join(place, RESULTS_DIR)
            if os.path.isdir(parent) and layout.writable(parent):
                stamps += [(d, os.path.join(parent, d)) for d in os.listdir(parent)
                           if os.path.isdir(os.path.join(parent, d))]
        stamps.sort()
        for stamp, path in stamps[:max(len(stamps) - keep, 0)]:
            doomed.append(Doomed(path, size_of(path), f"compare result {stamp}"))
    return doomed


@dataclass
class Cleaning:
    """What `clean` deleted (on a dry run: would delete), each with its size and why, and
    the bytes in all."""
    dry_run: bool
    deleted: List[Doomed]
    bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def clean(ws: Workspace, replays: bool = True, results: bool = True, keep: int = 1,
          partial: bool = True, dry_run: bool = False) -> Cleaning:
    """plan_clean's choice, deleted unless dry_run."""
    doomed = plan_clean(ws, replays, results, keep, partial)
    if not dry_run:
        delete(ws, doomed)
    return Cleaning(dry_run, doomed, sum(d.bytes for d in doomed))


def delete(ws: Workspace, doomed: List[Doomed]) -> None:
    """Delete what plan_clean chose; a path outside the workspace and its results directory
    is refused; a failure names the file it failed on, whole."""
    places = [os.path.realpath(p) + os.sep for p in ws.places]
    for d in doomed:
        if not any(os.path.realpath(d.path).startswith(p) for p in places):
            raise ValueError(f"{d.path} is outside the workspace {ws.root}")

        def failed(function, path, exc_info):
            e = exc_info[1]
            if isinstance(e, OSError):
                raise OSError(e.errno, e.strerror, os.path.abspath(path)) from None
            raise e
        shutil.rmtree(d.path, onerror=failed)
