/* CSV files read as named columns: table.read_csv, whose csv-module code defines
 * what is read and which errors are raised (the rules are in that module's docstring).
 * One pass over the bytes; numbers are parsed by Python's own float parser. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

typedef struct {
    const char *p, *end;
    Py_ssize_t line;                /* the physical line p is on, from 1 */
} Scan;

typedef struct {
    const char *s;                  /* the field's bytes, quotes taken off */
    Py_ssize_t n;
    int doubled;                    /* quoted, and holds "" for a quote */
} Field;

enum { MORE, LAST, OPEN_QUOTE, AFTER_QUOTE };

/* line breaks within a quoted field: \r\n, \r and \n each count one */
static Py_ssize_t breaks(const char *s, const char *e)
{
    Py_ssize_t k = 0;
    for (; s < e; s++)
        k += *s == '\n' || (*s == '\r' && (s + 1 == e || s[1] != '\n'));
    return k;
}

static int scan_field(Scan *sc, Field *f)
{
    const char *p = sc->p, *end = sc->end;
    f->doubled = 0;
    if (p < end && *p == '"') {
        f->s = ++p;
        for (;;) {
            const char *q = memchr(p, '"', end - p);
            if (q == NULL) return OPEN_QUOTE;
            if (q + 1 < end && q[1] == '"') { f->doubled = 1; p = q + 2; continue; }
            f->n = q - f->s;
            p = q + 1;
            break;
        }
        sc->line += breaks(f->s, f->s + f->n);
        if (p < end && *p != ',' && *p != '\n' && *p != '\r') return AFTER_QUOTE;
    } else {
        f->s = p;
        while (p < end && *p != ',' && *p != '\n' && *p != '\r') p++;
        f->n = p - f->s;
    }
    if (p < end && *p == ',') { sc->p = p + 1; return MORE; }
    if (p < end) {
        if (*p == '\r' && p + 1 < end && p[1] == '\n') p++;
        p++;
        sc->line++;
    }
    sc->p = p;
    return LAST;
}

/* blank lines (csv's empty records) are skipped; 0 at the end of the data */
static int next_record(Scan *sc)
{
    while (sc->p < sc->end && (*sc->p == '\n' || *sc->p == '\r')) {
        if (*sc->p == '\r' && sc->p + 1 < sc->end && sc->p[1] == '\n') sc->p++;
        sc->p++;
        sc->line++;
    }
    return sc->p < sc->end;
}

/* a record's fields into *fields (grown as needed); its count, or -1 with the error set */
static Py_ssize_t scan_record(Scan *sc, Field **fields, Py_ssize_t *cap)
{
    Py_ssize_t line = sc->line, k = 0;
    for (;;) {
        if (k == *cap) {
            Py_ssize_t grown = *cap ? 2 * *cap : 16;
            Field *more = PyMem_Realloc(*fields, grown * sizeof(Field));
            if (more == NULL) { PyErr_NoMemory(); return -1; }
            *fields = more;
            *cap = grown;
        }
        int rc = scan_field(sc, &(*fields)[k]);
        if (rc == OPEN_QUOTE) {
            PyErr_Format(PyExc_ValueError, "line %zd: a quoted field is not closed", line);
            return -1;
        }
        if (rc == AFTER_QUOTE) {
            PyErr_Format(PyExc_ValueError, "line %zd: a closing quote is followed by more text",
                         line);
            return -1;
        }
        k++;
        if (rc == LAST) return k;
    }
}

/* the field as str (doubled quotes made single), or NULL with the error set */
static PyObject *field_text(const Field *f, char **scratch, Py_ssize_t *cap)
{
    if (!f->doubled) return PyUnicode_DecodeUTF8(f->s, f->n, NULL);
    if (f->n > *cap) {
        char *more = PyMem_Realloc(*scratch, f->n);
        if (more == NULL) return PyErr_NoMemory();
        *scratch = more;
        *cap = f->n;
    }
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < f->n; i++) {
        (*scratch)[n++] = f->s[i];
        if (f->s[i] == '"') i++;             /* a quote inside a quoted field is doubled */
    }
    return PyUnicode_DecodeUTF8(*scratch, n, NULL);
}

static int digits(const char *s, Py_ssize_t n, Py_ssize_t *i)
{
    Py_ssize_t from = *i;
    while (*i < n && s[*i] >= '0' && s[*i] <= '9') (*i)++;
    return *i > from;
}

/* table.NUMBER */
static int is_number(const char *s, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    if (i < n && (s[i] == '+' || s[i] == '-')) i++;
    Py_ssize_t rest = n - i;
    if ((rest == 3 && (PyOS_strnicmp(s + i, "nan", 3) == 0 || PyOS_strnicmp(s + i, "inf", 3) == 0))
            || (rest == 8 && PyOS_strnicmp(s + i, "infinity", 8) == 0))
        return 1;
    int whole = digits(s, n, &i), part = 0;
    if (i < n && s[i] == '.') { i++; part = digits(s, n, &i); }
    if (!whole && !part) return 0;
    if (i < n && (s[i] == 'e' || s[i] == 'E')) {
        i++;
        if (i < n && (s[i] == '+' || s[i] == '-')) i++;
        if (!digits(s, n, &i)) return 0;
    }
    return i == n;
}

/* A decimal number's value without the general parser, when it can be had exactly: a
 * mantissa of at most 15 significant digits times or over a power of ten up to 1e22 is one
 * correctly rounded operation (Clinger); up to 19 digits and 1e27, the 64-bit mantissa of
 * x87's long double holds both operands exactly and its one rounding is then rounded to
 * double, which is the correctly rounded result unless the long double lies within one of
 * its units of a point halfway between two doubles (then, as for any other form, 0: the
 * caller parses the field in full) */
static int exact_number(const char *s, Py_ssize_t n, double *out)
{
    static const double tens[] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11,
                                  1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21,
                                  1e22};
    Py_ssize_t i = 0;
    int negative = 0, count = 0, scale = 0;
    uint64_t m = 0;
    if (s[0] == '+' || s[0] == '-') { negative = s[0] == '-'; i++; }
    for (; i < n && s[i] >= '0' && s[i] <= '9'; i++) {
        if (m == 0 && s[i] == '0') continue;           /* leading zeros are not significant */
        if (++count > 19) return 0;
        m = 10 * m + (uint64_t)(s[i] - '0');
    }
    if (i < n && s[i] == '.')
        for (i++; i < n && s[i] >= '0' && s[i] <= '9'; i++) {
            if (m == 0 && s[i] == '0') { scale--; continue; }
            if (++count > 19) return 0;
            m = 10 * m + (uint64_t)(s[i] - '0');
            scale--;
        }
    if (i < n && (s[i] == 'e' || s[i] == 'E')) {
        int sign = 1, e = 0;
        i++;
        if (i < n && (s[i] == '+' || s[i] == '-')) sign = s[i++] == '-' ? -1 : 1;
        for (; i < n && s[i] >= '0' && s[i] <= '9'; i++)
            if ((e = 10 * e + (s[i] - '0')) > 400) return 0;
        scale += sign * e;
    }
    if (i != n) return 0;                               /* a word: nan, inf */
    double v;
    if (m == 0) {
        v = 0.0;
    } else if (count <= 15 && scale >= -22 && scale <= 22) {
        v = scale < 0 ? (double)m / tens[-scale] : (double)m * tens[scale];
    } else {
#if LDBL_MANT_DIG == 64
        if (scale < -27 || scale > 27) return 0;
        long double p = 1.0L, x;
        for (int k = scale < 0 ? -scale : scale; k > 0; k--) p *= 10.0L;     /* exact to 1e27 */
        x = scale < 0 ? (long double)m / p : (long double)m * p;
        int exp2;
        uint64_t bits = (uint64_t)ldexpl(frexpl(x, &exp2), 64);
        unsigned low = (unsigned)(bits & 0x7ff);        /* the 11 bits that double drops */
        if (low >= 0x3ff && low <= 0x401) return 0;     /* within a unit of a halfway point */
        v = (double)x;
        if (!(fabs(v) >= DBL_MIN && fabs(v) <= DBL_MAX)) return 0;
#else
        return 0;
#endif
    }
    *out = negative ? -v : v;
    return 1;
}

#define SEEN 16

typedef struct {
    char kind;                      /* 'f', 't', or 0: not read */
    PyObject *name;
    double *numbers;                /* 'f' */
    PyObject *texts;                /* 't': a list */
    /* 't': the last distinct values read (bytes in the data, and their str), shared instead
     * of made again: an op type, a dtype or a verdict repeats on every row */
    const char *seen_at[SEEN];
    Py_ssize_t seen_n[SEEN];
    PyObject *seen[SEEN];
    int next;
} Column;

/* the field's str, the same object as an earlier row's where the bytes are the same */
static PyObject *column_text(Column *col, const Field *f, char **scratch, Py_ssize_t *cap)
{
    if (f->doubled) return field_text(f, scratch, cap);
    for (int k = 0; k < SEEN && col->seen[k] != NULL; k++)
        if (col->seen_n[k] == f->n && memcmp(col->seen_at[k], f->s, f->n) == 0) {
            Py_INCREF(col->seen[k]);
            return col->seen[k];
        }
    PyObject *text = field_text(f, scratch, cap);
    if (text != NULL) {
        int k = col->next;
        Py_XSETREF(col->seen[k], Py_NewRef(text));
        col->seen_at[k] = f->s;
        col->seen_n[k] = f->n;
        col->next = (k + 1) % SEEN;
    }
    return text;
}

/* read_csv(data, kinds[, rest]) -> (header, {name: bytearray of float64 | list of str}, rows):
 * the columns kinds names, and every other column with the kind `rest` when given */
PyObject *pt_read_csv(PyObject *self, PyObject *args)
{
    Py_buffer view;
    PyObject *kinds, *rest = Py_None, *header = NULL, *found = NULL, *out = NULL;
    if (!PyArg_ParseTuple(args, "y*O!|O", &view, &PyDict_Type, &kinds, &rest)) return NULL;
    Scan sc = {view.buf, (const char *)view.buf + view.len, 1};
    if (view.len >= 3 && memcmp(sc.p, "\xef\xbb\xbf", 3) == 0) sc.p += 3;
    Field *fields = NULL;
    Column *cols = NULL;
    char *scratch = NULL;
    Py_ssize_t fcap = 0, scap = 0, ncols = 0, rows = 0, rcap = 0;

    if (!next_record(&sc)) {
        PyErr_SetString(PyExc_ValueError, "no header line");
        goto done;
    }
    ncols = scan_record(&sc, &fields, &fcap);
    if (ncols < 0) goto done;
    header = PyList_New(ncols);
    cols = PyMem_Calloc(ncols, sizeof(Column));
    if (header == NULL || cols == NULL) { if (cols == NULL) PyErr_NoMemory(); goto done; }
    for (Py_ssize_t c = 0; c < ncols; c++) {
        PyObject *name = field_text(&fields[c], &scratch, &scap);
        if (name == NULL) {
            if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
                PyErr_Clear();
                PyErr_SetString(PyExc_ValueError, "the header is not UTF-8");
            }
            goto done;
        }
        PyList_SET_ITEM(header, c, name);
        cols[c].name = name;
    }
    for (Py_ssize_t c = 0; c < ncols; c++)
        for (Py_ssize_t d = 0; d < c; d++) {
            int same = PyUnicode_Compare(cols[c].name, cols[d].name);
            if (same == -1 && PyErr_Occurred()) goto done;
            if (same == 0) {
                PyErr_Format(PyExc_ValueError, "the header names %R twice", cols[c].name);
                goto done;
            }
        }
    for (Py_ssize_t c = 0; c < ncols; c++) {
        PyObject *kind = PyDict_GetItemWithError(kinds, cols[c].name);
        if (kind == NULL) {
            if (PyErr_Occurred()) goto done;
            if (rest == Py_None) continue;
            kind = rest;
        }
        const char *k = PyUnicode_Check(kind) ? PyUnicode_AsUTF8(kind) : NULL;
        if (k == NULL || (strcmp(k, "f") != 0 && strcmp(k, "t") != 0)) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "column %R: kind %R is not 'f' or 't'",
                                                cols[c].name, kind);
            goto done;
        }
        cols[c].kind = k[0];
        if (k[0] == 't' && (cols[c].texts = PyList_New(0)) == NULL) goto done;
    }

    while (next_record(&sc)) {
        Py_ssize_t line = sc.line, k = scan_record(&sc, &fields, &fcap);
        if (k < 0) goto done;
        if (k != ncols) {
            PyErr_Format(PyExc_ValueError, "line %zd: %zd field(s), the header has %zd", line, k,
                         ncols);
            goto done;
        }
        if (rows == rcap) {
            rcap = rcap ? 2 * rcap : 1024;
            for (Py_ssize_t c = 0; c < ncols; c++) {
                if (cols[c].kind != 'f') continue;
                double *more = PyMem_Realloc(cols[c].numbers, rcap * sizeof(double));
                if (more == NULL) { PyErr_NoMemory(); goto done; }
                cols[c].numbers = more;
            }
        }
        for (Py_ssize_t c = 0; c < ncols; c++) {
            const Field *f = &fields[c];
            if (cols[c].kind == 't') {
                PyObject *text = column_text(&cols[c], f, &scratch, &scap);
                if (text == NULL) {
                    if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
                        PyErr_Clear();
                        PyErr_Format(PyExc_ValueError, "line %zd, column %U: not UTF-8 text",
                                     line, cols[c].name);
                    }
                    goto done;
                }
                int failed = PyList_Append(cols[c].texts, text);
                Py_DECREF(text);
                if (failed) goto done;
            } else if (cols[c].kind == 'f') {
                double v = Py_NAN;
                if (f->n && !is_number(f->s, f->n)) {
                    PyErr_Format(PyExc_ValueError, "line %zd, column %U: not a number", line,
                                 cols[c].name);
                    goto done;
                }
                if (f->n && !exact_number(f->s, f->n, &v)) {
                    char small[64], *copy = f->n < 64 ? small : PyMem_Malloc(f->n + 1);
                    if (copy == NULL) { PyErr_NoMemory(); goto done; }
                    memcpy(copy, f->s, f->n);
                    copy[f->n] = 0;
                    v = PyOS_string_to_double(copy, NULL, NULL);
                    if (copy != small) PyMem_Free(copy);
                    if (v == -1.0 && PyErr_Occurred()) goto done;
                }
                cols[c].numbers[rows] = v;
            }
        }
        rows++;
    }

    found = PyDict_New();
    if (found == NULL) goto done;
    for (Py_ssize_t c = 0; c < ncols; c++) {
        PyObject *value;
        if (cols[c].kind == 'f')
            value = PyByteArray_FromStringAndSize((const char *)cols[c].numbers,
                                                  rows * (Py_ssize_t)sizeof(double));
        else if (cols[c].kind == 't') { value = cols[c].texts; Py_INCREF(value); }
        else continue;
        if (value == NULL || PyDict_SetItem(found, cols[c].name, value) < 0) {
            Py_XDECREF(value);
            goto done;
        }
        Py_DECREF(value);
    }
    out = Py_BuildValue("(OOn)", header, found, rows);

done:
    if (cols != NULL)
        for (Py_ssize_t c = 0; c < ncols; c++) {
            PyMem_Free(cols[c].numbers);
            Py_XDECREF(cols[c].texts);
            for (int k = 0; k < SEEN; k++) Py_XDECREF(cols[c].seen[k]);
        }
    PyMem_Free(cols);
    PyMem_Free(fields);
    PyMem_Free(scratch);
    Py_XDECREF(header);
    Py_XDECREF(found);
    PyBuffer_Release(&view);
    return out;
}
