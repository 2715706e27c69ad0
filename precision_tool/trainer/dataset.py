"""A small dataset over numpy arrays, in the shape of MindSpore's NumpySlicesDataset:

    ds = NumpySlicesDataset((x, y)).shuffle(seed=0).batch(32, drop_remainder=True)
    for xb, yb in ds: ...            # one pass
    len(ds)                          # batches per pass (get_dataset_size())

Each method returns a new dataset. A shuffled dataset draws a new order for every pass,
fixed by (seed, pass number), so runs repeat exactly.
"""
from __future__ import annotations

import itertools
from typing import Iterator, Optional, Sequence, Tuple

import numpy as np

from ..errors import PrecisionToolError


class DatasetError(PrecisionToolError, ValueError):
    """A dataset that cannot be built or used as asked."""


class NumpySlicesDataset:
    def __init__(self, columns: Sequence[np.ndarray], seed: Optional[int] = None,
                 batch_size: Optional[int] = None, drop_remainder: bool = False):
        if isinstance(columns, np.ndarray):
            columns = (columns,)
        cols = tuple(np.asarray(c) for c in columns)
        if not cols:
            raise DatasetError("a dataset needs at least one column")
        if any(c.ndim == 0 for c in cols):
            raise DatasetError("every column needs a leading sample axis; got a scalar")
        if len({len(c) for c in cols}) != 1:
            raise DatasetError(f"columns differ in length: {[len(c) for c in cols]}")
        if any(c.dtype == object for c in cols):
            raise DatasetError("object columns are not data: give numeric arrays")
        self.columns: Tuple[np.ndarray, ...] = cols
        self.seed = seed
        self.batch_size = batch_size
        self.drop_remainder = drop_remainder

    def shuffle(self, seed: int = 0) -> "NumpySlicesDataset":
        """A new order every pass, fixed by (seed, pass)."""
        return NumpySlicesDataset(self.columns, int(seed), self.batch_size, self.drop_remainder)

    def batch(self, batch_size: int, drop_remainder: bool = False) -> "NumpySlicesDataset":
        """Stack batch_size samples; with drop_remainder the last short batch is dropped
        (every step then sees the same shape)."""
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise DatasetError(f"batch_size must be a positive integer, got {batch_size!r}")
        return NumpySlicesDataset(self.columns, self.seed, int(batch_size), bool(drop_remainder))

    @property
    def num_samples(self) -> int:
        return len(self.columns[0])

    def get_dataset_size(self) -> int:
        """Items per pass: batches when batched, else samples."""
        if self.batch_size is None:
            return self.num_samples
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_remainder else 0)

    __len__ = get_dataset_size

    def epoch(self, number: int = 0) -> Iterator[Tuple[np.ndarray, ...]]:
        """One pass: pass `number` fixes the shuffled order."""
        n = self.num_samples
        order = (np.random.default_rng([self.seed, number]).permutation(n)
                 if self.seed is not None else None)
        if self.batch_size is None:
            for i in range(n):
                k = i if order is None else order[i]
                yield tuple(c[k] for c in self.columns)
            return
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            idx = slice(start, start + self.batch_size) if order is None \
                else order[start:start + self.batch_size]
            yield tuple(c[idx] for c in self.columns)

    def endless(self, first_pass: int = 0) -> Iterator[Tuple[np.ndarray, ...]]:
        """Pass after pass, each continuing where the last stopped (sink mode's view)."""
        if len(self) == 0:
            raise DatasetError("the dataset is empty")
        for number in itertools.count(first_pass):
            yield from self.epoch(number)

    def __iter__(self):
        return self.epoch(0)

    def __repr__(self):
        shapes = ", ".join(f"{c.dtype}{list(c.shape)}" for c in self.columns)
        return (f"NumpySlicesDataset({shapes}, seed={self.seed}, batch_size={self.batch_size}, "
                f"drop_remainder={self.drop_remainder})")
