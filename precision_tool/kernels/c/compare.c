/* A pair's comparison totals and KL's sums, the portable loops: kernels.compare defines
 * them; avx512.c has the same on sixteen lanes. */
#include "kernels.h"

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

/* the same for a block of finite elements, both sides normalised: avx2.c's KL blocks with
 * a term out of its short series' range */
double kl_excess_sum_normalised(const double *x, const double *y, Py_ssize_t n, Unit u)
{
    return kl_excess_sum(x, y, n, u, 1, 1);
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
    int simd = xk != 'd' && yk != 'd' && (!u.on || u.normalised) ? simd_level() : SIMD_NONE;
    for (Py_ssize_t at = start; at < stop; at += BLOCK) {
        Py_ssize_t m = stop - at < BLOCK ? stop - at : BLOCK;
        double kx, ky;                  /* the moments' shift: the block's first finite pair */
        to_double(xd + at * xs, xk, 1, &kx);
        to_double(yd + at * ys, yk, 1, &ky);
        if (!(simd && m % 16 == 0 &&
              compare_simd(simd, xd + at * xs, xk, yd + at * ys, yk, m, kx, ky, u, t, shifted))) {
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
    int simd = xk != 'd' && yk != 'd' && u.normalised ? simd_level() : SIMD_NONE;
    for (Py_ssize_t at = start; at < stop; at += BLOCK) {
        Py_ssize_t m = stop - at < BLOCK ? stop - at : BLOCK;
        if (simd && m % 16 == 0 && kl_simd(simd, xd + at * xs, xk, yd + at * ys, yk, m, u, t)) continue;
        to_double(xd + at * xs, xk, m, xb);
        to_double(yd + at * ys, yk, m, yb);
        kl_block(xb, yb, m, u, t);
    }
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

PyObject *py_compare(PyObject *self, PyObject *args)
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

PyObject *py_kl(PyObject *self, PyObject *args)
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

/* compare_batch(xs, ys, kinds) -> [totals]: each pair (flat arrays of equal size, kinds
 * two characters a pair, back to back) compared whole and, where a pair has finite
 * elements, its KL sums taken for the ranges its first pass found (in T_SP, T_SQ, T_S):
 * compare() then kl() per pair, as kernels.compare.batch_totals defines, in one call
 * without the GIL. The per-call cost is what small tensors pay most. */
PyObject *py_compare_batch(PyObject *self, PyObject *args)
{
    PyObject *xs, *ys, *sx = NULL, *sy = NULL, *out = NULL;
    const char *kinds;
    Py_ssize_t nk, n = 0, got = 0, k;
    if (!PyArg_ParseTuple(args, "OOs#", &xs, &ys, &kinds, &nk)) return NULL;
    Py_buffer *views = NULL;
    double *t = NULL;
    sx = PySequence_Fast(xs, "xs must be a sequence");
    sy = sx ? PySequence_Fast(ys, "ys must be a sequence") : NULL;
    if (!sy) goto done;
    n = PySequence_Fast_GET_SIZE(sx);
    if (PySequence_Fast_GET_SIZE(sy) != n || nk != 2 * n) {
        PyErr_SetString(PyExc_ValueError, "compare_batch: as many ys as xs, two kinds a pair");
        goto done;
    }
    for (k = 0; k < 2 * n; k++)
        if (!is_float(kinds[k])) {
            PyErr_SetString(PyExc_ValueError, "kinds: the comparisons take floats only");
            goto done;
        }
    views = PyMem_Calloc(2 * n + 1, sizeof(Py_buffer));
    t = PyMem_Malloc((n + 1) * T_FIELDS * sizeof(double));
    if (!views || !t) { PyErr_NoMemory(); goto done; }
    for (got = 0; got < n; got++) {
        Py_buffer *x = &views[2 * got], *y = &views[2 * got + 1];
        if (get_buffer(PySequence_Fast_GET_ITEM(sx, got), kinds[2 * got], -1, x) < 0) goto done;
        if (get_buffer(PySequence_Fast_GET_ITEM(sy, got), kinds[2 * got + 1],
                       x->len / itemsize(kinds[2 * got]), y) < 0) {
            PyBuffer_Release(x);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (k = 0; k < n; k++) {
        const Py_buffer *x = &views[2 * k], *y = &views[2 * k + 1];
        double *tk = t + k * T_FIELDS, kl[3];
        char xk = kinds[2 * k], yk = kinds[2 * k + 1];
        Py_ssize_t m = x->len / itemsize(xk);
        Unit off = {0, 0, 0.0, 1.0, 0.0, 1.0};
        compare_range(x->buf, xk, y->buf, yk, 0, m, off, tk);
        if (tk[T_N] > 0) {
            double r[4] = {tk[T_LO_X], tk[T_HI_X], tk[T_LO_Y], tk[T_HI_Y]};
            kl_range(x->buf, xk, y->buf, yk, 0, m, make_unit(r), kl);
            tk[T_SP] = kl[0]; tk[T_SQ] = kl[1]; tk[T_S] = kl[2];
        }
    }
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    for (k = 0; out && k < n; k++) {
        PyObject *row = PyTuple_New(T_FIELDS);
        for (int f = 0; row && f < T_FIELDS; f++) {
            PyObject *v = PyFloat_FromDouble(t[k * T_FIELDS + f]);
            if (!v) Py_CLEAR(row);
            else PyTuple_SET_ITEM(row, f, v);
        }
        if (!row) Py_CLEAR(out);
        else PyList_SET_ITEM(out, k, row);
    }
done:
    for (k = 0; views && k < 2 * got; k++) PyBuffer_Release(&views[k]);
    PyMem_Free(views);
    PyMem_Free(t);
    Py_XDECREF(sx);
    Py_XDECREF(sy);
    return out;
}
