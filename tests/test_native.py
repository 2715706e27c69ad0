"""The C one-pass reductions against float64 references and against the numpy code that
defines each quantity: statistics, comparison totals, KL with and without the index's
ranges, every float16 and bfloat16 bit pattern, and the merge of split ranges."""
import errno
import os
import signal
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from precision_tool import kernels, numerics
from precision_tool.kernels import totals as kcompare
from precision_tool.kernels import native
from precision_tool.analysis.comparing import metrics
from precision_tool.analysis.comparing.engine import Engine, Pair, Side, compare_pairs

import refs

EPS = float(np.finfo(np.float32).eps)


@pytest.fixture(autouse=True, params=["avx512", "avx2", "portable"])
def c_module(monkeypatch, request):
    """These tests are of the C module: on, whatever the environment (the tests that compare
    it with the numpy code switch that on themselves), and each runs three times: with the
    AVX-512 loops where the CPU has them, with the AVX2 loops (where it has those, and
    AVX-512 is turned off) and with the portable loops only."""
    monkeypatch.delenv("PRECISION_TOOL_NUMPY_ONLY", raising=False)
    for name in ("PRECISION_TOOL_NO_AVX512", "PRECISION_TOOL_NO_AVX2"):
        monkeypatch.delenv(name, raising=False)
    if request.param in ("avx2", "portable"):
        monkeypatch.setenv("PRECISION_TOOL_NO_AVX512", "1")
    if request.param == "portable":
        monkeypatch.setenv("PRECISION_TOOL_NO_AVX2", "1")
    native.refresh_simd()
    yield request.param
    monkeypatch.undo()
    native.refresh_simd()


def test_the_c_module_is_built():
    # an install without a C compiler runs the numpy code; this suite must test both
    assert native._reduce is not None, "precision_tool._reduce was not built (no C compiler?)"


def test_the_vector_loops_run_where_the_cpu_has_them(c_module):
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(line for line in f if line.startswith("flags")).split())
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo to tell what this CPU has")
    avx512 = {"avx512f", "avx512dq"} <= flags
    avx2 = {"avx2", "fma", "f16c", "popcnt"} <= flags
    want = {"avx512": "avx512" if avx512 else "avx2" if avx2 else "",
            "avx2": "avx2" if avx2 else "", "portable": ""}[c_module]
    assert native.simd() == want


def _hostile(n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.normal(scale=3.0, size=n)
    a[rng.integers(0, n, 5)] = np.nan
    a[rng.integers(0, n, 3)] = np.inf
    a[rng.integers(0, n, 3)] = -np.inf
    a[rng.integers(0, n, 7)] = 0.0
    return a.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_stats_match_float64_reference(dtype):
    arrays = [_hostile(n, dtype, seed=n) for n in (1, 17, 1023, 1024, 1025, 5000)]
    arrays.append(np.full(9, np.nan, dtype))           # no finite element
    arrays.append(np.arange(12, dtype=dtype).reshape(3, 4)[:, ::2])    # strided
    rows = native.stats(arrays)
    for a, row in zip(arrays, rows):
        ref = refs.tensor_stats(a)
        if np.isnan(ref[0]):
            assert np.isnan(row[:4]).all() and row[4:].tolist() == ref[4:]
            continue
        assert row[0] == ref[0] and row[1] == ref[1]
        np.testing.assert_allclose(row[2:4], ref[2:4], rtol=1e-13)
        assert row[4:].tolist() == ref[4:]


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64,
                                   np.int64, np.bool_])
def test_a_strided_arrays_stats_are_its_contiguous_copys_without_the_copy(dtype):
    """A transpose, a step slice, a reversed axis, a broadcast and a column are read where
    they lie, in C order, block for block as their contiguous copy is: the same numbers bit
    for bit, and the float64 reference's. Rows span the 1024-element blocks unevenly."""
    a = _hostile(300 * 517, np.float64, seed=5).reshape(300, 517)
    a = (a > 0) if dtype is np.bool_ else \
        (np.nan_to_num(a, posinf=0, neginf=0) * 100).astype(dtype) if dtype is np.int64 \
        else a.astype(dtype)
    b = a[:60].reshape(6, 10, 517)
    views = [a.T, a[::3, 1::2], a[:, ::-1], np.broadcast_to(a[0], (40, 517)), a[:, 5],
             b.transpose(2, 0, 1), b[:, ::2, 3:].transpose(1, 2, 0)]
    assert not any(v.flags.c_contiguous for v in views)
    rows = native.stats(views)
    for v, row in zip(views, rows):
        copy = native.stats([np.ascontiguousarray(v)])[0]
        assert np.array_equal(row, copy, equal_nan=True), v.shape
        ref = refs.tensor_stats(v)
        assert row[0] == ref[0] and row[1] == ref[1] and row[4:].tolist() == ref[4:]
        np.testing.assert_allclose(row[2:4], ref[2:4], rtol=1e-13)


INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
              np.bool_]


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_integer_and_boolean_stats_match_float64_reference(dtype):
    """The statistics take integers and booleans (a step's labels, masks, shapes) in C too:
    each element as the nearest double, as numpy's astype gives it, the extremes of the
    type included; one call and stats_rows agree."""
    info = np.iinfo(dtype) if dtype is not np.bool_ else None
    rng = np.random.default_rng(7)
    arrays = [rng.integers(0, 2, 1100).astype(dtype), np.ones(1, dtype),
              np.arange(40).astype(dtype).reshape(5, 8)[:, ::3]]          # strided
    if info is not None:
        arrays.append(np.array([info.min, info.max, 0, info.max - 1] * 300, dtype))
        arrays.append(rng.integers(info.min // 2, info.max // 2, 5000, dtype=dtype, endpoint=True))
    rows = native.stats(arrays)
    table = np.full((len(arrays), 8), -1.0)
    contiguous = [np.ascontiguousarray(a) for a in arrays]
    kinds = "".join(native.stats_kind(a) for a in contiguous)
    assert native.stats_rows(contiguous, kinds, table, np.arange(len(arrays))) is True
    for a, row, full in zip(arrays, rows, table):
        ref = refs.tensor_stats(a)
        assert row[0] == ref[0] and row[1] == ref[1] and row[4:].tolist() == [0, 0, 0]
        np.testing.assert_allclose(row[2:4], ref[2:4], rtol=1e-13)
        assert np.array_equal(full[:7], row) and full[7] == a.size
    # a kind that is not the array's (the signedness or the width) writes nothing
    for a, wrong in ((np.arange(3, dtype=np.int32), "q"), (np.arange(3, dtype=np.int64), "i"),
                     (np.arange(3, dtype=np.uint8), "c"), (np.arange(3, dtype=np.int8), "B"),
                     (np.arange(3, dtype=np.uint8), "?"), (np.arange(3, dtype=np.int16), "e")):
        assert native.stats_rows([a], wrong, table, np.array([0])) is False, (a.dtype, wrong)
        assert np.array_equal(table[0, :7], rows[0])


def test_comparisons_refuse_integer_kinds():
    x = np.arange(4, dtype=np.int32)
    with pytest.raises(ValueError, match="floats only"):
        native._reduce.compare(x, x, "ii", 0, 4, None)
    assert native.kind(x) is None and native.stats_kind(x) == "i"


def test_batch_stats_is_the_same_on_both_paths(monkeypatch):
    arrays = [_hostile(300, np.float32, 1), np.arange(7, dtype=np.int32), np.zeros(0, np.float32),
              np.array([True, False]), _hostile(70000, np.float16, 2)]
    fast = kernels.batch_stats(arrays)
    monkeypatch.setenv("PRECISION_TOOL_NUMPY_ONLY", "1")
    slow = kernels.batch_stats(arrays)
    for field in kernels.STAT_FIELDS:
        np.testing.assert_allclose(fast[field], slow[field], rtol=1e-13, equal_nan=True)
    assert kernels.tensor_stats(arrays[0]) == pytest.approx(dict(zip(kernels.STAT_FIELDS, refs.tensor_stats(arrays[0]))))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_every_16_bit_pattern_converts_exactly(dtype):
    x = np.arange(1 << 16, dtype=np.uint16).view(dtype)
    y = x.astype(np.float32)                       # numpy's (ml_dtypes') conversion
    t = kcompare.range_totals(x, y)
    finite = np.isfinite(y)
    assert t.abs_d_max == 0.0 and t.n == finite.sum()
    assert t.counts["NpuNanCount"] == np.isnan(y).sum() == t.counts["GoldenNanCount"]
    assert t.counts["NpuInfCount"] == np.isinf(y).sum()
    assert t.lo["x"] == y[finite].min() and t.hi["x"] == y[finite].max()
    assert t.xx == pytest.approx(float(np.dot(y[finite].astype(np.float64), y[finite].astype(np.float64))), rel=1e-14, abs=0)


def _pair(n=50000, seed=3, x_dtype=np.float16, y_dtype=np.float32):
    """Close tensors with nan, inf and zeros in the first block; blocks after it are plain
    (as most are), and the last is not a whole block."""
    rng = np.random.default_rng(seed)
    y = rng.normal(size=n).astype(y_dtype)
    x = (y.astype(np.float64) + rng.normal(scale=1e-2, size=n)).astype(x_dtype)
    x[[5, 70]] = [np.inf, np.nan]
    y[[9, 70]] = [np.nan, -np.inf]
    y[100:140] = 0.0
    x[120:160] = 0.0
    y[2048 + 10:2048 + 30] = 0.0        # and in a plain block
    x[2048 + 20:2048 + 50] = 0.0
    return x, y


PAIRS = [(np.float16, np.float32), (np.float32, np.float32), (ml_dtypes.bfloat16, np.float32),
         (np.float32, np.float16), (np.float64, np.float32)]


@pytest.mark.parametrize("x_dtype,y_dtype", PAIRS)
def test_comparison_totals_match_float64_reference(x_dtype, y_dtype):
    x, y = _pair(x_dtype=x_dtype, y_dtype=y_dtype)
    if y.dtype == np.float32:
        y[3000] = 3e38                  # past reciprocal()'s range: the portable loops' general case
    t = kcompare.range_totals(x, y)
    xf, yf = x.astype(np.float64), y.astype(np.float64)
    fin = np.isfinite(xf) & np.isfinite(yf)
    a, b = xf[fin], yf[fin]
    d = np.abs(a - b)
    rel = np.abs(b) > EPS
    err = np.where(rel, d / np.where(rel, np.abs(b), 1.0), d)
    assert t.n == fin.sum() and t.left_out == (~fin).sum()
    assert t.counts == {"NpuNanCount": 1, "NpuInfCount": 1, "GoldenNanCount": 1, "GoldenInfCount": 1,
                        "NpuAtFp16Max": 1}
    assert t.live == (yf != 0).sum() and t.flushed == ((yf != 0) & (xf == 0)).sum()
    for got, want in ((t.xy, a @ b), (t.xx, a @ a), (t.yy, b @ b), (t.dd, d @ d), (t.abs_d_sum, d.sum()),
                      (t.rel_sum, err[rel].sum())):
        assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert t.abs_d_max == d.max() and t.rel_max == pytest.approx(err[rel].max(), rel=1e-15, abs=0)
    assert t.rel_n == rel.sum() and t.within_1e3 == (err < 1e-3).sum() and t.within_5e3 == (err < 5e-3).sum()
    assert t.ranges() == (a.min(), a.max(), b.min(), b.max())
    for side, v in (("x", a), ("y", b)):
        n, mean, m2 = t.moments[side]
        assert n == v.size and mean == pytest.approx(v.mean(), rel=1e-12, abs=0)
        assert m2 == pytest.approx(((v - v.mean()) ** 2).sum(), rel=1e-12, abs=0)


def _close_pair(n, seed=5):
    rng = np.random.default_rng(seed)
    y = rng.normal(size=n).astype(np.float32)
    return (y * (1 + rng.normal(scale=1e-4, size=n))).astype(np.float32), y


def test_kl_of_close_tensors_to_a_few_ulps(c_module):
    """KL's raw sums (Sp, Sq and the excess terms' sum) against extended-precision sums over
    the same p and q. In the third block x is zero where y is not: terms far from p = q,
    which the loops take through the log."""
    if np.finfo(np.longdouble).eps >= np.finfo(np.float64).eps:
        pytest.skip("no extended precision long double here for the reference")
    x, y = _close_pair(8192)
    x[2048 + 100:2048 + 140] = 0.0
    ranges = (float(x.min()), float(x.max()), float(y.min()), float(y.max()))
    unit = [np.maximum((v.astype(np.float64) - lo) * (1.0 / (hi - lo)), EPS)
            for v, lo, hi in ((x, *ranges[:2]), (y, *ranges[2:]))]
    p, q = (u.astype(np.longdouble) for u in unit)
    want = float(refs.kl_excess(p, q).sum())
    for sums in (native.compare(x, y, 0, x.size, ranges)[-3:], native.kl(x, y, 0, x.size, ranges)):
        assert sums[0] == pytest.approx(float(p.sum()), rel=1e-15, abs=0)
        assert sums[1] == pytest.approx(float(q.sum()), rel=1e-15, abs=0)
        assert sums[2] == pytest.approx(want, rel=1e-14, abs=0)


def test_kl_terms_at_the_edge_of_the_series():
    """p / q - 1 just under 1/64, where the series needs its last term, and just over, where
    the log takes over; and either side of 1/256, under which the AVX-512 loop's shorter
    series runs (over it, the block is summed again): ranges (0, 1) make p = x and q = y."""
    if np.finfo(np.longdouble).eps >= np.finfo(np.float64).eps:
        pytest.skip("no extended precision long double here for the reference")
    x = np.random.default_rng(6).uniform(0.1, 1.0, 4096).astype(np.float32)
    for ratio in (1.0038, 1.0040, 1.0155, 1.0158):
        y = (x / np.float32(ratio)).astype(np.float32)
        want = float(refs.kl_excess(x.astype(np.longdouble), y.astype(np.longdouble)).sum())
        assert native.kl(x, y, 0, x.size, (0.0, 1.0, 0.0, 1.0))[2] == pytest.approx(want, rel=1e-14, abs=0)


def _reference_kl(x, y):
    xf, yf = x.astype(np.float64), y.astype(np.float64)
    fin = np.isfinite(xf) & np.isfinite(yf)
    p, q = xf[fin], yf[fin]
    p = np.maximum((p - p.min()) / (p.max() - p.min()), EPS)
    q = np.maximum((q - q.min()) / (q.max() - q.min()), EPS)
    return refs.kl_divergence(p, q)


def test_kl_from_the_first_pass_when_the_ranges_hold():
    x, y = _pair()
    no_hint = metrics.compare_tensors(x, y)
    t = kcompare.range_totals(x, y)
    right = kcompare.range_totals(x, y, ranges=t.ranges())
    assert right.early_kl() is not None
    wrong = kcompare.range_totals(x, y, ranges=(t.lo["x"] - 1, t.hi["x"], t.lo["y"], t.hi["y"]))
    assert wrong.early_kl() is None                    # a stale index never decides KL
    kl_second_pass = kcompare.range_kl(x.reshape(-1), y.reshape(-1), 0, x.size, t.ranges())
    np.testing.assert_allclose(right.early_kl(), kl_second_pass, rtol=1e-13)
    hinted = metrics.compare_tensors(x, y, ranges=t.ranges())
    stale = metrics.compare_tensors(x, y, ranges=wrong.kl_hint)
    want = _reference_kl(x, y)
    for row in (no_hint, hinted, stale):
        assert row["KullbackLeiblerDivergence"] == pytest.approx(want, rel=1e-11, abs=0)
    assert stale["KullbackLeiblerDivergence"] == no_hint["KullbackLeiblerDivergence"]


@pytest.mark.parametrize("side,value", [("x", np.nan), ("x", -np.inf), ("y", np.inf), ("y", np.nan)])
def test_a_lone_inf_or_nan_in_a_later_block_is_counted_and_left_out(monkeypatch, side, value):
    """The AVX-512 loop finds a non-finite element through its sums of squares (no check of
    its own): one on either side, in a block of its own, must still send that block to the
    masked loop."""
    x, y = (v.astype(np.float32) for v in _close_pair(8192))
    (x if side == "x" else y)[5000] = value
    fast = _both_paths_agree(monkeypatch, x, y)
    keep = np.ones(x.size, bool)
    keep[5000] = False
    a, b = x[keep].astype(np.float64), y[keep].astype(np.float64)
    assert fast["CosineSimilarity"] == pytest.approx(a @ b / np.linalg.norm(a) / np.linalg.norm(b), rel=1e-14, abs=0)


def _both_paths_agree(monkeypatch, x, y) -> dict:
    """compare_tensors through the C module and through numpy: the same row to 1e-11."""
    fast = metrics.compare_tensors(x, y)
    monkeypatch.setenv("PRECISION_TOOL_NUMPY_ONLY", "1")
    slow = metrics.compare_tensors(x, y)
    monkeypatch.delenv("PRECISION_TOOL_NUMPY_ONLY")
    assert fast.keys() == slow.keys()
    for k, v in fast.items():
        if isinstance(v, str):
            assert v == slow[k], k
        else:
            assert v == pytest.approx(slow[k], rel=1e-11, abs=0, nan_ok=True), k
    return fast


def test_both_paths_give_the_same_row(monkeypatch):
    _both_paths_agree(monkeypatch, *_pair())


def test_split_ranges_with_the_index_hint_need_no_kl_pass(tmp_path, monkeypatch):
    from precision_tool.analysis.comparing import engine as engine_module
    monkeypatch.setattr(engine_module, "SPLIT_ELEMENTS", 1000)
    monkeypatch.setattr(engine_module, "RANGE_ELEMENTS", 3000)
    monkeypatch.setattr(engine_module, "BATCH_BYTES", 100)
    x, y = _pair(10000)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    t = kcompare.range_totals(x, y)
    plain = Pair(Side(str(tmp_path / "x.npy")), Side(str(tmp_path / "y.npy")))
    hinted = Pair(Side(str(tmp_path / "x.npy"), lo=t.lo["x"], hi=t.hi["x"]),
                  Side(str(tmp_path / "y.npy"), lo=t.lo["y"], hi=t.hi["y"]))

    class Counting(Engine):
        tasks = []

        def map(self, tasks, done, seconds=None):
            self.tasks += [(task[0], len(task[3])) for task in tasks]
            return super().map(tasks, done, seconds)

    rows = {}
    for name, pair in (("plain", plain), ("hinted", hinted)):
        engine = Counting()
        engine.tasks = []
        rows[name] = compare_pairs(str(tmp_path), [pair], engine)[0]
        # in this process a tensor's ranges go in one task (its parts share the threads)
        assert engine.tasks == [("totals", 4)] + ([("kl", 4)] if name == "plain" else [])
    whole = metrics.compare_tensors(x, y)
    for row in rows.values():
        assert row["KullbackLeiblerDivergence"] == pytest.approx(whole["KullbackLeiblerDivergence"], rel=1e-12, abs=0)
        assert row["CosineSimilarity"] == pytest.approx(whole["CosineSimilarity"], rel=1e-14, abs=0)


def test_bad_buffers_are_refused():
    x = np.zeros(4, np.float32)
    with pytest.raises(ValueError):
        native._reduce.compare(x, np.zeros(5, np.float32), "ff", 0, 4, None)
    with pytest.raises(ValueError):
        native._reduce.compare(x, x, "ff", 0, 5, None)
    with pytest.raises(ValueError):
        native._reduce.compare(x, x, "fz", 0, 4, None)
    with pytest.raises(ValueError):
        native._reduce.stats([x], "ff", np.empty((1, 7)))


def test_index_text_of_stats_is_the_same_on_both_paths(monkeypatch):
    arrays = [np.random.default_rng(i).normal(size=50).astype(np.float32) * 10.0 ** (i - 3) for i in range(40)]
    arrays += [np.array([np.nan, np.inf, -np.inf, 1.0]), np.full(3, np.nan), np.array([-0.0]),
               np.array([3.0]), np.arange(5), np.array([1e-310, 2.0 ** 60])]
    stats = kernels.batch_stats(arrays)
    fast = kernels.stats_text(stats)
    monkeypatch.setenv("PRECISION_TOOL_NUMPY_ONLY", "1")
    assert fast == kernels.stats_text(stats)
    for text, field in zip(fast[-3].split(","), kernels.STAT_FIELDS):   # reads back exactly
        assert float(text) == stats[field][-3]


def _doubles_to_format():
    """Doubles across every exponent (random bit patterns), log-uniform over the range the
    exact integer path takes, short dyadic fractions (exact expansions of few digits: some
    end in a 5 at the 18th digit, a tie), powers of ten and their neighbours, and the edges."""
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2 ** 63, 20000, dtype=np.int64).view(np.float64)
    spread = 10.0 ** rng.uniform(-8, 40, 40000)
    dyadic = rng.integers(1, 2 ** 24, 20000) / 2.0 ** rng.integers(0, 70, 20000)
    tens = 10.0 ** np.arange(-9, 40)
    near = np.concatenate([np.nextafter(tens, 0), np.nextafter(tens, np.inf), tens])
    edges = np.array([0.0, -0.0, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308,
                      np.inf, -np.inf, 2.0 ** 53, 2.0 ** 53 + 2, 2.0 ** 56, 2.0 ** 57,
                      9.9999999999999995e16, 99999999999999999.0, 0.1, 1 / 3, 1e-6, 1e-5,
                      9.99999999999999e-5, 123456789012345678.0, 2.0 ** 127, 2.0 ** 126])
    x = np.concatenate([bits, spread, dyadic, near, edges])
    x = x[np.isfinite(x) | np.isinf(x)]
    return np.concatenate([x, -x])


def test_stats_text_is_printf_17g():
    # reference: Python's %-formatting (correctly rounded, half to even on exact ties)
    x = _doubles_to_format()
    rows = np.zeros((x.size, 7))
    rows[:, 0] = x
    rows[:, 4:] = [[3, 0, 12345678901]]
    got = [line.split(",") for line in native.stats_text(rows)]
    assert [g[0] for g in got] == ["%.17g" % v for v in x.tolist()]
    assert {tuple(g[4:]) for g in got} == {("3", "0", "12345678901")}


def test_sums_do_not_depend_on_the_thread_count(monkeypatch):
    monkeypatch.setattr(kcompare, "PART", 4096)       # many parts out of a small pair
    x, y = _pair(50000)
    rows = {}
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("PRECISION_TOOL_THREADS", threads)
        rows[threads] = metrics.compare_tensors(x, y)
    def same(a, b):          # bit for bit, nan equal to nan
        return a == b or (isinstance(a, float) and np.isnan(a) and np.isnan(b))
    for threads in ("2", "3"):
        assert all(same(v, rows[threads][k]) for k, v in rows["1"].items())


def test_huge_golden_values_take_the_exact_division():
    # |golden| >= 1e37 is beyond the float reciprocal's range: such blocks divide exactly
    rng = np.random.default_rng(5)
    y = rng.normal(size=3000) * 1e300
    x = y * (1 + rng.normal(scale=1e-6, size=3000))
    t = kcompare.range_totals(x, y)
    err = np.abs(x - y) / np.abs(y)
    assert t.rel_sum == pytest.approx(err.sum(), rel=1e-13, abs=0) and t.rel_max == err.max()
    assert t.within_1e3 == 3000


@pytest.mark.parametrize("path", ["one C call", "numpy"])
def test_npy_files_written_in_one_call_read_back(tmp_path, monkeypatch, path):
    from precision_tool.kernels.write import write_files
    if path == "numpy":
        monkeypatch.setenv("PRECISION_TOOL_NUMPY_ONLY", "1")
    arrays = [np.arange(12, dtype=np.float16).reshape(3, 4), np.array(2.5, np.float32),
              np.zeros((0, 3), np.int32), np.arange(10.0)[::3], np.array([True, False])]
    paths = [str(tmp_path / f"t{k}.npy") for k in range(len(arrays))]
    write_files(paths, arrays)
    for p, a in zip(paths, arrays):
        b = np.load(p, allow_pickle=False)
        assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b)
    missing = str(tmp_path / "no-such-dir" / "x.npy")
    with pytest.raises(OSError) as err:
        write_files([paths[0], missing], arrays[:2])
    assert err.value.filename == missing and err.value.errno == errno.ENOENT


@pytest.mark.parametrize("path", ["one C call", "numpy"])
def test_a_directory_of_files_links_and_renames_in_one_call(tmp_path, monkeypatch, path):
    """A step's directory made empty (an interrupted dump's leftovers removed), a bundle's
    raw arrays back to back, a graph linked where its source exists and written where it
    does not, then the directory renamed into place, replacing one already there; a failed
    rename names where it was going."""
    from precision_tool.kernels.write import write_files
    if path == "numpy":
        monkeypatch.setenv("PRECISION_TOOL_NUMPY_ONLY", "1")
    (tmp_path / "graph.json").write_bytes(b"graph")
    partial, final = tmp_path / "run" / ".0.partial", tmp_path / "run" / "0"

    def step(files, renames=True):
        write_files([str(partial / name) for name in files], list(files.values()),
                    [b""] * len(files), "." * len(files), dirs=[str(partial)],
                    renames=[(str(partial), str(final))] if renames else ())

    step({"stale.bin": b"old"}, renames=False)          # an interrupted dump (no parent yet)
    pieces = (np.arange(3, dtype=np.float32), np.arange(2, dtype=np.int64)[::-1], np.float64(7.0))
    write_files([str(partial / "a.npy"), str(partial / "v.bin"), str(partial / "index.csv")],
                [np.eye(2), pieces, b"x,y\n"], [b"HEAD", b"", b""], "...",
                links=[(str(tmp_path / "graph.json"), str(partial / "g1.json"), b"graph"),
                       (str(tmp_path / "gone.json"), str(partial / "g2.json"), b"graph")],
                renames=[(str(partial), str(final))], dirs=[str(partial)])
    assert not partial.exists() and sorted(os.listdir(final)) == [
        "a.npy", "g1.json", "g2.json", "index.csv", "v.bin"]
    assert (final / "a.npy").read_bytes() == b"HEAD" + np.eye(2).tobytes()
    assert (final / "v.bin").read_bytes() == b"".join(np.ascontiguousarray(p).tobytes()
                                                      for p in pieces)
    assert (final / "index.csv").read_bytes() == b"x,y\n"
    assert os.path.samefile(final / "g1.json", tmp_path / "graph.json")
    assert (final / "g2.json").read_bytes() == b"graph"
    assert not os.path.samefile(final / "g2.json", tmp_path / "graph.json")
    step({"b.bin": b"new"})                             # dumped again: replaces the step
    assert os.listdir(final) == ["b.bin"] and sorted(os.listdir(tmp_path / "run")) == ["0"]
    with pytest.raises(OSError) as err:
        write_files([], [], [], "", renames=[(str(partial), str(final))])
    assert err.value.filename == str(final) and err.value.errno == errno.ENOENT
    assert os.listdir(final) == ["b.bin"]


def _half_boundaries():
    """float32 bit patterns where float32 -> float16 rounding decides: every half value, the
    midpoints to its neighbours and one float32 ulp either side of them, plus a strided
    sample of all 2^32 patterns (the whole space was checked once; it takes minutes)."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    h = halves[np.isfinite(halves)].astype(np.float64)
    h = np.unique(h)
    mids = ((h[1:] + h[:-1]) / 2).astype(np.float32).view(np.uint32)   # exact in float32
    near = np.concatenate([mids - 1, mids, mids + 1, h.astype(np.float32).view(np.uint32)])
    edges = np.array([0x477fefff, 0x477ff000, 0x477ff001, 0x33000000, 0x33000001, 0x32ffffff,
                      0x7f800000, 0xff800000, 0x7f7fffff], dtype=np.uint32)
    sample = np.arange(0, 1 << 32, 65521, dtype=np.uint64).astype(np.uint32)
    bits = np.concatenate([near, near | 0x80000000, edges, sample])
    return bits.view(np.float32)


def _nan_halves(bits):
    """A float32 nan's float16, by the rule the dump states: sign, all-ones exponent, the
    payload's top ten bits (1 where they are zero)."""
    payload = (bits >> 13) & 0x3FF
    return ((bits >> 16) & 0x8000) | 0x7C00 | np.where(payload == 0, 1, payload)


@pytest.mark.parametrize("path", ["one C call", "numpy"])
def test_float32_written_as_float16_rounds_as_astype(tmp_path, monkeypatch, path):
    """Every finite or infinite value as astype rounds it; every nan (quiet, signalling, of
    either sign, in every lane of a 16-wide vector) by the stated rule, on both paths."""
    from precision_tool.kernels.write import npy_header, write_files
    if path == "numpy":
        monkeypatch.setenv("PRECISION_TOOL_NUMPY_ONLY", "1")
    nans = np.array([0x7F800001, 0x7FC00000, 0xFFC00001, 0x7FBFE000, 0x7F802000, 0x7FFFFFFF,
                     0xFF800001, 0x7FC02000], dtype=np.uint32)
    x = np.concatenate([_half_boundaries(), np.tile(nans, 5).view(np.float32)])
    p = str(tmp_path / "h.npy")
    write_files([p], [x], [npy_header(np.dtype(np.float16), x.shape)], "e")
    got = np.load(p, allow_pickle=False)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    assert got.dtype == np.float16 and got.shape == x.shape
    nan = np.isnan(x)
    assert np.array_equal(got[~nan].view(np.uint16), want[~nan].view(np.uint16))
    assert np.array_equal(got[nan].view(np.uint16), _nan_halves(x[nan].view(np.uint32)))


def test_write_files_refuses_bad_conversions(tmp_path):
    from precision_tool.kernels.write import npy_header
    path = str(tmp_path / "x.npy")
    x = np.zeros(3, np.float64)
    head = npy_header(np.dtype(np.float16), x.shape)
    with pytest.raises(ValueError, match="float32"):
        native.write_files([path], [head], [x], "e")
    with pytest.raises(ValueError, match="'.' or 'e'"):
        native.write_files([path], [head], [x.astype(np.float32)], "x")
    with pytest.raises(ValueError, match="one conversion"):
        native.write_files([path], [head], [x.astype(np.float32)], "ee")


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="POSIX file size limit")
@pytest.mark.parametrize("convert", [".", "e"])
def test_a_file_the_size_limit_cuts_short_fails_naming_it(tmp_path, convert):
    """The kernel takes part of a write and then refuses the rest (here RLIMIT_FSIZE, in a
    child process): the short write is followed up, and the refusal is an OSError naming
    the file, never a file that looks whole."""
    path = str(tmp_path / "t.npy")
    child = f"""
import resource, signal, numpy as np
from precision_tool.kernels import native
from precision_tool.kernels.write import npy_header
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (300, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
x = np.arange(1000, dtype=np.float32)
dtype = np.dtype(np.float16 if {convert!r} == "e" else np.float32)
try:
    native.write_files([{path!r}], [npy_header(dtype, x.shape)], [x], {convert!r})
    print("written")
except OSError as e:
    print(e.errno, e.filename)
"""
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         env={**os.environ, "PRECISION_TOOL_NUMPY_ONLY": ""})
    assert out.stdout.split() == [str(errno.EFBIG), path], out.stderr
    assert (tmp_path / "t.npy").stat().st_size == 300        # what the limit let through


def _stamped_template():
    from precision_tool.dump.template import Template
    t = Template().text("op_type,name,timestamp,stats\n")
    for k, name in enumerate(["MatMul,a", '"q"', "ünï"]):
        t.text(f"{name},").stamp(k % 2).text(",").stats(k).text("\n")
    return t.stats(0).text("|").stamp(1).freeze()


def test_index_text_fills_the_template_as_python_does():
    t = _stamped_template()
    arrays = [_hostile(1000, np.float32), np.arange(7, dtype=np.int32),
              _hostile(300, np.float16)]
    stats = np.full((3, 7), -1.0)
    stats[1] = [6, 0, 3, 9.539392014169456, 0, 0, 0]      # an int array: given, as numerics would
    stamps = np.array([1700000000123456, 7], dtype=np.int64)
    text = native.index_text([arrays[0], None, arrays[2]], "f.e", stats, stamps, t)
    want = kernels.batch_stats(arrays)
    lines = ["%.17g,%.17g,%.17g,%.17g,%d,%d,%d" % tuple(want[f][k] for f in kernels.STAT_FIELDS)
             for k in range(3)]
    assert text == t.fill([1700000000123456, 7], lines)
    assert text.decode("utf-8").splitlines()[3].startswith("ünï,1700000000123456,")
    for k in (0, 2):                         # stats written back for the arrays it computed
        assert stats[k, 4:].tolist() == [want[f][k] for f in ("nan_count", "pos_inf_count",
                                                              "neg_inf_count")]
        assert stats[k, 0] == want["max"][k] and stats[k, 3] == pytest.approx(want["l2norm"][k])


def test_the_writer_finds_a_step_it_was_not_woken_for(tmp_path):
    """A step queued without waking the thread (a statistics step) is written all the same,
    found by the idle thread within its polling interval; a full queue, flush() and close()
    wake it."""
    import time
    w = native.writer(1)

    def job(name, data):
        return None, ([str(tmp_path / name)], [b""], [data], None, (), (), ())
    first = w.submit(*job("a", b"quiet"), False)
    done, deadline = [], time.monotonic() + 10
    while not done and time.monotonic() < deadline:
        time.sleep(0.001)
        done = w.done()
    assert done == [(first, None)] and (tmp_path / "a").read_bytes() == b"quiet"
    time.sleep(0.3)                 # idle long enough to poll at its longest interval
    second = w.submit(*job("b", b"1"), False)
    third = w.submit(*job("c", b"2"), False)     # the queue holds one: the thread is woken
    assert w.flush() == [(second, None), (third, None)]
    fourth = w.submit(*job("d", b"3"), False)
    assert w.close() == [(fourth, None)]
    assert [(tmp_path / n).read_bytes() for n in "bcd"] == [b"1", b"2", b"3"]


def test_pack_copies_arrays_back_to_back_and_reports_their_layout():
    arrays = [_hostile(33, np.float32), np.arange(6, dtype=np.int64).reshape(2, 3),
              np.float16(2.5), np.zeros((0, 4), np.uint8), np.array([True, False])]
    data, layout = native.pack(arrays)
    assert data == b"".join(a.tobytes() for a in arrays)
    want = []
    for a in arrays:
        want += [a.itemsize, a.ndim, *a.shape]
    assert np.frombuffer(layout, np.int64).tolist() == want
    assert native.pack([]) == (b"", b"")
    with pytest.raises((BufferError, ValueError)):        # numpy says ValueError
        native.pack([arrays[0], np.zeros((4, 4))[:, ::2]])
    bf = np.arange(3, dtype=np.float32).astype(ml_dtypes.bfloat16)    # its bytes, no format
    assert native.pack([bf]) == (bf.tobytes(), np.array([2, 1, 3], np.int64).tobytes())
    with pytest.raises(TypeError):
        native.pack([[1.0, 2.0]])                               # not a buffer


def test_index_text_takes_statistics_rows_with_their_sizes():
    """A statistics table's rows (8 float64: the statistics, then the size) give the index
    the 7-column rows give; the statistics it computes go into the first seven columns."""
    t = _stamped_template()
    arrays = [_hostile(1000, np.float32), np.arange(7, dtype=np.int32), _hostile(300, np.float16)]
    stamps = np.array([1700000000123456, 7], dtype=np.int64)
    seven = np.zeros((3, 7))
    seven[1] = [6, 0, 3, 9.539392014169456, 0, 0, 0]
    eight = np.zeros((3, 8))
    eight[:, :7], eight[:, 7] = seven, [1000, 7, 300]
    given = [arrays[0], None, arrays[2]]
    assert native.index_text(given, "f.e", eight, stamps, t) == \
        native.index_text(given, "f.e", seven, stamps, t)
    assert eight[:, :7].tolist() == seven.tolist()
    assert eight[:, 7].tolist() == [1000, 7, 300]


def test_index_text_refuses_a_template_that_does_not_fit():
    t = _stamped_template()
    stats = np.zeros((3, 7))
    good = [None, None, None]
    stamps = np.zeros(2, dtype=np.int64)
    with pytest.raises(ValueError, match="names no stamp"):
        native.index_text(good, "fff", stats, stamps[:1], t)
    with pytest.raises(ValueError, match=r"7 \(or 8\) stats per array"):
        native.index_text(good[:2], "ff", stats, stamps, t)
    with pytest.raises(ValueError, match=r"7 \(or 8\) stats per array"):
        native.index_text(good, "fff", np.zeros((3, 6)), stamps, t)
    t.cuts[2] = len(t.literal) + 1
    with pytest.raises(ValueError, match="cuts outside"):
        native.index_text(good, "fff", stats, stamps, t)


def _grid_cases(size, seed):
    """Random bit patterns (every class of float32) with the edges of both grids first: ties,
    subnormals, the float16 overflow threshold, bfloat16's carry into inf, nan payloads."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 2 ** 32, size=size, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edge = np.array([0.0, -0.0, 65504.0, 65519.99, 65520.0, -65520.0, 2.0 ** -24, 2.0 ** -25,
                     3 * 2.0 ** -26, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 1.0 + 2.0 ** -8,
                     1.0 + 3 * 2.0 ** -8, 3.4e38, -3.4e38, np.inf, -np.inf, 1e-45], np.float32)
    nans = np.array([0x7f800001, 0xffc00000, 0x7fffffff, 0xffbfffff], np.uint32).view(np.float32)
    head = np.concatenate([edge, nans])
    x[:min(size, len(head))] = head[:size]
    return x


@pytest.mark.parametrize("size", [0, 5, 17, 70_000])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("saturation", [False, True])
def test_rounding_onto_the_grid_in_one_pass_is_the_numpy_definition(monkeypatch, size, dtype,
                                                                    saturation):
    """kernels.round_result through the C module gives the numpy definition's bits and
    overflow flag, and the values of the reference conversions (numpy's float16, ml_dtypes'
    bfloat16) wherever the result is finite."""
    x = _grid_cases(size, seed=size)
    assert native.enabled()                 # the C module's pass, then the numpy definition
    got, got_bad = kernels.round_result(x, dtype, saturation)
    monkeypatch.setenv("PRECISION_TOOL_NUMPY_ONLY", "1")
    want, want_bad = kernels.round_result(x, dtype, saturation)
    assert got_bad == want_bad == bool(size and not np.isfinite(want if not saturation else
                                                                 numerics.quantize(x, dtype)).all())
    assert got.dtype == np.float32 and got.shape == x.shape
    assert got.view(np.uint32).tobytes() == want.view(np.uint32).tobytes()
    ref = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    with np.errstate(over="ignore", invalid="ignore"):
        conv = x.astype(ref).astype(np.float32)
    finite = np.isfinite(conv)
    assert np.array_equal(got[finite], conv[finite])
    if saturation:          # inf to the signed max, nan to 0
        top = numerics.max_of(dtype)
        assert np.array_equal(got[np.isinf(conv)], np.copysign(top, conv[np.isinf(conv)]).astype(np.float32))
        assert (got[np.isnan(conv)] == 0).all() and np.isfinite(got).all()
    else:                   # nan is the positive quiet nan, whatever its payload and sign
        assert (got[np.isnan(conv)].view(np.uint32) == 0x7fc00000).all()


def _float64_stats(x: np.ndarray) -> np.ndarray:
    """The statistics row (kernels.stats_row's 8 numbers) by a float64 reference."""
    with np.errstate(invalid="ignore"):
        f = x.astype(np.float64).reshape(-1)
    fin = f[np.isfinite(f)]
    head = [fin.max(), fin.min(), fin.mean(), np.sqrt(np.dot(fin, fin))] if fin.size else [np.nan] * 4
    return np.array(head + [np.isnan(f).sum(), np.isposinf(f).sum(), np.isneginf(f).sum(), f.size])


@pytest.mark.parametrize("size", [0, 5, 17, 70_000])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("saturation", [False, True])
def test_rounding_gives_the_statistics_of_what_it_stores(size, dtype, saturation):
    """round_result's statistics (a statistics dump's, computed in the rounding pass) are
    those the index computes from the stored value, bit for bit, and agree with a float64
    reference; its value and overflow flag do not change for being asked."""
    x = _grid_cases(size, seed=size + 1)
    row = np.full(8, -1.0)
    got, bad = kernels.round_result(x, dtype, saturation, stats=row)
    plain, plain_bad = kernels.round_result(x, dtype, saturation)
    assert bad == plain_bad and got.tobytes() == plain.tobytes()
    want = np.empty(8)
    want[:7] = native.stats([got])[0] if size else [np.nan] * 4 + [0] * 3
    want[7] = size
    assert np.array_equal(row, want, equal_nan=True)
    ref = _float64_stats(got)
    assert np.array_equal(row[[0, 1, 4, 5, 6, 7]], ref[[0, 1, 4, 5, 6, 7]], equal_nan=True)
    # a mean that cancels to about 0 is exact only to its summation error, n eps sum|x| / n
    # (the SIMD loops add in another order than numpy's pairwise sum)
    finite = got[np.isfinite(got)].astype(np.float64)
    scale = np.abs(finite).mean() * finite.size * np.finfo(np.float64).eps if finite.size else 0.0
    assert np.allclose(row[2], ref[2], rtol=1e-12, atol=scale, equal_nan=True)
    assert np.allclose(row[3], ref[3], rtol=1e-12, equal_nan=True)


@pytest.mark.parametrize("size", [1, 15, 16, 33, 5000])
def test_the_finite_check_finds_one_inf_or_nan_wherever_it_is(size):
    """native.any_nonfinite (the float32 results' overflow check) looks at every element: the vector
    body and the tail."""
    x = np.linspace(-1e38, 3e38, size, dtype=np.float32)
    assert native.any_nonfinite(x) is False
    for where in sorted({0, size // 2, size - 1}):
        for bad in (np.inf, -np.inf, np.nan):
            y = x.copy()
            y[where] = bad
            assert native.any_nonfinite(y) is True, (where, bad)


def test_stats_rows_fills_the_named_rows_or_nothing():
    """stats_rows (a statistics-only run's sources) writes each array's statistics and size
    into its row, skips '.', and writes nothing, saying False, when an array is not of the
    kind named or is strided; rows outside the table are refused."""
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(37).astype(np.float32), np.float16([1, -2, np.inf]),
              rng.standard_normal((4, 5)), np.arange(6, dtype=np.int32), np.empty(0, np.float32)]
    table = np.full((7, 8), -7.0)
    rows = np.array([6, 0, 3, 1, 4], dtype=np.int64)
    assert native.stats_rows(arrays, "fed.f", table, rows) is True
    for a, r in zip(arrays, rows):
        if a.dtype == np.int32:
            assert (table[r] == -7.0).all()
            continue
        want = np.append(native.stats([a])[0] if a.size else [np.nan] * 4 + [0] * 3, a.size)
        assert np.array_equal(table[r], want, equal_nan=True), a.dtype
    assert (table[[2, 5]] == -7.0).all()
    before = table.copy()
    for kinds, arrs in (("ffd.f", arrays), ("fed.f", [arrays[0], arrays[1], arrays[2][:, ::2],
                                                        arrays[3], arrays[4]])):
        assert native.stats_rows(arrs, kinds, table, rows) is False
        assert np.array_equal(table, before, equal_nan=True)
    with pytest.raises(ValueError, match="outside the table"):
        native.stats_rows(arrays, "fed.f", table, np.array([6, 0, 3, 1, 7], dtype=np.int64))
    with pytest.raises(ValueError, match="one kind"):
        native.stats_rows(arrays, "fe", table, rows)


def test_rounding_a_scalar_keeps_its_shape():
    got, bad = kernels.round_result(np.array(7e4, np.float32), "float16", True)
    assert got.shape == () and float(got) == 65504.0 and bad


def test_a_c_pass_reaches_python_with_its_fields_named():
    """The C pass's totals come as PassTotals, one field per entry of kernels.h's T_* enum,
    each holding what its name says (a pair with a nan, an inf and a flushed element)."""
    assert native._reduce.FIELDS == len(native.PassTotals._fields)
    x = np.array([1.0, 0.0, np.nan, 3.0, 70000.0, -2.0], np.float32)
    y = np.array([1.5, 0.5, 1.0, np.inf, 60000.0, -2.0], np.float32)
    t = native.compare(x, y, 0, x.size, (-2.0, 70000.0, -2.0, 60000.0))
    finite = np.isfinite(x) & np.isfinite(y)
    xs, ys = x[finite].astype(np.float64), y[finite].astype(np.float64)
    assert (t.x_nan, t.x_inf, t.y_nan, t.y_inf, t.x_at_fp16_max) == (1, 0, 0, 1, 1)
    assert (t.n, t.left_out, t.live, t.flushed) == (4, 2, 6, 1)
    assert (t.lo_x, t.hi_x, t.lo_y, t.hi_y) == (-2.0, 70000.0, -2.0, 60000.0)
    assert t.xy == pytest.approx(xs @ ys) and t.dd == pytest.approx(((xs - ys) ** 2).sum())
    assert t.abs_d_max == 10000.0 and t.mean_x == pytest.approx(xs.mean())
    assert native.kl(x, y, 0, x.size, (-2.0, 70000.0, -2.0, 60000.0)) == \
        pytest.approx((t.kl_p, t.kl_q, t.kl_excess))


def test_a_batch_of_mixed_kinds_gives_each_pair_its_own_row():
    """A batch of small pairs where some kinds the C module does not take (integer labels)
    sit among float ones: every pair's row is compare_tensors' own, bit for bit."""
    rng = np.random.default_rng(11)
    pairs = [(rng.normal(size=64).astype(np.float16), rng.normal(size=64).astype(np.float32)),
             (rng.integers(0, 9, 64), rng.integers(0, 9, 64)),
             (rng.normal(size=(4, 4)).astype(np.float32), rng.normal(size=(4, 4)).astype(np.float32)),
             (np.array([np.inf, 1.0, np.nan], np.float32), np.array([1.0, 2.0, 3.0], np.float32))]
    for got, (x, y) in zip(metrics.compare_many(pairs), pairs):
        want = metrics.compare_tensors(x, y)
        assert got.keys() == want.keys()
        for name in want:
            assert got[name] == want[name] or (got[name] != got[name] and want[name] != want[name]), name


def _eight_lane_sum(terms: np.ndarray, block: int = 1024) -> float:
    """The vector loops' order of a sum (avx512.c's, which avx2.c keeps): per block, lane j
    of eight adds terms 8k + j in order of k; the lanes reduce as _mm512_reduce_add_pd does
    (4 + 4, then 2 + 2, then 1 + 1); the blocks' sums add up in order."""
    total = 0.0
    for start in range(0, terms.size, block):
        lanes = np.zeros(8)
        for row in terms[start:start + block].reshape(-1, 8):
            lanes = lanes + row
        t = lanes[4:] + lanes[:4]
        u = t[2:] + t[:2]
        total += float(u[0] + u[1])
    return total


def test_the_vector_loops_sum_in_the_eight_lane_order(c_module):
    """Every vector loop sums in one order, so the AVX-512 and AVX2 paths give the same
    numbers bit for bit: checked against that order written out in numpy, on values in
    [1, 2) where every product and difference is exact (so a fused multiply-add rounds as
    a multiply then an add) and each division is correctly rounded on both sides."""
    if c_module == "portable":
        pytest.skip("the portable loops sum in the order the compiler vectorises them to")
    if not native.simd():
        pytest.skip("this CPU has no AVX2: the vector loops do not run")
    rng = np.random.default_rng(3)
    n = 4096
    x = rng.uniform(1, 2, n).astype(np.float32)
    y = rng.uniform(1, 2, n).astype(np.float32)
    t = native.compare(x, y, 0, n, None)
    a, b = x.astype(np.float64), y.astype(np.float64)
    d = a - b
    for field, terms in (("xy", a * b), ("xx", a * a), ("yy", b * b), ("dd", d * d),
                         ("abs_d_sum", np.abs(d)), ("rel_sum", np.abs(d) / np.abs(b))):
        assert getattr(t, field) == _eight_lane_sum(terms), field
    assert t.abs_d_max == np.abs(d).max() and t.rel_max == (np.abs(d) / np.abs(b)).max()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int64, np.bool_])
def test_a_spilled_file_holds_the_array_and_its_statistics_match_the_reference(tmp_path,
                                                                              dtype):
    """kernels.write.spill: the file np.load reads back is the array (shape and bytes, in C
    order for a strided one); the statistics taken on the way, piece by piece, are those
    tensor_stats gives its contiguous copy (one piece, several, a last partial block; inf
    and nan in a later piece) and the float64 reference's."""
    from precision_tool.kernels.write import spill
    sizes = (0, 1, 1025, 64 * 1024 * 3 + 17)
    for n in sizes:
        if dtype in (np.int64, np.bool_):
            a = np.random.default_rng(n).integers(-5, 6, n).astype(dtype)
        else:
            a = _hostile(n, dtype, seed=n) if n else np.empty(0, dtype)
        whole = a.reshape((n // 17, 17) if n and n % 17 == 0 else (n,))
        # and strided: a transpose, a slice with a step
        for k, a in enumerate([whole, whole.T, whole[::-3]]):
            path = str(tmp_path / f"{n}.{k}.npy")
            row = np.empty(8)
            spill(path, a, row)
            back = np.load(path, allow_pickle=False)
            assert back.shape == a.shape and back.dtype == a.dtype
            assert back.tobytes() == np.ascontiguousarray(a).tobytes()
            assert row[7] == a.size
            if a.size:
                assert np.array_equal(row[:7], native.stats([np.ascontiguousarray(a)])[0],
                                      equal_nan=True), (n, k)
                ref = refs.tensor_stats(a)
                assert row[4:7].tolist() == ref[4:]
                if not np.isnan(ref[0]):
                    assert row[0] == ref[0] and row[1] == ref[1]
                    np.testing.assert_allclose(row[2:4], ref[2:4], rtol=1e-12)


def test_a_spill_to_a_missing_directory_names_the_path(tmp_path):
    from precision_tool.kernels.write import spill
    path = str(tmp_path / "gone" / "x.npy")
    with pytest.raises(OSError) as e:
        spill(path, np.ones(4, np.float32), np.empty(8))
    assert e.value.errno == errno.ENOENT and e.value.filename == path
