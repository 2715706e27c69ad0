"""A core for the dump writer: while a dump is open, BLAS runs one thread short of the cores.

The writer computes each step's statistics and writes its files on another core while the
next step runs. A BLAS pool with a thread per core keeps its idle threads spinning after
every call (OpenBLAS does, for a while), so the writer and a spinner share a core and the
training step waits for both, while the undumped step is no slower with one thread fewer
(the figures: docs/design-notes.md). The pool is cut once, when the first dumped step has run, and
given back when the dump closes: changing it every step would wake the idle threads every
step. Not before that step: OpenBLAS's float32 sums depend on its thread count, and the
step a user dumps should hold the numbers the run computes without the dump (the steps
after it can differ from an undumped run's in their last bits). Each replay bundle records
the count its step ran with, and a replay runs with it. The price is once per dump: the
idle threads of that first step's BLAS calls spin beside its writer.
"""
from __future__ import annotations

import contextlib
import os
from typing import List, Optional, Tuple


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):       # not on Linux
        return os.cpu_count() or 1


class WriterCore:
    """limit() leaves the writer a core (a BLAS pool of at most cores - 1 threads, at least
    one); restore() gives back what limit() took, unless someone has set the pool since."""

    def __init__(self):
        self._changed: List[Tuple[object, int, int]] = []    # (pool, before, after)
        self._limited = False
        self._pools = None      # found when first needed: finding them takes about 1 ms

    def limit(self) -> None:
        if self._limited:
            return
        self._limited = True
        keep = max(1, usable_cores() - 1)
        for pool in self._found_pools():
            try:
                before = pool.num_threads
                if before > keep:
                    pool.set_num_threads(keep)
                    self._changed.append((pool, before, keep))
            except Exception:       # a pool that cannot be asked or set is left as it is
                continue

    def threads(self) -> Optional[int]:
        """The BLAS thread count a step run now gets (the first pool's: numpy's), None when
        no pool is visible."""
        pools = self._found_pools()
        try:
            return int(pools[0].num_threads) if pools else None
        except Exception:           # a pool that cannot be asked
            return None

    def _found_pools(self) -> list:
        if self._pools is None:
            self._pools = _blas_pools()
        return self._pools

    def restore(self) -> None:
        changed, self._changed, self._limited = self._changed, [], False
        for pool, before, after in changed:
            try:
                if pool.num_threads == after:
                    pool.set_num_threads(before)
            except Exception:
                continue


@contextlib.contextmanager
def blas_threads_as(threads: Optional[int]):
    """BLAS at `threads` threads inside the block (None: as it is), given back after: a
    replayed step runs as it ran, since OpenBLAS's sums depend on its thread count."""
    if threads is None:
        yield
        return
    from threadpoolctl import threadpool_limits     # a dependency: setup.cfg
    with threadpool_limits(limits=int(threads), user_api="blas"):
        yield


def _blas_pools() -> list:
    """The thread pools of the BLAS libraries loaded in this process (threadpoolctl finds
    OpenBLAS, MKL and BLIS by their symbols, whatever numpy was built with)."""
    try:
        from threadpoolctl import ThreadpoolController
        return list(ThreadpoolController().select(user_api="blas").lib_controllers)
    except Exception:         # no threadpoolctl, or a library it cannot read: nothing to limit
        return []
