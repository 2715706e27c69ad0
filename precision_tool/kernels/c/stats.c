/* A tensor's statistics in one pass: kernels.stats.tensor_stats defines them. */
#include "kernels.h"

CLONES void to_double(const char *src, char kind, Py_ssize_t n, double *dst)
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

/* one block of m elements, back to back, into st: the vector loop where it takes them, else
 * each converted to double in buf */
static void stats_of(const char *block, char kind, Py_ssize_t m, int simd, double *buf, Stats *st)
{
    if (simd && m % 16 == 0 && stats_simd(simd, block, kind, m, st)) return;
    to_double(block, kind, m, buf);
    stats_block(buf, m, st);
}

void stats_out(const Stats *st, double *out)
{
    if (st->n) {
        out[0] = st->hi; out[1] = st->lo; out[2] = st->sum / (double)st->n;
        out[3] = sqrt(st->squares);
    } else {
        out[0] = out[1] = out[2] = out[3] = NAN;
    }
    out[4] = (double)st->nan; out[5] = (double)st->pos; out[6] = (double)st->neg;
}

static int simd_for(char kind) { return is_float(kind) && kind != 'd' ? simd_level() : SIMD_NONE; }

/* n elements' statistics into st, BLOCK at a time from data: a tensor read in pieces of
 * whole blocks gets tensor_stats's blocks, and so its numbers */
void stats_add(const char *data, char kind, Py_ssize_t n, Stats *st)
{
    double buf[BLOCK];
    int size = itemsize(kind), simd = simd_for(kind);
    for (Py_ssize_t start = 0; start < n; start += BLOCK)
        stats_of(data + start * size, kind, n - start < BLOCK ? n - start : BLOCK, simd, buf, st);
}

void tensor_stats(const char *data, char kind, Py_ssize_t n, double *out)
{
    Stats st = STATS_EMPTY;
    stats_add(data, kind, n, &st);
    stats_out(&st, out);
}

/* run elements of size bytes, stride bytes apart, back to back into dst */
static void gather_run(const char *src, Py_ssize_t stride, int size, Py_ssize_t run, char *dst)
{
    Py_ssize_t i;
    if (stride == size) {               /* a row of a slice: one copy */
        memcpy(dst, src, (size_t)(run * size));
        return;
    }
    switch (size) {
#define RUN(T) { T *d = (T *)dst; for (i = 0; i < run; i++, src += stride) memcpy(d + i, src, sizeof(T)); } break;
    case 1: RUN(uint8_t)
    case 2: RUN(uint16_t)
    case 4: RUN(uint32_t)
    default: RUN(uint64_t)
#undef RUN
    }
}

void walk_start(Walk *w, const char *data, int ndim, const Py_ssize_t *shape,
                const Py_ssize_t *strides, int size)
{
    w->at = data;
    w->ndim = ndim;
    w->shape = shape;
    w->strides = strides;
    w->size = size;
    for (int d = 0; d < PyBUF_MAX_NDIM; d++) w->idx[d] = 0;
}

/* the next m elements in C order, back to back into dst */
void walk_gather(Walk *w, Py_ssize_t m, char *dst)
{
    int last = w->ndim - 1;
    Py_ssize_t filled = 0, *idx = w->idx;
    const Py_ssize_t *shape = w->shape, *strides = w->strides;
    while (filled < m) {
        Py_ssize_t run = MIN(m - filled, shape[last] - idx[last]);
        gather_run(w->at, strides[last], w->size, run, dst + filled * w->size);
        w->at += run * strides[last];
        idx[last] += run;
        filled += run;
        if (idx[last] < shape[last]) continue;
        w->at -= shape[last] * strides[last];           /* carry into the outer indices */
        idx[last] = 0;
        for (int d = last - 1; d >= 0; d--) {
            w->at += strides[d];
            if (++idx[d] < shape[d]) break;
            w->at -= shape[d] * strides[d];
            idx[d] = 0;
        }
    }
}

/* A strided tensor's statistics (a transpose, a slice, a broadcast): its elements in C order
 * gathered BLOCK at a time, so that the blocks, and so the numbers, are those of its
 * contiguous copy, without making the copy (a fresh buffer of the tensor's size a call,
 * faulted in page by page: strided tensors summed at a quarter of the others' rate). */
static void strided_stats(const char *data, char kind, int ndim, const Py_ssize_t *shape,
                          const Py_ssize_t *strides, double *out)
{
    double buf[BLOCK];
    uint64_t gathered[BLOCK];             /* BLOCK elements of up to 8 bytes */
    Py_ssize_t n = 1;
    Stats st = STATS_EMPTY;
    int size = itemsize(kind), simd = simd_for(kind);
    Walk w;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    walk_start(&w, data, ndim, shape, strides, size);
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        Py_ssize_t m = n - start < BLOCK ? n - start : BLOCK;
        walk_gather(&w, m, (char *)gathered);
        stats_of((const char *)gathered, kind, m, simd, buf, &st);
    }
    stats_out(&st, out);
}

PyObject *py_stats(PyObject *self, PyObject *args)
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
    for (got = 0; got < n; got++) {
        Py_buffer *v = &views[got];
        if (!itemsize(kinds[got])) {
            PyErr_Format(PyExc_ValueError, "unknown element kind %c", kinds[got]);
            goto done;
        }
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), v, PyBUF_STRIDES) < 0) goto done;
        if (v->itemsize != itemsize(kinds[got])) {
            PyBuffer_Release(v);
            PyErr_SetString(PyExc_ValueError, "buffer size does not match its element kind");
            goto done;
        }
    }
    double *o = (double *)out.buf;
    Py_BEGIN_ALLOW_THREADS
    for (k = 0; k < n; k++) {
        Py_buffer *v = &views[k];
        if (PyBuffer_IsContiguous(v, 'C'))
            tensor_stats(v->buf, kinds[k], v->len / v->itemsize, o + 7 * k);
        else
            strided_stats(v->buf, kinds[k], v->ndim, v->shape, v->strides, o + 7 * k);
    }
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
PyObject *py_stats_rows(PyObject *self, PyObject *args)
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
