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
#include "kernels.h"

/* a C-contiguous buffer of `count` elements of `kind` (count < 0: any) */
int get_buffer(PyObject *obj, char kind, Py_ssize_t count, Py_buffer *view)
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


/* pack(arrays) -> (data, layout): the C-contiguous buffers' bytes back to back, and per
 * buffer its item size, its number of dimensions and each dimension, as int64 back to back;
 * a strided one, or one that exports no buffer, raises what its export raises. A
 * replay bundle's variables go to the writer as one buffer taken when the step starts (the
 * arrays are not held until they are written), and the layout tells whether replay.json's
 * list of them still holds. */
PyObject *py_pack(PyObject *self, PyObject *arg)
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

PyObject *py_simd_refresh(PyObject *self, PyObject *args)
{
    simd_refresh();
    Py_RETURN_NONE;
}

PyObject *py_simd(PyObject *self, PyObject *args)
{
    static const char *names[] = {"", "avx2", "avx512"};
    return PyUnicode_FromString(names[simd_level()]);
}

static PyMethodDef methods[] = {
    {"read_csv", pt_read_csv, METH_VARARGS,
     "read_csv(data, kinds) -> (header, columns, rows): the CSV bytes' columns named in kinds "
     "('f': a bytearray of float64, 't': a list of str), as table defines."},
    {"simd", py_simd, METH_NOARGS,
     "simd() -> 'avx512', 'avx2' or '': the vector loops that comparisons and statistics of "
     "16- and 32-bit floats run here (simd.c)."},
    {"simd_refresh", py_simd_refresh, METH_NOARGS,
     "simd_refresh(): read PRECISION_TOOL_NO_AVX512 and PRECISION_TOOL_NO_AVX2 again."},
    {"pack", py_pack, METH_O,
     "pack(arrays) -> (data, layout): the C-contiguous arrays' bytes back to back, and each "
     "one's item size, number of dimensions and dimensions as int64."},
    {"write_files", py_write_files, METH_VARARGS,
     "write_files(paths, headers, arrays[, converts[, links[, renames[, dirs]]]]): each file "
     "its header and its array's bytes ('e' in converts: a float32 array written as float16; "
     "a tuple of arrays: back to back); dirs and links first, renames last."},
    {"spill", py_spill, METH_VARARGS,
     "spill(path, header, array, kind, row): a file of the header and the array's elements "
     "in C order, its statistics into row[:7] and its size into row[7], in one read."},
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
     "stats(arrays, kinds, out): per array (strided or not) max, min, mean, l2norm over the "
     "finite elements and its nan, +inf, -inf counts, into out (7 float64 per array)."},
    {"compare", py_compare, METH_VARARGS,
     "compare(x, y, kinds, start, stop, ranges): the comparison totals of one range "
     "(KL sums too when ranges = (lo_x, hi_x, lo_y, hi_y), else nan)."},
    {"compare_batch", py_compare_batch, METH_VARARGS,
     "compare_batch(xs, ys, kinds) -> [totals]: compare() of each whole pair and, where it has "
     "finite elements, kl() for the ranges it found, in its KL fields; one call for them all."},
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
