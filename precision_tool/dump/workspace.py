"""Reading a precision_data/ workspace: the one index of what is on disk.

`Workspace(root)` lists runs, their steps and graphs from the directory tree once, reads a
step's index once (a kernels.table Table, cached: index_table; as a pandas DataFrame:
index) and loads tensors lazily, never unpickling. pandas is imported only when a
DataFrame is asked for or a step history is read: vc and vcs start without it. Dumps
written by Ascend's tools (no index.csv; file names with or without the stream id) are
indexed from their file names and .npy headers.
"""
from __future__ import annotations

import errno
import functools
import hashlib
import io
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

import ml_dtypes
import numpy as np

from ..errors import GraphFormatError, PrecisionToolError
from ..graph.serialize import GraphView
from ..version import __version__
from ..fileio import READ_FLAGS, check_regular, load_json, open_regular, parse_json, read_bytes
from ..kernels.table import Table, TableError, read_csv
from . import layout

if TYPE_CHECKING:
    import pandas as pd


class WorkspaceError(PrecisionToolError, ValueError):
    """A workspace, run, step or file that is missing or unreadable."""


MMAP_BYTES = 64 * 2 ** 20
STAT_COLUMNS = ("max", "min", "mean", "l2norm")    # every index has them, as floats
INDEX_COLUMNS = ("op_type", "op_name", "io", "index", "tensor", "dtype", "shape", "file")
ASCEND_NPU_NAME = re.compile(
    r"^(?P<op_type>[^.]+)\.(?P<op_name>[^.]+)\.(?P<task_id>\d+)(?:\.(?P<stream_id>\d+))?"
    r"\.(?P<timestamp>\d+)\.(?P<io>input|output)\.(?P<index>\d+)\.npy$")
CPU_NAME = re.compile(r"^(?P<op_name>[^.]+)\.(?P<index>\d+)\.(?P<timestamp>\d+)\.npy$")


@dataclass
class StepDump:
    step: int
    path: str
    complete: bool          # its index.csv is written (an interrupted step has none)


@dataclass
class Run:
    target: str
    name: str
    path: str
    info: dict
    steps: List[StepDump] = field(default_factory=list)
    # steps left partial (a dump killed, or stopped by a write failure): their dump
    # directory or their replay bundle (never read); partials: those directories
    interrupted: List[int] = field(default_factory=list)
    partials: List[str] = field(default_factory=list)
    bundles: List[int] = field(default_factory=list)      # steps with a whole replay bundle

    @property
    def why_partial(self) -> str:
        """Why its partial steps are partial, as far as the run knows: the write failure
        that stopped its dump (run.json's dump_stopped), else a dump killed mid-step."""
        stopped = self.info.get("dump_stopped")
        if isinstance(stopped, dict):
            return f"the dump stopped at step {stopped.get('step')}: {stopped.get('error')}"
        return "the dump was killed or failed while writing them"

    @property
    def ours(self) -> bool:
        return self.info.get("writer") == "precision_tool"

    @property
    def label(self) -> str:
        """How commands name the run: npu/debug_0."""
        return f"{self.target}/{self.name}"

    @property
    def complete_steps(self) -> List[int]:
        return [s.step for s in self.steps if s.complete]

    def step(self, number: int) -> StepDump:
        for s in self.steps:
            if s.step == number and s.complete:
                return s
        if number in self.interrupted or any(s.step == number for s in self.steps):
            raise WorkspaceError(f"step {number} of {self.label} is partial ({self.why_partial}); "
                                 f"it is not read (dumped steps: "
                                 f"{layout.format_steps(self.complete_steps) or 'none'})")
        raise WorkspaceError(f"{self.label} has no dump of step {number}; "
                             f"dumped steps: {layout.format_steps(self.complete_steps) or 'none'}")


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
        self._real_root = os.path.realpath(self.root)
        self._real_dirs: Dict[str, str] = {}
        self._real_results: Optional[str] = None

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
            for base in self.places:
                for tgt in ("npu", "cpu"):
                    self._list_runs(base, tgt)
            self._runs = dict(sorted(self._runs.items(), key=lambda kv: (
                kv[0][0] != "npu", int(kv[0][1].split("_")[1]))))
        return [r for r in self._runs.values() if target is None or r.target == target]

    def _list_runs(self, base: str, tgt: str) -> None:
        parent = os.path.join(base, tgt)
        if not os.path.isdir(parent):
            return
        names = [d for d in os.listdir(parent) if re.fullmatch(r"debug_\d+", d)]
        for name in sorted(names, key=lambda d: int(d.split("_")[1])):
            if (tgt, name) in self._runs:      # a results directory that is another workspace
                continue
            path = os.path.join(parent, name)
            run = Run(tgt, name, path, _read_json(os.path.join(path, "run.json")))
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
        path = os.path.realpath(spec)
        for r in self.runs():
            if os.path.realpath(r.path) == path:
                return r
        if "/" in spec.strip("/"):
            t, _, name = spec.strip("/").partition("/")
            if t in ("npu", "cpu") and name:
                return self.run(t, name)
        for t in (target, "cpu" if target == "npu" else "npu"):
            for r in self.runs(t):
                if r.name == spec:
                    return r
        raise WorkspaceError(f"no run {spec!r} in {self.root}; runs: "
                             f"{[r.label for r in self.runs()] or 'none'}")

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

    def _find_steps(self, run: Run) -> List[StepDump]:
        dump = os.path.join(run.path, "dump")
        if not os.path.isdir(dump):
            return []
        steps = []
        # npu: dump/<time>/<device>/<graph>/<graph_id>/<step>; cpu: dump/<step>
        depth = 5 if run.target == "npu" else 1
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
        """The run's compiled graph (NPU runs), read and checked once: None where the run has
        none (a golden run, a foreign dump); one that cannot be read as a graph is an error,
        never an empty graph (the mapping would then silently miss every fused op), and so
        is a missing one where our NPU dump always writes it."""
        if run.path not in self._graphs:
            gdir = os.path.join(run.path, "graph")
            files = sorted(f for f in os.listdir(gdir) if f.endswith(".json")) if os.path.isdir(gdir) else []
            if files:
                path = os.path.join(gdir, files[0])
                raw = read_bytes(path, WorkspaceError, "compiled graph")
                data = parse_json(raw, path, WorkspaceError, "compiled graph")
                # the bytes our dumper wrote, unchanged: well formed by construction
                written = run.ours and run.info.get("graph_sha1") == hashlib.sha1(raw).hexdigest() \
                    and run.info.get("version") == __version__
                try:
                    check_compiled_graph(data, walk=not written)
                except PrecisionToolError as e:
                    raise WorkspaceError(f"compiled graph {path} is broken: {e}") from None
                self._graphs[run.path] = data
            elif run.ours and run.target == "npu":
                raise WorkspaceError(f"{run.label} has no compiled graph ({gdir}/*.json is missing)")
            else:
                self._graphs[run.path] = None
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
        """fusion_result.json of an NPU run as pass -> fused nodes, for the passes that fused
        something; None where the run has no such record (a golden run, a foreign dump). A
        broken one, or one missing where our NPU dump always writes it, is an error: "no pass
        fired" would be a guess."""
        path = os.path.join(run.path, "fusion_result.json")
        if not os.path.isfile(path):
            if run.ours and run.target == "npu":
                raise WorkspaceError(f"{run.label} has no fusion result ({path} is missing)")
            return None
        data = load_json(path, WorkspaceError, "fusion result")
        fired = {}
        try:
            if not isinstance(data, dict):
                raise TypeError("not an object of graphs")
            for graph in data.values():
                for kind in ("graph_fusion", "ub_fusion"):
                    for name, counts in graph.get(kind, {}).items():
                        effect = counts.get("effect_times", 0)
                        nodes = counts.get("fused_nodes", [])
                        if not isinstance(effect, int) or not isinstance(nodes, list) or \
                                not all(isinstance(n, str) for n in nodes):
                            raise TypeError(f"pass {name!r} has malformed counts")
                        if effect > 0:
                            fired[str(name)] = list(nodes)
        except (AttributeError, TypeError) as e:
            raise WorkspaceError(f"fusion result {path} is broken: {e}") from None
        return fired

    def step_history(self, run: Run) -> pd.DataFrame:
        """step_history.csv: every observed step's status word, loss scale and loss (empty if
        the run predates it or observed no step; loss nan where not recorded). A torn last
        line is dropped."""
        import pandas as pd
        path = os.path.join(run.path, layout.HISTORY_FILE)
        columns = layout.HISTORY_HEADER.split(",")
        if not os.path.isfile(path):
            return pd.DataFrame(columns=columns)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            # rows are written whole, each ending its line: a last line without its end was
            # torn by a kill, and a number cut short in it would still parse
            text = text[:text.rfind("\n") + 1] if not text.endswith("\n") else text
            table = pd.read_csv(io.StringIO(text), on_bad_lines="skip")
            if list(table.columns) == layout.HISTORY_HEADER_V1.split(","):
                table["loss"] = float("nan")          # written before the loss was
            if list(table.columns) != columns:
                raise ValueError(f"columns {list(table.columns)}")
            table = table.dropna(subset=["step", "status"]).astype({"step": int, "status": int})
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError,
                OSError) as e:
            raise WorkspaceError(f"{path} is not a readable step history: {e}") from None
        return table.sort_values("step", kind="stable").reset_index(drop=True)

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
        index_path = os.path.join(sd.path, layout.INDEX_FILE)
        if os.path.isfile(index_path):
            table = _read_index_file(index_path)
        else:
            table = _index_from_names(sd.path, run.target)
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

    def load(self, run: Run, step: int, file: str) -> np.ndarray:
        """A dumped tensor by its file name in the step (allow_pickle=False, never outside the
        workspace)."""
        if not file:
            raise WorkspaceError(f"step {step} of {run.target}/{run.name} holds statistics only "
                                 f"(dump_data='stats'): no tensor file to load")
        return self.load_file(os.path.join(self.step_path(run, step), file))

    def load_file(self, path: str, mmap_over: Optional[int] = None) -> np.ndarray:
        """A tensor file that must resolve inside the workspace (an index names it); one larger
        than mmap_over bytes (default MMAP_BYTES) is mapped read-only."""
        return read_tensor_file(path, self._open_inside, mmap_over)

    def _open_inside(self, path: str) -> int:
        """A read-only descriptor of the file, checked to resolve inside the workspace. Its
        directory is resolved once (a compare opens thousands of files in a few); the file is
        opened without following a link (no lstat per file), and one that is a link is
        resolved and checked before it is opened."""
        # string operations, not os.path's: a compare opens thousands of files
        directory, _, name = (path if path.startswith(os.sep) else os.path.abspath(path)).rpartition(os.sep)
        real_dir = self._real_dirs.get(directory)
        if real_dir is None:
            real_dir = self._real_dirs[directory] = os.path.realpath(directory or os.sep)
        real = real_dir + name if real_dir.endswith(os.sep) else real_dir + os.sep + name
        if _NOFOLLOW:
            self._check_inside(path, real)
            try:
                return os.open(real, READ_FLAGS | _NOFOLLOW)
            except OSError as e:
                if e.errno != errno.ELOOP:
                    raise
        real = os.path.realpath(real)
        self._check_inside(path, real)
        return os.open(real, READ_FLAGS)

    def _check_inside(self, path: str, real: str) -> None:
        if not real.startswith(self._real_root + os.sep):
            if self._real_results is None:
                self._real_results = os.path.realpath(self.results)
            if not real.startswith(self._real_results + os.sep):
                raise WorkspaceError(f"{path} is outside the workspace {self.root}")


def read_tensor_file(path: str, opener=None, mmap_over: Optional[int] = None) -> np.ndarray:
    """An .npy file read as read_npy reads it (allow_pickle=False, sizes checked, a large one
    memory-mapped), its failures as one-line WorkspaceErrors. opener(path) -> descriptor:
    the workspace passes one that refuses paths outside it; a path the user typed
    (pt, cp, dc) is opened as it is."""
    try:
        fd = opener(path) if opener else os.open(path, READ_FLAGS)
        try:
            # a large tensor is memory-mapped: compares stream it block by block
            return read_npy(fd, mmap_over=MMAP_BYTES if mmap_over is None else mmap_over)
        finally:
            os.close(fd)
    except WorkspaceError:           # outside the workspace: said as it is
        raise
    except FileNotFoundError:
        raise WorkspaceError(f"tensor file {path} is missing") from None
    except IsADirectoryError:
        raise WorkspaceError(f"{path} is a directory, not a tensor file") from None
    except ValueError as e:          # its message says what the file is (read_npy)
        raise WorkspaceError(f"tensor file {path} {e}") from None
    except EOFError:
        raise WorkspaceError(f"tensor file {path} is corrupt: empty or cut off") from None
    except OSError as e:
        raise WorkspaceError(f"tensor file {path} is unreadable: {e}") from None


_HEADER_BYTES = 1 << 16        # more than numpy's parser accepts in a header
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NPY_HEADER = re.compile(r"\{'descr': '([<>|=]?[a-zA-Z]\d*)', 'fortran_order': (True|False), "
                         r"'shape': \(((?:\d+, ?)*\d*)\), \}\s*$")


def _npy_header(f):
    """(shape, fortran_order, dtype) from an open .npy positioned at its start. The header
    numpy writes is parsed by a strict pattern (no literal_eval per file: a compare opens
    thousands); any other goes to numpy's parser. Whatever a corrupt header makes either of
    them raise becomes a ValueError."""
    try:
        magic = f.read(8)
        if len(magic) == 8 and magic[:6] == b"\x93NUMPY" and magic[6] in (1, 2, 3):
            width = 2 if magic[6] == 1 else 4
            length = int.from_bytes(f.read(width), "little")
            text = f.read(length)
            # a header cut short (its newline, say) is numpy's parser's to refuse
            m = _NPY_HEADER.match(text.decode("latin1")) if len(text) == length else None
            if m is not None:
                shape = tuple(int(d) for d in m.group(3).replace(" ", "").split(",") if d)
                return shape, m.group(2) == "True", np.dtype(m.group(1))
        f.seek(0)
        version = np.lib.format.read_magic(f)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                else np.lib.format.read_array_header_2_0)
        return read(f)
    except MemoryError:
        raise
    except Exception as e:        # SyntaxError, TokenError, TypeError... from a corrupt header
        raise ValueError(f"is corrupt: not an .npy file, or its header is broken "
                         f"({type(e).__name__}: {e})") from None


_FIRST_READ = 1 << 16       # a small tensor's whole file comes in this one read


def read_npy(fd: int, mmap_over: float = math.inf) -> np.ndarray:
    """The .npy file open on fd, never unpickling: a header that is not a plain numeric array
    (objects, records) is refused, and the data length must be what the header claims,
    checked before anything is allocated (a header may claim terabytes). A file larger than
    mmap_over bytes is mapped read-only; a smaller one is read whole, header and data. A file
    under _FIRST_READ bytes takes one read and no fstat (only one that seems cut off is
    measured, and the rest read, if any): a compare reads thousands of small files, and a
    system call is most of the cost of each."""
    head = b""
    if mmap_over >= _FIRST_READ:
        head = os.read(fd, _FIRST_READ)
        if len(head) < _FIRST_READ:
            try:
                return _array_of(bytearray(head), head)    # writable, as a larger file's
            except ValueError:       # or a signal cut the read short: the size decides
                pass
    try:
        size = check_regular(fd, "").st_size
    except IsADirectoryError:
        raise
    except OSError as e:             # a named pipe, a socket, a device: said as the file's
        raise ValueError(f"is {e.strerror}") from None
    if size > mmap_over:             # its header parsed and checked as a small file's
        dtype, count, offset, shape, order = _layout(_header_of(os.pread(fd, _HEADER_BYTES, 0)),
                                                     size)
        if not count:
            return np.zeros(shape, dtype)            # no data: an empty array
        with os.fdopen(os.dup(fd), "rb") as f:
            return np.memmap(f, dtype=dtype, mode="r", offset=offset, shape=shape, order=order)
    if len(head) > size:
        raise ValueError("is corrupt: it changed while it was read")
    raw = np.empty(size, np.uint8)               # writable, and not zeroed only to be overwritten
    got, view = len(head), memoryview(raw)
    view[:got] = head
    while got < size:                            # one call but for a signal's short read
        n = os.readv(fd, [view[got:]])
        if n == 0:
            raise ValueError("is corrupt: it changed while it was read")
        got += n
    return _array_of(raw)


def _array_of(raw, head: Optional[bytes] = None) -> np.ndarray:
    """The array a whole .npy file's bytes (raw) hold, a view of them where its data is
    aligned; head: raw's first bytes as bytes, if the caller has them."""
    head = bytes(memoryview(raw)[:_HEADER_BYTES]) if head is None else head
    dtype, count, offset, shape, order = _layout(_header_of(head), len(raw))
    array = np.frombuffer(raw, dtype, count=count, offset=offset)
    if offset % 16:                              # a foreign header: keep the data aligned
        array = array.copy()
    return array.reshape(shape, order=order)


def _header_of(head: bytes) -> bytes:
    """The header of the .npy file whose first bytes are head; where head holds no whole
    header, all of head that a header may take (_layout then says what is wrong)."""
    if len(head) >= 10 and head[:6] == b"\x93NUMPY" and head[6] in (1, 2, 3):
        width = 2 if head[6] == 1 else 4
        end = 8 + width + int.from_bytes(head[8:8 + width], "little")
        if end <= min(len(head), _HEADER_BYTES):
            return head[:end]
    return head[:_HEADER_BYTES]


@functools.lru_cache(maxsize=1024)
def _layout(header: bytes, size: int) -> tuple:
    """(stored dtype, element count, data offset, shape, order) of a whole .npy file of
    `size` bytes with this header. The files of a dump share a few headers and sizes: each
    distinct pair is parsed and checked once (an exception is raised again each time)."""
    f = io.BytesIO(header)
    shape, fortran, dtype = _npy_header(f)
    dtype = stored_dtype(dtype)
    want = _checked(shape, dtype, size - f.tell())
    return dtype, want // dtype.itemsize, f.tell(), shape, "F" if fortran else "C"


BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def stored_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a tensor file's data is read as: its header's, but for 2-byte raw values
    (descr '<V2' or '|V2'), which is how numpy saves an ml_dtypes bfloat16 array: .npy has
    no name for bfloat16, so such a file is read as bfloat16."""
    return BFLOAT16 if dtype.kind == "V" and dtype.itemsize == 2 and dtype.names is None \
        and dtype.subdtype is None else dtype


def _checked(shape, dtype, have: int) -> int:
    """The data bytes the header claims, refused unless a plain numeric array of `have`.
    The messages say what the file is: read_tensor_file puts its path before them."""
    if dtype.hasobject:
        raise ValueError("holds Python objects, which only unpickling could read (refused: "
                         "allow_pickle=False)")
    if dtype.kind not in "biufc" and dtype != BFLOAT16:
        raise ValueError(f"holds {dtype.str} values, not a numeric tensor")
    want = math.prod(shape) * dtype.itemsize
    if have != want:
        raise ValueError(f"is corrupt or cut off: the header's {dtype.str}{list(shape)} needs "
                         f"{want} data bytes, the file holds {have}")
    return want


INTEGER_COLUMNS = ("index", "task_id", "stream_id", "timestamp", "nan_count", "pos_inf_count",
                   "neg_inf_count")
NUMBER_COLUMNS = INTEGER_COLUMNS + STAT_COLUMNS        # the rest of an index is text


def _read_index_file(path: str) -> Table:
    """An index.csv as a Table: every column of its header (numbers where NUMBER_COLUMNS
    says, text otherwise), refused with the row it stops at when it is not whole."""
    data = read_bytes(path, WorkspaceError, "the index")
    try:
        table = read_csv(data, {name: "f" for name in NUMBER_COLUMNS}, rest="t")
    except TableError as e:
        where = f"row {e.line} is incomplete or not a tensor row (was the file cut off?): " \
            if e.line else ""
        raise WorkspaceError(f"{path} is not a readable index: {where}{e.detail}") from None
    missing = [c for c in INDEX_COLUMNS if c not in table]
    if missing:
        raise WorkspaceError(f"{path} is not a readable index: no {', '.join(missing)} column")
    _check_rows(table, path)
    if data and not data.endswith(b"\n"):      # our index ends every row with a line break
        raise WorkspaceError(f"{path} is not a readable index: row {len(table) + 1} "
                             f"is cut off (no line break at the end of the file)")
    return table


def _check_rows(table: Table, path: str) -> None:
    """Every row of an index is whole: names present, io an io, integers integral. A file
    cut off mid-row (a dump killed while a foreign tool copied it, a full disk) is refused
    naming the row, never read as a row with holes. Rows count as lines of the file."""
    bad = ~np.isin(table["io"], ["input", "output"])
    for name in ("op_type", "op_name", "tensor", "dtype"):
        bad |= table[name] == ""
    for name in INTEGER_COLUMNS:
        if name in table:
            v = table[name]
            with np.errstate(invalid="ignore"):
                bad |= ~np.isfinite(v) | (v != np.round(v))
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise WorkspaceError(f"{path} is not a readable index: row {row + 2} is incomplete or "
                             f"not a tensor row (was the file cut off?)")


def check_compiled_graph(data, walk: bool = True) -> dict:
    """A compiled graph's JSON, checked as a graph: well formed, no dangling input, no
    cycle, every op type known (walk=False: its header and node list only, for the bytes our
    own dumper wrote). Not shape-checked: compiled tensors are in 5HD."""
    from ..graph.serialize import check_graph_dict, graph_nodes

    if not isinstance(data, dict):
        raise GraphFormatError("a compiled graph is a JSON object with a node list")
    if walk:
        from ..ops import REGISTRY      # the op implementations: only a walk asks them
        check_graph_dict(data, REGISTRY.__contains__)
    else:
        graph_nodes(data)
    return data


def _read_json(path: str) -> dict:
    try:
        with open_regular(path) as f:
            data = json.loads(f.read().decode("utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}


def npy_header(path: str):
    """(shape, fortran_order, dtype) of an .npy from its header alone."""
    with open_regular(path) as f:
        return _npy_header(f)


def _index_from_names(step_dir: str, target: str) -> Table:
    """Index a step directory written by Ascend's tools from its file names and npy headers."""
    rows = []
    pattern = ASCEND_NPU_NAME if target == "npu" else CPU_NAME
    for name in sorted(os.listdir(step_dir)):
        m = pattern.match(name)
        if not m:
            continue
        try:
            shape, _, dtype = npy_header(os.path.join(step_dir, name))
        except (OSError, ValueError):
            continue        # unreadable files are not indexed (the analysis reports them)
        row = m.groupdict()
        io_ = row.get("io", "output")
        # an output is its op's tensor; what an input file holds, its name does not say
        row.update(file=name, shape=" ".join(map(str, shape)), dtype=str(dtype), io=io_,
                   op_type=row.get("op_type", ""),
                   tensor=f"{row['op_name']}:{row['index']}" if io_ == "output" else "")
        for col in ("task_id", "stream_id", "timestamp", "index"):
            if col in row:
                row[col] = float(row[col]) if row[col] is not None else np.nan
        rows.append(row)
    names = list(dict.fromkeys([*INDEX_COLUMNS, *(k for r in rows for k in r)]))
    if not rows:        # the index's columns even where no file matched: an empty step
        return Table({k: np.empty(0, float if k in NUMBER_COLUMNS else object) for k in names}, 0)
    return Table.from_rows(rows, names)
