"""Writing a dump without holding up the run: a bounded queue drained by one thread.

put() blocks when the queue is full (back-pressure instead of growing memory); flush()
waits until everything queued is on disk and re-raises the first write error. Every file
is written under a temporary name in its directory and renamed into place, so a file with
its final name is always whole.
"""
from __future__ import annotations

import io
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


def write_npy(path: str, array: np.ndarray) -> None:
    """Write an .npy file without the per-call overhead of np.save. Only for directories that
    are renamed into place when complete (a step's partial directory)."""
    if not array.flags.c_contiguous:     # (np.ascontiguousarray would make a 0-d array 1-d)
        array = array.copy(order="C")
    write_buffers(path, [npy_header(array.dtype, array.shape), array])


def write_npys(paths, arrays, headers=None, halves: str = "") -> None:
    """write_npy for many files (same rules), in one call of the C module that writes them
    all with the GIL released where it is built, one by one otherwise. headers: each file's
    (npy_header of what it holds) when the caller has them. halves, one character per file
    when given: 'e' writes that float32 array as float16 (rounded as astype rounds; an array
    holding nan goes through astype, which decides its payload), '.' as it is."""
    arrays = [a if a.flags.c_contiguous else a.copy(order="C") for a in arrays]
    if not native.enabled():
        if halves:
            arrays = [a.astype(np.float16) if h == "e" else a for a, h in zip(arrays, halves)]
        for path, array in zip(paths, arrays):
            write_npy(path, array)
        return
    if headers is None:
        headers = [npy_header(np.dtype(np.float16) if h == "e" else a.dtype, a.shape)
                   for a, h in zip(arrays, halves or "." * len(arrays))]
    native.write_files(paths, headers, arrays, halves or None)


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
