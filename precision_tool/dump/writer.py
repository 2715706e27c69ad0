"""Writing a dump without holding up the run: a bounded queue drained by one thread.

put() blocks when the queue is full (back-pressure instead of growing memory); flush()
waits until everything queued is on disk and re-raises the first write error. Every file
is written under a temporary name in its directory and renamed into place, so a file with
its final name is always whole.
"""
from __future__ import annotations

import io
import os
import queue
import threading

import numpy as np

from .. import native
from ..errors import PrecisionToolError
from ..fileio import write_buffers


class DumpWriteError(PrecisionToolError, OSError):
    """The dump could not be written (disk full, permissions...); the message names the path."""


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


def write_files(paths, arrays, headers=None, halves: str = "", links=(), renames=()) -> None:
    """Files for a directory that is renamed into place when complete, in one call of the C
    module that writes them all with the GIL released where it is built, one by one
    otherwise. Each file is its header (headers: each file's, by default the npy_header of
    what it holds; b"" for a file that is not an .npy) then its array's bytes; an array may
    be a tuple of arrays, written back to back. halves, one character per file when given:
    'e' writes that float32 array as float16 (rounded as astype rounds; an array holding nan
    goes through astype, which decides its payload), '.' as it is. links, (src, dst,
    contents) each, are made first: a hard link, or a file holding contents where linking
    fails; renames, (src, dst) each, are done last, once every file is written."""
    halves = halves or "." * len(arrays)
    if headers is None:
        headers = [npy_header(np.dtype(np.float16) if h == "e" else a.dtype, a.shape)
                   for a, h in zip(arrays, halves)]
    if native.enabled():
        try:        # the C module takes every buffer before it writes anything
            native.write_files(paths, headers, arrays, halves, links, renames)
        except (BufferError, ValueError):       # a strided array: written from a copy
            native.write_files(paths, headers, _contiguous(arrays), halves, links, renames)
        return
    arrays = _contiguous(arrays)
    for src, dst, contents in links:
        try:
            os.link(src, dst)
        except OSError:
            write_buffers(dst, [contents])
    for path, header, array, half in zip(paths, headers, arrays, halves):
        if half == "e":
            array = array.astype(np.float16)
        write_buffers(path, [header, *(array if isinstance(array, tuple) else (array,))])
    for src, dst in renames:
        try:
            os.rename(src, dst)
        except OSError as e:        # named by where it goes, as the C module names it
            raise OSError(e.errno, e.strerror, dst) from None


def _contiguous(arrays):
    """The arrays (or tuples of arrays) with each strided one copied (np.ascontiguousarray
    would make a 0-d array 1-d)."""
    def one(a):
        return a if not isinstance(a, np.ndarray) or a.flags.c_contiguous else a.copy(order="C")
    return [tuple(map(one, a)) if isinstance(a, tuple) else one(a) for a in arrays]


class AsyncWriter:
    """Runs write jobs (callables) in order on one background thread."""

    def __init__(self, max_pending: int = 256):
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error = None
        self._thread = threading.Thread(target=self._drain, name="precision-tool-dump",
                                        daemon=True)
        self._thread.start()

    def _drain(self):
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                if self._error is None:       # after a failure, drop the rest of the step
                    job()
            except OSError as e:
                self._error = DumpWriteError(f"cannot write the dump: {e.strerror or e} "
                                             f"({e.filename or 'unknown path'})")
            except Exception as e:    # a job failing for another reason is reported the same way
                self._error = DumpWriteError(f"cannot write the dump: {e}")
            finally:
                self._queue.task_done()

    def put(self, job) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(job)

    def flush(self) -> None:
        self._queue.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)
