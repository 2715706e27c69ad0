"""Rounding a float32 result onto the grid of the dtype the device stores it in (fp16 or
bf16, held in float32), saturated in saturation mode, with the overflow it shows. numerics'
quantize and saturate define it; the C module does it in one pass where it runs."""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from ..numerics import quantize, saturate
from . import native
from .stats import stats_row


def round_result(x: np.ndarray, dtype: str, saturation: bool,
                 stats: Optional[np.ndarray] = None):
    """A float32 result as the device stores it in `dtype` (fp16/bf16 on their grid, held in
    float32), saturated in saturation mode. Returns (value, overflowed): whether the rounded
    value held inf/nan before saturation. Callers decide which status bit that is. stats: 8
    float64 that take the value's statistics and size (stats_row's). The C module does it
    all in one pass where it runs (the same bits: tested against the numpy code)."""
    return rounder()(x, dtype, saturation, stats)


def rounder() -> Callable:
    """round_result with the choice of the C pass made now, once: for an executor that rounds
    every op of a run (the choice reads the environment). The function itself, not a
    wrapper: a step calls it hundreds of times."""
    return _round_in_c if native.enabled() else _round_in_numpy


def _round_in_c(x, dtype, saturation, stats=None):
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        return _round_in_numpy(x, dtype, saturation, stats)
    if dtype in ("float16", "bfloat16"):
        return native.grid(x, dtype, saturation, stats)
    overflowed = native.any_nonfinite(x, stats)
    if overflowed and saturation:
        x = saturate(x, dtype)
        if stats is not None:
            stats_row(x, stats)
    return x, overflowed


def _round_in_numpy(x, dtype, saturation, stats=None):
    """The definition."""
    out = quantize(x, dtype) if dtype in ("float16", "bfloat16") else x
    overflowed = out.size > 0 and not np.isfinite(out).all()
    if overflowed and saturation:
        out = saturate(out, dtype)
    if stats is not None:
        stats_row(out, stats)
    return out, overflowed
