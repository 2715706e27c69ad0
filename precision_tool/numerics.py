"""Conversions that both the runtime and the analysis need: low-precision rounding,
saturation, the AI Core float-status bits, and the NCHW <-> NC1HWC0 (5HD) data format.

A leaf module (numpy and ml_dtypes only), so that the simulated NPU and the analysis of its
dumps use one definition of each conversion."""
from __future__ import annotations

from typing import List, Sequence

import ml_dtypes
import numpy as np


FP16_MAX = float(np.finfo(np.float16).max)                 # 65504
BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)  # 3.3895e38
FP32_MAX = float(np.finfo(np.float32).max)

# AI Core status word bits (aclrtFloatOverflowMode / NPUGetFloatStatus)
STATUS_INT_OVERFLOW = 0x8          # integer arithmetic wrapped around
STATUS_INT_DIV_ZERO = 0x10         # integer division by zero (no op of our set produces it)
STATUS_FLOAT_OVERFLOW = 0x20       # a float result left the range of its dtype, or became inf/nan
STATUS_FLOAT_TO_INT = 0x80         # a float to integer conversion was out of range
STATUS_CAST_OVERFLOW = 0x100       # an fp32 -> fp16/bf16 conversion overflowed
STATUS_CUBE_OVERFLOW = 0x400       # the cube unit's fp32 accumulator overflowed

STATUS_BITS = {
    STATUS_INT_OVERFLOW: "integer overflow",
    STATUS_INT_DIV_ZERO: "integer divide by zero",
    STATUS_FLOAT_OVERFLOW: "floating-point overflow",
    STATUS_FLOAT_TO_INT: "float to integer conversion overflow",
    STATUS_CAST_OVERFLOW: "fp32 to fp16/bf16 conversion overflow",
    STATUS_CUBE_OVERFLOW: "cube accumulation overflow",
}


def decode_status(status: int) -> List[str]:
    """The status word as words, lowest bit first; unknown bits are shown in hex."""
    words, rest = [], int(status)
    for bit, word in STATUS_BITS.items():
        if rest & bit:
            words.append(word)
            rest &= ~bit
    if rest:
        words.append(f"unknown bits 0x{rest:x}")
    return words


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


# -- NC1HWC0 ----------------------------------------------------------------------------------
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
