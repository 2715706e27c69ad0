/* Numbers as text, and a dump step's index.csv from its template. */
#include "kernels.h"

/* n in decimal; returns its length */
int format_int(long long n, char *out)
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
int format_stats(const double *v, char *line)
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
PyObject *py_stats_text(PyObject *self, PyObject *args)
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


void index_release(Index *x)
{
    for (Py_ssize_t k = 0; k < x->got; k++) if (x->views[k].obj) PyBuffer_Release(&x->views[k]);
    PyMem_Free(x->views);
    PyMem_Free(x->kinds);
    Py_buffer *b[5] = {&x->stats, &x->stamps, &x->literal, &x->cuts, &x->refs};
    for (int i = 0; i < x->held; i++) PyBuffer_Release(b[i]);
    Py_XDECREF(x->seq);
    memset(x, 0, sizeof *x);
}

int index_parse(Index *x, PyObject *arrays, PyObject *kinds_obj, PyObject *stats,
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


void scratch_free(Scratch *s)
{
    PyMem_RawFree(s->lines);
    PyMem_RawFree(s->text);
    PyMem_RawFree(s->length);
    memset(s, 0, sizeof *s);
}

/* Each array's statistics into stats, and the text; returns its length (the text is
 * s->text), -1 when out of memory. No GIL needed. */
Py_ssize_t index_run(const Index *x, Scratch *s)
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
PyObject *py_index_text(PyObject *self, PyObject *args)
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
