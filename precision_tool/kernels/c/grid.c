/* Results rounded onto the float16 or bfloat16 grid (kernels.grid). */
#include "kernels.h"

CLONES void floats_to_halves(const uint32_t *src, Py_ssize_t n, uint16_t *dst)
{
    Py_ssize_t i = halves_simd((const float *)src, n, dst);
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
    Py_ssize_t i = grid_simd(src, n, kind, dst, &bad);
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
PyObject *py_grid(PyObject *self, PyObject *args)
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
