/* What the C module's source files share: element kinds and their conversions, the
 * structures that pass between files, and the functions one file gives the others. Each
 * file is one concern: stats.c (a tensor's statistics), compare.c (a pair's comparison
 * totals and KL's sums), simd.c, avx512.c and avx2.c (the vector loops of both), grid.c
 * (fp16/bf16 rounding), text.c (numbers as text, a step's index), files.c and writer.c
 * (writing a step), table.c (reading CSV), module.c (the Python module). */
#ifndef PRECISION_TOOL_KERNELS_H
#define PRECISION_TOOL_KERNELS_H
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

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#include <xmmintrin.h>
/* Ask for the line AHEAD elements past element i (of kind 'f', or a 2-byte kind): the vector
 * loops do so much arithmetic per element that they do not run ahead far enough by
 * themselves, and the hardware's prefetcher stops at each 4 KiB page, so that without this
 * a pair beyond the caches compared at half the rate of one within them. (A prefetch past
 * the end of a mapping faults nothing.) */
#define AHEAD 512
static inline void fetch_ahead(const char *data, char kind, Py_ssize_t i)
{
    _mm_prefetch(data + (i + AHEAD) * (kind == 'f' ? 4 : 2), _MM_HINT_T0);
}
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
static inline int itemsize(char kind)
{
    switch (kind) {
    case 'e': case 'b': case 'h': case 'H': return 2;
    case 'f': case 'i': case 'I': return 4;
    case 'd': case 'q': case 'Q': return 8;
    case 'c': case 'B': case '?': return 1;
    default: return 0;
    }
}

static inline int is_float(char kind) { return kind == 'e' || kind == 'b' || kind == 'f' || kind == 'd'; }

/* float32 bits -> float16 bits (grid.c, files.c, avx512.c) */
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

/* ---- statistics (stats.c) ---- */
typedef struct { double hi, lo, sum, squares; int64_t n, nan, pos, neg; } Stats;

void to_double(const char *src, char kind, Py_ssize_t n, double *dst);
#define STATS_EMPTY {-INFINITY, INFINITY, 0, 0, 0, 0, 0, 0}
void tensor_stats(const char *data, char kind, Py_ssize_t n, double *out);
void stats_add(const char *data, char kind, Py_ssize_t n, Stats *st);
void stats_out(const Stats *st, double *out);      /* st as tensor_stats' 7 numbers */
PyObject *py_spill(PyObject *self, PyObject *args);
/* a strided buffer's elements read in C order, piece by piece (stats.c) */
typedef struct {
    const char *at;
    Py_ssize_t idx[PyBUF_MAX_NDIM];
    const Py_ssize_t *shape, *strides;
    int ndim, size;
} Walk;
void walk_start(Walk *w, const char *data, int ndim, const Py_ssize_t *shape,
                const Py_ssize_t *strides, int size);
void walk_gather(Walk *w, Py_ssize_t m, char *dst);
PyObject *py_stats(PyObject *self, PyObject *args);
PyObject *py_stats_rows(PyObject *self, PyObject *args);

/* ---- comparison totals (compare.c) ---- */
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

PyObject *py_compare(PyObject *self, PyObject *args);
PyObject *py_kl(PyObject *self, PyObject *args);
PyObject *py_compare_batch(PyObject *self, PyObject *args);

/* ---- the vector loops (simd.c chooses; avx512.c, avx2.c): 0 (or nothing done) where a
 * block is not theirs to take ---- */
enum { SIMD_NONE, SIMD_AVX2, SIMD_AVX512 };
int simd_level(void);
void simd_refresh(void);
int compare_simd(int level, const char *x, char xk, const char *y, char yk, Py_ssize_t n,
                 double kx, double ky, Unit u, double *t, double *shifted);
int kl_simd(int level, const char *x, char xk, const char *y, char yk, Py_ssize_t n, Unit u,
            double *t);
int stats_simd(int level, const char *data, char kind, Py_ssize_t n, Stats *st);
Py_ssize_t halves_simd(const float *src, Py_ssize_t n, uint16_t *dst);
Py_ssize_t grid_simd(const float *src, Py_ssize_t n, char kind, float *dst, int *bad);
/* each instruction set's loops: whether the CPU has it, and its compare, KL and stats */
#define SIMD_LOOPS(isa)                                                                      \
    int isa##_cpu(void);                                                                     \
    int compare_##isa(const char *x, char xk, const char *y, char yk, Py_ssize_t n,          \
                      double kx, double ky, Unit u, double *t, double *shifted);             \
    int kl_##isa(const char *x, char xk, const char *y, char yk, Py_ssize_t n, Unit u,       \
                 double *t);                                                                 \
    int stats_##isa(const char *data, char kind, Py_ssize_t n, Stats *st);
SIMD_LOOPS(avx512)
SIMD_LOOPS(avx2)
Py_ssize_t halves_avx512(const float *src, Py_ssize_t n, uint16_t *dst);
Py_ssize_t grid_avx512(const float *src, Py_ssize_t n, char kind, float *dst, int *bad);
double kl_excess_sum_normalised(const double *x, const double *y, Py_ssize_t n, Unit u);

/* ---- fp16/bf16 rounding (grid.c) ---- */
void floats_to_halves(const uint32_t *src, Py_ssize_t n, uint16_t *dst);
PyObject *py_grid(PyObject *self, PyObject *args);

/* ---- text: numbers, a step's index (text.c) ---- */
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

/* Working memory of index_run, kept from step to step by the writer thread: allocating it
 * anew each step (text of a few hundred KB: mmap'd) would map and unmap it each step, and
 * unmapping interrupts every core the process runs on. */
typedef struct {
    char *lines, *text;
    int *length;
    size_t nlines, ntext;
} Scratch;

#define STATS_LINE 256          /* room for one stats row's text */
int format_int(long long n, char *out);
int format_stats(const double *v, char *line);
int index_parse(Index *x, PyObject *arrays, PyObject *kinds_obj, PyObject *stats,
                PyObject *stamps, PyObject *literal, PyObject *cuts, PyObject *refs);
Py_ssize_t index_run(const Index *x, Scratch *s);
void index_release(Index *x);
void scratch_free(Scratch *s);
PyObject *py_stats_text(PyObject *self, PyObject *args);
PyObject *py_index_text(PyObject *self, PyObject *args);

/* ---- files (files.c) and the writer thread (writer.c) ---- */
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

int files_parse(Files *f, PyObject *paths, PyObject *headers, PyObject *arrays,
                PyObject *converts_obj, PyObject *links, PyObject *renames, PyObject *dirs);
int files_write(const Files *f, const char **failed, int *error);
int files_rename(const Files *f, const char **failed, int *error);
void files_release(Files *f);
int write_file(const char *path, struct iovec *v, int n);
PyObject *os_error(int error, const char *path);
PyObject *py_write_files(PyObject *self, PyObject *args);
extern PyTypeObject WriterType;

/* ---- module.c, table.c ---- */
int get_buffer(PyObject *obj, char kind, Py_ssize_t count, Py_buffer *view);
PyObject *pt_read_csv(PyObject *self, PyObject *args);
PyObject *py_simd_refresh(PyObject *self, PyObject *args);

#endif
