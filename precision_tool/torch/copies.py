"""A tensor dump's copies, made into memory an earlier step's copies used.

A tensor dump copies a step's every tensor (gigabytes a step for a model of a few hundred
million activations) and the writer thread frees those copies once they are on disk. Fresh
memory for each copy costs the training thread a page fault for every page of it, several
times the copy itself; memory freed by an earlier step is warm. A pool hands out the
buffers of a step whose files are written to the next steps' copies of the same dtype and
shape. A buffer goes back to the pool only when nothing but the pool holds it (no record,
no view of it, no writer job): reference counts say so, so a value still to be written or
read is never overwritten.
"""
from __future__ import annotations

import sys
from typing import Dict, List

import numpy as np


def _holders(buffers: List[np.ndarray]) -> List[int]:
    """Each buffer's reference count, as seen from here (the list, the loop, the call)."""
    return [sys.getrefcount(b) for b in buffers]


class CopyPool:
    """copy(value) -> a copy of value in a recycled buffer where one fits; recycle() at the
    end of a step takes back the buffers nothing holds any more (the step's own, once the
    writer has written them and the records are gone). Buffers a whole step left unused are
    let go: the pool holds no more than the steps in flight use."""

    def __init__(self):
        self._lent: List[np.ndarray] = []                 # handed out, maybe still held
        self._free: Dict[tuple, List[np.ndarray]] = {}    # (dtype, shape) -> buffers
        # what a buffer held by the pool alone counts (Python versions count differently)
        self._alone = _holders([np.empty(1)])[0]
        self.reused = 0                                   # copies made into a recycled buffer

    def copy(self, value: np.ndarray) -> np.ndarray:
        free = self._free.get((value.dtype, value.shape))
        if free:
            buffer = free.pop()
            np.copyto(buffer, value)
            self.reused += 1
        else:
            buffer = value.copy()
        self._lent.append(buffer)
        return buffer

    def recycle(self) -> None:
        lent, self._lent = self._lent, []
        free: Dict[tuple, List[np.ndarray]] = {}
        for buffer, count in zip(lent, _holders(lent)):
            if count <= self._alone:
                free.setdefault((buffer.dtype, buffer.shape), []).append(buffer)
            else:
                self._lent.append(buffer)
        self._free = free

    def clear(self) -> None:
        """Let every buffer go (a stopped dump's: nothing is left to write)."""
        self._lent, self._free = [], {}
