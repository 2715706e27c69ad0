"""The files a dumped run keeps beside its steps: its directory (debug_<k>, claimed at the
start), run.json (what ran, and under which configuration; its list of dumped steps kept
up to date), the compiled graph and fusion_result.json of an NPU run, and the step history
(step_history.csv: status word and loss scale of every observed step, dumped or not)."""
from __future__ import annotations

import csv
import hashlib
import json
import os
import platform
import time
from typing import List, Optional

import numpy as np

from ..fileio import write_text_atomic
from ..graph import graph_to_json
from ..kernels.write import write_error
from ..version import __version__
from . import layout


def run_json(data) -> str:
    """The JSON text of a run-level file (and of an Opdebug record)."""
    return json.dumps(data, indent=1, sort_keys=False, default=str) + "\n"


class RunFiles:
    """A run's directory and its run-level files, for a session under a dump's settings."""

    def __init__(self, session, settings: layout.DumpSettings):
        self.npu = session.target == "npu"
        try:
            self.run_dir = layout.next_debug_dir(os.path.join(settings.root, session.target),
                                                 settings.debug_dir, settings.first_free)
        except OSError as e:        # a workspace under a file, a read-only disk...
            raise write_error(e) from None
        self.started = time.strftime("%Y%m%d%H%M%S")
        self.graph = session.compiled.graph if self.npu else session.graph
        self.dumped_steps: List[int] = []
        self.history: List[list] = []      # step_history.csv rows of every observed step
        self._history_written = 0          # how many of them are in the file
        self.history_at = 0.0              # when they were last appended (time.monotonic)
        self._info = self._run_info(session, settings)
        compiled = graph_to_json(self.graph) + "\n" if self.npu else None
        if compiled is not None:
            # a reader that finds these bytes unchanged knows the graph well formed (it came
            # from a Graph) and skips the walk that checks a hand-edited or foreign one
            self._info["graph_sha1"] = hashlib.sha1(compiled.encode("utf-8")).hexdigest()
        try:
            write_text_atomic(os.path.join(self.run_dir, "run.json"), run_json(self._info))
            if self.npu:
                graphs = os.path.join(self.run_dir, "graph")
                os.makedirs(graphs, exist_ok=True)
                write_text_atomic(os.path.join(graphs, f"{layout.mangle(self.graph.name)}.json"),
                                  compiled)
                write_text_atomic(os.path.join(self.run_dir, "fusion_result.json"),
                                  run_json(session.fusion_result()))
        except OSError as e:
            raise write_error(e) from None

    def steps_dir(self) -> str:
        """Where the step directories go, each named by its number (with the trailing
        separator): Ascend's dump/<time>/0/<graph>/0/ for an NPU run, dump/ for a golden."""
        if self.npu:
            return os.path.join(self.run_dir, "dump", self.started, "0",
                                layout.mangle(self.graph.name), "0", "")
        return os.path.join(self.run_dir, "dump", "")

    def _run_info(self, session, settings: layout.DumpSettings) -> dict:
        cfg = session.config
        source = session.graph
        info = {
            "writer": "precision_tool", "version": __version__, "target": session.target,
            "graph": source.name, "seed": source.seed, "started": self.started,
            "device_id": 0, "actions": sorted(settings.actions),
            "dump_step": "all" if settings.steps is None else sorted(settings.steps),
            "dump_mode": settings.mode, "dump_data": settings.data,
            "dumped_steps": [], "replay_of": settings.replay_of,
            "values_from": settings.values_from,
            "versions": {"python": platform.python_version(), "numpy": np.__version__},
        }
        if self.npu:
            info.update(precision_mode=cfg.precision_mode, amp_level=cfg.amp_level,
                        overflow_mode=cfg.overflow_mode, mode=cfg.mode,
                        fusion_passes=sorted(session.compiled.fusion),
                        numerics="simulated: cube ops accumulate in fp32, vector ops compute "
                                 "in fp32 and round per op")
        else:
            info.update(golden_dtype=cfg.golden_dtype)
        return info

    def observed(self, step: int, status: int, loss_scale: Optional[tuple],
                 loss: Optional[float] = None) -> None:
        """A step the session ran (dumped or not): its history row, written later."""
        scale = [repr(loss_scale[0]), repr(loss_scale[1]), int(loss_scale[2])] \
            if loss_scale else ["", "", ""]
        self.history.append([step, status, *scale, "" if loss is None else repr(loss)])

    def finish(self) -> None:
        """The history rows observed so far, and run.json's list of dumped steps, on disk."""
        self.write_history()
        if self._info["dumped_steps"] != self.dumped_steps:
            self._info["dumped_steps"] = list(self.dumped_steps)
            write_text_atomic(os.path.join(self.run_dir, "run.json"), run_json(self._info),
                              durable=False)

    def stopped(self, step: Optional[int], error: str) -> None:
        """run.json records that the dump stopped at `step` (a write failure) and why, with
        the steps that are on disk, and the history observed so far is written."""
        self._info["dump_stopped"] = {"step": step, "error": error}
        self._info["dumped_steps"] = list(self.dumped_steps)
        try:
            self.write_history()
        finally:
            write_text_atomic(os.path.join(self.run_dir, "run.json"), run_json(self._info),
                              durable=False)

    def write_history(self) -> None:
        """Append the rows observed since the last call (a named run's old history is
        replaced by the first). Called at most once a second while steps are written, and
        at close: a killed run loses a second of history at most (a torn last line is
        skipped by the reader); rewriting it all each step would grow with the run."""
        rows = self.history[self._history_written:]     # a snapshot: the main thread appends
        self.history_at = time.monotonic()
        if not rows:
            return
        path = os.path.join(self.run_dir, layout.HISTORY_FILE)
        try:
            with open(path, "a" if self._history_written else "w", encoding="utf-8",
                      newline="") as f:
                out = csv.writer(f, lineterminator="\n")
                if not self._history_written:
                    out.writerow(layout.HISTORY_HEADER.split(","))
                out.writerows(rows)
        except OSError as e:        # a write's own error names no file: say which
            self._history_written = 0      # the file may end torn: written whole next time
            raise OSError(e.errno, e.strerror, e.filename or path) from None
        self._history_written += len(rows)
