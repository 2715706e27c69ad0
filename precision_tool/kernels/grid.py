"""Rounding a float32 result onto the grid of the dtype the device stores it in (fp16 or
bf16, held in float32), saturated in saturation mode, with the overflow it shows. numerics'
quantize and saturate define it; the C module does it in one pass where it runs."""
from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import numpy as np

from ..numerics import quantize, saturate
from . import native
from .stats import stats_row


def round_result(x: np.ndarray, dtype: str, saturation: bool,
                 stats: Optional[np.ndarray] = None, in_c: Optional[bool] = None):
    """A float32 result as the device stores it in `dtype` (fp16/bf16 on their grid, held in
    float32), saturated in saturation mode. Returns (value, overflowed): whether the rounded
    value held inf/nan before saturation. Callers decide which status bit that is. The C
    module does it in one pass where it runs (the same bits: tested against this). stats: 8
    float64 that take the value's statistics and size (stats_row's), computed in the same
    pass where the C module does it. in_c: whether the C pass may run (None: as
    native.enabled() says now; rounder() asks once for a run's every op)."""
    low = dtype in ("float16", "bfloat16")
    if in_c is None:
        in_c = native.enabled()
    if in_c and x.dtype == np.float32 and x.flags.c_contiguous:
        if low:
            return native.grid(x, dtype, saturation, stats)
        overflowed = native.any_nonfinite(x, stats)
        if overflowed and saturation:
            x = saturate(x, dtype)
            if stats is not None:
                stats_row(x, stats)
        return x, overflowed
    out = quantize(x, dtype) if low else x
    overflowed = out.size > 0 and not np.isfinite(out).all()
    if overflowed and saturation:
        out = saturate(out, dtype)
    if stats is not None:
        stats_row(out, stats)
    return out, overflowed


def rounder() -> Callable:
    """round_result(x, dtype, saturation, stats=None) with the choice of the C pass made now,
    once: for an executor that rounds every op of a run (the choice reads the environment)."""
    return partial(round_result, in_c=native.enabled())    # no Python frame of its own
