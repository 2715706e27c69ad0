"""The bytes of a dumped step and the one call that writes them: .npy headers, the index
text filled with each tensor's statistics, the paths of a step's files, fp16 bits of float32
values, and write_files (the C module's loop where it is built, the same in Python
otherwise). The thread that drains a dump's queue of steps is the dump layer's
(dump.writer); this is the part with a C fast path."""
from __future__ import annotations

import errno
import io
import os
import shutil

from functools import lru_cache

import numpy as np

from . import native
from .. import numerics
from ..fileio import write_buffers
from .stats import stats_row, stats_table, table_text


_HEADERS = {}


def npy_header(dtype: np.dtype, shape: tuple) -> bytes:
    """The .npy header of an array of this dtype and shape (cached: a dump writes thousands)."""
    key = (dtype.str, shape)
    header = _HEADERS.get(key)
    if header is None:
        if dtype.hasobject:
            raise ValueError("object arrays are never dumped (they would need pickling)")
        buf = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            buf, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                  "shape": tuple(shape)})
        header = _HEADERS[key] = buf.getvalue()
    return header


def write_files(paths, arrays, headers=None, halves: str = "", links=(), renames=(),
                dirs=()) -> None:
    """Files for a directory that is renamed into place when complete, in one call of the C
    module that writes them all with the GIL released where it is built, one by one
    otherwise. dirs are made first, empty (what an interrupted dump left there is removed).
    Each file is its header (headers: each file's, by default the npy_header of what it
    holds; b"" for a file that is not an .npy) then its array's bytes; an array may be a
    tuple of arrays, written back to back. halves, one character per file when given: 'e'
    writes that float32 array as float16 (half_bits), '.' as it is. links, (src, dst,
    contents) each, come before the files: a hard link, or a file holding contents where
    linking fails; renames, (src, dst) each, come last, once every file is written (a
    directory already at dst is replaced). The first failure raises OSError naming its path,
    and nothing after it is done."""
    halves = halves or "." * len(arrays)
    if headers is None:
        headers = [npy_header(np.dtype(np.float16) if h == "e" else a.dtype, a.shape)
                   for a, h in zip(arrays, halves)]
    if native.enabled():
        try:        # the C module takes every buffer before it writes anything
            native.write_files(paths, headers, arrays, halves, links, renames, dirs)
        except (BufferError, ValueError):       # a strided array: written from a copy
            native.write_files(paths, headers, contiguous_arrays(arrays), halves, links, renames, dirs)
        return
    arrays = contiguous_arrays(arrays)
    for directory in dirs:
        fresh_directory(directory)
    for src, dst, contents in links:
        try:
            os.link(src, dst)
        except OSError:
            write_buffers(dst, [contents])
    for path, header, array, half in zip(paths, headers, arrays, halves):
        if half == "e":
            array = half_bits(array)
        write_buffers(path, [header, *(array if isinstance(array, tuple) else (array,))])
    for src, dst in renames:
        replace_directory(src, dst)


def spill(path: str, array: np.ndarray, row) -> None:
    """A new .npy file holding array (strided or not: its elements in C order), with its
    statistics and size into row (8 float64, as kernels.stats_row gives them) taken on the
    way: in one read of the array, and no copy, by the C module where it takes the dtype."""
    header = npy_header(array.dtype, array.shape)
    if native.enabled() and native.stats_kind(array) and array.dtype.kind in "fiub":
        native.spill(path, header, array, row)
        return
    stats_row(array, row)
    write_buffers(path, [header, np.ascontiguousarray(array)])


def step_paths(names, stamps: np.ndarray, directory: str) -> list:
    """The paths of a step's tensor files: the frozen file-name template (dump.template, names
    apart by NUL) filled with the records' timestamps, in directory; bytes from the C
    module, str from Python."""
    if native.enabled():
        blob = native.index_text([], "", np.empty((0, 7)), stamps, names)
        prefix = os.fsencode(directory) + b"/"
        return [prefix + name for name in blob.split(b"\0")]
    return [os.path.join(directory, n) for n in names.fill(stamps, ()).decode("utf-8").split("\0")]


def index_text(index, stamps: np.ndarray, values, kinds: str, stats: np.ndarray) -> bytes:
    """A step's index.csv: the frozen template (dump.template) filled with the records'
    timestamps and each value's statistics, into stats ((len(values), 7) float64) on the
    way. kinds: each value's stats kind, '.' where stats already holds its row (what the C
    module does not take: empty, NC1HWC0 and odd-dtype tensors). One C call without the GIL
    where it runs."""
    if native.enabled():
        try:
            return native.index_text(c_arrays(values, kinds), kinds, stats, stamps, index)
        except (ValueError, BufferError):       # a strided value: flat() copies it
            return native.index_text(c_arrays(values, kinds, True), kinds, stats, stamps, index)
    todo = [i for i, k in enumerate(kinds) if k != "."]
    if todo:
        stats[todo] = stats_table([values[i] for i in todo])
    return index.fill(stamps, table_text(stats))


@lru_cache(maxsize=256)
def _direct(kinds: str) -> bool:
    return "." not in kinds and "b" not in kinds


def c_arrays(values, kinds: str, contiguous: bool = False) -> list:
    """The values as the C module's statistics take them: numpy's own numbers as they are
    (contiguous: a strided one copied), bfloat16 as its bits, None where the kind is '.'
    (the row is given); all None for a statistics step (values None)."""
    if values is None:
        return [None] * len(kinds)
    if not contiguous and _direct(kinds):
        return values
    return [None if k == "." else v if k != "b" and v.flags.c_contiguous else native.flat(v)
            for v, k in zip(values, kinds)]


def pack(arrays):
    """(bytes, layout) of the arrays back to back (see native.pack), or None where the C
    module does not run or cannot take them (a strided array, one without a buffer)."""
    if not native.enabled():
        return None
    try:
        return native.pack(arrays)
    except (BufferError, ValueError, TypeError):
        return None


def half_bits(x: np.ndarray) -> np.ndarray:
    """float32 as float16, as numpy's own conversion rounds (to nearest even, overflow to
    inf, gradual underflow); a nan keeps its sign and the top ten bits of its payload (a nan
    that came from a float16 comes back as it was), 1 where those are all zero. numpy builds
    that convert in hardware quiet a nan instead: the dump does not depend on which. The
    rounding is numerics.quantize's (the one definition of the float16 grid); the values it
    gives are float16 values, which astype then encodes exactly."""
    h = numerics.quantize(x, "float16").astype(np.float16)
    nan = np.isnan(x)
    if nan.any():
        bits = x.view(np.uint32)[nan]
        payload = (bits >> 13) & 0x3FF
        h.view(np.uint16)[nan] = (((bits >> 16) & 0x8000) | 0x7C00
                                  | np.where(payload == 0, 1, payload)).astype(np.uint16)
    return h


def fresh_directory(path: str) -> None:
    """An empty directory at path: what an interrupted dump left there is removed."""
    try:
        os.mkdir(path)
    except FileExistsError:
        shutil.rmtree(path)
        os.mkdir(path)
    except FileNotFoundError:
        os.makedirs(path)


def replace_directory(src: str, dst: str) -> None:
    """Rename src to dst; a directory already at dst (a replayed step dumped again into a
    named run) is moved aside first and removed once src is in its place. An OSError names
    dst, as the C module names it."""
    try:
        try:
            os.rename(src, dst)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            aside = f"{dst}.replaced"
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(dst, aside)
            os.rename(src, dst)
            shutil.rmtree(aside, ignore_errors=True)
    except OSError as e:
        raise OSError(e.errno, e.strerror, dst) from None


def contiguous_arrays(arrays):
    """The arrays (or tuples of arrays) with each strided one copied (np.ascontiguousarray
    would make a 0-d array 1-d)."""
    def one(a):
        return a if not isinstance(a, np.ndarray) or a.flags.c_contiguous else a.copy(order="C")
    return [tuple(map(one, a)) if isinstance(a, tuple) else one(a) for a in arrays]


def native_writer(max_pending: int):
    """The C module's writer thread (it never takes the GIL: dump.writer.NativeWriter drives
    it), or None where the C module is not built or not wanted."""
    return native.writer(max_pending) if native.enabled() else None
