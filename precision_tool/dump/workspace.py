"""Reading a precision_data/ workspace: the one index of what is on disk.

`Workspace(root)` lists runs, their steps and graphs from the directory tree once, reads a
step's index once (a table.Table, cached: index_table; as a pandas DataFrame:
index) and loads tensors lazily, never unpickling. pandas is imported only when a
DataFrame is asked for or a step history is read: vc and vcs start without it. What a
step directory holds is read by its format (dump.formats: ours, Ascend's); tensors are .npy
files (formats.npy).
"""
from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

import numpy as np

from ..errors import PrecisionToolError, WorkspaceError  # noqa: F401 (WorkspaceError: its API's)
from ..graph.serialize import GraphView
from ..table import Table
from . import layout
from .formats import (INTEGER_COLUMNS, STAT_COLUMNS, msprobe, read_step_calls, read_step_index,
                      read_tensor_file)
from .formats.npy import Confined
from .formats.ours import (read_compiled_graph, read_fusion_result, read_run_json,
                           read_step_history)
from .run import Run, StepDump  # noqa: F401 (the types its API returns)

if TYPE_CHECKING:
    import pandas as pd


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class Workspace:
    """root: the dumps, only read; results: where commands write what they make (compare
    results, replays, reports, fix configs): layout.resolve_results, the workspace itself when
    it can be written. Runs are listed from both: a replay written beside a read-only
    workspace is one of its runs."""

    def __init__(self, root: Optional[str] = None, results: Optional[str] = None):
        self.root = layout.resolve_root(root)
        self._results_given = results
        self._results: Optional[tuple] = None
        # told the results directory once, the first time something is written beside a
        # workspace that cannot be written (the command line says it on stderr)
        self.announce: Optional[Callable[[str], None]] = None
        self._runs: Optional[Dict[tuple, Run]] = None
        self._indexes: Dict[tuple, Table] = {}
        self._graphs: Dict[str, Optional[dict]] = {}
        self._views: Dict[str, Optional[GraphView]] = {}
        # tensor files are opened only where they resolve inside the workspace or its results
        self._opener = Confined(self.root, lambda: self.results, self._sources)

    # -- where results go ---------------------------------------------------------------------
    @property
    def results(self) -> str:
        """The directory commands write into (see the class)."""
        if self._results is None:
            self._results = layout.resolve_results(self.root, self._results_given)
        return self._results[0]

    @property
    def results_elsewhere(self) -> bool:
        """Results go beside a workspace that cannot be written, where nobody named."""
        self.results
        return self._results[1] == "read-only"

    def results_dir(self, *parts: str) -> str:
        """<results>/<parts...>, made if missing; one line naming it when it cannot be."""
        if self.announce is not None and self.results_elsewhere:
            announce, self.announce = self.announce, None
            announce(self.results)
        path = os.path.join(self.results, *parts)
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise WorkspaceError(f"cannot write results into {path}: {e.strerror or e} "
                                 f"(give --results-dir DIR or {layout.ENV_RESULTS})") from None
        return path

    @property
    def places(self) -> List[str]:
        """Where what commands made can be: the workspace, and the results directory when
        that is elsewhere (a result made while the workspace could be written stays found)."""
        return [self.root] + ([self.results] if self.results != self.root else [])

    @property
    def where(self) -> tuple:
        """(root, results): what opens the same workspace elsewhere (Workspace(*where))."""
        return (self.root, self.results)

    def _sources(self) -> List[str]:
        """The dumps the workspace's imported runs refer to (dump.imports): read in place."""
        try:
            runs = self.runs()
        except WorkspaceError:
            return []
        return [r.info["source"] for r in runs if isinstance(r.info.get("source"), str)]

    def relist(self) -> None:
        """List the runs again when next asked (a command added one)."""
        self._runs = None
        self._opener = Confined(self.root, lambda: self.results, self._sources)

    def reopened(self) -> "Workspace":
        """A new index of the same workspace and results (after a command wrote a run)."""
        ws = Workspace(self.root, self._results_given)
        ws.announce = self.announce
        return ws

    def first_free(self, target: str) -> int:
        """The least k a new debug_<k> of target may take so that no listed run has its name."""
        return 1 + max((int(r.name.split("_")[1]) for r in self.runs(target)), default=-1)

    # -- what is there ------------------------------------------------------------------------
    def runs(self, target: Optional[str] = None) -> List[Run]:
        if self._runs is None:
            if not os.path.isdir(self.root):
                raise WorkspaceError(f"no workspace at {self.root} (run a dump first, or give "
                                     f"--data-dir / {layout.ENV_ROOT})")
            self._runs = {}
            names = []
            for base in self.places:
                for tgt in _target_names(base):
                    self._list_runs(base, tgt)
                    names += [tgt] if tgt not in names else []
            # the device's runs first, then by target as listed (npu, cpu, the rest by name)
            self._runs = dict(sorted(self._runs.items(), key=lambda kv: (
                kv[1].kind != layout.DEVICE, names.index(kv[0][0]),
                int(kv[0][1].split("_")[1]))))
        return [r for r in self._runs.values() if target is None or r.target == target]

    @property
    def targets(self) -> List[str]:
        """The targets that hold runs, in the order runs are listed."""
        return list(dict.fromkeys(r.target for r in self.runs()))

    def _list_runs(self, base: str, tgt: str) -> None:
        parent = os.path.join(base, tgt)
        if not os.path.isdir(parent):
            return
        names = [d for d in os.listdir(parent) if re.fullmatch(r"debug_\d+", d)]
        for name in sorted(names, key=lambda d: int(d.split("_")[1])):
            if (tgt, name) in self._runs:      # a results directory that is another workspace
                continue
            path = os.path.join(parent, name)
            run = Run(tgt, name, path, read_run_json(os.path.join(path, "run.json")))
            source = run.info.get("source")
            if isinstance(source, str) and source:      # an imported dump: read where it is
                run.steps = self._find_imported_steps(run, source)
            else:
                run.steps = self._find_steps(run)
            self._find_bundles(run)
            run.interrupted = sorted(set(run.interrupted))
            self._runs[(tgt, name)] = run

    def run(self, target: str, name: Optional[str] = None) -> Run:
        runs = self.runs(target)
        if not runs:
            inner = os.path.join(self.root, layout.DEFAULT_ROOT)
            hint = (f" (it holds {inner}: give --data-dir that)"
                    if os.path.isdir(os.path.join(inner, target)) else "")
            raise WorkspaceError(f"the workspace {self.root} has no {target} run{hint}")
        if name is None:    # the newest original run that dumped something, else the newest
            with_steps = [r for r in runs if any(s.complete for s in r.steps)]
            originals = [r for r in with_steps
                         if not r.info.get("replay_of") and not r.info.get("values_from")]
            return (originals or with_steps or runs)[-1]
        for r in runs:
            if r.name == name:
                return r
        raise WorkspaceError(f"no {target} run {name!r} in {self.root}; runs: {[r.name for r in runs]}")

    def resolve_run(self, spec: Optional[str], target: str) -> Run:
        """The one way commands name a run: npu/debug_1, debug_1 (this target's first) or its
        directory; None is the target's default run (Workspace.run)."""
        if spec is None:
            return self.run(target)
        if msprobe.is_dump(spec):             # another tool's dump: a run of its own
            return self.imported(spec, target)[0]
        path = os.path.realpath(spec)
        for r in self.runs():
            if os.path.realpath(r.path) == path:
                return r
        if "/" in spec.strip("/"):
            t, _, name = spec.strip("/").partition("/")
            if t in self.targets and name:
                return self.run(t, name)
        for t in [target] + [t for t in self.targets if t != target]:
            for r in self.runs(t):
                if r.name == spec:
                    return r
        raise WorkspaceError(f"no run {spec!r} in {self.root}; runs: "
                             f"{[r.label for r in self.runs()] or 'none'}")

    def imported(self, path: str, target: str) -> List[Run]:
        """The runs (one per rank, in rank order) that the msprobe dump at path is in this
        workspace as runs of target: made on first use (dump.imports)."""
        from .imports import import_dump
        return import_dump(self, path, layout.target_of(target, {}))

    def reference_for(self, run: Run, among: Optional[List[Run]] = None) -> Optional[Run]:
        """run's own rank's reference: of `among` (the ranks of a reference dump), the one
        of run's rank (else the first); without it, for one rank of a distributed launch
        (run.json's rank_group), the newest reference run of the same launch and rank, else
        (the golden launched apart from the NPU run) the newest original reference run of
        the same rank of a launch as wide; None for any other run (a rank's run is never
        compared with another rank's by default: their data differ)."""
        rank = run.info.get("rank")
        if among is not None:
            same = [r for r in among if r.info.get("rank") == rank]
            return (same or among or [None])[0]
        group = run.info.get("rank_group")
        if not group:
            return None
        references = [r for r in self.runs() if r.kind == layout.REFERENCE and
                      r.info.get("rank") == rank]
        same = [r for r in references if r.info.get("rank_group") == group]
        if same:
            return same[-1]
        apart = [r for r in references if r.info.get("world_size") == run.info.get("world_size")
                 and not r.info.get("replay_of") and r.complete_steps]
        return apart[-1] if apart else None

    def default_reference(self, run: Run) -> Run:
        """The reference a run is compared with when none is named: its own rank's
        (reference_for), else the newest golden run."""
        return self.reference_for(run) or self.run("cpu")

    def resolve_step(self, run: Run, step: Optional[int] = None) -> int:
        """The step asked for, checked to be dumped whole in the run (the error names the
        runs that have it), or the run's first complete step."""
        if step is None:
            if not run.complete_steps:
                raise WorkspaceError(f"{run.label} has no complete dumped step"
                                     + (f" (interrupted: {run.interrupted})" if run.interrupted else ""))
            return run.complete_steps[0]
        if step < 0:
            raise WorkspaceError(f"step {step} is negative: steps count from 0")
        try:
            run.step(step)
        except WorkspaceError as e:
            others = [r.label for r in self.runs() if r is not run and step in r.complete_steps]
            raise WorkspaceError(f"{e}" + (f"; runs with step {step}: {', '.join(others)}"
                                           if others else "")) from None
        return step

    def _find_bundles(self, run: Run) -> None:
        """A run's replay bundles: whole ones (replay/<step>/) and interrupted ones
        (replay/.<step>.partial/, a killed dump's)."""
        replay_dir = os.path.join(run.path, "replay")
        names = os.listdir(replay_dir) if os.path.isdir(replay_dir) else []
        run.bundles = sorted(int(d) for d in names if d.isdigit())
        for d in names:
            if m := re.fullmatch(r"\.(\d+)\.partial", d):
                run.interrupted.append(int(m.group(1)))
                run.partials.append(os.path.join(replay_dir, d))

    def bundle_path(self, run: Run, step: int) -> str:
        """The replay bundle of a step, refused in one line when it is missing or interrupted."""
        if step in run.bundles:
            return os.path.join(run.path, "replay", str(step))
        if step in run.interrupted:
            raise WorkspaceError(f"the replay bundle of step {step} of {run.label} is partial "
                                 f"({run.why_partial}): it cannot be replayed")
        raise WorkspaceError(f"{run.label} has no replay bundle for step {step}"
                             + (f"; bundles: {run.bundles}" if run.bundles else
                                " (dump the step with the 'dump' action)"))

    def _find_imported_steps(self, run: Run, source: str) -> List[StepDump]:
        """An imported dump's steps for the run's rank (dump.imports): a step whose
        dump.json was never written is partial."""
        rank = run.info.get("rank")
        steps = msprobe.ranks_of(source).get(rank, {}) if isinstance(rank, str) else {}
        out = []
        for step, path in sorted(steps.items()):
            if msprobe.claims(path):
                out.append(StepDump(step, path, True))
            else:
                run.interrupted.append(step)
                run.partials.append(path)
        return out

    def _find_steps(self, run: Run) -> List[StepDump]:
        dump = os.path.join(run.path, "dump")
        if not os.path.isdir(dump):
            return []
        steps = []
        # a device: dump/<time>/<device>/<graph>/<graph_id>/<step>; a reference: dump/<step>
        depth = 5 if run.kind == layout.DEVICE else 1
        for dirpath, dirnames, _ in os.walk(dump):
            rel = os.path.relpath(dirpath, dump)
            level = 0 if rel == "." else rel.count(os.sep) + 1
            if level == depth - 1:
                for d in sorted(dirnames):
                    if re.fullmatch(r"\.\d+\.partial", d):
                        run.interrupted.append(int(d[1:-len(".partial")]))
                        run.partials.append(os.path.join(dirpath, d))
            if level == depth:
                dirnames[:] = []
                name = os.path.basename(dirpath)
                if name.isdigit():
                    has_index = os.path.isfile(os.path.join(dirpath, layout.INDEX_FILE))
                    # a step of ours without an index was interrupted; a foreign one is indexed by name
                    steps.append(StepDump(int(name), dirpath, has_index or not run.ours))
            elif level > depth:
                dirnames[:] = []
        return sorted(steps, key=lambda s: s.step)

    def graph_json(self, run: Run) -> Optional[dict]:
        """The run's compiled graph, read and checked once (formats.ours.read_compiled_graph)."""
        if run.path not in self._graphs:
            self._graphs[run.path] = read_compiled_graph(run)
        return self._graphs[run.path]

    def compiled_graph(self, run: Run) -> Optional[GraphView]:
        """graph_json's graph read as NodeViews (graph.serialize.GraphView), once; None where
        the run has no compiled graph."""
        if run.path not in self._views:
            data = self.graph_json(run)
            try:
                # graph_json checked it, or it is the bytes our dumper wrote
                self._views[run.path] = GraphView(data, checked=True) if data is not None else None
            except PrecisionToolError as e:
                raise WorkspaceError(f"the compiled graph of {run.label} is broken: {e}") from None
        return self._views[run.path]

    def fusion_result(self, run: Run) -> Optional[dict]:
        """fusion_result.json's passes that fused something (formats.ours)."""
        return read_fusion_result(run)

    def step_history(self, run: Run) -> "pd.DataFrame":
        """step_history.csv (formats.ours.read_step_history)."""
        return read_step_history(run)

    def call_sites(self, run: Run, step: int) -> dict:
        """The step's call sites (op name -> {"module", "source"}), {} where none were
        written (the step's format's read_calls)."""
        sd = run.step(step)
        return read_step_calls(sd.path) if sd.complete else {}

    # -- a step's index -----------------------------------------------------------------------
    def index(self, run: Run, step: int) -> pd.DataFrame:
        """The step's index as a pandas DataFrame (a new one each call: callers may modify
        it)."""
        return self.index_table(run, step).to_frame()

    def index_table(self, run: Run, step: int) -> Table:
        """The step's index, read once per workspace: the index file's columns (text, or
        numbers: int64 for the INTEGER_COLUMNS, float64 for the rest), the statistics (nan
        where unknown) and the step. Shared: not to be modified (Table.with_column makes a
        new one)."""
        key = (run.path, step)
        table = self._indexes.get(key)
        if table is None:
            table = self._read_index(run, step)
            self._indexes[key] = table
            if len(self._indexes) > 64:          # bounded: drop the oldest
                self._indexes.pop(next(iter(self._indexes)))
        return table

    def _read_index(self, run: Run, step: int) -> Table:
        sd = run.step(step)
        if not sd.complete:
            raise WorkspaceError(f"step {step} of {run.target}/{run.name} is partial (its index "
                                 f"was never written: {run.why_partial}); it is not read")
        table = read_step_index(sd.path, run.kind)
        columns = {name: table[name] for name in table.columns}
        for name in INTEGER_COLUMNS:    # whole (_check_rows), or a foreign dump's holes
            if name in columns and np.isfinite(columns[name]).all():
                columns[name] = columns[name].astype(np.int64)
        for name in STAT_COLUMNS:       # floats even where all look integral; nan where unknown
            if name not in columns:
                columns[name] = np.full(len(table), np.nan)
        columns["step"] = np.full(len(table), step, dtype=np.int64)
        return Table(columns, len(table))

    # -- tensors ------------------------------------------------------------------------------
    def step_path(self, run: Run, step: int) -> str:
        return run.step(step).path

    def load(self, run: Run, step: int, file: str, shape: Optional[str] = None) -> np.ndarray:
        """A dumped tensor by its file name in the step (allow_pickle=False, never outside the
        workspace), in shape, its index line's, when given (in_row_shape)."""
        if not file:
            raise WorkspaceError(f"step {step} of {run.target}/{run.name} holds statistics only "
                                 f"(dump_data='stats'): no tensor file to load")
        return in_row_shape(self.load_file(os.path.join(self.step_path(run, step), file)),
                            shape)

    def load_file(self, path: str, mmap_over: Optional[int] = None) -> np.ndarray:
        """A tensor file that must resolve inside the workspace (an index names it); one larger
        than mmap_over bytes (default MMAP_BYTES) is mapped read-only."""
        return read_tensor_file(path, self._opener, mmap_over)


def in_row_shape(value: np.ndarray, shape) -> np.ndarray:
    """A tensor file's array in the shape its index line gives ("8 128 384", dims apart by
    spaces; "" for a scalar; None: not given): a view of another tensor, dumped in a big step,
    names a link to that tensor's file (the same elements in the same order, written once)
    and keeps its own shape in the index. Unchanged where the line gives no shape it can
    read, or one of another size (the file is what the comparison then judges)."""
    if not isinstance(shape, str) or (shape and not _DIMS.fullmatch(shape)):
        return value
    dims = tuple(int(d) for d in shape.split())
    if dims == value.shape or int(np.prod(dims, dtype=np.int64)) != value.size:
        return value
    return value.reshape(dims)


_DIMS = re.compile(r"\d+( \d+)*")


def _target_names(base: str) -> List[str]:
    """The directories of base that hold runs: npu and cpu (ours and Ascend's, with or
    without run.json), then any other target (layout.Target) with a run of ours."""
    names = [t.name for t in (layout.NPU, layout.GOLDEN)]
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return names
    for d in entries:
        if d in names or d in layout.NOT_TARGETS or not layout.TARGET_NAME.fullmatch(d):
            continue
        parent = os.path.join(base, d)
        try:
            runs = [r for r in os.listdir(parent) if re.fullmatch(r"debug_\d+", r)]
        except OSError:         # a file, or unreadable: not a target
            continue
        if any(os.path.isfile(os.path.join(parent, r, "run.json")) for r in runs):
            names.append(d)
    return names
