"""Reading a precision_data/ workspace: the one index of what is on disk.

`Workspace(root)` lists runs, their steps and graphs from the directory tree once, returns a
step's index as a pandas DataFrame (read once, cached) and loads tensors lazily, never
unpickling. Dumps written by Ascend's tools (no index.csv; file names with or without the
stream id) are indexed from their file names and .npy headers.
"""
from __future__ import annotations

import errno
import io
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np
import pandas as pd

from ..errors import PrecisionToolError
from . import layout


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
    interrupted: List[int] = field(default_factory=list)   # steps a killed run left partial

    @property
    def ours(self) -> bool:
        return self.info.get("writer") == "precision_tool"

    def step(self, number: int) -> StepDump:
        for s in self.steps:
            if s.step == number:
                return s
        raise WorkspaceError(f"{self.target}/{self.name} has no dump of step {number}; "
                             f"dumped steps: {[s.step for s in self.steps if s.complete]}")


class Workspace:
    def __init__(self, root: Optional[str] = None):
        self.root = layout.resolve_root(root)
        self._runs: Optional[Dict[tuple, Run]] = None
        self._indexes: Dict[tuple, pd.DataFrame] = {}
        self._graphs: Dict[str, Optional[dict]] = {}
        self._real_root = os.path.realpath(self.root)
        self._real_dirs: Dict[str, str] = {}

    # -- what is there ------------------------------------------------------------------------
    def runs(self, target: Optional[str] = None) -> List[Run]:
        if self._runs is None:
            if not os.path.isdir(self.root):
                raise WorkspaceError(f"no workspace at {self.root} (run a dump first, or give "
                                     f"--data-dir / {layout.ENV_ROOT})")
            self._runs = {}
            for tgt in ("npu", "cpu"):
                parent = os.path.join(self.root, tgt)
                if not os.path.isdir(parent):
                    continue
                names = [d for d in os.listdir(parent) if re.fullmatch(r"debug_\d+", d)]
                for name in sorted(names, key=lambda d: int(d.split("_")[1])):
                    path = os.path.join(parent, name)
                    run = Run(tgt, name, path, _read_json(os.path.join(path, "run.json")))
                    run.steps = self._find_steps(run)
                    self._runs[(tgt, name)] = run
        return [r for r in self._runs.values() if target is None or r.target == target]

    def run(self, target: str, name: Optional[str] = None) -> Run:
        runs = self.runs(target)
        if not runs:
            raise WorkspaceError(f"the workspace {self.root} has no {target} run")
        if name is None:    # the newest original run that dumped something, else the newest
            with_steps = [r for r in runs if any(s.complete for s in r.steps)]
            originals = [r for r in with_steps if not r.info.get("replay_of")]
            return (originals or with_steps or runs)[-1]
        for r in runs:
            if r.name == name:
                return r
        raise WorkspaceError(f"no {target} run {name!r} in {self.root}; runs: {[r.name for r in runs]}")

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
                run.interrupted += sorted(int(d[1:-len(".partial")]) for d in dirnames
                                          if re.fullmatch(r"\.\d+\.partial", d))
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
        """The run's compiled graph (NPU runs), read once."""
        if run.path not in self._graphs:
            gdir = os.path.join(run.path, "graph")
            files = sorted(f for f in os.listdir(gdir) if f.endswith(".json")) if os.path.isdir(gdir) else []
            self._graphs[run.path] = _read_json(os.path.join(gdir, files[0])) if files else None
        return self._graphs[run.path]

    def step_history(self, run: Run) -> pd.DataFrame:
        """step_history.csv: every observed step's status word and loss scale (empty if the
        run predates it or observed no step). A torn last line is dropped."""
        path = os.path.join(run.path, layout.HISTORY_FILE)
        columns = layout.HISTORY_HEADER.split(",")
        if not os.path.isfile(path):
            return pd.DataFrame(columns=columns)
        try:
            table = pd.read_csv(path, on_bad_lines="skip")
            if list(table.columns) != columns:
                raise ValueError(f"columns {list(table.columns)}")
            table = table.dropna(subset=["step", "status"]).astype({"step": int, "status": int})
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError) as e:
            raise WorkspaceError(f"{path} is not a readable step history: {e}") from None
        return table.sort_values("step", kind="stable").reset_index(drop=True)

    # -- a step's index -----------------------------------------------------------------------
    def index(self, run: Run, step: int) -> pd.DataFrame:
        """The step's index, read once per workspace (a copy: callers may modify it)."""
        key = (run.path, step)
        table = self._indexes.get(key)
        if table is None:
            table = self._read_index(run, step)
            self._indexes[key] = table
            if len(self._indexes) > 64:          # bounded: drop the oldest
                self._indexes.pop(next(iter(self._indexes)))
        return table.copy()

    def _read_index(self, run: Run, step: int) -> pd.DataFrame:
        target = run.target
        sd = run.step(step)
        if not sd.complete:
            raise WorkspaceError(f"step {step} of {run.target}/{run.name} was interrupted before "
                                 f"its index was written; it is not read")
        index_path = os.path.join(sd.path, layout.INDEX_FILE)
        if os.path.isfile(index_path):
            try:
                table = pd.read_csv(index_path, keep_default_na=False, na_values=["nan", "NaN"],
                                    dtype={"file": str, "op_name": str, "tensor": str})
            except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
                raise WorkspaceError(f"{index_path} is not a readable index: {e}") from None
            missing = [c for c in INDEX_COLUMNS if c not in table.columns]
            if missing:
                raise WorkspaceError(f"{index_path} is not a readable index: no "
                                     f"{', '.join(missing)} column")
            bad = table[~table["io"].isin(["input", "output"]) |
                        pd.to_numeric(table["index"], errors="coerce").isna()]
            if len(bad):
                raise WorkspaceError(f"{index_path} is not a readable index: row "
                                     f"{int(bad.index[0]) + 2} is not a tensor row")
            table["index"] = table["index"].astype(int)
            table["file"] = table["file"].fillna("").astype(str)
        else:
            table = _index_from_names(sd.path, target)
        for column in STAT_COLUMNS:     # floats even where all look integral; nan where unknown
            table[column] = (pd.to_numeric(table[column], errors="coerce").astype(float)
                             if column in table else np.nan)
        table["step"] = step
        return table

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
        directory, name = os.path.split(path if os.path.isabs(path) else os.path.abspath(path))
        real_dir = self._real_dirs.get(directory)
        if real_dir is None:
            real_dir = self._real_dirs[directory] = os.path.realpath(directory)
        real = os.path.join(real_dir, name)
        if _NOFOLLOW:
            self._check_inside(path, real)
            try:
                return os.open(real, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
            except OSError as e:
                if e.errno != errno.ELOOP:
                    raise
        real = os.path.realpath(real)
        self._check_inside(path, real)
        return os.open(real, os.O_RDONLY | _CLOEXEC)

    def _check_inside(self, path: str, real: str) -> None:
        if not real.startswith(self._real_root + os.sep):
            raise WorkspaceError(f"{path} is outside the workspace {self.root}")


def read_tensor_file(path: str, opener=None, mmap_over: Optional[int] = None) -> np.ndarray:
    """An .npy file read as read_npy reads it (allow_pickle=False, sizes checked, a large one
    memory-mapped), its failures as one-line WorkspaceErrors. opener(path) -> descriptor:
    the workspace passes one that refuses paths outside it; a path the user typed
    (pt, cp, dc) is opened as it is."""
    try:
        fd = opener(path) if opener else os.open(path, os.O_RDONLY | _CLOEXEC)
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
    except (ValueError, EOFError) as e:      # EOFError: an empty or cut-off file
        raise WorkspaceError(f"tensor file {path} cannot be loaded without unpickling or is "
                             f"corrupt: {e or 'no data'}") from None
    except OSError as e:
        raise WorkspaceError(f"tensor file {path} is unreadable: {e}") from None


_HEADER_BYTES = 1 << 16        # more than numpy's parser accepts in a header
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
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
            m = _NPY_HEADER.match(f.read(int.from_bytes(f.read(width), "little")).decode("latin1"))
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
        raise ValueError(f"not an .npy file, or its header is corrupt ({type(e).__name__}: "
                         f"{e})") from None


def read_npy(fd: int, mmap_over: float = math.inf) -> np.ndarray:
    """The .npy file open on fd, never unpickling: a header that is not a plain numeric array
    (objects, records) is refused, and the data length must be what the header claims,
    checked before anything is allocated (a header may claim terabytes). A file larger than
    mmap_over bytes is mapped read-only; a smaller one is read whole, header and data, in
    one call (a compare reads thousands of small files)."""
    size = os.fstat(fd).st_size
    if size > mmap_over:
        with os.fdopen(os.dup(fd), "rb") as f:
            shape, fortran, dtype = _npy_header(f)
            offset = f.tell()
            if _checked(shape, dtype, size - offset):
                return np.memmap(f, dtype=dtype, mode="r", offset=offset, shape=shape,
                                 order="F" if fortran else "C")
        return np.zeros(shape, dtype)                # no data: an empty array
    raw = np.empty(size, np.uint8)               # writable, and not zeroed only to be overwritten
    got, view = 0, memoryview(raw)
    while got < size:                            # one call but for a signal's short read
        n = os.readv(fd, [view[got:]])
        if n == 0:
            raise ValueError("the file changed while it was read")
        got += n
    header = io.BytesIO(view[:_HEADER_BYTES])    # a copy of the header's bytes only
    shape, fortran, dtype = _npy_header(header)
    offset = header.tell()
    want = _checked(shape, dtype, size - offset)
    array = np.frombuffer(raw, dtype, count=want // dtype.itemsize, offset=offset)
    if offset % 16:                              # a foreign header: keep the data aligned
        array = array.copy()
    return array.reshape(shape, order="F" if fortran else "C")


def _checked(shape, dtype, have: int) -> int:
    """The data bytes the header claims, refused unless a plain numeric array of `have`."""
    if dtype.hasobject:
        raise ValueError("it holds Python objects, which only unpickling could read "
                         "(refused: allow_pickle=False)")
    if dtype.kind not in "biufc":
        raise ValueError(f"its dtype {dtype} is not a numeric tensor")
    want = math.prod(shape) * dtype.itemsize
    if have != want:
        raise ValueError(f"the header's {dtype}{list(shape)} needs {want} data bytes, the "
                         f"file holds {have}")
    return want


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}


def npy_header(path: str):
    """(shape, fortran_order, dtype) of an .npy from its header alone."""
    with open(path, "rb") as f:
        return _npy_header(f)


def _index_from_names(step_dir: str, target: str) -> pd.DataFrame:
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
        row.update(file=name, shape=" ".join(map(str, shape)), dtype=str(dtype),
                   io=row.get("io", "output"))
        rows.append(row)
    table = pd.DataFrame(rows)
    for col in ("task_id", "stream_id", "timestamp", "index"):
        if col in table:
            table[col] = pd.to_numeric(table[col], errors="coerce")
    return table
