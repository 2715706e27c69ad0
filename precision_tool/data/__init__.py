"""Data sets shipped with the package (nothing is downloaded at run time)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

_HERE = os.path.dirname(__file__)


@dataclass(frozen=True)
class Dataset:
    """A train/test split. x: float32 [N, 64] (or [N, 1, 8, 8] images); y: int32 class ids."""
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    def batches(self, batch_size: int, seed: int = 0, epoch: int = 0):
        """Shuffled training batches of one epoch, fixed by (seed, epoch); the last partial
        batch is dropped so that every step sees the same shape."""
        order = np.random.default_rng([seed, epoch]).permutation(len(self.x_train))
        for start in range(0, len(order) - batch_size + 1, batch_size):
            idx = order[start:start + batch_size]
            yield self.x_train[idx], self.y_train[idx]


def digits(test_fraction: float = 0.2, seed: int = 0, scale: float = 1.0 / 16.0,
           images: bool = False) -> Dataset:
    """The UCI hand-written digits (1,797 8x8 images, see DIGITS.md for the attribution).

    Pixels 0..16 are multiplied by `scale` (default: into [0, 1]; scale=1 keeps the raw,
    unnormalised values). The split is stratified-free but fixed by `seed`. With
    images=True, x is NCHW [N, 1, 8, 8] for convolutional models.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    with np.load(os.path.join(_HERE, "digits.npz"), allow_pickle=False) as f:
        x = f["images"].astype(np.float32) * np.float32(scale)
        y = f["labels"].astype(np.int32)
    if images:
        x = x.reshape(-1, 1, 8, 8)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return Dataset(x[train], y[train], x[test], y[test], 10)
