"""The float16 and bfloat16 grids: the dtypes' extremes, rounding onto them (held in float32)
and saturation, the one definition the simulated NPU, the dump writer and the analysis use."""
from __future__ import annotations

import ml_dtypes
import numpy as np

FP16_MAX = float(np.finfo(np.float16).max)                 # 65504
BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)  # 3.3895e38
FP32_MAX = float(np.finfo(np.float32).max)


def max_of(dtype) -> float:
    dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    if dtype == np.float16:
        return FP16_MAX
    if dtype == np.dtype(ml_dtypes.bfloat16):
        return BF16_MAX
    return float(np.finfo(dtype).max)


_FP16_MIN_NORMAL = np.float32(2.0 ** -14)
_FP16_SUBNORMAL_STEP = np.float32(2.0 ** 24)
_U32 = np.uint32


def quantize(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float32 values to the fp16 or bf16 grid and keep them as float32: the same values
    as x.astype(dtype).astype(float32), bit for bit (round to nearest even, subnormals, inf
    beyond the range, nan kept), without numpy's slow fp16 conversion. The simulated NPU
    holds its low-precision tensors this way; dumps write them in their real dtype."""
    x = np.asarray(x, dtype=np.float32)
    shape = x.shape
    x = x.reshape(-1)          # 0-d arrays would decay to numpy scalars in the bit arithmetic
    if dtype == "bfloat16":
        shift, keep = 16, 0xFFFF0000
    elif dtype == "float16":
        shift, keep = 13, 0xFFFFE000
    else:
        raise ValueError(f"quantize rounds to float16 or bfloat16, not {dtype}")
    u = x.view(_U32)
    # add half an ulp of the target minus one, plus the lowest kept bit (ties to even), truncate
    t = u >> _U32(shift)
    t &= _U32(1)
    t += _U32((1 << (shift - 1)) - 1)
    t += u
    t &= _U32(keep)
    r = t.view(np.float32)
    a = np.abs(x)
    if dtype == "float16":
        small = a < _FP16_MIN_NORMAL
        if small.any():        # fp16 subnormals: a fixed grid of 2^-24
            r[small] = np.round(x[small] * _FP16_SUBNORMAL_STEP) / _FP16_SUBNORMAL_STEP
        in_range = a < np.float32(65520.0)      # 65520 and up rounds past 65504: inf
    else:
        in_range = a <= np.float32(FP32_MAX)    # the carry already made inf where needed
    if not in_range.all():     # out of range, inf or nan (nan compares false)
        out = ~in_range
        r[out] = np.where(np.isnan(x[out]), np.float32(np.nan), np.copysign(np.float32(np.inf), x[out]))
    return r.reshape(shape)


def saturate(x: np.ndarray, dtype=None) -> np.ndarray:
    """Saturation mode (Ascend 910's default): +-inf -> +-max of the dtype (of `dtype` when a
    low-precision tensor is held in float32), nan -> 0."""
    if x.dtype.kind not in "fV" or x.size == 0:
        return x
    finite = np.isfinite(x)
    if finite.all():
        return x
    out = x.copy()
    m = max_of(dtype if dtype is not None else x.dtype)
    bad = ~finite
    out[bad] = np.where(np.isnan(x[bad].astype(np.float32)), 0.0,
                        np.copysign(m, x[bad].astype(np.float32)))
    return out
