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

void tensor_stats(const char *data, char kind, Py_ssize_t n, double *out)
{
    double buf[BLOCK];
    Stats st = {-INFINITY, INFINITY, 0, 0, 0, 0, 0, 0};
    int size = itemsize(kind), simd = is_float(kind) && kind != 'd' ? simd_level() : SIMD_NONE;
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        Py_ssize_t m = n - start < BLOCK ? n - start : BLOCK;
        if (simd && m % 16 == 0 && stats_simd(simd, data + start * size, kind, m, &st)) continue;
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
