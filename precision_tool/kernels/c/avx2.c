/* The AVX2 loops of the statistics and the comparison (with FMA and F16C: x86-64-v3), for
 * CPUs without AVX-512. They are avx512.c's loops on half-width registers: each of its
 * eight-lane double accumulators is two four-lane ones here (lanes 0-3 and 4-7), fed the
 * same elements in the same order and reduced in the same order, its sixteen-lane float
 * work is two eight-lane halves, and its mask popcounts are movemask popcounts. The
 * arithmetic per element is the same (hardware division included), so are the sums.
 * KL's blocks with a term outside the short series' range are summed again element by
 * element with compare.c's own excess term (AVX2 has no rcp14 for avx512.c's vector log). */
#include "kernels.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma,f16c,popcnt")))

typedef struct { __m256 lo, hi; } F16;          /* sixteen floats */
typedef struct { __m256d lo, hi; } D8;          /* avx512.c's eight doubles */

AVX2 static inline D8 d8_set(double v) { D8 r = {_mm256_set1_pd(v), _mm256_set1_pd(v)}; return r; }
AVX2 static inline D8 d8_zero(void) { return d8_set(0.0); }
AVX2 static inline D8 d8_add(D8 a, D8 b)
{ D8 r = {_mm256_add_pd(a.lo, b.lo), _mm256_add_pd(a.hi, b.hi)}; return r; }
AVX2 static inline D8 d8_sub(D8 a, D8 b)
{ D8 r = {_mm256_sub_pd(a.lo, b.lo), _mm256_sub_pd(a.hi, b.hi)}; return r; }
AVX2 static inline D8 d8_mul(D8 a, D8 b)
{ D8 r = {_mm256_mul_pd(a.lo, b.lo), _mm256_mul_pd(a.hi, b.hi)}; return r; }
AVX2 static inline D8 d8_div(D8 a, D8 b)
{ D8 r = {_mm256_div_pd(a.lo, b.lo), _mm256_div_pd(a.hi, b.hi)}; return r; }
AVX2 static inline D8 d8_fmadd(D8 a, D8 b, D8 c)
{ D8 r = {_mm256_fmadd_pd(a.lo, b.lo, c.lo), _mm256_fmadd_pd(a.hi, b.hi, c.hi)}; return r; }
AVX2 static inline D8 d8_max(D8 a, D8 b)
{ D8 r = {_mm256_max_pd(a.lo, b.lo), _mm256_max_pd(a.hi, b.hi)}; return r; }
AVX2 static inline D8 d8_abs(D8 a)
{
    const __m256d m = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffLL));
    D8 r = {_mm256_and_pd(a.lo, m), _mm256_and_pd(a.hi, m)};
    return r;
}

/* _mm512_reduce_add_pd's order: the halves added lane by lane, then 2 + 2, then 1 + 1 */
AVX2 static inline double d8_sum(D8 a)
{
    __m256d t = _mm256_add_pd(a.hi, a.lo);
    __m128d u = _mm_add_pd(_mm256_extractf128_pd(t, 1), _mm256_castpd256_pd128(t));
    return _mm_cvtsd_f64(u) + _mm_cvtsd_f64(_mm_unpackhi_pd(u, u));
}

AVX2 static inline double d8_largest(D8 a)
{
    __m256d t = _mm256_max_pd(a.hi, a.lo);
    __m128d u = _mm_max_pd(_mm256_extractf128_pd(t, 1), _mm256_castpd256_pd128(t));
    return fmax(_mm_cvtsd_f64(u), _mm_cvtsd_f64(_mm_unpackhi_pd(u, u)));
}

AVX2 static inline float f16_reduce(F16 a, int largest)
{
    __m256 t = largest ? _mm256_max_ps(a.lo, a.hi) : _mm256_min_ps(a.lo, a.hi);
    __m128 u = largest ? _mm_max_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t))
                       : _mm_min_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
    float v[4];
    _mm_storeu_ps(v, u);
    float r = v[0];
    for (int k = 1; k < 4; k++) r = largest ? fmaxf(r, v[k]) : fminf(r, v[k]);
    return r;
}

/* the mask's set lanes: movemask of a comparison, counted on the integer units */
AVX2 static inline int count_ps(__m256 m) { return __builtin_popcount(_mm256_movemask_ps(m)); }
AVX2 static inline int count_pd(D8 m)
{
    return __builtin_popcount(_mm256_movemask_pd(m.lo)) + __builtin_popcount(_mm256_movemask_pd(m.hi));
}

#define AHEAD 512           /* as avx512.c: the line AHEAD elements on, asked for ahead */
AVX2 static inline void fetch_ahead(const char *data, char kind, Py_ssize_t i)
{
    _mm_prefetch(data + (i + AHEAD) * (kind == 'f' ? 4 : 2), _MM_HINT_T0);
}

AVX2 static inline __m256 load8(const char *data, char kind, Py_ssize_t i)
{
    if (kind == 'f') return _mm256_loadu_ps((const float *)data + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)data + i));
    if (kind == 'e') return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

AVX2 static inline F16 load16(const char *data, char kind, Py_ssize_t i)
{
    F16 r = {load8(data, kind, i), load8(data, kind, i + 8)};
    return r;
}

/* avx512.c's half_pd(v, h): elements 8h .. 8h + 7 in double, as lanes 0-3 and 4-7 */
AVX2 static inline D8 half_pd(F16 v, int h)
{
    __m256 e = h ? v.hi : v.lo;
    D8 r = {_mm256_cvtps_pd(_mm256_castps256_ps128(e)), _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1))};
    return r;
}

typedef struct { D8 sp, sq, s, wide; } KLSums;

AVX2 static inline void kl_add(KLSums *k, D8 a, D8 b, Unit u)
{
    const D8 eps = d8_set(EPS);
    D8 p = d8_max(d8_mul(d8_sub(a, d8_set(u.lo_x)), d8_set(u.scale_x)), eps);
    D8 q = d8_max(d8_mul(d8_sub(b, d8_set(u.lo_y)), d8_set(u.scale_y)), eps);
    k->sp = d8_add(k->sp, p);
    k->sq = d8_add(k->sq, q);
    D8 diff = d8_sub(p, q), d = d8_div(diff, q);
    k->wide = d8_max(k->wide, d8_abs(d));
    /* avx512.c's series_pd(diff, d, 7) */
    D8 r = d8_set(-1.0 / 42);
    for (int j = 6; j >= 2; j--) r = d8_fmadd(r, d, d8_set((j % 2 ? -1.0 : 1.0) / (j * (j - 1))));
    k->s = d8_add(k->s, d8_mul(d8_mul(diff, d), r));
}

/* KL's excess terms of a block, one by one (a term was out of the short series' range) */
static double kl_wide(const char *x, char xk, const char *y, char yk, Py_ssize_t n, Unit u)
{
    double a[BLOCK], b[BLOCK], s = 0.0;
    for (Py_ssize_t at = 0; at < n; at += BLOCK) {
        Py_ssize_t m = n - at < BLOCK ? n - at : BLOCK;
        to_double(x + at * itemsize(xk), xk, m, a);
        to_double(y + at * itemsize(yk), yk, m, b);
        s += kl_excess_sum_normalised(a, b, m, u);
    }
    return s;
}

AVX2 static void kl_commit(const KLSums *k, double *sums, const char *x, char xk,
                           const char *y, char yk, Py_ssize_t n, Unit u)
{
    sums[0] += d8_sum(k->sp);
    sums[1] += d8_sum(k->sq);
    sums[2] += d8_largest(k->wide) < KL_NEAR ? d8_sum(k->s) : kl_wide(x, xk, y, yk, n, u);
}

/* avx512.c's compare_simd: n a multiple of 16; 0, leaving t alone, for a block with an inf
 * or nan (compare_loop takes it) */
AVX2 int compare_avx2(const char *x, char xk, const char *y, char yk, Py_ssize_t n,
                      double kx_, double ky_, Unit u, double *t, double *shifted)
{
    const __m256 zero = _mm256_setzero_ps(), fp16_max = _mm256_set1_ps((float)FP16_MAX);
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const D8 eps = d8_set(EPS), e3 = d8_set(1e-3), e5 = d8_set(5e-3);
    const D8 kx = d8_set(kx_), ky = d8_set(ky_), dzero = d8_zero();
    F16 xlo = {_mm256_set1_ps(INFINITY), _mm256_set1_ps(INFINITY)};
    F16 xhi = {_mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY)};
    F16 ylo = xlo, yhi = xhi;
    long long at_max = 0, live = 0, flushed = 0, rel_n = 0, w1 = 0, w5 = 0;
    D8 xy = dzero, xx = dzero, yy = dzero, dd = dzero, ad_sum = dzero, ad_max = dzero;
    D8 rel_sum = dzero, rel_max = dzero, sx = dzero, sxx = dzero, sy = dzero, syy = dzero;
    KLSums kl = {dzero, dzero, dzero, dzero};
    for (Py_ssize_t i = 0; i < n; i += 16) {
        fetch_ahead(x, xk, i);
        fetch_ahead(y, yk, i);
        F16 a16 = load16(x, xk, i), b16 = load16(y, yk, i);
        __m256 av[2] = {a16.lo, a16.hi}, bv[2] = {b16.lo, b16.hi};
        xlo.lo = _mm256_min_ps(xlo.lo, a16.lo); xlo.hi = _mm256_min_ps(xlo.hi, a16.hi);
        xhi.lo = _mm256_max_ps(xhi.lo, a16.lo); xhi.hi = _mm256_max_ps(xhi.hi, a16.hi);
        ylo.lo = _mm256_min_ps(ylo.lo, b16.lo); ylo.hi = _mm256_min_ps(ylo.hi, b16.hi);
        yhi.lo = _mm256_max_ps(yhi.lo, b16.lo); yhi.hi = _mm256_max_ps(yhi.hi, b16.hi);
        for (int h = 0; h < 2; h++) {
            at_max += count_ps(_mm256_cmp_ps(_mm256_and_ps(av[h], sign), fp16_max, _CMP_GE_OQ));
            __m256 nonzero = _mm256_cmp_ps(bv[h], zero, _CMP_NEQ_UQ);
            live += count_ps(nonzero);
            flushed += count_ps(_mm256_and_ps(nonzero, _mm256_cmp_ps(av[h], zero, _CMP_EQ_OQ)));
        }
        for (int h = 0; h < 2; h++) {
            D8 a = half_pd(a16, h), b = half_pd(b16, h);
            xy = d8_fmadd(a, b, xy);
            xx = d8_fmadd(a, a, xx);        /* inf or nan once an inf or nan passes */
            yy = d8_fmadd(b, b, yy);
            D8 d = d8_sub(a, b), ad = d8_abs(d), ay = d8_abs(b);
            dd = d8_fmadd(d, d, dd);
            ad_sum = d8_add(ad_sum, ad);
            ad_max = d8_max(ad_max, ad);
            D8 rel = {_mm256_cmp_pd(ay.lo, eps.lo, _CMP_GT_OQ), _mm256_cmp_pd(ay.hi, eps.hi, _CMP_GT_OQ)};
            D8 q = d8_div(ad, ay);
            D8 err = {_mm256_blendv_pd(ad.lo, q.lo, rel.lo), _mm256_blendv_pd(ad.hi, q.hi, rel.hi)};
            D8 kept = {_mm256_and_pd(err.lo, rel.lo), _mm256_and_pd(err.hi, rel.hi)};
            rel_n += count_pd(rel);
            rel_sum = d8_add(rel_sum, kept);        /* + 0 where not rel: the sum as masked */
            rel_max = d8_max(rel_max, kept);
            D8 lt3 = {_mm256_cmp_pd(err.lo, e3.lo, _CMP_LT_OQ), _mm256_cmp_pd(err.hi, e3.hi, _CMP_LT_OQ)};
            D8 lt5 = {_mm256_cmp_pd(err.lo, e5.lo, _CMP_LT_OQ), _mm256_cmp_pd(err.hi, e5.hi, _CMP_LT_OQ)};
            w1 += count_pd(lt3);
            w5 += count_pd(lt5);
            D8 cx = d8_sub(a, kx), cy = d8_sub(b, ky);
            sx = d8_add(sx, cx); sxx = d8_fmadd(cx, cx, sxx);
            sy = d8_add(sy, cy); syy = d8_fmadd(cy, cy, syy);
            if (u.on) kl_add(&kl, a, b, u);
        }
    }
    double sum_xx = d8_sum(xx), sum_yy = d8_sum(yy);
    if (!(fabs(sum_xx) <= DBL_MAX && fabs(sum_yy) <= DBL_MAX)) return 0;
    t[T_X_AT_MAX] += (double)at_max;
    t[T_LIVE] += (double)live;
    t[T_FLUSHED] += (double)flushed;
    t[T_XY] += d8_sum(xy); t[T_XX] += sum_xx;
    t[T_YY] += sum_yy; t[T_DD] += d8_sum(dd);
    t[T_ABS_D_SUM] += d8_sum(ad_sum);
    t[T_ABS_D_MAX] = fmax(t[T_ABS_D_MAX], d8_largest(ad_max));
    t[T_REL_N] += (double)rel_n; t[T_REL_SUM] += d8_sum(rel_sum);
    t[T_REL_MAX] = fmax(t[T_REL_MAX], d8_largest(rel_max));
    t[T_WITHIN_1E3] += (double)w1; t[T_WITHIN_5E3] += (double)w5;
    t[T_LO_X] = fmin(t[T_LO_X], f16_reduce(xlo, 0));
    t[T_HI_X] = fmax(t[T_HI_X], f16_reduce(xhi, 1));
    t[T_LO_Y] = fmin(t[T_LO_Y], f16_reduce(ylo, 0));
    t[T_HI_Y] = fmax(t[T_HI_Y], f16_reduce(yhi, 1));
    if (u.on) kl_commit(&kl, t + T_SP, x, xk, y, yk, n, u);     /* T_SP, T_SQ, T_S */
    shifted[0] = (double)n;
    shifted[1] = d8_sum(sx); shifted[2] = d8_sum(sxx);
    shifted[3] = d8_sum(sy); shifted[4] = d8_sum(syy);
    return 1;
}

/* avx512.c's kl_simd */
AVX2 int kl_avx2(const char *x, char xk, const char *y, char yk, Py_ssize_t n, Unit u, double *t)
{
    const __m256 zero = _mm256_setzero_ps();
    __m256 check = zero;
    const D8 dzero = d8_zero();
    KLSums kl = {dzero, dzero, dzero, dzero};
    for (Py_ssize_t i = 0; i < n; i += 16) {
        fetch_ahead(x, xk, i);
        fetch_ahead(y, yk, i);
        F16 a16 = load16(x, xk, i), b16 = load16(y, yk, i);
        check = _mm256_fmadd_ps(a16.lo, zero, _mm256_fmadd_ps(b16.lo, zero, check));
        check = _mm256_fmadd_ps(a16.hi, zero, _mm256_fmadd_ps(b16.hi, zero, check));
        for (int h = 0; h < 2; h++) kl_add(&kl, half_pd(a16, h), half_pd(b16, h), u);
    }
    if (_mm256_movemask_ps(_mm256_cmp_ps(check, check, _CMP_UNORD_Q))) return 0;
    kl_commit(&kl, t, x, xk, y, yk, n, u);
    return 1;
}

/* avx512.c's stats_simd: min and max in float32, the sums in double (sum0/sq0 the first
 * eight of each sixteen, sum1/sq1 the second) */
AVX2 int stats_avx2(const char *data, char kind, Py_ssize_t n, Stats *st)
{
    F16 lo = {_mm256_set1_ps(INFINITY), _mm256_set1_ps(INFINITY)};
    F16 hi = {_mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY)};
    D8 sum0 = d8_zero(), sum1 = sum0, sq0 = sum0, sq1 = sum0;
    for (Py_ssize_t i = 0; i < n; i += 16) {
        F16 v = load16(data, kind, i);
        lo.lo = _mm256_min_ps(lo.lo, v.lo); lo.hi = _mm256_min_ps(lo.hi, v.hi);
        hi.lo = _mm256_max_ps(hi.lo, v.lo); hi.hi = _mm256_max_ps(hi.hi, v.hi);
        D8 a = half_pd(v, 0), b = half_pd(v, 1);
        sum0 = d8_add(sum0, a); sq0 = d8_fmadd(a, a, sq0);
        sum1 = d8_add(sum1, b); sq1 = d8_fmadd(b, b, sq1);
    }
    double sum = d8_sum(d8_add(sum0, sum1)), squares = d8_sum(d8_add(sq0, sq1));
    if (!isfinite(sum) || !isfinite(squares)) return 0;
    st->hi = fmax(st->hi, f16_reduce(hi, 1));
    st->lo = fmin(st->lo, f16_reduce(lo, 0));
    st->sum += sum;
    st->squares += squares;
    st->n += n;
    return 1;
}

int avx2_cpu(void)
{
    static int cpu = -1;
    if (cpu < 0)
        cpu = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
              __builtin_cpu_supports("f16c") && __builtin_cpu_supports("popcnt");
    return cpu;
}
#else
int compare_avx2(const char *x, char xk, const char *y, char yk, Py_ssize_t n,
                 double kx, double ky, Unit u, double *t, double *shifted) { return 0; }
int kl_avx2(const char *x, char xk, const char *y, char yk, Py_ssize_t n, Unit u,
            double *t) { return 0; }
int stats_avx2(const char *data, char kind, Py_ssize_t n, Stats *st) { return 0; }
int avx2_cpu(void) { return 0; }
#endif
