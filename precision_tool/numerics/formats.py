"""The NCHW <-> NC1HWC0 (5HD) data format of the NPU's feature maps."""
from __future__ import annotations

from typing import Sequence

import numpy as np

C0 = 16


def five_hd_shape(nchw: Sequence[int], c0: int = C0):
    n, c, h, w = nchw
    return (n, -(-c // c0), h, w, c0)


def nchw_to_5hd(x: np.ndarray, c0: int = C0) -> np.ndarray:
    """NCHW -> NC1HWC0: C1 = ceil(C / C0), channels zero-padded up to C1 * C0."""
    n, c, h, w = x.shape
    c1 = -(-c // c0)
    padded = np.zeros((n, c1 * c0, h, w), dtype=x.dtype)
    padded[:, :c] = x
    return np.ascontiguousarray(padded.reshape(n, c1, c0, h, w).transpose(0, 1, 3, 4, 2))


def logical_view(x: np.ndarray, channels: int) -> np.ndarray:
    """An NC1HWC0 tensor's real values as NCHW, without its padding channels (what its
    statistics are taken over: the padding zeros would enter the mean, and the max or min
    of a tensor of one sign)."""
    n, c1, h, w, c0 = x.shape
    return x.transpose(0, 1, 4, 2, 3).reshape(n, c1 * c0, h, w)[:, :channels]


def five_hd_to_nchw(x: np.ndarray, original_shape: Sequence[int]) -> np.ndarray:
    """NC1HWC0 -> NCHW: transpose (0, 1, 4, 2, 3), merge C1 and C0, crop the padding."""
    n, c1, h, w, c0 = x.shape
    c = original_shape[1]
    return np.ascontiguousarray(x.transpose(0, 1, 4, 2, 3).reshape(n, c1 * c0, h, w)[:, :c])
