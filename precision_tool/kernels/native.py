"""The optional C module (precision_tool._reduce) and the arrays it takes.

The C module reads a tensor once for all its statistics, or a pair once for all the
comparison totals, formats the index's numbers and writes a step's tensor files, all with
the GIL released. It is an accelerator only: the rest of the kernels package keeps the
numpy code that defines every quantity, which runs where the module was not built (no C
compiler at install time), for element types it does not take (integers and booleans in
comparisons), and when PRECISION_TOOL_NUMPY_ONLY is set (the tests run both). Nothing
outside the kernels package calls this module.
"""
from __future__ import annotations

import os
from typing import NamedTuple, Optional

import ml_dtypes  # noqa: F401  (registers the name bfloat16 with numpy)
import numpy as np

try:
    from .. import _reduce
except ImportError:           # built without a C compiler: the numpy code runs
    _reduce = None

# by dtype object: a dict look-up, where dtype.name would cost more than a small tensor's stats
_KINDS = {np.dtype(t): k for t, k in ((np.float16, "e"), ("bfloat16", "b"), (np.float32, "f"),
                                      (np.float64, "d"))}
# the statistics take integers and booleans too (a training step's labels, masks, shapes)
_STATS_KINDS = {**_KINDS, **{np.dtype(t): k for t, k in (
    (np.int8, "c"), (np.int16, "h"), (np.int32, "i"), (np.int64, "q"), (np.uint8, "B"),
    (np.uint16, "H"), (np.uint32, "I"), (np.uint64, "Q"), (np.bool_, "?"))}}


def enabled() -> bool:
    return _reduce is not None and not os.environ.get("PRECISION_TOOL_NUMPY_ONLY")


def threads() -> int:
    """Threads for one large comparison: PRECISION_TOOL_THREADS, else the cores this process
    may use (a pool's worker processes are set to 1: the pool already fills the cores)."""
    wanted = os.environ.get("PRECISION_TOOL_THREADS", "")
    if wanted.isdigit() and int(wanted) > 0:
        return int(wanted)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:        # not on Linux
        return os.cpu_count() or 1


def simd() -> str:
    """The vector loops comparisons and statistics of float16, bfloat16 and float32 tensors
    run here: "avx512", "avx2" (the CPU has them, and PRECISION_TOOL_NO_AVX512 or
    PRECISION_TOOL_NO_AVX2 does not turn them off) or "" (the portable loops)."""
    return _reduce.simd() if enabled() else ""


def refresh_simd() -> None:
    """Read PRECISION_TOOL_NO_AVX512 and PRECISION_TOOL_NO_AVX2 again (the C module reads
    them once: the tests and the benchmarks that switch paths call this after)."""
    if _reduce is not None:
        _reduce.simd_refresh()


def kind(a: np.ndarray) -> Optional[str]:
    """The C module's element kind of a float array (what its comparisons take), or None
    when it takes no such array."""
    return _KINDS.get(a.dtype)          # a byte-swapped dtype is not among them


def stats_kind(a: np.ndarray) -> Optional[str]:
    """kind(), or for its statistics also an integer or boolean array's kind."""
    return _STATS_KINDS.get(a.dtype)


def flat(a: np.ndarray) -> np.ndarray:
    """The array as a C-contiguous buffer the C module reads (a copy only when a is
    strided): numpy's own numbers as they are, bfloat16 (which exports no buffer) as its
    bits."""
    if a.flags.c_contiguous and a.dtype.kind in "fiub":
        return a                  # numpy's own numbers export their buffer as they are
    a = np.ascontiguousarray(a).reshape(-1)
    return a.view(np.uint16) if a.dtype.kind not in "fiub" else a


def grid(x: np.ndarray, dtype: str, saturation: bool, stats: Optional[np.ndarray] = None):
    """kernels.round_result in one pass: float32 x (C-contiguous) onto the float16 or
    bfloat16 grid, held in float32, saturated if asked; (value, whether it held inf/nan).
    stats: 8 float64 to fill with the value's statistics (as stats() gives them) and size."""
    out = np.empty_like(x)
    bad = _reduce.grid(x, out, "e" if dtype == "float16" else "b", saturation, stats)
    return out, bad


def any_nonfinite(x: np.ndarray, stats: Optional[np.ndarray] = None) -> bool:
    """Whether the float32 x (C-contiguous) holds an inf or nan; stats: 8 float64 that take
    its statistics and size on the way."""
    return _reduce.grid(x, None, "f", False, stats)


def stats(arrays, out: Optional[np.ndarray] = None) -> np.ndarray:
    """(len(arrays), 7) float64: max, min, mean, l2norm, nan, +inf, -inf counts per array
    (every array must have a stats_kind), into out (C-contiguous) when given."""
    if out is None:
        out = np.empty((len(arrays), 7))
    # strided arrays are read where they lie, in C order (the numbers of a contiguous copy)
    _reduce.stats([a if a.dtype.kind in "fiub" else a.view(np.uint16) for a in arrays],
                  "".join(stats_kind(a) for a in arrays), out)
    return out


def spill(path: str, header: bytes, array: np.ndarray, row) -> None:
    """A file of header then the array's elements in C order (an array with a stats_kind,
    strided or not), its statistics (as stats() gives them) and size into row (8 float64),
    in one read of the array without the GIL. OSError names the path."""
    _reduce.spill(path, header, array, stats_kind(array), row)


def stats_rows(arrays, kinds: str, table: np.ndarray, rows: np.ndarray) -> bool:
    """Each array's statistics (as stats() gives them) and size into its row of table
    ((rows, 8) float64), where kinds names a stats_kind other than bfloat16's ('.' skips
    the array). False, writing nothing, when an array is not of the kind named or is
    strided."""
    return _reduce.stats_rows(arrays, kinds, table, rows)


def stats_text(rows: np.ndarray) -> list:
    """Per row of stats (max, min, mean, l2norm with 17 significant digits, then the three
    counts as integers) its CSV fields."""
    return _reduce.stats_text(np.ascontiguousarray(rows, dtype=np.float64))


class PassTotals(NamedTuple):
    """One C pass over a pair (x the NPU side, y the golden): the fields of kernels/c/kernels.h's
    T_* enum, in its order (a test holds the two to one count). Counts arrive as floats."""
    x_nan: float
    x_inf: float
    y_nan: float
    y_inf: float
    x_at_fp16_max: float
    live: float                 # golden elements that are not zero
    flushed: float              # of those, the NPU's zeros
    left_out: float             # pairs with a non-finite side
    n: float                    # the finite pairs, over which the rest is summed
    xy: float
    xx: float
    yy: float
    dd: float                   # sum (x - y)^2
    abs_d_sum: float
    abs_d_max: float
    rel_n: float                # pairs with |y| > eps, over which the relative errors go
    rel_sum: float
    rel_max: float
    within_1e3: float
    within_5e3: float
    lo_x: float
    hi_x: float
    lo_y: float
    hi_y: float
    mean_x: float
    m2_x: float
    mean_y: float
    m2_y: float
    kl_p: float                 # KL's sums with the ranges given (KLSums' fields)
    kl_q: float
    kl_excess: float


class KLSums(NamedTuple):
    """KL's sums over the finite pairs for the whole tensors' ranges: of the normalised x
    (p), of the normalised y (q), and of the excess terms."""
    p: float
    q: float
    excess: float


def compare(x: np.ndarray, y: np.ndarray, start: int, stop: int, ranges=None) -> PassTotals:
    """The comparison totals of x[start:stop] against y[start:stop] (flat arrays of the same
    size), KL sums included when ranges = (lo_x, hi_x, lo_y, hi_y) is given."""
    ranges = None if ranges is None else tuple(map(float, ranges))
    return PassTotals._make(_reduce.compare(flat(x), flat(y), kind(x) + kind(y), start, stop,
                                            ranges))


def compare_batch(pairs) -> list:
    """compare() of each whole pair (x, y: flat arrays of one size, of kinds this module
    takes) and, where it found finite elements, kl() for the ranges it found, in its KL
    fields: one call for them all, the GIL released."""
    xs = [flat(x) for x, _ in pairs]
    ys = [flat(y) for _, y in pairs]
    kinds = "".join(kind(x) + kind(y) for x, y in pairs)
    return [PassTotals._make(v) for v in _reduce.compare_batch(xs, ys, kinds)]


def kl(x: np.ndarray, y: np.ndarray, start: int, stop: int, ranges) -> KLSums:
    return KLSums._make(_reduce.kl(flat(x), flat(y), kind(x) + kind(y), start, stop,
                                   tuple(map(float, ranges))))


def index_text(arrays, kinds: str, stats: np.ndarray, stamps: np.ndarray, template) -> bytes:
    """A frozen dump template (see dump.template) filled: stamps (int64, one per record)
    and the statistics of arrays (flat, as flat() gives them, with their kinds) written into
    stats ((len(arrays), 7) float64) and formatted as stats_text does. An array given as None
    keeps the statistics already in its row of stats (its kind character is not read)."""
    return _reduce.index_text(arrays, kinds, stats, stamps, template.literal, template.cuts,
                              template.refs)


def pack(arrays) -> tuple:
    """(data, layout): the arrays' bytes back to back in one bytes object, and per array its
    item size, number of dimensions and dimensions (int64 bytes). A strided array, or one
    that exports no buffer (bfloat16, objects), raises what its buffer export raises
    (numpy: ValueError; BufferError or TypeError for others)."""
    return _reduce.pack(arrays)


def write_files(paths, headers, arrays, converts=None, links=(), renames=(), dirs=()) -> None:
    """Empty directories made first, then hard links (or files of their contents where
    linking fails), then each path its header and its array's bytes (an array may be a tuple
    of arrays, written back to back; converts, one character per path: '.' the bytes as they
    are, 'e' a float32 array written as float16, see writer.half_bits), then renames: all of
    it in one call without the GIL. OSError names the path that failed, and nothing after it
    is done."""
    _reduce.write_files(paths, headers, arrays, converts, tuple(links), tuple(renames),
                        tuple(dirs))


WRITER_THREAD = "pt-dump-writer"     # the writer thread's name, as the C module sets it


def writer(max_pending: int):
    """The C module's writer thread (see dump.writer.NativeWriter)."""
    return _reduce.Writer(max_pending)


def writer_threads() -> list:
    """The /proc/self/task entries of the C module's writer threads alive in this process:
    threading does not see them; on Linux /proc does, by their name (elsewhere the threads
    are not named: none)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    found = []
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == WRITER_THREAD:
                    found.append(f"/proc/self/task/{tid}")
        except OSError:             # the thread ended meanwhile
            continue
    return found


def writer_running() -> bool:
    """Is one of the C module's writer threads alive in this process?"""
    return bool(writer_threads())


def read_csv(data, kinds: dict, rest=None):
    """table.read_csv's columns: (header, {name: bytearray of float64 or list of
    str}, rows); ValueError says what is wrong and where."""
    return _reduce.read_csv(data, kinds, rest)
