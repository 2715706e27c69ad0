"""What a workspace holds on disk, and what `clean` may delete: the runs replays wrote
(`fo`, `train`: each a directory npu/debug_<k> whose run.json names the run it replays) and
compare results older than the newest few (temp/vector_compare/<timestamp>/). Original runs
are never candidates."""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import List

from .workspace import Workspace

RESULTS_DIR = os.path.join("temp", "vector_compare")


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


def plan_clean(ws: Workspace, replays: bool = True, results: bool = True,
               keep: int = 1) -> List[Doomed]:
    """What clean would delete: every replay run (replays=True) and every compare result but
    the newest `keep` (results=True)."""
    doomed = []
    if replays:
        for run in ws.runs():
            if run.info.get("replay_of"):
                doomed.append(Doomed(run.path, size_of(run.path),
                                     f"{run.label}: a replay of {run.info['replay_of']}"))
    if results:
        parent = os.path.join(ws.root, RESULTS_DIR)
        stamps = sorted(d for d in os.listdir(parent) if os.path.isdir(os.path.join(parent, d))) \
            if os.path.isdir(parent) else []
        for stamp in stamps[:max(len(stamps) - keep, 0)]:
            path = os.path.join(parent, stamp)
            doomed.append(Doomed(path, size_of(path), f"compare result {stamp}"))
    return doomed


def delete(ws: Workspace, doomed: List[Doomed]) -> None:
    """Delete what plan_clean chose; a path outside the workspace is refused."""
    root = os.path.realpath(ws.root) + os.sep
    for d in doomed:
        if not os.path.realpath(d.path).startswith(root):
            raise ValueError(f"{d.path} is outside the workspace {ws.root}")
        shutil.rmtree(d.path)
