"""What a dumped step writes, worked out once and filled in every step.

While the kernels and the shapes stay the same (they do in a training loop), every index
line and file name is fixed text but for a timestamp and a tensor's statistics, and each
tensor file's header and dtype conversion are fixed too. A StepPlan holds all of that; a
step then gathers its values and works out its paths on the training thread (fill), and
the writer computes the statistics, fills the index, writes every file of the step and
renames its directory into place (dump.writer: the C module's writer thread, without the
GIL, or write() here and now). A step whose kernels or shapes differ gets a new plan.
Without the C module the same plan is filled in Python, to the same bytes.
"""
from __future__ import annotations

import os
import shutil
from typing import List, NamedTuple, Sequence

import numpy as np

from .. import kernels, numerics
from . import layout
from .template import Template
from ..table import csv_field
from ..kernels.write import (contiguous_arrays, index_text, npy_header, replace_directory,
                             spill, step_paths, write_files)

_HALF = np.dtype(np.float16)
_SINGLE = np.dtype(np.float32)


class Row(NamedTuple):
    """One index line: the value is records[record][side][k] (side 1 inputs, 2 outputs);
    the line is before + record's timestamp + after + "," + file + "," + statistics."""
    record: int
    side: int
    k: int
    tensor: str            # lines naming the same tensor share its file and statistics
    before: str
    after: str
    file: tuple            # (name before the timestamp, after it): the file of a first line
    disk: np.dtype         # what the file holds (see disk_dtype)
    channels: int = 0      # an NC1HWC0 tensor's real channels: its statistics leave out the
                           # padding (numerics.logical_view), 0 for any other format


class Summary:
    """A value given by its statistics, for a statistics dump that keeps no copy of it:
    what a plan reads of a value (its shape, dtype and size) and kernels.stats_row's eight
    numbers, taken when it is made (the tensor may change in place after)."""
    __slots__ = ("shape", "dtype", "size", "stats")

    def __init__(self, value: np.ndarray):
        self.shape, self.dtype, self.size = value.shape, value.dtype, value.size
        self.stats = np.empty(8)
        kernels.stats_row(value, self.stats)

    def reshaped(self, shape: tuple) -> "Summary":
        """The same elements in another shape (a view's): the same statistics."""
        other = Summary.__new__(Summary)
        other.shape, other.dtype, other.size, other.stats = shape, self.dtype, self.size, \
            self.stats
        return other


class Spilled:
    """A tensor dump's value written to disk as it was made, in a step too big to keep a
    copy of each value until it is written (the copy and its fresh memory cost as much as
    the write): its file (under spill_dir: a header for the shape it was made in, then the
    bytes; a view's Spilled names the same file in the view's shape), what a plan reads of a
    value and its statistics, taken from the same memory as the file. The step's writing
    then links each file to its name in the step (StepPlan.fill)."""
    __slots__ = ("path", "shape", "dtype", "size", "stats")

    def __init__(self, path: str, value: np.ndarray):
        self.path = path
        self.shape, self.dtype, self.size = value.shape, value.dtype, value.size
        self.stats = np.empty(8)
        spill(path, value, self.stats)

    def reshaped(self, shape: tuple) -> "Spilled":
        """The same elements in another shape (a view's): the same file and statistics."""
        other = Spilled.__new__(Spilled)
        other.path, other.dtype, other.size, other.stats = \
            self.path, self.dtype, self.size, self.stats
        other.shape = shape
        return other

    def load(self) -> np.ndarray:
        """Its elements, in its shape (mapped from the file, not read)."""
        return np.load(self.path, mmap_mode="r", allow_pickle=False).reshape(self.shape)


SPILL_DIR = ".spilled"      # in a step's hidden directory, removed before it is renamed


def disk_dtype(value: np.ndarray, spec_dtype: str) -> np.dtype:
    """What the dump stores: fp16 as fp16 (the NPU holds its fp16 values in float32); bf16,
    which .npy cannot name, as its exact float32 values (the index says 'bfloat16')."""
    if spec_dtype == "float16":
        return _HALF
    if spec_dtype == "bfloat16":
        return _SINGLE
    return value.dtype


def _quoted(before: str, after: str) -> tuple:
    """csv_field of a field made of two pieces around a timestamp (digits: they never need
    quoting), as the two pieces."""
    if csv_field(before + "0" + after) != before + "0" + after:
        return '"' + before.replace('"', '""'), after.replace('"', '""') + '"'
    return before, after


class StepPlan:
    """key: whatever identifies the step's kernels for the caller; header: the index's first
    line; rows: its lines; values: each line's value in the step the plan is made from;
    files: whether tensor files are written (a tensor dump) or statistics only."""

    def __init__(self, key, header: str, rows: Sequence[Row], values: Sequence[np.ndarray],
                 files: bool):
        self.key = key
        first, position = [], {}
        index = Template().text(header + "\n")
        names = Template()
        for i, row in enumerate(rows):
            pos = position.get(row.tensor)
            if pos is None:
                pos = position[row.tensor] = len(first)
                first.append(i)
                if files:       # names apart by NUL, which no file name holds
                    names.text("\0" if pos else "").text(row.file[0]).stamp(row.record) \
                        .text(row.file[1])
            index.text(row.before).stamp(row.record).text(row.after + ",")
            if files:
                quoted = _quoted(*rows[first[pos]].file)
                index.text(quoted[0]).stamp(rows[first[pos]].record).text(quoted[1])
            index.text(",").stats(pos).text("\n")
        # where each tensor's value is (its first line): the lines after it read the same array
        self.where = [(rows[i].record, rows[i].side, rows[i].k) for i in first]
        self.shapes = [values[i].shape for i in first]
        self.sizes = np.array([values[i].size for i in first], dtype=np.float64)
        self.index = index.freeze()
        self.names = names.freeze() if files else None
        unique = [values[i] for i in first]
        self.dtypes = [v.dtype for v in unique]
        # the C module's statistics where it takes the kind; the rest (empty tensors, other
        # dtypes, NC1HWC0 tensors, whose padding channels are left out) is computed by
        # numerics and handed in
        self.channels = [rows[i].channels for i in first]
        kinds = [kernels.stats_kind(v) if v.size and not c and isinstance(v, np.ndarray)
                 else None
                 for v, c in zip(unique, self.channels)]
        self.kinds = "".join(k or "." for k in kinds)
        # a spilled value's statistics came with it
        self.spilled = [i for i, v in enumerate(unique) if isinstance(v, Spilled)]
        self.numpy_stats = [i for i, k in enumerate(kinds)
                            if k is None and not isinstance(unique[i], Spilled)]
        disk = [rows[i].disk for i in first]
        self.headers = [npy_header(d, v.shape) for d, v in zip(disk, unique)]
        self.halves = "".join("e" if d == _HALF and v.dtype == _SINGLE else "."
                              for d, v in zip(disk, unique))
        self.casts = {i: d for i, (d, v) in enumerate(zip(disk, unique))
                      if d != v.dtype and self.halves[i] == "."}

    def _logical(self, values, i: int) -> np.ndarray:
        """values[i] as its statistics see it: an NC1HWC0 tensor without its padding."""
        c = self.channels[i]
        return numerics.logical_view(values[i], c) if c else values[i]

    def gather(self, records) -> List[np.ndarray]:
        """Each tensor's value, in the order of their first lines."""
        return [records[r][side][k] for r, side, k in self.where]

    def fits(self, values) -> bool:
        """Whether these values (gather's) have the shapes and dtypes the plan was made for."""
        return [v.shape for v in values] == self.shapes and [v.dtype for v in values] == self.dtypes

    def fill(self, directory: str, stamps: Sequence[int], values) -> "Filled":
        """The training thread's part of a step: its values (gather's) and timestamps, the
        paths of its files in directory, what each file holds. Nothing here touches the disk
        or reads a tensor but the few the C module does not take (their statistics), so
        that what is left, write() or the C writer thread's job, runs without the GIL."""
        stamps = np.asarray(stamps, dtype=np.int64)
        paths, arrays, links = [], [], []
        if self.names is not None and values:
            paths = step_paths(self.names, stamps, directory)
            arrays = values
            if self.casts or self.spilled:
                arrays = list(values)
            for i, dtype in self.casts.items():     # bfloat16, which .npy cannot name, as
                arrays[i] = values[i].astype(dtype)  # its float32 values
            for i in self.spilled:      # its file linked in: a view of another shape too,
                links.append((values[i].path, paths[i]))    # its index line says its shape
                arrays[i] = None
        stats = np.empty((len(values), 7))
        if self.numpy_stats:    # the kinds the C module does not take (its '.' kinds)
            stats[self.numpy_stats] = kernels.stats_table([self._logical(values, i)
                                                           for i in self.numpy_stats])
        for i in self.spilled:
            stats[i] = values[i].stats[:7]
        spill_dir = os.path.dirname(values[self.spilled[0]].path) if self.spilled else ""
        return Filled(os.path.join(directory, layout.INDEX_FILE), stamps, values, paths, arrays,
                      stats, tuple(links), spill_dir)

    def fill_stats(self, directory: str, stamps: Sequence[int], stats: np.ndarray) -> "Filled":
        """fill() for a statistics dump given each tensor's statistics instead of its value
        ((tensors, 7) or (tensors, 8) float64: kernels.stats_row's first seven, or its
        rows whole): nothing is left to read."""
        return Filled(os.path.join(directory, layout.INDEX_FILE),
                      np.asarray(stamps, dtype=np.int64), None, [], [], stats)

    def files(self, filled: "Filled", more, contiguous: bool = False):
        """paths, arrays, headers and conversions of the step's tensor files and of `more`,
        (path, bytes) each."""
        paths, arrays = list(filled.paths), list(filled.arrays)
        headers = list(self.headers) if filled.paths else []
        halves = self.halves if filled.paths else ""
        if filled.links:            # the files linked in from where they were spilled
            kept = [i for i, a in enumerate(arrays) if a is not None]
            paths, arrays = [paths[i] for i in kept], [arrays[i] for i in kept]
            headers, halves = [headers[i] for i in kept], "".join(halves[i] for i in kept)
        paths += [path for path, _ in more]
        arrays = list(contiguous_arrays(arrays) if contiguous else arrays)
        arrays += [data for _, data in more]
        return paths, arrays, headers + [b""] * len(more), halves + "." * len(more)

    def write(self, filled: "Filled", more=(), links=(), renames=(), dirs=()) -> None:
        """Write the step here and now: index.csv and, for a tensor dump, the tensor files;
        more: other files of the step, (path, bytes) each; dirs, links and renames as
        kernels.write.write_files makes them (dirs and links first, renames once every file is
        written)."""
        if filled.values is None:
            text = self.index.fill(filled.stamps, kernels.table_text(filled.stats))
        else:
            text = index_text(self.index, filled.stamps, filled.values, self.kinds,
                              filled.stats)
        paths, arrays, headers, halves = self.files(filled, more)
        # a step that spilled values: its directory holds them already (not made anew), each
        # is linked to its name, and their directory goes before the step is renamed in
        spilled = bool(filled.spill_dir)
        for src, dst in filled.links:
            os.link(src, dst)
        write_files(paths + [filled.index_path], arrays + [text], headers + [b""],
                    halves + ".", links, () if spilled else renames, () if spilled else dirs)
        if spilled:
            shutil.rmtree(filled.spill_dir)
            for src, dst in renames:
                replace_directory(src, dst)


class Filled(NamedTuple):
    """A step's part of the plan, filled in by the training thread (see StepPlan.fill)."""
    index_path: str
    stamps: np.ndarray
    values: list            # None when the statistics are given
    paths: list             # the tensor files (empty for a statistics dump)
    arrays: list            # what each holds (bfloat16 as float32)
    stats: object           # the statistics: the rows of the '.' kinds given, the rest to fill
    links: tuple = ()       # (spilled file, its path in the step) each: its array is None
    spill_dir: str = ""     # where the step's values were spilled (Spilled), if it spilled
