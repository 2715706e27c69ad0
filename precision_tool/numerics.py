"""Conversions that both the runtime and the analysis need: low-precision rounding,
saturation, the AI Core float-status bits, and the NCHW <-> NC1HWC0 (5HD) data format.

A leaf module (numpy and ml_dtypes only), so that the simulated NPU and the analysis of its
dumps use one definition of each conversion."""
from __future__ import annotations

from typing import List, Optional, Sequence

import ml_dtypes
import numpy as np

from . import native

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


def round_result(x: np.ndarray, dtype: str, saturation: bool, in_c: Optional[bool] = None,
                 stats: Optional[np.ndarray] = None):
    """A float32 result as the device stores it in `dtype` (fp16/bf16 on their grid, held in
    float32), saturated in saturation mode. Returns (value, overflowed): whether the rounded
    value held inf/nan before saturation. Callers decide which status bit that is. The C
    module does it in one pass where it is built (the same bits: tested against this). in_c:
    whether it may (None: ask native.enabled(), which reads the environment: a caller that
    rounds every op asks once per run). stats: 8 float64 that take the value's statistics
    and size (stats_row's), computed in the same pass where the C module does it."""
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


# -- tensor statistics ----------------------------------------------------------------------
STAT_FIELDS = ("max", "min", "mean", "l2norm", "nan_count", "pos_inf_count", "neg_inf_count")


STATS_BLOCK = 1 << 20       # elements per block: a memory-mapped 2 GiB tensor is streamed


def tensor_stats(x: np.ndarray) -> dict:
    """max, min, mean and L2 norm over the finite elements (nan when there are none: an empty
    or all-inf/nan tensor), and the counts of nan, +inf and -inf; computed in float64, block
    by block (memory stays bounded whatever the size)."""
    a = np.asarray(x).reshape(-1)
    if a.size and native.enabled() and native.stats_kind(a):
        row = native.stats([a])[0]
        return dict(zip(STAT_FIELDS, [*row[:4].tolist(), *map(int, row[4:])]))
    nan = pos = neg = n = 0
    hi, lo, total, squares = -np.inf, np.inf, 0.0, 0.0
    for start in range(0, a.size, STATS_BLOCK):
        b = a[start:start + STATS_BLOCK]
        if b.dtype.kind == "b":
            b = b.astype(np.float64)
        elif b.dtype.kind not in "fiu":       # bfloat16 arrives as a void-kind numpy dtype
            b = b.astype(np.float32)
        if b.dtype.kind == "f" and not np.isfinite(b).all():
            nan += int(np.isnan(b).sum())
            pos += int(np.isposinf(b).sum())
            neg += int(np.isneginf(b).sum())
            b = b[np.isfinite(b)]
        if b.size == 0:
            continue
        f = b.astype(np.float64, copy=False)
        n += f.size
        hi, lo = max(hi, float(f.max())), min(lo, float(f.min()))
        total += float(f.sum())
        squares += float(np.dot(f, f))
    if n == 0:
        return {"max": np.nan, "min": np.nan, "mean": np.nan, "l2norm": np.nan,
                "nan_count": nan, "pos_inf_count": pos, "neg_inf_count": neg}
    return {"max": hi, "min": lo, "mean": total / n, "l2norm": float(np.sqrt(squares)),
            "nan_count": nan, "pos_inf_count": pos, "neg_inf_count": neg}


def stats_row(x: np.ndarray, row) -> None:
    """tensor_stats of x into row[:7] (STAT_FIELDS' order, counts as floats) and its size
    into row[7]: the C module's one pass where it takes the dtype. row: 8 float64, a numpy
    array or a memoryview."""
    if x.size and native.enabled() and native.stats_kind(x):
        native.stats([x], row[:7])
    else:
        stats = tensor_stats(x)
        np.asarray(row)[:7] = [stats[f] for f in STAT_FIELDS]
    row[7] = float(x.size)


def batch_stats(arrays) -> dict:
    """tensor_stats of many tensors at once, as arrays by field (one entry per tensor): the
    C module's one pass per tensor, GIL released, where it is built (see native); otherwise
    one concatenation and a few numpy reductions over it, with tensor_stats for the rare
    tensor that is empty or holds inf/nan. Same values, float64."""
    n = len(arrays)
    out = {f: np.full(n, np.nan) for f in ("max", "min", "mean", "l2norm")}
    out.update({f: np.zeros(n, dtype=np.int64) for f in ("nan_count", "pos_inf_count", "neg_inf_count")})
    fast = native.enabled()
    special, flat, positions, one_pass = [], [], [], []
    for k, a in enumerate(arrays):
        if fast and a.size and native.stats_kind(a):
            one_pass.append(k)
        elif a.size == 0 or a.dtype.kind not in "fiub":
            special.append(k)
        else:
            flat.append(a.reshape(-1))
            positions.append(k)
    if flat:
        sizes = np.fromiter((f.size for f in flat), dtype=np.int64, count=len(flat))
        # float32 holds every dumped float exactly (fp16/bf16 too); ints beyond 2^24 need float64
        wide = any(f.dtype == np.float64 or (f.dtype.kind in "iu" and f.dtype.itemsize > 2
                                             and np.abs(f).max() >= 2 ** 24) for f in flat)
        buf = np.concatenate(flat, dtype=np.float64 if wide else np.float32, casting="unsafe")
        starts = np.zeros(len(flat), dtype=np.int64)
        np.cumsum(sizes[:-1], out=starts[1:])
        pos = np.asarray(positions)
        # a tensor holding inf/nan makes its sums nan here (inf - inf): it is done again by
        # tensor_stats below, so numpy's warning about it says nothing
        with np.errstate(invalid="ignore", over="ignore"):
            out["max"][pos] = np.maximum.reduceat(buf, starts)
            out["min"][pos] = np.minimum.reduceat(buf, starts)
            out["mean"][pos] = np.add.reduceat(buf, starts, dtype=np.float64) / sizes
            sq = np.square(buf, dtype=np.float64)
            out["l2norm"][pos] = np.sqrt(np.add.reduceat(sq, starts))
        finite = np.isfinite(buf)
        if not finite.all():
            special += pos[np.add.reduceat(~finite, starts) > 0].tolist()
    for k in special:
        for field, value in tensor_stats(arrays[k]).items():
            out[field][k] = value
    if one_pass:
        rows = native.stats([arrays[k] for k in one_pass])
        for j, field in enumerate(STAT_FIELDS):
            out[field][one_pass] = rows[:, j]
    return out


def stats_text(stats: dict) -> list:
    """Per tensor of batch_stats' result, its index fields: the floats with 17 significant
    digits (they read back exactly; repr's shortest digits cost as much to find, and the C
    module formats these without the GIL), the counts as ints."""
    if native.enabled():
        return native.stats_text(np.column_stack([stats[f] for f in STAT_FIELDS]))
    columns = [stats[f].tolist() for f in STAT_FIELDS]
    return ["%.17g,%.17g,%.17g,%.17g,%d,%d,%d" % values for values in zip(*columns)]

