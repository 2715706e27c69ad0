"""Writing a dump's steps without holding up the run: a bounded queue of steps drained by
one thread.

The thread is the C module's where it is built (NativeWriter: it never takes the GIL), a
Python thread otherwise (AsyncWriter). put_step() blocks when the queue is full
(back-pressure instead of growing memory); flush() waits until everything queued is on disk
and re-raises the first write error. What a step writes, and how its bytes are made, is
kernels.write's (the files, the index text): every file goes into a partial directory that
is renamed into place when complete, so a directory with its final name is always whole.
"""
from __future__ import annotations

import atexit
import queue
import threading
import weakref

from ..errors import PrecisionToolError
from ..kernels.write import c_arrays, native_writer


class DumpWriteError(PrecisionToolError, OSError):
    """The dump could not be written (disk full, permissions...); the message names the path."""



def _drain(jobs: queue.Queue, errors: list) -> None:
    """AsyncWriter's thread: run the jobs until None; after a failure, drop the rest of the
    step (its first error waits in `errors` for the writer to report it)."""
    while True:
        job = jobs.get()
        try:
            if job is None:
                return
            if not errors:
                job()
        except Exception as e:    # OSError or not, reported as a DumpWriteError
            errors.append(write_error(e))
        finally:
            jobs.task_done()


def write_error(e: Exception) -> DumpWriteError:
    """A failure while writing a dump, as the one-line error the user sees (naming the
    path where the failure has one)."""
    if isinstance(e, OSError):
        return DumpWriteError(f"cannot write the dump: {e.strerror or e} "
                              f"({e.filename or 'unknown path'})")
    return DumpWriteError(f"cannot write the dump: {e}")


class AsyncWriter:
    """Runs write jobs (callables) in order on one background thread. The thread holds the
    queue, not the writer: once the writer is collected, the thread ends (a process that
    opens many dumps, as a fusion bisection does, would otherwise keep a thread for each)."""

    def __init__(self, max_pending: int = 256):
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._errors: list = []               # the thread's first failure, until reported
        self._thread = threading.Thread(target=_drain, args=(self._queue, self._errors),
                                        name="precision-tool-dump", daemon=True)
        self._thread.start()
        weakref.finalize(self, self._queue.put, None)

    def put(self, job) -> None:
        if self._errors:
            raise self._errors[0]
        self._queue.put(job)

    def flush(self) -> None:
        self._queue.join()
        if self._errors:
            raise self._errors.pop()

    def put_step(self, plan, filled, more, links, renames, dirs, on_done) -> None:
        """Queue a step of a StepPlan (see StepPlan.write); on_done() runs once it is on
        disk."""
        def job():
            plan.write(filled, more, links, renames, dirs)
            on_done()
        self.put(job)


class NativeWriter:
    """A dump's steps written by the C module's own thread, which never takes the GIL (a
    Python writer thread holds it for its Python, and the training thread waits meanwhile).
    The training thread hands over a step whose every path and buffer is known (the buffers
    are held until it is written) and learns at its next step, or at flush(), which steps
    are on disk; their on_done() then runs on the training thread. Same contract as
    AsyncWriter: bounded (back-pressure), the first error raised by the next put_step or
    flush, the steps after a failure not written."""

    def __init__(self, max_pending: int = 2, thread=None):
        self._thread = thread if thread is not None else native_writer(max_pending)
        if self._thread is None:
            raise RuntimeError("the C module's writer thread is not built (make_writer "
                               "chooses the Python writer then)")
        self._waiting = {}          # ticket -> on_done
        self._error = None

    def put_step(self, plan, filled, more, links, renames, dirs, on_done) -> None:
        self._settle(self._thread.done())
        if self._error is not None:
            raise self._error
        # a step of tensor files wakes the thread at once; a statistics step waits for its
        # next look (a wake costs the training thread more than the writing it hastens)
        wake = bool(filled.paths)
        try:
            ticket = self._thread.submit(*_job(plan, filled, more, links, renames, dirs), wake)
        except (BufferError, ValueError):      # a strided array: written from a copy
            ticket = self._thread.submit(*_job(plan, filled, more, links, renames, dirs, True),
                                         wake)
        self._waiting[ticket] = on_done

    def _settle(self, finished) -> None:
        for ticket, outcome in finished:
            on_done = self._waiting.pop(ticket)
            if outcome is None:
                try:
                    on_done()
                except Exception as e:      # its bookkeeping failed (a full disk...)
                    self._error = self._error or write_error(e)
            elif isinstance(outcome, OSError) and self._error is None:
                self._error = write_error(outcome)

    def flush(self) -> None:
        self._settle(self._thread.flush())
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        self._settle(self._thread.close())


def _job(plan, filled, more, links, renames, dirs, contiguous: bool = False) -> tuple:
    """A step of a StepPlan as the C module's writer thread takes it: (index, files), the
    index written after the files and before the renames."""
    paths, arrays, headers, halves = plan.files(filled, more, contiguous)
    index = (c_arrays(filled.values, plan.kinds, contiguous), plan.kinds, filled.stats,
             filled.stamps, plan.index.literal, plan.index.cuts, plan.index.refs,
             filled.index_path)
    return index, (paths, headers, arrays, halves, tuple(links), tuple(renames), tuple(dirs))


_OPEN = weakref.WeakSet()


def close_at_exit(owner) -> None:
    """owner.close() when the process exits, if it is still alive: a dump's last steps,
    queued to its writer thread, are on disk before the process ends (a killed process
    cannot wait)."""
    _OPEN.add(owner)


@atexit.register
def _close_open_dumps() -> None:
    for owner in list(_OPEN):
        try:
            owner.close()
        except Exception:       # exiting anyway: a step that failed to write has no index
            pass


def make_writer(max_pending: int = 2):
    """The C module's writer thread where it is built, a Python thread otherwise."""
    thread = native_writer(max_pending)
    return AsyncWriter(max_pending) if thread is None else NativeWriter(thread=thread)
