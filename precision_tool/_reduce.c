/* One-pass reductions over dumped tensors, and the dump's bulk text and file writing, with
 * the GIL released.
 *
 * numpy needs one call, and one pass over memory, per quantity: a tensor's statistics take
 * ten of them and a comparison's metrics some sixty. These loops read each element once,
 * convert it to double and feed every sum, extreme and count at the same time. They are an
 * accelerator, not a definition: precision_tool.numerics and precision_tool.analysis.metrics
 * hold the numpy code that defines every quantity (and that runs when this module is not
 * built), and the tests check both against float64 references.
 *
 * Element kinds: 'e' float16, 'b' bfloat16 (as its uint16 bits), 'f' float32, 'd' float64.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <fcntl.h>
#include <unistd.h>
#include <sys/uio.h>
#include <sys/stat.h>
#include <ftw.h>
#include <pthread.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>

#define BLOCK 1024                       /* elements converted to double at a time: in L1 */
#define EPS 1.1920928955078125e-07       /* float32 eps: kernels.compare.EPS */
#define FP16_MAX 65504.0
#define GRID_GIL (1 << 15)               /* grid() releases the GIL from this many elements */
#define KL_SERIES (1.0 / 64)              /* |p / q - 1| under which KL's terms use a series */
#define KL_NEAR (1.0 / 256)                /* ... and under which the AVX-512 loop's shorter one does */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
/* one build runs everywhere and uses AVX-512 or AVX2 where the CPU has them */
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

/* not fmax/fmin: their nan rules keep loops from vectorising (no nan reaches these) */
#define MAX(a, b) ((a) > (b) ? (a) : (b))
#define MIN(a, b) ((a) < (b) ? (a) : (b))

static inline double as_double(uint64_t b) { double d; memcpy(&d, &b, 8); return d; }
static inline uint64_t as_bits(double d) { uint64_t b; memcpy(&b, &d, 8); return b; }
static inline float as_float(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }

/* float16 bits -> float, exact for every value (zeros, subnormals, inf, nan), branch-free */
static inline float half_to_float(uint16_t h)
{
    uint32_t o = (uint32_t)(h & 0x7fff) << 13;
    uint32_t exp = o & 0x0f800000u;
    o += (uint32_t)(127 - 15) << 23;
    float f;
    if (exp == 0x0f800000u) {
        f = as_float(o + ((uint32_t)(128 - 16) << 23));       /* inf / nan */
    } else if (exp == 0) {
        f = as_float(o + (1u << 23)) - as_float(113u << 23);  /* zero / subnormal */
    } else {
        f = as_float(o);
    }
    uint32_t bits;
    memcpy(&bits, &f, 4);
    return as_float(bits | ((uint32_t)(h & 0x8000) << 16));
}

/* Element kinds: the floats 'e' (float16), 'b' (bfloat16, as its bits), 'f', 'd'; for
 * statistics only, the integers by their buffer format letter ('c' stands for int8, whose
 * letter 'b' is bfloat16's here) and '?' (bool). */
static int itemsize(char kind)
{
    switch (kind) {
    case 'e': case 'b': case 'h': case 'H': return 2;
    case 'f': case 'i': case 'I': return 4;
    case 'd': case 'q': case 'Q': return 8;
    case 'c': case 'B': case '?': return 1;
    default: return 0;
    }
}

static int is_float(char kind) { return kind == 'e' || kind == 'b' || kind == 'f' || kind == 'd'; }

CLONES static void to_double(const char *src, char kind, Py_ssize_t n, double *dst)
{
    Py_ssize_t i;
    switch (kind) {
    case 'd': memcpy(dst, src, (size_t)n * 8); break;
    case 'f': { const float *s = (const float *)src; for (i = 0; i < n; i++) dst[i] = s[i]; } break;
    case 'e': { const uint16_t *s = (const uint16_t *)src; for (i = 0; i < n; i++) dst[i] = half_to_float(s[i]); } break;
    case 'b': { const uint16_t *s = (const uint16_t *)src; for (i = 0; i < n; i++) dst[i] = as_float((uint32_t)s[i] << 16); } break;
#define INTS(k, T) case k: { const T *s = (const T *)src; for (i = 0; i < n; i++) dst[i] = (double)s[i]; } break;
    INTS('c', int8_t) INTS('h', int16_t) INTS('i', int32_t) INTS('q', int64_t)
    INTS('B', uint8_t) INTS('H', uint16_t) INTS('I', uint32_t) INTS('Q', uint64_t)
#undef INTS
    case '?': { const uint8_t *s = (const uint8_t *)src; for (i = 0; i < n; i++) dst[i] = s[i] != 0; } break;
    }
}

/* ---- statistics of one tensor (kernels.stats.tensor_stats) ---------------------------------- */

typedef struct { double hi, lo, sum, squares; int64_t n, nan, pos, neg; } Stats;

/* The common block: every element finite. Four sums instead of eight; returns 0 (and
 * leaves st alone) when an inf or nan is there, for stats_block to count them. */
CLONES static int finite_block(const double *v, Py_ssize_t n, Stats *st)
{
    double hi = -INFINITY, lo = INFINITY, sum = 0, sq = 0, check = 0;
    Py_ssize_t i;
#pragma omp simd reduction(max:hi) reduction(min:lo) reduction(+:sum, sq, check)
    for (i = 0; i < n; i++) {
        double x = v[i];
        hi = MAX(hi, x);
        lo = MIN(lo, x);
        sum += x;
        sq += x * x;
        check += x - x;             /* 0 for a finite x, nan for inf and nan */
    }
    if (check != check) return 0;
    st->hi = fmax(st->hi, hi);
    st->lo = fmin(st->lo, lo);
    st->sum += sum;
    st->squares += sq;
    st->n += n;
    return 1;
}

CLONES static void stats_block(const double *v, Py_ssize_t n, Stats *st)
{
    if (finite_block(v, n, st)) return;
    double hi = -INFINITY, lo = INFINITY, sum = 0, sq = 0, fin = 0, nan = 0, pos = 0, neg = 0;
    Py_ssize_t i;
#pragma omp simd reduction(max:hi) reduction(min:lo) reduction(+:sum, sq, fin, nan, pos, neg)
    for (i = 0; i < n; i++) {
        double x = v[i];
        int finite = fabs(x) <= DBL_MAX;
        double xf = finite ? x : 0.0;
        hi = MAX(hi, finite ? x : -INFINITY);
        lo = MIN(lo, finite ? x : INFINITY);
        sum += xf;
        sq += xf * xf;
        fin += finite ? 1.0 : 0.0;
        nan += x != x ? 1.0 : 0.0;
        pos += x == INFINITY ? 1.0 : 0.0;
        neg += x == -INFINITY ? 1.0 : 0.0;
    }
    st->hi = fmax(st->hi, hi);
    st->lo = fmin(st->lo, lo);
    st->sum += sum;
    st->squares += sq;
    st->n += (int64_t)fin;
    st->nan += (int64_t)nan;
    st->pos += (int64_t)pos;
    st->neg += (int64_t)neg;
}

static int use_simd(void);
static int stats_simd(const char *data, char kind, Py_ssize_t n, Stats *st);
static Py_ssize_t halves_simd(const float *src, Py_ssize_t n, uint16_t *dst);
static Py_ssize_t grid_simd(const float *src, Py_ssize_t n, char kind, float *dst, int *bad);
static inline uint16_t float_to_half_bits(uint32_t f);

static void tensor_stats(const char *data, char kind, Py_ssize_t n, double *out)
{
    double buf[BLOCK];
    Stats st = {-INFINITY, INFINITY, 0, 0, 0, 0, 0, 0};
    int size = itemsize(kind), simd = is_float(kind) && kind != 'd' && use_simd();
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        Py_ssize_t m = n - start < BLOCK ? n - start : BLOCK;
        if (simd && m % 16 == 0 && stats_simd(data + start * size, kind, m, &st)) continue;
        to_double(data + start * size, kind, m, buf);
        stats_block(buf, m, &st);
    }
    if (st.n) {
        out[0] = st.hi; out[1] = st.lo; out[2] = st.sum / (double)st.n; out[3] = sqrt(st.squares);
    } else {
        out[0] = out[1] = out[2] = out[3] = NAN;
    }
    out[4] = (double)st.nan; out[5] = (double)st.pos; out[6] = (double)st.neg;
}

/* ---- comparison totals (kernels.compare.Totals) ------------------------------------------------- */

enum {
    T_X_NAN, T_X_INF, T_Y_NAN, T_Y_INF, T_X_AT_MAX, T_LIVE, T_FLUSHED, T_LEFT_OUT,
    T_N, T_XY, T_XX, T_YY, T_DD, T_ABS_D_SUM, T_ABS_D_MAX, T_REL_N, T_REL_SUM, T_REL_MAX,
    T_WITHIN_1E3, T_WITHIN_5E3, T_LO_X, T_HI_X, T_LO_Y, T_HI_Y,
    T_MEAN_X, T_M2_X, T_MEAN_Y, T_M2_Y, T_SP, T_SQ, T_S, T_FIELDS
};

typedef struct {            /* the KL pass's normalisation: p = max((x - lo) * scale, eps) */
    int on;
    int normalised;         /* both sides span a range: p and q lie in [eps, 1] */
    double lo_x, scale_x, lo_y, scale_y;
} Unit;

static Unit make_unit(const double *r)     /* (lo_x, hi_x, lo_y, hi_y) */
{
    Unit u = {1, r[1] > r[0] && r[3] > r[2], 0.0, 1.0, 0.0, 1.0};
    if (r[1] > r[0]) { u.lo_x = r[0]; u.scale_x = 1.0 / (r[1] - r[0]); }
    if (r[3] > r[2]) { u.lo_y = r[2]; u.scale_y = 1.0 / (r[3] - r[2]); }
    return u;
}

/* Chan et al.: combine (n, mean, M2) of two sets of elements */
static void chan(double *n, double *mean, double *m2, double nb, double mb, double m2b)
{
    if (nb == 0) return;
    if (*n == 0) { *n = nb; *mean = mb; *m2 = m2b; return; }
    double total = *n + nb, delta = mb - *mean;
    *mean += delta * nb / total;
    *m2 += m2b + delta * delta * *n * nb / total;
    *n = total;
}

/* log of a positive normal double to within an ulp, in straight-line code the compiler can
 * vectorise (libm's log is a call it cannot): fdlibm's reduction to [sqrt(1/2), sqrt(2))
 * and its polynomial in s = f / (2 + f). The KL terms' arguments are >= float32 eps. */
static inline double log_positive(double v)
{
    const double ln2_hi = 6.93147180369123816490e-01, ln2_lo = 1.90821492927058770002e-10;
    const double Lg1 = 6.666666666666735130e-01, Lg2 = 3.999999999940941908e-01,
                 Lg3 = 2.857142874366239149e-01, Lg4 = 2.222219843214978396e-01,
                 Lg5 = 1.818357216161805012e-01, Lg6 = 1.531383769920937332e-01,
                 Lg7 = 1.479819860511658591e-01;
    uint64_t b = as_bits(v);
    int64_t k = (int64_t)(b - 0x3fe6a09e667f3bcdULL) >> 52;     /* bits of sqrt(1/2) */
    double f = as_double(b - ((uint64_t)k << 52)) - 1.0;       /* v = 2^k (1 + f) */
    double s = f / (2.0 + f), z = s * s, w = z * z;
    double r = z * (Lg1 + w * (Lg3 + w * (Lg5 + w * Lg7))) + w * (Lg2 + w * (Lg4 + w * Lg6));
    double hfsq = 0.5 * f * f, dk = (double)k;
    return dk * ln2_hi - ((hfsq - (s * (hfsq + r) + dk * ln2_lo)) - f);
}

/* log(1 + d) for 1 + d = p / q in [eps, 1 / eps]: the log of u = 1 + d, rounded, corrected
 * by its rounding (d - (u - 1)) / u (u - 1 is exact where it matters, u in [1/2, 2]), so that
 * the error is an ulp of the log, not an ulp of u: the log of a rounded ratio would be off by
 * 2^-53 absolute, 64 times its ulp where d = 1/64, before the excess term cancels more. */
static inline double log_ratio(double d)
{
    double u = 1.0 + d;
    return log_positive(u) + (d - (u - 1.0)) / u;
}

/* p log(p / q), d = (p - q) / q: where both sides are normalised through log_ratio (free of
 * the cancellation of log p - log q); otherwise p or q may be any magnitude (1 + d may round
 * to 0) and the two logs are taken apart */
static inline double kl_term(double p, double q, double d, int normalised)
{
    return normalised ? p * log_ratio(d) : p * (log_positive(p) - log_positive(q));
}

/* the excess term (below) where |d| < KL_SERIES: diff d phi(d), phi(d) = sum over k >= 2 of
 * (-1)^k d^(k - 2) / (k (k - 1)) to k = 10 (the next term is under 2^-59 of the first) */
static inline double kl_series(double diff, double d)
{
    double r = 1.0 / 90;
    for (int k = 9; k >= 2; k--) r = r * d + (k % 2 ? -1.0 : 1.0) / (k * (k - 1));
    return diff * d * r;
}

/* KL's excess term p log(p / q) - (p - q) >= 0 (metrics.set_kl says why KL is summed so):
 * with d = (p - q) / q it is (p - q) d phi(d), p - q exact where p and q are within a factor
 * of two (Sterbenz), so near p = q (close tensors: nearly every element) the term is good to
 * a few ulps; elsewhere the log less p - q, which cancels at most log2(2 / |d|) < 7 bits. */
static inline double kl_excess(double p, double q, int normalised)
{
    double diff = p - q, d = diff / q;
    return fabs(d) < KL_SERIES ? kl_series(diff, d) : kl_term(p, q, d, normalised) - diff;
}

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* an element's p (or q) as the KL pass normalises it: (v - lo) * scale, at least eps */
static inline double unit_value(double v, double lo, double scale)
{
    return MAX((v - lo) * scale, EPS);
}

/* KL's excess terms of a block, each as kl_excess() takes it: the loops below sum the series
 * alone (nearly every block of close tensors) and call this for a block where some |d| was
 * out of the series' range, rather than take a log for every element of every block */
ALWAYS_INLINE double kl_excess_sum(const double *x, const double *y, Py_ssize_t n, Unit u,
                                   const int fast, const int ratio)
{
    double s = 0;
    Py_ssize_t i;
#pragma omp simd reduction(+:s)
    for (i = 0; i < n; i++) {
        double a = x[i], b = y[i];
        int f = fast || (fabs(a) <= DBL_MAX && fabs(b) <= DBL_MAX);
        double p = unit_value(f ? a : 0.0, u.lo_x, u.scale_x);
        double q = unit_value(f ? b : 0.0, u.lo_y, u.scale_y);
        s += f ? kl_excess(p, q, ratio) : 0.0;
    }
    return s;
}

/* Everything but the moments' combination over one block; moments are shifted by the
 * block's first finite pair (kx, ky), which keeps sum (x - k)^2 free of cancellation.
 * `fast`: every element of the block is finite, so nothing is masked and nothing
 * non-finite is counted; the compiler makes one loop of each case. */
ALWAYS_INLINE void compare_loop(const double *x, const double *y, Py_ssize_t n, double kx,
                                double ky, Unit u, double *t, double *shifted, const int fast,
                                const int kl, const int ratio)
{
    double x_nan = 0, x_inf = 0, y_nan = 0, y_inf = 0, at_max = 0, live = 0, flushed = 0;
    double fin = 0, xy = 0, xx = 0, yy = 0, dd = 0, ad_sum = 0, ad_max = 0;
    double rel_n = 0, rel_sum = 0, rel_max = 0, w1 = 0, w5 = 0;
    double lo_x = INFINITY, hi_x = -INFINITY, lo_y = INFINITY, hi_y = -INFINITY;
    double sx = 0, sxx = 0, sy = 0, syy = 0, sp = 0, sq = 0, s = 0, wide = 0;
    Py_ssize_t i;
#pragma omp simd reduction(+:x_nan, x_inf, y_nan, y_inf, at_max, live, flushed, fin, xy, xx, yy, dd, ad_sum, rel_n, rel_sum, w1, w5, sx, sxx, sy, syy, sp, sq, s) \
                 reduction(max:ad_max, rel_max, hi_x, hi_y, wide) reduction(min:lo_x, lo_y)
    for (i = 0; i < n; i++) {
        double a = x[i], b = y[i];
        double abs_a = fabs(a), abs_b = fabs(b);
        int f = 1;
        if (!fast) {
            x_nan += a != a ? 1.0 : 0.0;
            y_nan += b != b ? 1.0 : 0.0;
            x_inf += abs_a == INFINITY ? 1.0 : 0.0;
            y_inf += abs_b == INFINITY ? 1.0 : 0.0;
            f = abs_a <= DBL_MAX && abs_b <= DBL_MAX;
            fin += f ? 1.0 : 0.0;
        }
        at_max += abs_a >= FP16_MAX ? 1.0 : 0.0;
        live += b != 0.0 ? 1.0 : 0.0;                       /* nan counts as live, as in numpy */
        flushed += (b != 0.0 && a == 0.0) ? 1.0 : 0.0;
        double xf = f ? a : 0.0, yf = f ? b : 0.0;
        xy += xf * yf;
        xx += xf * xf;
        yy += yf * yf;
        double d = xf - yf, ad = fabs(d), ay = fabs(yf);
        dd += d * d;
        ad_sum += ad;
        ad_max = MAX(ad_max, ad);
        int rel = ay > EPS;
        double err = rel ? ad / ay : ad;
        rel_n += rel ? 1.0 : 0.0;
        rel_sum += rel ? err : 0.0;
        rel_max = MAX(rel_max, rel ? err : 0.0);
        w1 += (f && err < 1e-3) ? 1.0 : 0.0;
        w5 += (f && err < 5e-3) ? 1.0 : 0.0;
        lo_x = MIN(lo_x, f ? a : INFINITY);
        hi_x = MAX(hi_x, f ? a : -INFINITY);
        lo_y = MIN(lo_y, f ? b : INFINITY);
        hi_y = MAX(hi_y, f ? b : -INFINITY);
        double cx = f ? a - kx : 0.0, cy = f ? b - ky : 0.0;
        sx += cx; sxx += cx * cx;
        sy += cy; syy += cy * cy;
        if (kl) {
            double p = unit_value(xf, u.lo_x, u.scale_x), q = unit_value(yf, u.lo_y, u.scale_y);
            double pq_diff = p - q, pq_rel = pq_diff / q;
            sp += f ? p : 0.0;
            sq += f ? q : 0.0;
            s += f ? kl_series(pq_diff, pq_rel) : 0.0;
            wide = MAX(wide, f ? fabs(pq_rel) : 0.0);
        }
    }
    if (kl && !(wide < KL_SERIES)) s = kl_excess_sum(x, y, n, u, fast, ratio);
    if (fast) fin = (double)n;
    t[T_X_NAN] += x_nan; t[T_X_INF] += x_inf; t[T_Y_NAN] += y_nan; t[T_Y_INF] += y_inf;
    t[T_X_AT_MAX] += at_max; t[T_LIVE] += live; t[T_FLUSHED] += flushed;
    t[T_LEFT_OUT] += (double)n - fin;
    t[T_XY] += xy; t[T_XX] += xx; t[T_YY] += yy; t[T_DD] += dd;
    t[T_ABS_D_SUM] += ad_sum; t[T_ABS_D_MAX] = fmax(t[T_ABS_D_MAX], ad_max);
    t[T_REL_N] += rel_n; t[T_REL_SUM] += rel_sum; t[T_REL_MAX] = fmax(t[T_REL_MAX], rel_max);
    t[T_WITHIN_1E3] += w1; t[T_WITHIN_5E3] += w5;
    t[T_LO_X] = fmin(t[T_LO_X], lo_x); t[T_HI_X] = fmax(t[T_HI_X], hi_x);
    t[T_LO_Y] = fmin(t[T_LO_Y], lo_y); t[T_HI_Y] = fmax(t[T_HI_Y], hi_y);
    t[T_SP] += sp; t[T_SQ] += sq; t[T_S] += s;
    shifted[0] = fin; shifted[1] = sx; shifted[2] = sxx; shifted[3] = sy; shifted[4] = syy;
}

ALWAYS_INLINE void kl_loop(const double *x, const double *y, Py_ssize_t n, Unit u, double *t,
                           const int fast, const int ratio)
{
    double sp = 0, sq = 0, s = 0, wide = 0;
    Py_ssize_t i;
#pragma omp simd reduction(+:sp, sq, s) reduction(max:wide)
    for (i = 0; i < n; i++) {
        double a = x[i], b = y[i];
        int f = fast || (fabs(a) <= DBL_MAX && fabs(b) <= DBL_MAX);
        double p = unit_value(f ? a : 0.0, u.lo_x, u.scale_x);
        double q = unit_value(f ? b : 0.0, u.lo_y, u.scale_y);
        double pq_diff = p - q, pq_rel = pq_diff / q;
        sp += f ? p : 0.0;
        sq += f ? q : 0.0;
        s += f ? kl_series(pq_diff, pq_rel) : 0.0;
        wide = MAX(wide, f ? fabs(pq_rel) : 0.0);
    }
    if (!(wide < KL_SERIES)) s = kl_excess_sum(x, y, n, u, fast, ratio);
    t[0] += sp; t[1] += sq; t[2] += s;
}

/* Is every element finite? (the fast loops' condition) */
CLONES static int plain_block(const double *x, const double *y, Py_ssize_t n)
{
    double ax = 0, ay = 0;
    Py_ssize_t i;
#pragma omp simd reduction(max:ax, ay)
    for (i = 0; i < n; i++) {
        double u = fabs(x[i]), v = fabs(y[i]);
        ax = MAX(ax, u != u ? INFINITY : u);
        ay = MAX(ay, v != v ? INFINITY : v);
    }
    return ax <= DBL_MAX && ay <= DBL_MAX;
}

CLONES static void compare_block(const double *x, const double *y, Py_ssize_t n, double kx,
                                 double ky, Unit u, double *t, double *shifted)
{
    if (plain_block(x, y, n)) {
        if (!u.on) compare_loop(x, y, n, kx, ky, u, t, shifted, 1, 0, 0);
        else if (u.normalised) compare_loop(x, y, n, kx, ky, u, t, shifted, 1, 1, 1);
        else compare_loop(x, y, n, kx, ky, u, t, shifted, 1, 1, 0);
    } else {
        if (u.on) compare_loop(x, y, n, kx, ky, u, t, shifted, 0, 1, 0);
        else compare_loop(x, y, n, kx, ky, u, t, shifted, 0, 0, 0);
    }
}

CLONES static void kl_block(const double *x, const double *y, Py_ssize_t n, Unit u, double *t)
{
    if (!plain_block(x, y, n)) kl_loop(x, y, n, u, t, 0, 0);
    else if (u.normalised) kl_loop(x, y, n, u, t, 1, 1);
    else kl_loop(x, y, n, u, t, 1, 0);
}

static Py_ssize_t first_finite(const double *x, const double *y, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        if (fabs(x[i]) <= DBL_MAX && fabs(y[i]) <= DBL_MAX) return i;
    return -1;
}

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

/* Ask for the line AHEAD elements past element i: the loops below do so much arithmetic per
 * element that they do not run ahead far enough by themselves, and the hardware's prefetcher
 * stops at each 4 KiB page, so that without this a pair beyond the caches compared at half the
 * rate of one within them. (A prefetch past the end of a mapping faults nothing.) */
#define AHEAD 512
AVX512 static inline void fetch_ahead(const char *data, char kind, Py_ssize_t i)
{
    _mm_prefetch(data + (i + AHEAD) * (kind == 'f' ? 4 : 2), _MM_HINT_T0);
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
AVX512 static int compare_simd(const char *x, char xk, const char *y, char yk, Py_ssize_t n,
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
 * DBL_MAX). float32 is converted to double straight from memory, half a vector at a time. */
AVX512 static int stats_simd(const char *data, char kind, Py_ssize_t n, Stats *st)
{
    __m512 lo = _mm512_set1_ps(INFINITY), hi = _mm512_set1_ps(-INFINITY);
    __m512d sum0 = _mm512_setzero_pd(), sum1 = sum0, sq0 = sum0, sq1 = sum0;
    const float *f = (const float *)data;
    for (Py_ssize_t i = 0; i < n; i += 16) {
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
AVX512 static Py_ssize_t halves_simd(const float *src, Py_ssize_t n, uint16_t *dst)
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
AVX512 static Py_ssize_t grid_simd(const float *src, Py_ssize_t n, char kind, float *dst, int *bad)
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
AVX512 static int kl_simd(const char *x, char xk, const char *y, char yk, Py_ssize_t n, Unit u,
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

/* Does this CPU run the AVX-512 loops (and are they not turned off, as the tests do to test
 * the portable ones)? Asked per call. */
static int use_simd(void)
{
    static int cpu = -1;
    if (cpu < 0) cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
    return cpu && !getenv("PRECISION_TOOL_NO_AVX512");
}
#else
static int compare_simd(const char *x, char xk, const char *y, char yk, Py_ssize_t n,
                        double kx, double ky, Unit u, double *t, double *shifted) { return 0; }
static int kl_simd(const char *x, char xk, const char *y, char yk, Py_ssize_t n, Unit u,
                   double *t) { return 0; }
static int stats_simd(const char *data, char kind, Py_ssize_t n, Stats *st) { return 0; }
static Py_ssize_t halves_simd(const float *src, Py_ssize_t n, uint16_t *dst) { return 0; }
static Py_ssize_t grid_simd(const float *src, Py_ssize_t n, char kind, float *dst, int *bad) { return 0; }
static int use_simd(void) { return 0; }
#endif

/* totals of x[start:stop] against y[start:stop]; KL sums too when u.on */
static void compare_range(const char *xd, char xk, const char *yd, char yk,
                          Py_ssize_t start, Py_ssize_t stop, Unit u, double *t)
{
    double xb[BLOCK], yb[BLOCK], shifted[5];
    double nx = 0, nx_mean = 0, nx_m2 = 0, ny = 0, ny_mean = 0, ny_m2 = 0;
    int xs = itemsize(xk), ys = itemsize(yk);
    for (int k = 0; k < T_FIELDS; k++) t[k] = 0.0;
    t[T_LO_X] = t[T_LO_Y] = INFINITY;
    t[T_HI_X] = t[T_HI_Y] = -INFINITY;
    int simd = xk != 'd' && yk != 'd' && (!u.on || u.normalised) && use_simd();
    for (Py_ssize_t at = start; at < stop; at += BLOCK) {
        Py_ssize_t m = stop - at < BLOCK ? stop - at : BLOCK;
        double kx, ky;                  /* the moments' shift: the block's first finite pair */
        to_double(xd + at * xs, xk, 1, &kx);
        to_double(yd + at * ys, yk, 1, &ky);
        if (!(simd && m % 16 == 0 &&
              compare_simd(xd + at * xs, xk, yd + at * ys, yk, m, kx, ky, u, t, shifted))) {
            to_double(xd + at * xs, xk, m, xb);
            to_double(yd + at * ys, yk, m, yb);
            Py_ssize_t j = first_finite(xb, yb, m);
            kx = j < 0 ? 0.0 : xb[j]; ky = j < 0 ? 0.0 : yb[j];
            compare_block(xb, yb, m, kx, ky, u, t, shifted);
        }
        double nb = shifted[0];
        if (nb > 0) {
            double mx = shifted[1] / nb, my = shifted[3] / nb;
            chan(&nx, &nx_mean, &nx_m2, nb, kx + mx, fmax(shifted[2] - shifted[1] * mx, 0.0));
            chan(&ny, &ny_mean, &ny_m2, nb, ky + my, fmax(shifted[4] - shifted[3] * my, 0.0));
        }
    }
    t[T_N] = nx;
    t[T_MEAN_X] = nx_mean; t[T_M2_X] = nx_m2;
    t[T_MEAN_Y] = ny_mean; t[T_M2_Y] = ny_m2;
    if (!u.on) t[T_SP] = t[T_SQ] = t[T_S] = NAN;
}

static void kl_range(const char *xd, char xk, const char *yd, char yk,
                     Py_ssize_t start, Py_ssize_t stop, Unit u, double *t)
{
    double xb[BLOCK], yb[BLOCK];
    int xs = itemsize(xk), ys = itemsize(yk);
    t[0] = t[1] = t[2] = 0.0;
    int simd = xk != 'd' && yk != 'd' && u.normalised && use_simd();
    for (Py_ssize_t at = start; at < stop; at += BLOCK) {
        Py_ssize_t m = stop - at < BLOCK ? stop - at : BLOCK;
        if (simd && m % 16 == 0 && kl_simd(xd + at * xs, xk, yd + at * ys, yk, m, u, t)) continue;
        to_double(xd + at * xs, xk, m, xb);
        to_double(yd + at * ys, yk, m, yb);
        kl_block(xb, yb, m, u, t);
    }
}

/* ---- the Python interface ---------------------------------------------------------------- */

/* a C-contiguous buffer of `count` elements of `kind` (count < 0: any) */
static int get_buffer(PyObject *obj, char kind, Py_ssize_t count, Py_buffer *view)
{
    int size = itemsize(kind);
    if (!size) {
        PyErr_Format(PyExc_ValueError, "unknown element kind %c", kind);
        return -1;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len % size || (count >= 0 && view->len / size != count)) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "buffer size does not match its element kind and count");
        return -1;
    }
    return 0;
}

static PyObject *py_stats(PyObject *self, PyObject *args)
{
    PyObject *arrays, *seq;
    const char *kinds;
    Py_ssize_t nkinds;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "Os#w*", &arrays, &kinds, &nkinds, &out)) return NULL;
    seq = PySequence_Fast(arrays, "arrays must be a sequence");
    if (!seq) { PyBuffer_Release(&out); return NULL; }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), k, got = 0;
    Py_buffer *views = NULL;
    PyObject *result = NULL;
    if (nkinds != n || out.len != (Py_ssize_t)(n * 7 * sizeof(double))) {
        PyErr_SetString(PyExc_ValueError, "stats: need one kind per array and 7 doubles per array out");
        goto done;
    }
    views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    if (!views) { PyErr_NoMemory(); goto done; }
    for (got = 0; got < n; got++)
        if (get_buffer(PySequence_Fast_GET_ITEM(seq, got), kinds[got], -1, &views[got]) < 0) goto done;
    double *o = (double *)out.buf;
    Py_BEGIN_ALLOW_THREADS
    for (k = 0; k < n; k++)
        tensor_stats(views[k].buf, kinds[k], views[k].len / itemsize(kinds[k]), o + 7 * k);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    for (k = 0; k < got; k++) PyBuffer_Release(&views[k]);
    PyMem_Free(views);
    Py_DECREF(seq);
    PyBuffer_Release(&out);
    return result;
}

/* whether a buffer of format fmt (its byte order letter skipped) holds elements of kind
 * (itemsize checked apart: numpy names int64 'l' or 'q') */
static int format_is(char kind, const char *fmt)
{
    if (!fmt[0] || fmt[1]) return 0;
    if (is_float(kind) || kind == '?') return fmt[0] == kind;
    if (strchr("chiq", kind)) return strchr("bhilq", fmt[0]) != NULL;
    return strchr("BHILQ", fmt[0]) != NULL;
}

/* stats_rows(arrays, kinds, table, rows): the statistics of arrays[i] (of kind kinds[i],
 * numpy's own: not bfloat16; C-contiguous; '.' leaves it to the caller) and its size into row rows[i]
 * of table (8 float64 a row), as grid() writes them. Returns False, writing nothing, when an
 * array is not what its kind says or not contiguous: the caller works the kinds out anew. */
static PyObject *py_stats_rows(PyObject *self, PyObject *args)
{
    PyObject *arrays, *seq;
    const char *kinds;
    Py_ssize_t nkinds;
    Py_buffer table, rows;
    if (!PyArg_ParseTuple(args, "Os#w*y*", &arrays, &kinds, &nkinds, &table, &rows)) return NULL;
    PyObject *result = NULL;
    Py_buffer *views = NULL;
    Py_ssize_t n = 0, got = 0, k;
    seq = PySequence_Fast(arrays, "arrays must be a sequence");
    if (!seq) goto done;
    n = PySequence_Fast_GET_SIZE(seq);
    const int64_t *row = rows.buf;
    Py_ssize_t nrows = table.len / (8 * (Py_ssize_t)sizeof(double));
    if (nkinds != n || rows.len != n * 8 || table.len % (8 * sizeof(double))) {
        PyErr_SetString(PyExc_ValueError, "stats_rows: one kind and one int64 row per array, "
                        "8 float64 a table row");
        goto done;
    }
    for (k = 0; k < n; k++)
        if (row[k] < 0 || row[k] >= nrows) {
            PyErr_SetString(PyExc_ValueError, "stats_rows: a row outside the table");
            goto done;
        }
    views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    if (!views) { PyErr_NoMemory(); goto done; }
    for (got = 0; got < n; got++) {
        if (kinds[got] == '.') continue;
        Py_buffer *v = &views[got];
        if (!itemsize(kinds[got]) || kinds[got] == 'b' ||
            PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), v,
                               PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            PyErr_Clear();
            v->obj = NULL;
            result = Py_False;
            goto done;
        }
        const char *fmt = v->format ? v->format : "B";
        if (fmt[0] == '<' || fmt[0] == '=' || fmt[0] == '@') fmt++;
        if (!format_is(kinds[got], fmt) || v->itemsize != itemsize(kinds[got])) {
            PyBuffer_Release(v);
            v->obj = NULL;
            result = Py_False;
            goto done;
        }
    }
    double *t = table.buf;
    Py_BEGIN_ALLOW_THREADS
    for (k = 0; k < n; k++) {
        if (!views[k].obj) continue;
        Py_ssize_t m = views[k].len / views[k].itemsize;
        tensor_stats(views[k].buf, kinds[k], m, t + 8 * row[k]);
        t[8 * row[k] + 7] = (double)m;
    }
    Py_END_ALLOW_THREADS
    result = Py_True;
done:
    for (k = 0; k < got && views; k++) if (views[k].obj) PyBuffer_Release(&views[k]);
    PyMem_Free(views);
    Py_XDECREF(seq);
    PyBuffer_Release(&table);
    PyBuffer_Release(&rows);
    Py_XINCREF(result);
    return result;
}

static int parse_pair(PyObject *args, Py_buffer *x, Py_buffer *y, char *kinds,
                      Py_ssize_t *start, Py_ssize_t *stop, PyObject **ranges)
{
    PyObject *xo, *yo;
    const char *k;
    Py_ssize_t nk;
    if (!PyArg_ParseTuple(args, "OOs#nnO", &xo, &yo, &k, &nk, start, stop, ranges)) return -1;
    if (nk != 2) { PyErr_SetString(PyExc_ValueError, "kinds: two characters"); return -1; }
    kinds[0] = k[0]; kinds[1] = k[1];
    if (!is_float(kinds[0]) || !is_float(kinds[1])) {
        PyErr_SetString(PyExc_ValueError, "kinds: the comparisons take floats only");
        return -1;
    }
    if (get_buffer(xo, kinds[0], -1, x) < 0) return -1;
    if (get_buffer(yo, kinds[1], x->len / itemsize(kinds[0]), y) < 0) { PyBuffer_Release(x); return -1; }
    Py_ssize_t n = x->len / itemsize(kinds[0]);
    if (*start < 0 || *stop > n || *start > *stop) {
        PyBuffer_Release(x); PyBuffer_Release(y);
        PyErr_SetString(PyExc_ValueError, "range outside the tensors");
        return -1;
    }
    return 0;
}

static int parse_ranges(PyObject *ranges, double *r)
{
    if (!PyArg_ParseTuple(ranges, "dddd", &r[0], &r[1], &r[2], &r[3])) return -1;
    return 0;
}

static PyObject *py_compare(PyObject *self, PyObject *args)
{
    Py_buffer x, y;
    char kinds[2];
    Py_ssize_t start, stop;
    PyObject *ranges;
    double t[T_FIELDS], r[4];
    Unit u = {0, 0, 0.0, 1.0, 0.0, 1.0};
    if (parse_pair(args, &x, &y, kinds, &start, &stop, &ranges) < 0) return NULL;
    if (ranges != Py_None) {
        if (parse_ranges(ranges, r) < 0) { PyBuffer_Release(&x); PyBuffer_Release(&y); return NULL; }
        u = make_unit(r);
    }
    Py_BEGIN_ALLOW_THREADS
    compare_range(x.buf, kinds[0], y.buf, kinds[1], start, stop, u, t);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    PyObject *out = PyTuple_New(T_FIELDS);
    if (!out) return NULL;
    for (int k = 0; k < T_FIELDS; k++) {
        PyObject *v = PyFloat_FromDouble(t[k]);
        if (!v) { Py_DECREF(out); return NULL; }
        PyTuple_SET_ITEM(out, k, v);
    }
    return out;
}

static PyObject *py_kl(PyObject *self, PyObject *args)
{
    Py_buffer x, y;
    char kinds[2];
    Py_ssize_t start, stop;
    PyObject *ranges;
    double t[3], r[4];
    if (parse_pair(args, &x, &y, kinds, &start, &stop, &ranges) < 0) return NULL;
    if (parse_ranges(ranges, r) < 0) { PyBuffer_Release(&x); PyBuffer_Release(&y); return NULL; }
    Unit u = make_unit(r);
    Py_BEGIN_ALLOW_THREADS
    kl_range(x.buf, kinds[0], y.buf, kinds[1], start, stop, u, t);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    return Py_BuildValue("(ddd)", t[0], t[1], t[2]);
}

/* ---- text ------------------------------------------------------------------------------ */

/* n in decimal; returns its length */
static int format_int(long long n, char *out)
{
    char digits[24];
    int len = 0, at = 0;
    unsigned long long u = n < 0 ? 0ULL - (unsigned long long)n : (unsigned long long)n;
    do { digits[len++] = (char)('0' + u % 10); u /= 10; } while (u);
    if (n < 0) out[at++] = '-';
    while (len) out[at++] = digits[--len];
    return at;
}

#ifdef __SIZEOF_INT128__
typedef unsigned __int128 u128;

static u128 pow10_128(int k)            /* 0 <= k <= 38 */
{
    u128 p = 1;
    while (k--) p *= 10;
    return p;
}

#define G17_LOW 1e16
#define G17_HIGH 1e17

/* The 17 significant digits of |x| (in [1e-6, 1e38)) as an integer D in [1e16, 1e17), and
 * its decimal exponent, rounded from the exact binary value half to even as printf rounds:
 * x = m 2^e scaled by 10^s in 128-bit integers is exact over that range (m < 2^53, 10^s <
 * 2^74). Returns 0 where it would not be exact (the caller asks snprintf). */
static int g17_digits(double ax, uint64_t *digits, int *exponent)
{
    uint64_t bits = as_bits(ax);
    uint64_t m = (bits & ((1ULL << 52) - 1)) | (1ULL << 52);
    int e = (int)(bits >> 52) - 1075, X = (int)floor(log10(ax));
    u128 q, r, d;
    for (int tries = 0; tries < 4; tries++) {
        int s = 16 - X;                  /* D = round(|x| 10^s) */
        if (s > 22 || s < -22) return 0;
        if (s >= 0) {
            u128 num = (u128)m * pow10_128(s);
            if (e >= 0) {
                if (e > 10) return 0;
                q = num << e; r = 0; d = 1;
            } else {
                if (-e >= 127) return 0;
                d = (u128)1 << -e; q = num >> -e; r = num & (d - 1);
            }
        } else {
            if (e < 0 || e > 74) return 0;
            d = pow10_128(-s);
            u128 num = (u128)m << e;
            q = num / d; r = num % d;
        }
        if (q >= (u128)G17_HIGH) { X++; continue; }    /* log10's estimate was one off */
        if (q < (u128)G17_LOW) { X--; continue; }
        uint64_t D = (uint64_t)q;
        if (r > d - r || (r == d - r && (D & 1))) D++;
        if (D == (uint64_t)G17_HIGH) { D = (uint64_t)G17_LOW; X++; }
        *digits = D;
        *exponent = X;
        return 1;
    }
    return 0;
}
#else
static int g17_digits(double ax, uint64_t *digits, int *exponent) { return 0; }
#endif

/* "%.17g" of x (not nan); returns the length. snprintf's own takes about a microsecond a
 * value (its exact multi-precision path), and a dump step's index has a thousand or more. */
static int format_g17(double x, char *out)
{
    double ax = fabs(x);
    uint64_t D;
    int X;
    if (!(ax >= 1e-6 && ax < 1e38) || !g17_digits(ax, &D, &X))
        return snprintf(out, 32, "%.17g", x);
    char dig[17];
    for (int k = 16; k >= 0; k--) { dig[k] = (char)('0' + D % 10); D /= 10; }
    int nd = 17, at = 0;                 /* %g drops trailing zeros (and a bare point) */
    while (nd > 1 && dig[nd - 1] == '0') nd--;
    if (x < 0) out[at++] = '-';
    if (X < -4 || X >= 17) {             /* d.ddde+XX */
        out[at++] = dig[0];
        if (nd > 1) {
            out[at++] = '.';
            memcpy(out + at, dig + 1, (size_t)(nd - 1)); at += nd - 1;
        }
        out[at++] = 'e';
        out[at++] = X < 0 ? '-' : '+';
        int magnitude = X < 0 ? -X : X;            /* two digits at least */
        if (magnitude < 10) out[at++] = '0';
        at += format_int(magnitude, out + at);
    } else if (X >= 0) {                 /* ddd.ddd */
        memcpy(out + at, dig, (size_t)(X + 1)); at += X + 1;
        if (nd > X + 1) {
            out[at++] = '.';
            memcpy(out + at, dig + X + 1, (size_t)(nd - X - 1)); at += nd - X - 1;
        }
    } else {                             /* 0.000ddd */
        out[at++] = '0'; out[at++] = '.';
        for (int k = 0; k < -X - 1; k++) out[at++] = '0';
        memcpy(out + at, dig, (size_t)nd); at += nd;
    }
    return at;
}

/* The CSV text of one stats row "max,min,mean,l2norm,nan,pos,neg": the floats with 17
 * significant digits (they read back exactly), the counts as integers; the same text as
 * kernels.stats_text's numpy path. Returns its length (at most STATS_LINE - 1). */
#define STATS_LINE 256
static int format_stats(const double *v, char *line)
{
    int at = 0;
    for (int k = 0; k < 7; k++) {
        double x = v[k];
        if (k) line[at++] = ',';
        if (k >= 4)
            at += format_int((long long)x, line + at);
        else if (x != x) {                  /* never "-nan" */
            memcpy(line + at, "nan", 3); at += 3;
        } else
            at += format_g17(x, line + at);
    }
    return at;
}

/* Formatting a full-precision double costs about a microsecond whatever does it, and a
 * step's index has thousands: done here without the GIL, the training thread runs meanwhile. */
static PyObject *py_stats_text(PyObject *self, PyObject *args)
{
    Py_buffer in;
    if (!PyArg_ParseTuple(args, "y*", &in)) return NULL;
    if (in.len % (7 * sizeof(double))) {
        PyBuffer_Release(&in);
        PyErr_SetString(PyExc_ValueError, "stats_text: 7 float64 per row");
        return NULL;
    }
    Py_ssize_t rows = in.len / (7 * sizeof(double));
    const double *v = (const double *)in.buf;
    char *text = PyMem_RawMalloc((size_t)(rows ? rows : 1) * STATS_LINE);
    int *length = PyMem_RawMalloc((size_t)(rows ? rows : 1) * sizeof(int));
    if (!text || !length) {
        PyMem_RawFree(text); PyMem_RawFree(length); PyBuffer_Release(&in);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows; r++)
        length[r] = format_stats(v + 7 * r, text + r * STATS_LINE);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&in);
    PyObject *out = PyList_New(rows);
    for (Py_ssize_t r = 0; out && r < rows; r++) {
        PyObject *line = PyUnicode_FromStringAndSize(text + r * STATS_LINE, length[r]);
        if (!line) Py_CLEAR(out);
        else PyList_SET_ITEM(out, r, line);
    }
    PyMem_RawFree(text);
    PyMem_RawFree(length);
    return out;
}

/* ---- a dump step's index ------------------------------------------------------------- */

/* What index_text needs, taken from Python objects with the GIL (index_parse) so that
 * index_run can work without it, in this thread or in the writer's. The statistics of an
 * array given as None are already in `stats` (the caller computed them, for a kind this
 * module does not take). */
typedef struct {
    PyObject *seq;                  /* the arrays */
    Py_buffer *views;
    char *kinds;
    Py_ssize_t n, got, width;       /* width: 7 or 8 float64 a row of stats (8: the size too) */
    Py_buffer stats, stamps, literal, cuts, refs;
    int held;                       /* how many of the five buffers above are held */
} Index;

static void index_release(Index *x)
{
    for (Py_ssize_t k = 0; k < x->got; k++) if (x->views[k].obj) PyBuffer_Release(&x->views[k]);
    PyMem_Free(x->views);
    PyMem_Free(x->kinds);
    Py_buffer *b[5] = {&x->stats, &x->stamps, &x->literal, &x->cuts, &x->refs};
    for (int i = 0; i < x->held; i++) PyBuffer_Release(b[i]);
    Py_XDECREF(x->seq);
    memset(x, 0, sizeof *x);
}

static int index_parse(Index *x, PyObject *arrays, PyObject *kinds_obj, PyObject *stats,
                       PyObject *stamps, PyObject *literal, PyObject *cuts, PyObject *refs)
{
    memset(x, 0, sizeof *x);
    PyObject *objs[5] = {stats, stamps, literal, cuts, refs};
    Py_buffer *b[5] = {&x->stats, &x->stamps, &x->literal, &x->cuts, &x->refs};
    for (; x->held < 5; x->held++)
        if (PyObject_GetBuffer(objs[x->held], b[x->held],
                               x->held ? PyBUF_SIMPLE : PyBUF_WRITABLE) < 0) goto fail;
    const char *kinds;
    Py_ssize_t nkinds;
    if (PyBytes_Check(kinds_obj)) {
        kinds = PyBytes_AS_STRING(kinds_obj);
        nkinds = PyBytes_GET_SIZE(kinds_obj);
    } else if (!(kinds = PyUnicode_AsUTF8AndSize(kinds_obj, &nkinds))) goto fail;
    x->seq = PySequence_Fast(arrays, "arrays must be a sequence");
    if (!x->seq) goto fail;
    x->n = PySequence_Fast_GET_SIZE(x->seq);
    Py_ssize_t nrefs = x->refs.len / 8, nstamps = x->stamps.len / 8;
    const int64_t *ref = x->refs.buf, *cut = x->cuts.buf;
    x->width = x->n && x->stats.len == (Py_ssize_t)(x->n * 8 * sizeof(double)) ? 8 : 7;
    if (nkinds != x->n || x->stats.len != (Py_ssize_t)(x->n * x->width * sizeof(double)) ||
        x->refs.len % 8 || x->stamps.len % 8 || x->cuts.len != (nrefs + 1) * 8) {
        PyErr_SetString(PyExc_ValueError, "index_text: one kind and 7 (or 8) stats per array, "
                        "int64 stamps and refs, one cut more than refs");
        goto fail;
    }
    for (Py_ssize_t k = 0; k <= nrefs; k++)
        if (cut[k] < 0 || cut[k] > x->literal.len || (k && cut[k] < cut[k - 1])) {
            PyErr_SetString(PyExc_ValueError, "index_text: cuts outside the literal");
            goto fail;
        }
    for (Py_ssize_t k = 0; k < nrefs; k++)
        if (ref[k] >= nstamps || -1 - ref[k] >= x->n) {
            PyErr_SetString(PyExc_ValueError, "index_text: a ref names no stamp or array");
            goto fail;
        }
    x->views = PyMem_Calloc(x->n ? x->n : 1, sizeof(Py_buffer));
    x->kinds = PyMem_Malloc(x->n ? x->n : 1);
    if (!x->views || !x->kinds) { PyErr_NoMemory(); goto fail; }
    memcpy(x->kinds, kinds, (size_t)x->n);
    for (x->got = 0; x->got < x->n; x->got++) {
        PyObject *item = PySequence_Fast_GET_ITEM(x->seq, x->got);
        if (item != Py_None && get_buffer(item, kinds[x->got], -1, &x->views[x->got]) < 0)
            goto fail;
    }
    return 0;
fail:
    index_release(x);
    return -1;
}

/* Working memory of index_run, kept from step to step by the writer thread: allocating it
 * anew each step (text of a few hundred KB: mmap'd) would map and unmap it each step, and
 * unmapping interrupts every core the process runs on. */
typedef struct {
    char *lines, *text;
    int *length;
    size_t nlines, ntext;
} Scratch;

static void scratch_free(Scratch *s)
{
    PyMem_RawFree(s->lines);
    PyMem_RawFree(s->text);
    PyMem_RawFree(s->length);
    memset(s, 0, sizeof *s);
}

/* Each array's statistics into stats, and the text; returns its length (the text is
 * s->text), -1 when out of memory. No GIL needed. */
static Py_ssize_t index_run(const Index *x, Scratch *s)
{
    Py_ssize_t n = x->n, nrefs = x->refs.len / 8, at = 0;
    const int64_t *ref = x->refs.buf, *cut = x->cuts.buf, *stamp = x->stamps.buf;
    const char *lit = x->literal.buf;
    /* the largest text: every ref a stats line (a stamp is shorter) */
    size_t nlines = (size_t)(n ? n : 1), ntext = (size_t)x->literal.len + (size_t)nrefs * STATS_LINE + 1;
    if (nlines > s->nlines) {
        char *lines = PyMem_RawRealloc(s->lines, nlines * STATS_LINE);
        int *length = lines ? PyMem_RawRealloc(s->length, nlines * sizeof(int)) : NULL;
        if (lines) s->lines = lines;
        if (length) s->length = length;
        if (!lines || !length) return -1;
        s->nlines = nlines;
    }
    if (ntext > s->ntext) {
        char *text = PyMem_RawRealloc(s->text, ntext);
        if (!text) return -1;
        s->text = text;
        s->ntext = ntext;
    }
    char *lines = s->lines, *text = s->text;
    int *length = s->length;
    double *o = (double *)x->stats.buf;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (x->views[k].obj)          /* None: its statistics are given */
            tensor_stats(x->views[k].buf, x->kinds[k], x->views[k].len / itemsize(x->kinds[k]),
                         o + x->width * k);
        length[k] = format_stats(o + x->width * k, lines + k * STATS_LINE);
    }
    for (Py_ssize_t k = 0; k <= nrefs; k++) {
        Py_ssize_t end = k < nrefs ? cut[k + 1] : x->literal.len;
        memcpy(text + at, lit + cut[k], (size_t)(end - cut[k]));
        at += end - cut[k];
        if (k == nrefs) break;
        if (ref[k] >= 0) {
            at += format_int((long long)stamp[ref[k]], text + at);
        } else {
            memcpy(text + at, lines + (-1 - ref[k]) * STATS_LINE, (size_t)length[-1 - ref[k]]);
            at += length[-1 - ref[k]];
        }
    }
    return at;
}

/* index_text(arrays, kinds, stats, stamps, literal, cuts, refs) -> bytes: a dump step's
 * whole index in one call without the GIL. Each array's statistics go into `stats` (7
 * float64 per array, as stats() writes them; or 8, the eighth left alone, as a statistics
 * table's rows hold them with the size); the text is the template's literal pieces
 * (piece i starts at cuts[i] and ends where the next starts, the last at the literal's end)
 * with, between piece i and i+1, refs[i] filled in: a stamp (refs[i] >= 0: stamps[refs[i]]
 * in decimal) or an array's statistics (refs[i] < 0: the CSV fields of array -1 - refs[i]).
 * The template is the same from step to step; only the stamps and the values change. */
static PyObject *py_index_text(PyObject *self, PyObject *args)
{
    PyObject *arrays, *kinds, *stats, *stamps, *literal, *cuts, *refs, *result = NULL;
    if (!PyArg_ParseTuple(args, "OOOOOOO", &arrays, &kinds, &stats, &stamps, &literal, &cuts,
                          &refs)) return NULL;
    Index x;
    if (index_parse(&x, arrays, kinds, stats, stamps, literal, cuts, refs) < 0) return NULL;
    Scratch scratch = {0};
    Py_ssize_t len;
    Py_BEGIN_ALLOW_THREADS
    len = index_run(&x, &scratch);
    Py_END_ALLOW_THREADS
    if (len < 0) PyErr_NoMemory();
    else result = PyBytes_FromStringAndSize(scratch.text, len);
    scratch_free(&scratch);
    index_release(&x);
    return result;
}

/* ---- files --------------------------------------------------------------------------- */

static int write_all(int fd, const char *data, Py_ssize_t n)
{
    while (n > 0) {
        ssize_t done = write(fd, data, (size_t)n);
        if (done < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        data += done;
        n -= done;
    }
    return 0;
}

/* float32 bits -> float16 bits, as numpy's own conversion does: rounding to nearest even,
 * overflow to inf, gradual underflow to subnormals and zero; a nan keeps its sign and the
 * top ten bits of its payload (a nan that came from a float16 comes back as it was), made
 * nonzero where they are all zero so that it stays a nan. */
static inline uint16_t float_to_half_bits(uint32_t f)
{
    uint16_t sign = (uint16_t)((f >> 16) & 0x8000);
    uint32_t exp = (f >> 23) & 0xff, mant = f & 0x7fffff;
    if (exp == 0xff)
        return sign | (mant ? (uint16_t)(0x7c00 | ((mant >> 13) ? (mant >> 13) : 1)) : 0x7c00);
    if (exp >= 143)                       /* |x| >= 2^16: beyond every half */
        return sign | 0x7c00;
    if (exp >= 113) {                     /* a normal half: exponent exp - 112 */
        uint32_t h = ((exp - 112) << 10) | (mant >> 13), rest = mant & 0x1fff;
        if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;   /* may carry up to inf */
        return sign | (uint16_t)h;
    }
    if (exp < 102)                        /* below half the smallest subnormal: zero */
        return sign;
    uint32_t m = mant | 0x800000, shift = 126 - exp;       /* units of 2^-24 */
    uint32_t h = m >> shift, rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (h & 1))) h++;
    return sign | (uint16_t)h;
}

CLONES static void floats_to_halves(const uint32_t *src, Py_ssize_t n, uint16_t *dst)
{
    Py_ssize_t i = use_simd() ? halves_simd((const float *)src, n, dst) : 0;
    for (; i < n; i++) dst[i] = float_to_half_bits(src[i]);
}

/* float32 values onto the float16 ('e') or bfloat16 ('b') grid, held in float32, as
 * numerics.quantize rounds them (to nearest even; float16 with subnormals and inf beyond its
 * range; a nan becomes the positive quiet nan); then, where saturation is asked and some
 * result is an inf or a nan, inf becomes the dtype's max (signed) and nan 0, as
 * numerics.saturate. Returns whether a result was an inf or a nan before saturation. */
CLONES static int grid_values(const float *src, Py_ssize_t n, char kind, int saturation, float *dst)
{
    int bad = 0;
    Py_ssize_t i = use_simd() ? grid_simd(src, n, kind, dst, &bad) : 0;
    const uint32_t *u = (const uint32_t *)src;
    for (; i < n; i++) {
        float r;
        if (src[i] != src[i]) r = as_float(0x7fc00000u);
        else if (kind == 'e') r = half_to_float(float_to_half_bits(u[i]));
        else r = as_float((u[i] + 0x7fffu + ((u[i] >> 16) & 1u)) & 0xffff0000u);
        bad |= !(fabsf(r) <= FLT_MAX);
        dst[i] = r;
    }
    if (bad && saturation) {
        float max = kind == 'e' ? (float)FP16_MAX : as_float(0x7f7f0000u);    /* bfloat16's max */
        for (i = 0; i < n; i++) {
            float r = dst[i];
            if (r != r) dst[i] = 0.0f;
            else if (fabsf(r) > FLT_MAX) dst[i] = copysignf(max, r);
        }
    }
    return bad;
}

/* Whether every one of n float32 is finite: x * 0 is 0 for a finite x, nan otherwise. */
CLONES static int all_finite(const float *x, Py_ssize_t n)
{
    float check = 0.0f;
    Py_ssize_t i;
#pragma omp simd reduction(+:check)
    for (i = 0; i < n; i++) check += x[i] * 0.0f;
    return check == check;
}

/* grid(x, out, kind, saturation, stats=None): kind 'e' or 'b' rounds x into out (see
 * grid_values); kind 'f' (x already float32, out None) only looks at x. stats, when given,
 * takes 8 float64: tensor_stats of the result (out, or x for 'f'), as stats() gives them,
 * and its element count: a dump of statistics gets them while the result is in cache. For
 * 'f' with saturation and an inf or nan, stats is left alone: the caller saturates a copy.
 * Returns whether a result was inf or nan before saturation. */
static PyObject *py_grid(PyObject *self, PyObject *args)
{
    PyObject *xo, *outo, *statso = Py_None;
    const char *k;
    Py_ssize_t nk;
    int saturation;
    Py_buffer x, out = {0}, st = {0};
    if (!PyArg_ParseTuple(args, "OOs#p|O", &xo, &outo, &k, &nk, &saturation, &statso)) return NULL;
    if (nk != 1 || (k[0] != 'e' && k[0] != 'b' && k[0] != 'f')) {
        PyErr_SetString(PyExc_ValueError, "kind: 'e' (float16), 'b' (bfloat16) or 'f' (float32)");
        return NULL;
    }
    if ((k[0] == 'f') != (outo == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "out: None for kind 'f', an array otherwise");
        return NULL;
    }
    if (get_buffer(xo, 'f', -1, &x) < 0) return NULL;
    if (outo != Py_None && PyObject_GetBuffer(outo, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        goto fail;
    if (statso != Py_None && PyObject_GetBuffer(statso, &st, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        goto fail;
    if ((out.obj && out.len != x.len) || (st.obj && st.len != 8 * sizeof(double))) {
        PyErr_SetString(PyExc_ValueError, "out: as many float32 as x; stats: 8 float64");
        goto fail;
    }
    Py_ssize_t n = x.len / 4;
    double *row = st.obj ? st.buf : NULL;
    int bad;
    PyThreadState *released = n >= GRID_GIL ? PyEval_SaveThread() : NULL;
    if (k[0] == 'f' && !row) {
        bad = !all_finite(x.buf, n);
    } else if (k[0] == 'f') {
        tensor_stats(x.buf, 'f', n, row);
        bad = row[4] + row[5] + row[6] > 0;
        row[7] = (double)n;
    } else {
        bad = grid_values(x.buf, n, k[0], saturation, out.buf);
        if (row) {
            tensor_stats(out.buf, 'f', n, row);
            row[7] = (double)n;
        }
    }
    if (released) PyEval_RestoreThread(released);
    PyBuffer_Release(&x);
    if (out.obj) PyBuffer_Release(&out);
    if (st.obj) PyBuffer_Release(&st);
    return PyBool_FromLong(bad);
fail:
    PyBuffer_Release(&x);
    if (out.obj) PyBuffer_Release(&out);
    if (st.obj) PyBuffer_Release(&st);
    return NULL;
}

/* write as float16 the float32 array (n elements) in chunks: memory stays small */
#define HALF_CHUNK 16384
static int write_halves(int fd, const uint32_t *src, Py_ssize_t n)
{
    uint16_t chunk[HALF_CHUNK];
    for (Py_ssize_t at = 0; at < n; at += HALF_CHUNK) {
        Py_ssize_t m = MIN(n - at, HALF_CHUNK);
        floats_to_halves(src + at, m, chunk);
        if (write_all(fd, (const char *)chunk, m * 2) < 0) return -1;
    }
    return 0;
}

/* Write the parts (a header, then the data pieces) to fd, in as few writev calls as the
 * kernel takes. */
static int write_parts(int fd, struct iovec *v, int n)
{
    while (n > 0) {
        ssize_t done = writev(fd, v, n < 1024 ? n : 1024);
        if (done < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        while (n > 0 && (size_t)done >= v->iov_len) { done -= (ssize_t)v->iov_len; v++; n--; }
        if (n > 0) { v->iov_base = (char *)v->iov_base + done; v->iov_len -= (size_t)done; }
    }
    return 0;
}

static int new_file(const char *path)
{
    return open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
}

static int write_file(const char *path, struct iovec *v, int n)
{
    int fd = new_file(path);
    if (fd < 0) return -1;
    int bad = write_parts(fd, v, n) < 0, error = errno;
    if (close(fd) < 0 && !bad) return -1;
    errno = error;
    return bad ? -1 : 0;
}

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    return remove(path) < 0 ? -1 : 0;
}

/* rm -r path (not following links) */
static int remove_tree(const char *path)
{
    return nftw(path, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* An empty directory at path: what an interrupted dump left there is removed; missing
 * parents are made. */
static int fresh_directory(const char *path)
{
    if (mkdir(path, 0777) == 0) return 0;
    if (errno == EEXIST) {
        if (remove_tree(path) < 0) return -1;
        return mkdir(path, 0777);
    }
    if (errno != ENOENT) return -1;
    size_t len = strlen(path);
    char *p = malloc(len + 1);
    if (!p) return -1;
    memcpy(p, path, len + 1);
    for (size_t i = 1; i < len; i++) {
        if (p[i] != '/') continue;
        p[i] = 0;
        if (mkdir(p, 0777) < 0 && errno != EEXIST) { free(p); return -1; }
        p[i] = '/';
    }
    free(p);
    return mkdir(path, 0777);
}

/* rename src to dst; a directory already at dst (a replayed step dumped again into a named
 * run) is moved aside first and removed once src is in its place */
static int replace_dir(const char *src, const char *dst)
{
    if (rename(src, dst) == 0) return 0;
    if (errno != ENOTEMPTY && errno != EEXIST) return -1;
    size_t len = strlen(dst);
    char *aside = malloc(len + 16);
    if (!aside) return -1;
    snprintf(aside, len + 16, "%s.replaced", dst);
    remove_tree(aside);                 /* what an interrupted replacement left */
    int bad = rename(dst, aside) < 0 || rename(src, dst) < 0, error = errno;
    if (!bad) remove_tree(aside);
    free(aside);
    errno = error;
    return bad ? -1 : 0;
}

/* A set of files taken from Python objects with the GIL (files_parse), written without it
 * (files_write, then files_rename): directories made first, then links, files, and renames
 * last. Paths are held
 * as bytes objects (immutable: readable without the GIL). */
typedef struct {
    Py_ssize_t n, got, nparts, partsgot, ndirs, dirsgot, nl, lgot, nr, rgot;
    PyObject **names, **dirs, **lnames, **rnames;
    Py_buffer *heads, *parts, *lbodies;
    Py_ssize_t *first;          /* file k's pieces: parts[first[k] .. first[k + 1]) */
    char *converts;             /* NULL: every file as it is */
    Py_ssize_t widest;          /* most pieces of a file, plus its header */
} Files;

static void files_release(Files *f)
{
    for (Py_ssize_t k = 0; k < f->got; k++) {
        Py_XDECREF(f->names[k]);
        PyBuffer_Release(&f->heads[k]);
    }
    for (Py_ssize_t k = 0; k < f->partsgot; k++) PyBuffer_Release(&f->parts[k]);
    for (Py_ssize_t k = 0; k < f->dirsgot; k++) Py_XDECREF(f->dirs[k]);
    for (Py_ssize_t k = 0; k < f->lgot; k++) {
        Py_XDECREF(f->lnames[2 * k]);
        Py_XDECREF(f->lnames[2 * k + 1]);
        PyBuffer_Release(&f->lbodies[k]);
    }
    for (Py_ssize_t k = 0; k < f->rgot; k++) {
        Py_XDECREF(f->rnames[2 * k]);
        Py_XDECREF(f->rnames[2 * k + 1]);
    }
    PyMem_Free(f->names); PyMem_Free(f->dirs); PyMem_Free(f->lnames); PyMem_Free(f->rnames);
    PyMem_Free(f->heads); PyMem_Free(f->parts); PyMem_Free(f->lbodies);
    PyMem_Free(f->first); PyMem_Free(f->converts);
    memset(f, 0, sizeof *f);
}

/* Two paths of a (src, dst[, contents]) tuple as file system bytes. */
static int fs_pair(PyObject *item, Py_ssize_t want, PyObject **out)
{
    PyObject *seq = PySequence_Fast(item, "links and renames are tuples of paths");
    if (!seq) return -1;
    if (PySequence_Fast_GET_SIZE(seq) != want) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "a link is (src, dst, contents), a rename (src, dst)");
        return -1;
    }
    for (Py_ssize_t k = 0; k < 2; k++)
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(seq, k), &out[k])) {
            if (k) Py_CLEAR(out[0]);
            Py_DECREF(seq);
            return -1;
        }
    Py_DECREF(seq);
    return 0;
}

static PyObject *fast_or_empty(PyObject *obj, const char *what)
{
    return obj && obj != Py_None ? PySequence_Fast(obj, what) : PyTuple_New(0);
}

static int files_parse(Files *f, PyObject *paths, PyObject *headers, PyObject *arrays,
                       PyObject *converts_obj, PyObject *links, PyObject *renames, PyObject *dirs)
{
    memset(f, 0, sizeof *f);
    PyObject *p = PySequence_Fast(paths, "paths"), *h = PySequence_Fast(headers, "headers"),
             *a = PySequence_Fast(arrays, "arrays"), *l = fast_or_empty(links, "links"),
             *r = fast_or_empty(renames, "renames"), *d = fast_or_empty(dirs, "dirs");
    int ok = 0;
    Py_ssize_t k;
    if (!p || !h || !a || !l || !r || !d) goto done;
    f->n = PySequence_Fast_GET_SIZE(p);
    f->nl = PySequence_Fast_GET_SIZE(l);
    f->nr = PySequence_Fast_GET_SIZE(r);
    f->ndirs = PySequence_Fast_GET_SIZE(d);
    const char *converts = NULL;
    Py_ssize_t nconverts = 0;
    if (converts_obj && converts_obj != Py_None &&
        !(converts = PyUnicode_AsUTF8AndSize(converts_obj, &nconverts))) goto done;
    if (PySequence_Fast_GET_SIZE(h) != f->n || PySequence_Fast_GET_SIZE(a) != f->n ||
        (converts && nconverts != f->n)) {
        PyErr_SetString(PyExc_ValueError, "write_files: one header, one array (and one "
                        "conversion) per path");
        goto done;
    }
    for (k = 0; converts && k < f->n; k++)
        if (converts[k] != '.' && converts[k] != 'e') {
            PyErr_SetString(PyExc_ValueError, "write_files: conversions are '.' or 'e'");
            goto done;
        }
    f->widest = 1;
    for (k = 0; k < f->n; k++) {
        PyObject *item = PySequence_Fast_GET_ITEM(a, k);
        Py_ssize_t m = PyTuple_Check(item) ? PyTuple_GET_SIZE(item) : 1;
        if (PyTuple_Check(item) && converts && converts[k] == 'e') {
            PyErr_SetString(PyExc_ValueError, "write_files: 'e' converts one array, not a tuple");
            goto done;
        }
        f->nparts += m;
        f->widest = MAX(f->widest, m + 1);
    }
    f->names = PyMem_Calloc(f->n ? f->n : 1, sizeof(PyObject *));
    f->heads = PyMem_Calloc(f->n ? f->n : 1, sizeof(Py_buffer));
    f->parts = PyMem_Calloc(f->nparts ? f->nparts : 1, sizeof(Py_buffer));
    f->first = PyMem_Calloc(f->n + 1, sizeof(Py_ssize_t));
    f->dirs = PyMem_Calloc(f->ndirs ? f->ndirs : 1, sizeof(PyObject *));
    f->lnames = PyMem_Calloc(2 * (f->nl ? f->nl : 1), sizeof(PyObject *));
    f->lbodies = PyMem_Calloc(f->nl ? f->nl : 1, sizeof(Py_buffer));
    f->rnames = PyMem_Calloc(2 * (f->nr ? f->nr : 1), sizeof(PyObject *));
    if (converts) f->converts = PyMem_Malloc((size_t)f->n + 1);
    if (!f->names || !f->heads || !f->parts || !f->first || !f->dirs || !f->lnames ||
        !f->lbodies || !f->rnames || (converts && !f->converts)) {
        PyErr_NoMemory();
        goto done;
    }
    if (converts) memcpy(f->converts, converts, (size_t)f->n);
    for (f->got = 0; f->got < f->n; f->got++) {
        PyObject *item = PySequence_Fast_GET_ITEM(a, f->got);
        f->first[f->got] = f->partsgot;
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(p, f->got), &f->names[f->got]))
            goto done;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(h, f->got), &f->heads[f->got],
                               PyBUF_SIMPLE) < 0) {
            Py_CLEAR(f->names[f->got]);
            goto done;
        }
        Py_ssize_t m = PyTuple_Check(item) ? PyTuple_GET_SIZE(item) : 1;
        for (Py_ssize_t i = 0; i < m; i++) {
            PyObject *piece = PyTuple_Check(item) ? PyTuple_GET_ITEM(item, i) : item;
            if (PyObject_GetBuffer(piece, &f->parts[f->partsgot], PyBUF_C_CONTIGUOUS) < 0) {
                f->got++;           /* its name and header are released with the rest */
                goto done;
            }
            f->partsgot++;
        }
        if (converts && converts[f->got] == 'e' &&
            (f->parts[f->first[f->got]].itemsize != 4 || f->parts[f->first[f->got]].len % 4)) {
            f->got++;
            PyErr_SetString(PyExc_ValueError, "write_files: 'e' converts float32 arrays only");
            goto done;
        }
    }
    f->first[f->n] = f->partsgot;
    for (f->dirsgot = 0; f->dirsgot < f->ndirs; f->dirsgot++)
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(d, f->dirsgot), &f->dirs[f->dirsgot]))
            goto done;
    for (f->lgot = 0; f->lgot < f->nl; f->lgot++) {
        PyObject *link = PySequence_Fast_GET_ITEM(l, f->lgot), *body;
        if (fs_pair(link, 3, &f->lnames[2 * f->lgot]) < 0) goto done;
        body = PySequence_GetItem(link, 2);
        if (!body || PyObject_GetBuffer(body, &f->lbodies[f->lgot], PyBUF_SIMPLE) < 0) {
            Py_XDECREF(body);
            Py_CLEAR(f->lnames[2 * f->lgot]);
            Py_CLEAR(f->lnames[2 * f->lgot + 1]);
            goto done;
        }
        Py_DECREF(body);
    }
    for (f->rgot = 0; f->rgot < f->nr; f->rgot++)
        if (fs_pair(PySequence_Fast_GET_ITEM(r, f->rgot), 2, &f->rnames[2 * f->rgot]) < 0)
            goto done;
    ok = 1;
done:
    Py_XDECREF(p); Py_XDECREF(h); Py_XDECREF(a); Py_XDECREF(l); Py_XDECREF(r); Py_XDECREF(d);
    if (!ok) files_release(f);
    return ok ? 0 : -1;
}

/* Directories, links, files (the renames: files_rename): the first failure stops it, and its
 * path (owned by f) and errno are returned through *failed and *error. No GIL needed. 0 on
 * success. */
static int files_write(const Files *f, const char **failed, int *error)
{
    Py_ssize_t k;
    struct iovec stack[8], *iov = f->widest <= 8 ? stack : malloc(f->widest * sizeof *iov);
    *failed = NULL;
    if (!iov) { *error = ENOMEM; *failed = f->n ? PyBytes_AS_STRING(f->names[0]) : ""; return -1; }
#define FAIL(path) do { *failed = (path); *error = errno; goto out; } while (0)
    for (k = 0; k < f->ndirs; k++)
        if (fresh_directory(PyBytes_AS_STRING(f->dirs[k])) < 0) FAIL(PyBytes_AS_STRING(f->dirs[k]));
    for (k = 0; k < f->nl; k++) {
        const char *dst = PyBytes_AS_STRING(f->lnames[2 * k + 1]);
        if (link(PyBytes_AS_STRING(f->lnames[2 * k]), dst) == 0) continue;
        iov[0] = (struct iovec){f->lbodies[k].buf, (size_t)f->lbodies[k].len};
        if (write_file(dst, iov, 1) < 0) FAIL(dst);
    }
    for (k = 0; k < f->n; k++) {
        const char *path = PyBytes_AS_STRING(f->names[k]);
        if (f->converts && f->converts[k] == 'e') {
            int fd = new_file(path);
            if (fd < 0) FAIL(path);
            int bad = write_all(fd, f->heads[k].buf, f->heads[k].len) < 0 ||
                      write_halves(fd, f->parts[f->first[k]].buf, f->parts[f->first[k]].len / 4) < 0;
            int keep = errno;
            if (close(fd) < 0 && !bad) FAIL(path);
            errno = keep;
            if (bad) FAIL(path);
            continue;
        }
        int m = 0;
        iov[m++] = (struct iovec){f->heads[k].buf, (size_t)f->heads[k].len};
        for (Py_ssize_t i = f->first[k]; i < f->first[k + 1]; i++)
            iov[m++] = (struct iovec){f->parts[i].buf, (size_t)f->parts[i].len};
        if (write_file(path, iov, m) < 0) FAIL(path);
    }
#undef FAIL
out:
    if (iov != stack) free(iov);
    return *failed ? -1 : 0;
}

/* The renames, last (files_write first): the same failure reporting. */
static int files_rename(const Files *f, const char **failed, int *error)
{
    *failed = NULL;
    for (Py_ssize_t k = 0; k < f->nr; k++)
        if (replace_dir(PyBytes_AS_STRING(f->rnames[2 * k]),
                        PyBytes_AS_STRING(f->rnames[2 * k + 1])) < 0) {
            *failed = PyBytes_AS_STRING(f->rnames[2 * k + 1]);
            *error = errno;
            return -1;
        }
    return 0;
}

static PyObject *os_error(int error, const char *path)
{
    PyObject *name = PyUnicode_DecodeFSDefault(path);
    errno = error;
    if (name) PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, name);
    Py_XDECREF(name);
    return NULL;
}

/* write_files(paths, headers, arrays[, converts[, links[, renames[, dirs]]]]): each file is
 * its header then its array's bytes, all written with the GIL released (a tensor dump
 * writes hundreds of files a step, and the training thread needs the GIL meanwhile). An
 * array may be a tuple of buffers, written back to back. converts, one character per file:
 * '.' the bytes as they are, 'e' a float32 array written as float16 (the NPU's fp16 values
 * are held in float32; converting here saves an astype per tensor). dirs, made first, are
 * empty directories (whatever was there is removed); links, (src, dst, contents) each, come
 * next: dst becomes a hard link to src, or where that fails a new file holding contents.
 * renames, (src, dst) each, come last, once every file is written: that is how a dump's
 * partial directory appears whole (a directory already at dst is replaced). The first
 * failure raises OSError naming its path and nothing after it is done. */
static PyObject *py_write_files(PyObject *self, PyObject *args)
{
    PyObject *paths, *headers, *arrays, *converts = NULL, *links = NULL, *renames = NULL,
             *dirs = NULL;
    if (!PyArg_ParseTuple(args, "OOO|OOOO", &paths, &headers, &arrays, &converts, &links,
                          &renames, &dirs))
        return NULL;
    Files f;
    if (files_parse(&f, paths, headers, arrays, converts, links, renames, dirs) < 0) return NULL;
    const char *failed;
    int error, bad;
    Py_BEGIN_ALLOW_THREADS
    bad = files_write(&f, &failed, &error) < 0 || files_rename(&f, &failed, &error) < 0;
    Py_END_ALLOW_THREADS
    PyObject *result = bad ? os_error(error, failed) : (Py_INCREF(Py_None), Py_None);
    files_release(&f);
    return result;
}

/* ---- the dump's writer thread --------------------------------------------------------- */

/* One step: an index (its statistics and text, written to index_path) and a set of files,
 * parsed with the GIL by submit(), written by the thread without it, and released with the
 * GIL again by done(). */
typedef struct Job {
    struct Job *next;
    long long ticket;
    int has_index;
    Index index;
    PyObject *index_path;           /* bytes */
    Files files;
    int error;                      /* errno of the failure, 0 when written */
    const char *failed;             /* its path (owned by the job), NULL when written */
    int skipped;                    /* not written: an earlier job had failed */
} Job;

typedef struct {
    PyObject_HEAD
    pthread_t thread;
    int started, stop, failed;
    pthread_mutex_t lock;
    pthread_cond_t work, room;      /* the thread waits for work, submit() and flush() for room */
    Job *queue, *queue_tail, *done, *done_tail;
    Py_ssize_t pending, max_pending;
    long long tickets;
} Writer;

static void job_free(Job *j)
{
    if (j->has_index) index_release(&j->index);
    Py_XDECREF(j->index_path);
    files_release(&j->files);
    PyMem_RawFree(j);
}

/* The thread's part of a step: its directories, links and files, then its index, then the
 * renames, so that a directory appears whole, index included. */
static void job_run(Job *j, Scratch *scratch)
{
    if (files_write(&j->files, &j->failed, &j->error) < 0) return;
    if (j->has_index) {
        Py_ssize_t len = index_run(&j->index, scratch);
        const char *path = PyBytes_AS_STRING(j->index_path);
        struct iovec one = {scratch->text, (size_t)(len > 0 ? len : 0)};
        if (len < 0) { j->failed = path; j->error = ENOMEM; return; }
        if (write_file(path, &one, 1) < 0) { j->failed = path; j->error = errno; return; }
    }
    files_rename(&j->files, &j->failed, &j->error);
}

/* How the idle thread looks for work: submit(..., wake=False) queues a step without waking
 * it, since waking a sleeping thread costs the waker a system call and an interrupt to the
 * other core (18-25 us on a virtual machine, where the interrupt leaves the guest), and the
 * training thread is the waker: worth it for a step of tensor files, whose writing may take
 * as long as a training step, not for a statistics step's few small files. The thread looks
 * again after 1 ms, then after twice as long each time it finds nothing, up to 64 ms; a step
 * found resets it. A queue that is full (back-pressure), flush() and close() wake it. */
#define POLL_FIRST_NS 1000000L
#define POLL_LAST_NS 64000000L

static void wait_for_work(Writer *w, long *poll)
{
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_nsec += *poll;
    until.tv_sec += until.tv_nsec / 1000000000L;
    until.tv_nsec %= 1000000000L;
    if (pthread_cond_timedwait(&w->work, &w->lock, &until) == ETIMEDOUT && !w->queue)
        *poll = MIN(2 * *poll, POLL_LAST_NS);
}

static void *writer_main(void *arg)
{
    Writer *w = arg;
    Scratch scratch = {0};
    long poll = POLL_FIRST_NS;
    pthread_mutex_lock(&w->lock);
    for (;;) {
        while (!w->queue && !w->stop) wait_for_work(w, &poll);
        if (!w->queue) break;
        poll = POLL_FIRST_NS;
        Job *j = w->queue;
        w->queue = j->next;
        if (!w->queue) w->queue_tail = NULL;
        int skip = w->failed;
        pthread_mutex_unlock(&w->lock);
        if (skip) j->skipped = 1;
        else job_run(j, &scratch);
        pthread_mutex_lock(&w->lock);
        if (j->failed) w->failed = 1;
        j->next = NULL;
        if (w->done_tail) w->done_tail->next = j;
        else w->done = j;
        w->done_tail = j;
        w->pending--;
        pthread_cond_broadcast(&w->room);
    }
    pthread_mutex_unlock(&w->lock);
    scratch_free(&scratch);
#ifdef __linux__
    /* a joined thread stays listed in /proc for a moment while the kernel finishes its exit:
     * renamed first, it is not taken for a running writer (native.writer_running) */
    pthread_setname_np(pthread_self(), "pt-dump-ended");
#endif
    return NULL;
}

static PyObject *Writer_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Py_ssize_t max_pending = 2;
    if (!PyArg_ParseTuple(args, "|n", &max_pending)) return NULL;
    if (max_pending < 1) {
        PyErr_SetString(PyExc_ValueError, "Writer: max_pending must be at least 1");
        return NULL;
    }
    Writer *w = (Writer *)type->tp_alloc(type, 0);
    if (!w) return NULL;
    w->max_pending = max_pending;
    pthread_condattr_t monotonic;       /* the idle thread's timed waits (wait_for_work) */
    pthread_condattr_init(&monotonic);
    pthread_condattr_setclock(&monotonic, CLOCK_MONOTONIC);
    pthread_mutex_init(&w->lock, NULL);
    pthread_cond_init(&w->work, &monotonic);
    pthread_cond_init(&w->room, NULL);
    pthread_condattr_destroy(&monotonic);
    if (pthread_create(&w->thread, NULL, writer_main, w) != 0) {
        Py_DECREF(w);
        PyErr_SetString(PyExc_OSError, "Writer: cannot start its thread");
        return NULL;
    }
    w->started = 1;
#ifdef __linux__
    /* found by this name in /proc (native.writer_running), from the moment it exists */
    pthread_setname_np(w->thread, "pt-dump-writer");
#endif
    return (PyObject *)w;
}

/* submit(index, files, wake=True): queue a step, waking the thread if asked
 * (wait_for_work); blocks (without the GIL) while max_pending steps are queued or being
 * written. index: None or (arrays, kinds, stats, stamps, literal, cuts,
 * refs, path); files: (paths, headers, arrays, converts, links, renames, dirs) as
 * write_files takes them, the renames done after the index is written. Returns the step's
 * ticket. */
static PyObject *Writer_submit(Writer *w, PyObject *args)
{
    PyObject *index, *files;
    int wake = 1;
    if (!PyArg_ParseTuple(args, "OO|p", &index, &files, &wake)) return NULL;
    if (w->stop) {
        PyErr_SetString(PyExc_ValueError, "Writer: closed");
        return NULL;
    }
    Job *j = PyMem_RawCalloc(1, sizeof(Job));
    if (!j) return PyErr_NoMemory();
    PyObject *i[8] = {0}, *f[7] = {0};
    if (index != Py_None) {
        if (!PyArg_ParseTuple(index, "OOOOOOOO", &i[0], &i[1], &i[2], &i[3], &i[4], &i[5],
                              &i[6], &i[7]) ||
            !PyUnicode_FSConverter(i[7], &j->index_path) ||
            index_parse(&j->index, i[0], i[1], i[2], i[3], i[4], i[5], i[6]) < 0) {
            Py_XDECREF(j->index_path);
            PyMem_RawFree(j);
            return NULL;
        }
        j->has_index = 1;
    }
    if (!PyArg_ParseTuple(files, "OOOOOOO", &f[0], &f[1], &f[2], &f[3], &f[4], &f[5], &f[6]) ||
        files_parse(&j->files, f[0], f[1], f[2], f[3], f[4], f[5], f[6]) < 0) {
        if (j->has_index) index_release(&j->index);
        Py_XDECREF(j->index_path);
        PyMem_RawFree(j);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->lock);
    while (w->pending >= w->max_pending) {          /* full: the thread is woken to make room */
        pthread_cond_signal(&w->work);
        pthread_cond_wait(&w->room, &w->lock);
    }
    j->ticket = w->tickets++;
    if (w->queue_tail) w->queue_tail->next = j;
    else w->queue = j;
    w->queue_tail = j;
    w->pending++;
    if (wake) pthread_cond_signal(&w->work);        /* else it finds the step itself */
    pthread_mutex_unlock(&w->lock);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(j->ticket);
}

/* The steps written (or failed, or skipped after a failure) since the last call, as
 * (ticket, None | OSError | "skipped"); their arrays are let go. */
static PyObject *writer_collect(Writer *w)
{
    pthread_mutex_lock(&w->lock);
    Job *j = w->done;
    w->done = w->done_tail = NULL;
    pthread_mutex_unlock(&w->lock);
    PyObject *out = PyList_New(0);
    while (j) {
        Job *next = j->next;
        PyObject *outcome;
        if (j->skipped) outcome = PyUnicode_FromString("skipped");
        else if (j->failed) {
            PyObject *name = PyUnicode_DecodeFSDefault(j->failed);
            outcome = name ? PyObject_CallFunction(PyExc_OSError, "isO", j->error,
                                                   strerror(j->error), name) : NULL;
            Py_XDECREF(name);
        } else outcome = (Py_INCREF(Py_None), Py_None);
        PyObject *item = outcome ? Py_BuildValue("(LN)", j->ticket, outcome) : NULL;
        if (out && (!item || PyList_Append(out, item) < 0)) Py_CLEAR(out);
        Py_XDECREF(item);
        job_free(j);
        j = next;
    }
    return out;
}

static PyObject *Writer_done(Writer *w, PyObject *unused)
{
    return writer_collect(w);
}

/* flush(): wait (without the GIL) until every queued step is written; then done() */
static PyObject *Writer_flush(Writer *w, PyObject *unused)
{
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->lock);
    if (w->pending > 0) pthread_cond_signal(&w->work);
    while (w->pending > 0) pthread_cond_wait(&w->room, &w->lock);
    w->failed = 0;                  /* reported by this flush: later steps are written again */
    pthread_mutex_unlock(&w->lock);
    Py_END_ALLOW_THREADS
    return writer_collect(w);
}

static void writer_stop(Writer *w)
{
    if (!w->started) return;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->lock);
    w->stop = 1;
    pthread_cond_signal(&w->work);
    pthread_mutex_unlock(&w->lock);
    pthread_join(w->thread, NULL);
    Py_END_ALLOW_THREADS
    w->started = 0;
}

/* close(): write what is queued, stop the thread; then done() */
static PyObject *Writer_close(Writer *w, PyObject *unused)
{
    writer_stop(w);
    return writer_collect(w);
}

static void Writer_dealloc(Writer *w)
{
    writer_stop(w);
    PyObject *rest = writer_collect(w);
    Py_XDECREF(rest);
    pthread_mutex_destroy(&w->lock);
    pthread_cond_destroy(&w->work);
    pthread_cond_destroy(&w->room);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyMethodDef writer_methods[] = {
    {"submit", (PyCFunction)Writer_submit, METH_VARARGS,
     "submit(index, files, wake=True) -> ticket: queue a step (blocks while max_pending are "
     "queued); wake=False leaves the idle thread to find it within its polling interval."},
    {"done", (PyCFunction)Writer_done, METH_NOARGS,
     "done() -> [(ticket, None | OSError | 'skipped')]: the steps finished since the last call."},
    {"flush", (PyCFunction)Writer_flush, METH_NOARGS,
     "flush() -> done(): wait until every queued step is written (a failure is then "
     "forgotten: later steps are written again)."},
    {"close", (PyCFunction)Writer_close, METH_NOARGS,
     "close() -> done(): write what is queued and stop the thread."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "precision_tool._reduce.Writer",
    .tp_basicsize = sizeof(Writer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Writer(max_pending=2): a thread that writes dump steps without the GIL.",
    .tp_new = Writer_new,
    .tp_dealloc = (destructor)Writer_dealloc,
    .tp_methods = writer_methods,
};

/* pack(arrays) -> (data, layout): the C-contiguous buffers' bytes back to back, and per
 * buffer its item size, its number of dimensions and each dimension, as int64 back to back;
 * a strided one, or one that exports no buffer, raises what its export raises. A
 * replay bundle's variables go to the writer as one buffer taken when the step starts (the
 * arrays are not held until they are written), and the layout tells whether replay.json's
 * list of them still holds. */
static PyObject *py_pack(PyObject *self, PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "pack takes a sequence of arrays");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), total = 0, longs = 0, k;
    Py_buffer *views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    PyObject *data = NULL, *layout = NULL, *out = NULL;
    if (!views) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (k = 0; k < n; k++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, k), &views[k], PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        total += views[k].len;
        longs += 2 + views[k].ndim;
    }
    data = PyBytes_FromStringAndSize(NULL, total);
    layout = data ? PyBytes_FromStringAndSize(NULL, longs * (Py_ssize_t)sizeof(int64_t)) : NULL;
    if (layout) {
        char *at = PyBytes_AS_STRING(data);
        int64_t *shape = (int64_t *)PyBytes_AS_STRING(layout);
        for (Py_ssize_t i = 0; i < n; i++) {
            memcpy(at, views[i].buf, (size_t)views[i].len);
            at += views[i].len;
            *shape++ = views[i].itemsize;
            *shape++ = views[i].ndim;
            for (int d = 0; d < views[i].ndim; d++) *shape++ = views[i].shape[d];
        }
        out = PyTuple_Pack(2, data, layout);
    }
done:
    for (Py_ssize_t i = 0; i < k; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    Py_XDECREF(data);
    Py_XDECREF(layout);
    Py_DECREF(seq);
    return out;
}

static PyObject *py_simd(PyObject *self, PyObject *args)
{
    return PyBool_FromLong(use_simd());
}

static PyMethodDef methods[] = {
    {"simd", py_simd, METH_NOARGS,
     "simd(): do comparisons of 16- and 32-bit floats run the AVX-512 loops here (the CPU has "
     "them and PRECISION_TOOL_NO_AVX512 is not set)?"},
    {"pack", py_pack, METH_O,
     "pack(arrays) -> (data, layout): the C-contiguous arrays' bytes back to back, and each "
     "one's item size, number of dimensions and dimensions as int64."},
    {"write_files", py_write_files, METH_VARARGS,
     "write_files(paths, headers, arrays[, converts[, links[, renames[, dirs]]]]): each file "
     "its header and its array's bytes ('e' in converts: a float32 array written as float16; "
     "a tuple of arrays: back to back); dirs and links first, renames last."},
    {"index_text", py_index_text, METH_VARARGS,
     "index_text(arrays, kinds, stats, stamps, literal, cuts, refs): stats into `stats` and "
     "the template filled with stamps and stats text, as bytes."},
    {"grid", py_grid, METH_VARARGS,
     "grid(x, out, kind, saturation, stats=None): the float32 x rounded onto the float16 ('e') "
     "or bfloat16 ('b') grid into out, saturated if asked (kind 'f', out None: x as it is); "
     "stats: 8 float64 for the result's statistics and size; whether a result was inf or nan."},
    {"stats_rows", py_stats_rows, METH_VARARGS,
     "stats_rows(arrays, kinds, table, rows): each array's statistics and size into its row "
     "of table (8 float64 a row); False, writing nothing, where an array is not of its kind."},
    {"stats_text", py_stats_text, METH_VARARGS,
     "stats_text(rows): per row of 7 float64 (as stats writes them) its CSV text."},
    {"stats", py_stats, METH_VARARGS,
     "stats(arrays, kinds, out): per array max, min, mean, l2norm over the finite elements "
     "and its nan, +inf, -inf counts, into out (7 float64 per array)."},
    {"compare", py_compare, METH_VARARGS,
     "compare(x, y, kinds, start, stop, ranges): the comparison totals of one range "
     "(KL sums too when ranges = (lo_x, hi_x, lo_y, hi_y), else nan)."},
    {"kl", py_kl, METH_VARARGS,
     "kl(x, y, kinds, start, stop, ranges): (Sp, Sq, sum p (log p - log q)) of one range."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_reduce", "One-pass reductions over dumped tensors.", -1, methods,
};

PyMODINIT_FUNC PyInit__reduce(void)
{
    if (PyType_Ready(&WriterType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "FIELDS", T_FIELDS) < 0) { Py_DECREF(m); return NULL; }
    Py_INCREF(&WriterType);
    if (m && PyModule_AddObject(m, "Writer", (PyObject *)&WriterType) < 0) {
        Py_DECREF(&WriterType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
