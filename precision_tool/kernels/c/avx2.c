/* The AVX2 loops of the statistics and the comparison (with FMA and F16C: x86-64-v3), for
 * CPUs without AVX-512. They sum as avx512.c's loops do: each of its eight-lane double
 * accumulators is two four-lane ones here (lanes 0-3 and 4-7), fed the same elements in
 * the same order and reduced in the same order, and the arithmetic per element is the same
 * (hardware division included), so are the sums (tests/test_native.py writes that order
 * out). Its sixteen-lane float work is eight-lane here, its mask popcounts are counts in
 * vector lanes. KL's blocks with a term outside the short series' range are summed again
 * element by element with compare.c's own excess term (AVX2 has no rcp14 for avx512.c's
 * vector log). */
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
AVX2 static inline D8 d8_fmadd(D8 a, D8 b, D8 c)
{ D8 r = {_mm256_fmadd_pd(a.lo, b.lo, c.lo), _mm256_fmadd_pd(a.hi, b.hi, c.hi)}; return r; }


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

/* The double-precision work of a block runs in passes over the block converted once into
 * L1-resident doubles, each pass with a few of avx512.c's eight-lane accumulators (two
 * registers each here): lane j still sums elements 8k + j in order of k. One loop carrying
 * all sixteen (thirty-two registers of sixteen) spilled most of them to the stack on every
 * element; a pass per half of the lanes would wait on each accumulator's latency. */
typedef struct { double x[BLOCK], y[BLOCK]; } Doubles;

AVX2 static inline __m256d abs_pd(__m256d a)
{
    return _mm256_and_pd(a, _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffLL)));
}

/* the mask's set lanes, added to a vector of counts (a set lane is -1) */
AVX2 static inline __m256i count_in(__m256i c, __m256d m) { return _mm256_sub_epi64(c, _mm256_castpd_si256(m)); }
AVX2 static inline __m256i count_in_ps(__m256i c, __m256 m) { return _mm256_sub_epi32(c, _mm256_castps_si256(m)); }
AVX2 static inline long long lanes_total(__m256i c, int wide)
{
    long long v[4];
    if (!wide) c = _mm256_add_epi64(_mm256_cvtepu32_epi64(_mm256_castsi256_si128(c)),
                                    _mm256_cvtepu32_epi64(_mm256_extracti128_si256(c, 1)));
    _mm256_storeu_si256((__m256i *)v, c);
    return v[0] + v[1] + v[2] + v[3];
}

#define HALVES(h) for (int h = 0; h < 2; h++)       /* lanes 0-3, then 4-7 */
#define LANES(v, h) (*((h) ? &(v).hi : &(v).lo))

/* KL's sums (kl_add's lanes): sp, sq, the series' sum and the widest |d| */
AVX2 static void kl_block(const Doubles *b, Py_ssize_t n, Unit u, double *sums)
{
    const __m256d eps = _mm256_set1_pd(EPS);
    const __m256d lo_x = _mm256_set1_pd(u.lo_x), scale_x = _mm256_set1_pd(u.scale_x);
    const __m256d lo_y = _mm256_set1_pd(u.lo_y), scale_y = _mm256_set1_pd(u.scale_y);
    D8 sp = d8_zero(), sq = sp, s = sp, wide = sp;
    for (Py_ssize_t i = 0; i < n; i += 8) HALVES(h) {
        __m256d a = _mm256_load_pd(b->x + i + 4 * h), c = _mm256_load_pd(b->y + i + 4 * h);
        __m256d p = _mm256_max_pd(_mm256_mul_pd(_mm256_sub_pd(a, lo_x), scale_x), eps);
        __m256d q = _mm256_max_pd(_mm256_mul_pd(_mm256_sub_pd(c, lo_y), scale_y), eps);
        LANES(sp, h) = _mm256_add_pd(LANES(sp, h), p);
        LANES(sq, h) = _mm256_add_pd(LANES(sq, h), q);
        __m256d diff = _mm256_sub_pd(p, q), d = _mm256_div_pd(diff, q);
        LANES(wide, h) = _mm256_max_pd(LANES(wide, h), abs_pd(d));
        /* avx512.c's series_pd(diff, d, 7) */
        __m256d r = _mm256_set1_pd(-1.0 / 42);
        for (int j = 6; j >= 2; j--) r = _mm256_fmadd_pd(r, d, _mm256_set1_pd((j % 2 ? -1.0 : 1.0) / (j * (j - 1))));
        LANES(s, h) = _mm256_add_pd(LANES(s, h), _mm256_mul_pd(_mm256_mul_pd(diff, d), r));
    }
    sums[0] += d8_sum(sp);
    sums[1] += d8_sum(sq);
    /* a block with a term out of the short series' range: its excess terms one by one
     * (AVX2 has no rcp14 for avx512.c's vector log) */
    sums[2] += d8_largest(wide) < KL_NEAR ? d8_sum(s) : kl_excess_sum_normalised(b->x, b->y, n, u);
}

/* the block in double (the element kinds' conversion, once); for the comparison (f not
 * NULL), the float-domain work too: the counts of fp16-max values, live and flushed
 * elements, then the extremes (lo_x, hi_x, lo_y, hi_y) */
AVX2 static inline void to_doubles(const char *x, char xk, const char *y, char yk, Py_ssize_t n,
                                   Doubles *b, double *f)
{
    const __m256 zero = _mm256_setzero_ps(), fp16_max = _mm256_set1_ps((float)FP16_MAX);
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 xlo = _mm256_set1_ps(INFINITY), xhi = _mm256_set1_ps(-INFINITY), ylo = xlo, yhi = xhi;
    __m256i at_max = _mm256_setzero_si256(), live = at_max, flushed = at_max;
    for (Py_ssize_t i = 0; i < n; i += 8) {
        if (!(i & 8)) { fetch_ahead(x, xk, i); fetch_ahead(y, yk, i); }
        __m256 a = load8(x, xk, i), c = load8(y, yk, i);
        _mm256_store_pd(b->x + i, _mm256_cvtps_pd(_mm256_castps256_ps128(a)));
        _mm256_store_pd(b->x + i + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)));
        _mm256_store_pd(b->y + i, _mm256_cvtps_pd(_mm256_castps256_ps128(c)));
        _mm256_store_pd(b->y + i + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(c, 1)));
        if (!f) continue;
        xlo = _mm256_min_ps(xlo, a); xhi = _mm256_max_ps(xhi, a);
        ylo = _mm256_min_ps(ylo, c); yhi = _mm256_max_ps(yhi, c);
        at_max = count_in_ps(at_max, _mm256_cmp_ps(_mm256_and_ps(a, sign), fp16_max, _CMP_GE_OQ));
        __m256 nonzero = _mm256_cmp_ps(c, zero, _CMP_NEQ_UQ);
        live = count_in_ps(live, nonzero);
        flushed = count_in_ps(flushed, _mm256_and_ps(nonzero, _mm256_cmp_ps(a, zero, _CMP_EQ_OQ)));
    }
    if (!f) return;
    f[0] = (double)lanes_total(at_max, 0);
    f[1] = (double)lanes_total(live, 0);
    f[2] = (double)lanes_total(flushed, 0);
    F16 v[4] = {{xlo, xlo}, {xhi, xhi}, {ylo, ylo}, {yhi, yhi}};
    for (int k = 0; k < 4; k++) f[3 + k] = f16_reduce(v[k], k % 2);
}

/* the products and differences */
typedef struct { D8 xy, xx, yy, dd, ad_sum, ad_max; } Products;

AVX2 static inline void products(const Doubles *b, Py_ssize_t n, Products *r)
{
    D8 xy = d8_zero(), xx = xy, yy = xy, dd = xy, ad_sum = xy, ad_max = xy;
    for (Py_ssize_t i = 0; i < n; i += 8) HALVES(h) {
        __m256d a = _mm256_load_pd(b->x + i + 4 * h), c = _mm256_load_pd(b->y + i + 4 * h);
        LANES(xy, h) = _mm256_fmadd_pd(a, c, LANES(xy, h));
        LANES(xx, h) = _mm256_fmadd_pd(a, a, LANES(xx, h));  /* inf or nan once an inf or nan passes */
        LANES(yy, h) = _mm256_fmadd_pd(c, c, LANES(yy, h));
        __m256d d = _mm256_sub_pd(a, c), ad = abs_pd(d);
        LANES(dd, h) = _mm256_fmadd_pd(d, d, LANES(dd, h));
        LANES(ad_sum, h) = _mm256_add_pd(LANES(ad_sum, h), ad);
        LANES(ad_max, h) = _mm256_max_pd(LANES(ad_max, h), ad);
    }
    Products out = {xy, xx, yy, dd, ad_sum, ad_max};
    *r = out;
}

/* the ratios: relative errors where |y| > eps, absolute ones elsewhere */
typedef struct { D8 sum, max; long long n, w1, w5; } Ratios;

AVX2 static inline void ratios(const Doubles *b, Py_ssize_t n, Ratios *r)
{
    const __m256d eps = _mm256_set1_pd(EPS), e3 = _mm256_set1_pd(1e-3), e5 = _mm256_set1_pd(5e-3);
    D8 sum = d8_zero(), max = sum;
    __m256i rel_n = _mm256_setzero_si256(), w1 = rel_n, w5 = rel_n;
    for (Py_ssize_t i = 0; i < n; i += 8) HALVES(h) {
        __m256d a = _mm256_load_pd(b->x + i + 4 * h), c = _mm256_load_pd(b->y + i + 4 * h);
        __m256d ad = abs_pd(_mm256_sub_pd(a, c)), ay = abs_pd(c);
        __m256d rel = _mm256_cmp_pd(ay, eps, _CMP_GT_OQ);
        __m256d err = _mm256_blendv_pd(ad, _mm256_div_pd(ad, ay), rel);
        __m256d kept = _mm256_and_pd(err, rel);
        rel_n = count_in(rel_n, rel);
        LANES(sum, h) = _mm256_add_pd(LANES(sum, h), kept);   /* + 0 where not rel: the sum as masked */
        LANES(max, h) = _mm256_max_pd(LANES(max, h), kept);
        w1 = count_in(w1, _mm256_cmp_pd(err, e3, _CMP_LT_OQ));
        w5 = count_in(w5, _mm256_cmp_pd(err, e5, _CMP_LT_OQ));
    }
    r->sum = sum; r->max = max;
    r->n = lanes_total(rel_n, 1); r->w1 = lanes_total(w1, 1); r->w5 = lanes_total(w5, 1);
}

/* the shifted moments: sums of x - kx, (x - kx)^2 and the same of y, into shifted[1..4] */
AVX2 static inline void moments(const Doubles *b, Py_ssize_t n, double kx, double ky, double *shifted)
{
    const __m256d vx = _mm256_set1_pd(kx), vy = _mm256_set1_pd(ky);
    D8 sx = d8_zero(), sxx = sx, sy = sx, syy = sx;
    for (Py_ssize_t i = 0; i < n; i += 8) HALVES(h) {
        __m256d cx = _mm256_sub_pd(_mm256_load_pd(b->x + i + 4 * h), vx);
        __m256d cy = _mm256_sub_pd(_mm256_load_pd(b->y + i + 4 * h), vy);
        LANES(sx, h) = _mm256_add_pd(LANES(sx, h), cx);
        LANES(sxx, h) = _mm256_fmadd_pd(cx, cx, LANES(sxx, h));
        LANES(sy, h) = _mm256_add_pd(LANES(sy, h), cy);
        LANES(syy, h) = _mm256_fmadd_pd(cy, cy, LANES(syy, h));
    }
    shifted[1] = d8_sum(sx); shifted[2] = d8_sum(sxx);
    shifted[3] = d8_sum(sy); shifted[4] = d8_sum(syy);
}

/* avx512.c's compare_simd: n a multiple of 16, at most BLOCK; 0, leaving t alone, for a
 * block with an inf or nan (compare_loop takes it) */
AVX2 int compare_avx2(const char *x, char xk, const char *y, char yk, Py_ssize_t n,
                      double kx, double ky, Unit u, double *t, double *shifted)
{
    if (n > BLOCK) return 0;
    Doubles b __attribute__((aligned(32)));
    double f[7];
    Products p;
    Ratios r;
    to_doubles(x, xk, y, yk, n, &b, f);
    products(&b, n, &p);
    double sum_xx = d8_sum(p.xx), sum_yy = d8_sum(p.yy);
    if (!(fabs(sum_xx) <= DBL_MAX && fabs(sum_yy) <= DBL_MAX)) return 0;
    ratios(&b, n, &r);
    moments(&b, n, kx, ky, shifted);
    t[T_X_AT_MAX] += f[0];
    t[T_LIVE] += f[1];
    t[T_FLUSHED] += f[2];
    t[T_XY] += d8_sum(p.xy); t[T_XX] += sum_xx;
    t[T_YY] += sum_yy; t[T_DD] += d8_sum(p.dd);
    t[T_ABS_D_SUM] += d8_sum(p.ad_sum);
    t[T_ABS_D_MAX] = fmax(t[T_ABS_D_MAX], d8_largest(p.ad_max));
    t[T_REL_N] += (double)r.n; t[T_REL_SUM] += d8_sum(r.sum);
    t[T_REL_MAX] = fmax(t[T_REL_MAX], d8_largest(r.max));
    t[T_WITHIN_1E3] += (double)r.w1; t[T_WITHIN_5E3] += (double)r.w5;
    t[T_LO_X] = fmin(t[T_LO_X], f[3]);
    t[T_HI_X] = fmax(t[T_HI_X], f[4]);
    t[T_LO_Y] = fmin(t[T_LO_Y], f[5]);
    t[T_HI_Y] = fmax(t[T_HI_Y], f[6]);
    if (u.on) kl_block(&b, n, u, t + T_SP);     /* T_SP, T_SQ, T_S */
    shifted[0] = (double)n;
    return 1;
}

/* avx512.c's kl_simd */
AVX2 int kl_avx2(const char *x, char xk, const char *y, char yk, Py_ssize_t n, Unit u, double *t)
{
    if (n > BLOCK) return 0;
    Doubles b __attribute__((aligned(32)));
    to_doubles(x, xk, y, yk, n, &b, NULL);
    __m256d check = _mm256_setzero_pd();
    for (Py_ssize_t i = 0; i < n; i += 4) {
        const __m256d zero = _mm256_setzero_pd();
        check = _mm256_fmadd_pd(_mm256_load_pd(b.x + i), zero, _mm256_fmadd_pd(_mm256_load_pd(b.y + i), zero, check));
    }
    if (_mm256_movemask_pd(_mm256_cmp_pd(check, check, _CMP_UNORD_Q))) return 0;
    kl_block(&b, n, u, t);
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
        fetch_ahead(data, kind, i);
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
