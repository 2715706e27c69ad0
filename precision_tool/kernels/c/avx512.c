/* The AVX-512 loops of the statistics, the comparison, KL and the fp16 grid (simd.c says
 * when they run). */
#include "kernels.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f,avx512dq,popcnt")))

/* ---- pairs on AVX-512 ------------------------------------------------------------------------
 * compare_loop's plain case, reading the tensors where they lie (float16, bfloat16 and float32
 * widen exactly to float32): the comparisons and extremes that are exact in float32 (fp16
 * max, zeros, min and max) take sixteen lanes at a time, the rest is the same arithmetic in
 * double on eight. The vector units bound this loop, so work goes elsewhere where it can:
 * quotients are hardware divisions (the divider works beside the multiply-add units, where
 * rcp14 and two Newton steps would cost four operations a quotient), counts are popcounts
 * of the comparisons' masks on the integer units, and an inf or nan is found in the sums of
 * squares rather than by a check of its own.
 *
 * KL's excess term as kl_excess() takes it, the series where |p / q - 1| < KL_SERIES and the
 * log elsewhere; the loop itself runs a shorter series, exact to an ulp where |p / q - 1| <
 * KL_NEAR (close tensors: nearly every element), and a block with a term outside that range
 * is summed again through kl_wide, which takes both the full series and the log and keeps
 * the right one per element. */

/* 2^-1022 < |v| < 2^1022: every float32, bfloat16 and float16; 14 -> 28 -> 56 bits */
AVX512 static inline __m512d rcp_pd(__m512d v)
{
    const __m512d two = _mm512_set1_pd(2.0);
    __m512d r = _mm512_rcp14_pd(v);
    r = _mm512_mul_pd(r, _mm512_fnmadd_pd(v, r, two));
    return _mm512_mul_pd(r, _mm512_fnmadd_pd(v, r, two));
}

AVX512 static inline __m512d log_pd(__m512d v)          /* log_positive(), eight at a time */
{
    const __m512d one = _mm512_set1_pd(1.0), half = _mm512_set1_pd(0.5);
    __m512i b = _mm512_castpd_si512(v);
    __m512i k = _mm512_srai_epi64(_mm512_sub_epi64(b, _mm512_set1_epi64(0x3fe6a09e667f3bcdLL)), 52);
    __m512d f = _mm512_sub_pd(_mm512_castsi512_pd(_mm512_sub_epi64(b, _mm512_slli_epi64(k, 52))), one);
    __m512d s = _mm512_mul_pd(f, rcp_pd(_mm512_add_pd(_mm512_set1_pd(2.0), f)));
    __m512d z = _mm512_mul_pd(s, s), w = _mm512_mul_pd(z, z);
    __m512d odd = _mm512_fmadd_pd(w, _mm512_set1_pd(1.479819860511658591e-01), _mm512_set1_pd(1.818357216161805012e-01));
    odd = _mm512_fmadd_pd(w, odd, _mm512_set1_pd(2.857142874366239149e-01));
    odd = _mm512_fmadd_pd(w, odd, _mm512_set1_pd(6.666666666666735130e-01));
    __m512d even = _mm512_fmadd_pd(w, _mm512_set1_pd(1.531383769920937332e-01), _mm512_set1_pd(2.222219843214978396e-01));
    even = _mm512_fmadd_pd(w, even, _mm512_set1_pd(3.999999999940941908e-01));
    __m512d r = _mm512_fmadd_pd(z, odd, _mm512_mul_pd(w, even));
    __m512d hfsq = _mm512_mul_pd(_mm512_mul_pd(half, f), f), dk = _mm512_cvtepi64_pd(k);
    __m512d inner = _mm512_fmadd_pd(s, _mm512_add_pd(hfsq, r),
                                    _mm512_mul_pd(dk, _mm512_set1_pd(1.90821492927058770002e-10)));
    return _mm512_sub_pd(_mm512_mul_pd(dk, _mm512_set1_pd(6.93147180369123816490e-01)),
                         _mm512_sub_pd(_mm512_sub_pd(hfsq, inner), f));
}

/* kl_series() by eight, to k = last: last = 10 where |d| < KL_SERIES, as kl_series(); 7
 * where |d| < KL_NEAR (the next term is under 2^-52 of the first there) */
AVX512 static inline __m512d series_pd(__m512d diff, __m512d d, const int last)
{
    __m512d r = _mm512_set1_pd((last % 2 ? -1.0 : 1.0) / (last * (last - 1)));
    for (int k = last - 1; k >= 2; k--)
        r = _mm512_fmadd_pd(r, d, _mm512_set1_pd((k % 2 ? -1.0 : 1.0) / (k * (k - 1))));
    return _mm512_mul_pd(_mm512_mul_pd(diff, d), r);
}

/* kl_excess() where |d| < KL_NEAR; *wide gathers |d| (the block needs kl_wide if not) */
AVX512 static inline __m512d kl_excess_near(__m512d p, __m512d q, __m512d *wide)
{
    __m512d diff = _mm512_sub_pd(p, q), d = _mm512_div_pd(diff, q);
    *wide = _mm512_max_pd(*wide, _mm512_abs_pd(d));
    return series_pd(diff, d, 7);
}

AVX512 static inline __m512d kl_excess_any(__m512d p, __m512d q)
{
    __m512d diff = _mm512_sub_pd(p, q), d = _mm512_div_pd(diff, q);
    __mmask8 near = _mm512_cmp_pd_mask(_mm512_abs_pd(d), _mm512_set1_pd(KL_SERIES), _CMP_LT_OQ);
    __m512d u = _mm512_add_pd(_mm512_set1_pd(1.0), d);             /* log_ratio(d) */
    __m512d c = _mm512_sub_pd(d, _mm512_sub_pd(u, _mm512_set1_pd(1.0)));
    __m512d far = _mm512_fmsub_pd(p, _mm512_add_pd(log_pd(u), _mm512_div_pd(c, u)), diff);
    return _mm512_mask_blend_pd(near, far, series_pd(diff, d, 10));
}

/* sixteen elements of kind 'e', 'b' or 'f' as float32 (exact) */
AVX512 static inline __m512 load16(const char *data, char kind, Py_ssize_t i)
{
    if (kind == 'f') return _mm512_loadu_ps((const float *)data + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)data + i));
    if (kind == 'e') return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

AVX512 static inline __m512d half_pd(__m512 v, int h)        /* lanes 8h .. 8h+7 in double */
{
    __m512d w = _mm512_castps_pd(v);       /* the lane index must be a constant, inlined or not */
    __m256d lanes = h ? _mm512_extractf64x4_pd(w, 1) : _mm512_extractf64x4_pd(w, 0);
    return _mm512_cvtps_pd(_mm256_castpd_ps(lanes));
}

typedef struct { __m512d p, q; } PQ;

AVX512 static inline PQ unit_pd(__m512d a, __m512d b, Unit u)
{
    const __m512d eps = _mm512_set1_pd(EPS);
    PQ r = {_mm512_max_pd(_mm512_mul_pd(_mm512_sub_pd(a, _mm512_set1_pd(u.lo_x)), _mm512_set1_pd(u.scale_x)), eps),
            _mm512_max_pd(_mm512_mul_pd(_mm512_sub_pd(b, _mm512_set1_pd(u.lo_y)), _mm512_set1_pd(u.scale_y)), eps)};
    return r;
}

/* a block's KL sums (Sp, Sq, S) and the largest |p / q - 1| of its terms */
typedef struct { __m512d sp, sq, s, wide; } KLSums;

AVX512 static inline void kl_add(KLSums *k, __m512d a, __m512d b, Unit u)
{
    PQ pq = unit_pd(a, b, u);
    k->sp = _mm512_add_pd(k->sp, pq.p);
    k->sq = _mm512_add_pd(k->sq, pq.q);
    k->s = _mm512_add_pd(k->s, kl_excess_near(pq.p, pq.q, &k->wide));
}

AVX512 static double kl_wide(const char *x, char xk, const char *y, char yk, Py_ssize_t n, Unit u);

/* the block's sums added to sums[0..2]; S again through kl_wide when a term was not near */
AVX512 static void kl_commit(const KLSums *k, double *sums, const char *x, char xk,
                             const char *y, char yk, Py_ssize_t n, Unit u)
{
    sums[0] += _mm512_reduce_add_pd(k->sp);
    sums[1] += _mm512_reduce_add_pd(k->sq);
    sums[2] += _mm512_reduce_max_pd(k->wide) < KL_NEAR ? _mm512_reduce_add_pd(k->s)
                                                          : kl_wide(x, xk, y, yk, n, u);
}

/* nan where an element of a or b is not finite */
AVX512 static inline __m512 finite_check(__m512 check, __m512 a, __m512 b)
{
    const __m512 zero = _mm512_setzero_ps();
    return _mm512_fmadd_ps(a, zero, _mm512_fmadd_ps(b, zero, check));
}

/* KL's sum over a block whose terms are not all near: both logs, per element the right one */
AVX512 static double kl_wide(const char *x, char xk, const char *y, char yk, Py_ssize_t n, Unit u)
{
    __m512d s = _mm512_setzero_pd();
    for (Py_ssize_t i = 0; i < n; i += 16) {
        __m512 a16 = load16(x, xk, i), b16 = load16(y, yk, i);
        for (int h = 0; h < 2; h++) {
            PQ pq = unit_pd(half_pd(a16, h), half_pd(b16, h), u);
            s = _mm512_add_pd(s, kl_excess_any(pq.p, pq.q));
        }
    }
    return _mm512_reduce_add_pd(s);
}

/* n a multiple of 16; u.on: KL sums too (both sides normalised). Returns 0, leaving t alone,
 * when the block holds an inf or nan: compare_loop takes it. Moments shifted by (kx, ky). */
AVX512 int compare_avx512(const char *x, char xk, const char *y, char yk, Py_ssize_t n,
                               double kx_, double ky_, Unit u, double *t, double *shifted)
{
    const __m512 zero = _mm512_setzero_ps(), fp16_max = _mm512_set1_ps((float)FP16_MAX);
    const __m512d eps = _mm512_set1_pd(EPS);
    const __m512d e3 = _mm512_set1_pd(1e-3), e5 = _mm512_set1_pd(5e-3);
    const __m512d kx = _mm512_set1_pd(kx_), ky = _mm512_set1_pd(ky_);
    __m512 xlo = _mm512_set1_ps(INFINITY), xhi = _mm512_set1_ps(-INFINITY);
    __m512 ylo = xlo, yhi = xhi;
    long long at_max = 0, live = 0, flushed = 0, rel_n = 0, w1 = 0, w5 = 0;
    __m512d xy = _mm512_setzero_pd(), xx = xy, yy = xy, dd = xy, ad_sum = xy, ad_max = xy;
    __m512d rel_sum = xy, rel_max = xy;
    __m512d sx = xy, sxx = xy, sy = xy, syy = xy;
    KLSums kl = {xy, xy, xy, xy};
    for (Py_ssize_t i = 0; i < n; i += 16) {
        fetch_ahead(x, xk, i);
        fetch_ahead(y, yk, i);
        __m512 a16 = load16(x, xk, i), b16 = load16(y, yk, i);
        xlo = _mm512_min_ps(xlo, a16); xhi = _mm512_max_ps(xhi, a16);
        ylo = _mm512_min_ps(ylo, b16); yhi = _mm512_max_ps(yhi, b16);
        at_max += __builtin_popcount(_mm512_cmp_ps_mask(_mm512_abs_ps(a16), fp16_max, _CMP_GE_OQ));
        __mmask16 nonzero = _mm512_cmp_ps_mask(b16, zero, _CMP_NEQ_UQ);
        live += __builtin_popcount(nonzero);
        flushed += __builtin_popcount(_mm512_mask_cmp_ps_mask(nonzero, a16, zero, _CMP_EQ_OQ));
        for (int h = 0; h < 2; h++) {
            __m512d a = half_pd(a16, h), b = half_pd(b16, h);
            xy = _mm512_fmadd_pd(a, b, xy);
            xx = _mm512_fmadd_pd(a, a, xx);     /* inf or nan once an inf or nan passes */
            yy = _mm512_fmadd_pd(b, b, yy);
            __m512d d = _mm512_sub_pd(a, b), ad = _mm512_abs_pd(d), ay = _mm512_abs_pd(b);
            dd = _mm512_fmadd_pd(d, d, dd);
            ad_sum = _mm512_add_pd(ad_sum, ad);
            ad_max = _mm512_max_pd(ad_max, ad);
            __mmask8 rel = _mm512_cmp_pd_mask(ay, eps, _CMP_GT_OQ);
            __m512d err = _mm512_mask_div_pd(ad, rel, ad, ay);
            rel_n += __builtin_popcount(rel);
            rel_sum = _mm512_mask_add_pd(rel_sum, rel, rel_sum, err);
            rel_max = _mm512_mask_max_pd(rel_max, rel, rel_max, err);
            w1 += __builtin_popcount(_mm512_cmp_pd_mask(err, e3, _CMP_LT_OQ));
            w5 += __builtin_popcount(_mm512_cmp_pd_mask(err, e5, _CMP_LT_OQ));
            __m512d cx = _mm512_sub_pd(a, kx), cy = _mm512_sub_pd(b, ky);
            sx = _mm512_add_pd(sx, cx); sxx = _mm512_fmadd_pd(cx, cx, sxx);
            sy = _mm512_add_pd(sy, cy); syy = _mm512_fmadd_pd(cy, cy, syy);
            if (u.on) kl_add(&kl, a, b, u);
        }
    }
    double sum_xx = _mm512_reduce_add_pd(xx), sum_yy = _mm512_reduce_add_pd(yy);
    if (!(fabs(sum_xx) <= DBL_MAX && fabs(sum_yy) <= DBL_MAX)) return 0;
    t[T_X_AT_MAX] += (double)at_max;
    t[T_LIVE] += (double)live;
    t[T_FLUSHED] += (double)flushed;
    t[T_XY] += _mm512_reduce_add_pd(xy); t[T_XX] += sum_xx;
    t[T_YY] += sum_yy; t[T_DD] += _mm512_reduce_add_pd(dd);
    t[T_ABS_D_SUM] += _mm512_reduce_add_pd(ad_sum);
    t[T_ABS_D_MAX] = fmax(t[T_ABS_D_MAX], _mm512_reduce_max_pd(ad_max));
    t[T_REL_N] += (double)rel_n; t[T_REL_SUM] += _mm512_reduce_add_pd(rel_sum);
    t[T_REL_MAX] = fmax(t[T_REL_MAX], _mm512_reduce_max_pd(rel_max));
    t[T_WITHIN_1E3] += (double)w1; t[T_WITHIN_5E3] += (double)w5;
    t[T_LO_X] = fmin(t[T_LO_X], _mm512_reduce_min_ps(xlo));
    t[T_HI_X] = fmax(t[T_HI_X], _mm512_reduce_max_ps(xhi));
    t[T_LO_Y] = fmin(t[T_LO_Y], _mm512_reduce_min_ps(ylo));
    t[T_HI_Y] = fmax(t[T_HI_Y], _mm512_reduce_max_ps(yhi));
    if (u.on) kl_commit(&kl, t + T_SP, x, xk, y, yk, n, u);     /* T_SP, T_SQ, T_S */
    shifted[0] = (double)n;
    shifted[1] = _mm512_reduce_add_pd(sx); shifted[2] = _mm512_reduce_add_pd(sxx);
    shifted[3] = _mm512_reduce_add_pd(sy); shifted[4] = _mm512_reduce_add_pd(syy);
    return 1;
}

/* finite_block on sixteen lanes, reading the tensor where it lies: min and max in float32
 * (exact), the sums in double. n a multiple of 16; returns 0, leaving st alone, when the
 * block holds an inf or nan (stats_block counts them): the sums then are inf or nan, which
 * finite float32 values cannot make them (16 * 1024 squares of FLT_MAX are far below
 * DBL_MAX). float32 is converted to double straight from memory, half a vector at a time.
 * It asks for lines ahead (fetch_ahead): a training step's tensors are mostly beyond the
 * caches when summarised, and 8 MB ones read so at 12.5 GB/s, not 10. */
AVX512 int stats_avx512(const char *data, char kind, Py_ssize_t n, Stats *st)
{
    __m512 lo = _mm512_set1_ps(INFINITY), hi = _mm512_set1_ps(-INFINITY);
    __m512d sum0 = _mm512_setzero_pd(), sum1 = sum0, sq0 = sum0, sq1 = sum0;
    const float *f = (const float *)data;
    for (Py_ssize_t i = 0; i < n; i += 16) {
        fetch_ahead(data, kind, i);
        __m512 v = load16(data, kind, i);
        lo = _mm512_min_ps(lo, v);
        hi = _mm512_max_ps(hi, v);
        __m512d a, b;
        if (kind == 'f') {
            a = _mm512_cvtps_pd(_mm256_loadu_ps(f + i));
            b = _mm512_cvtps_pd(_mm256_loadu_ps(f + i + 8));
        } else {
            a = half_pd(v, 0);
            b = half_pd(v, 1);
        }
        sum0 = _mm512_add_pd(sum0, a); sq0 = _mm512_fmadd_pd(a, a, sq0);
        sum1 = _mm512_add_pd(sum1, b); sq1 = _mm512_fmadd_pd(b, b, sq1);
    }
    double sum = _mm512_reduce_add_pd(_mm512_add_pd(sum0, sum1));
    double squares = _mm512_reduce_add_pd(_mm512_add_pd(sq0, sq1));
    if (!isfinite(sum) || !isfinite(squares)) return 0;
    st->hi = fmax(st->hi, _mm512_reduce_max_ps(hi));
    st->lo = fmin(st->lo, _mm512_reduce_min_ps(lo));
    st->sum += sum;
    st->squares += squares;
    st->n += n;
    return 1;
}

/* float32 -> float16 sixteen at a time, rounding to nearest even in hardware as
 * float_to_half_bits does (overflow to inf, subnormals; a nan by float_to_half_bits itself);
 * returns how many it converted. */
AVX512 Py_ssize_t halves_avx512(const float *src, Py_ssize_t n, uint16_t *dst)
{
    Py_ssize_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(src + i);
        _mm256_storeu_si256((__m256i *)(dst + i),
                            _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        for (int l = 0; nan; l++, nan >>= 1)      /* the hardware quiets a nan: keep its bits */
            if (nan & 1) dst[i + l] = float_to_half_bits(((const uint32_t *)src)[i + l]);
    }
    return i;
}

/* grid_values() sixteen at a time: float16 by the hardware's conversion there and back
 * (rounding to nearest even, subnormals, inf beyond the range: numerics.quantize's rule),
 * bfloat16 by rounding the bits; a nan becomes the positive quiet nan. Returns how many it
 * did; *bad set when one of them is an inf or a nan. */
AVX512 Py_ssize_t grid_avx512(const float *src, Py_ssize_t n, char kind, float *dst, int *bad)
{
    const __m512 quiet = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000));
    const __m512i keep = _mm512_set1_epi32((int)0xffff0000u), half = _mm512_set1_epi32(0x7fff);
    const __m512i one = _mm512_set1_epi32(1);
    __m512 check = _mm512_setzero_ps();
    Py_ssize_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(src + i), r;
        if (kind == 'e') {
            r = _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        } else {
            __m512i u = _mm512_castps_si512(v);
            __m512i t = _mm512_add_epi32(_mm512_add_epi32(u, half),
                                         _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
            r = _mm512_castsi512_ps(_mm512_and_si512(t, keep));
        }
        r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, quiet);
        check = _mm512_fmadd_ps(r, _mm512_setzero_ps(), check);   /* nan once an inf or nan passes */
        _mm512_storeu_ps(dst + i, r);
    }
    if (_mm512_cmp_ps_mask(check, check, _CMP_UNORD_Q)) *bad = 1;
    return i;
}

/* kl_loop's plain case: n a multiple of 16, both sides normalised; 0 when not plain */
AVX512 int kl_avx512(const char *x, char xk, const char *y, char yk, Py_ssize_t n, Unit u,
                          double *t)
{
    __m512 check = _mm512_setzero_ps();
    KLSums kl = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd()};
    for (Py_ssize_t i = 0; i < n; i += 16) {
        fetch_ahead(x, xk, i);
        fetch_ahead(y, yk, i);
        __m512 a16 = load16(x, xk, i), b16 = load16(y, yk, i);
        check = finite_check(check, a16, b16);
        for (int h = 0; h < 2; h++) kl_add(&kl, half_pd(a16, h), half_pd(b16, h), u);
    }
    if (_mm512_cmp_ps_mask(check, check, _CMP_UNORD_Q)) return 0;
    kl_commit(&kl, t, x, xk, y, yk, n, u);
    return 1;
}

int avx512_cpu(void)
{
    static int cpu = -1;
    if (cpu < 0) cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
    return cpu;
}
#else
int compare_avx512(const char *x, char xk, const char *y, char yk, Py_ssize_t n,
                   double kx, double ky, Unit u, double *t, double *shifted) { return 0; }
int kl_avx512(const char *x, char xk, const char *y, char yk, Py_ssize_t n, Unit u,
              double *t) { return 0; }
int stats_avx512(const char *data, char kind, Py_ssize_t n, Stats *st) { return 0; }
Py_ssize_t halves_avx512(const float *src, Py_ssize_t n, uint16_t *dst) { return 0; }
Py_ssize_t grid_avx512(const float *src, Py_ssize_t n, char kind, float *dst, int *bad) { return 0; }
int avx512_cpu(void) { return 0; }
#endif
