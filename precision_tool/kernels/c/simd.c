/* Which vector loops run: avx512.c's where the CPU has AVX-512 F and DQ, else avx2.c's where
 * it has AVX2, FMA and F16C, else none (the portable loops of stats.c and compare.c). The
 * environment can turn them off: PRECISION_TOOL_NO_AVX512 (then the AVX2 loops or the
 * portable ones run) and PRECISION_TOOL_NO_AVX2 (no AVX2 loops). It is read on the first
 * call and again after simd_refresh() (native.refresh_simd(): the tests switch paths so),
 * not per call: getenv scans the whole environment, and a small tensor's statistics are a
 * call each (8% of a small model's simulated step). */
#include "kernels.h"

static int level = -1;

void simd_refresh(void) { level = -1; }

int simd_level(void)
{
    if (level < 0)
        level = avx512_cpu() && !getenv("PRECISION_TOOL_NO_AVX512") ? SIMD_AVX512
              : avx2_cpu() && !getenv("PRECISION_TOOL_NO_AVX2") ? SIMD_AVX2 : SIMD_NONE;
    return level;
}

int compare_simd(int level, const char *x, char xk, const char *y, char yk, Py_ssize_t n,
                 double kx, double ky, Unit u, double *t, double *shifted)
{
    if (level == SIMD_AVX512) return compare_avx512(x, xk, y, yk, n, kx, ky, u, t, shifted);
    if (level == SIMD_AVX2) return compare_avx2(x, xk, y, yk, n, kx, ky, u, t, shifted);
    return 0;
}

int kl_simd(int level, const char *x, char xk, const char *y, char yk, Py_ssize_t n, Unit u,
            double *t)
{
    if (level == SIMD_AVX512) return kl_avx512(x, xk, y, yk, n, u, t);
    if (level == SIMD_AVX2) return kl_avx2(x, xk, y, yk, n, u, t);
    return 0;
}

int stats_simd(int level, const char *data, char kind, Py_ssize_t n, Stats *st)
{
    if (level == SIMD_AVX512) return stats_avx512(data, kind, n, st);
    if (level == SIMD_AVX2) return stats_avx2(data, kind, n, st);
    return 0;
}

/* float16 conversions have AVX-512 loops only: elsewhere the portable ones (0 done) */
Py_ssize_t halves_simd(const float *src, Py_ssize_t n, uint16_t *dst)
{
    return simd_level() == SIMD_AVX512 ? halves_avx512(src, n, dst) : 0;
}

Py_ssize_t grid_simd(const float *src, Py_ssize_t n, char kind, float *dst, int *bad)
{
    return simd_level() == SIMD_AVX512 ? grid_avx512(src, n, kind, dst, bad) : 0;
}
