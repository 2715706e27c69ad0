/* A dump step's files, written without the GIL (kernels.write). */
#include "kernels.h"

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
    return open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);    /* less the umask */
}

int write_file(const char *path, struct iovec *v, int n)
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


void files_release(Files *f)
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

int files_parse(Files *f, PyObject *paths, PyObject *headers, PyObject *arrays,
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
int files_write(const Files *f, const char **failed, int *error)
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
int files_rename(const Files *f, const char **failed, int *error)
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

PyObject *os_error(int error, const char *path)
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
PyObject *py_write_files(PyObject *self, PyObject *args)
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

/* spill(path, header, array, kind, row): a new file of the header then the array's
 * elements in C order (of the stats kind `kind`; a strided array's gathered a piece at a
 * time), and its statistics (tensor_stats's numbers) into row[:7] and its size into row[7]:
 * piece by piece, each piece's statistics taken while it is in cache, just before it is
 * written (one read of the array for both, no copy of it). */
#define SPILL_PIECE (64 * BLOCK)
PyObject *py_spill(PyObject *self, PyObject *args)
{
    PyObject *path, *array;
    Py_buffer head, arr = {0}, row;
    const char *kind;
    Py_ssize_t nkind;
    if (!PyArg_ParseTuple(args, "O&y*Os#w*", PyUnicode_FSConverter, &path, &head, &array,
                          &kind, &nkind, &row))
        return NULL;
    PyObject *result = NULL;
    int size = nkind == 1 ? itemsize(kind[0]) : 0, got = 0;
    if (!size || row.len != 8 * (Py_ssize_t)sizeof(double)) {
        PyErr_SetString(PyExc_ValueError, "spill: one known kind, a row of 8 float64");
        goto done;
    }
    if (PyObject_GetBuffer(array, &arr, PyBUF_STRIDES) < 0) goto done;
    got = 1;
    if (arr.itemsize != size) {
        PyErr_SetString(PyExc_ValueError, "spill: the array's elements are not of its kind");
        goto done;
    }
    int contiguous = PyBuffer_IsContiguous(&arr, 'C');
    char *piece_buf = contiguous ? NULL : malloc((size_t)SPILL_PIECE * size);
    if (!contiguous && !piece_buf) { PyErr_NoMemory(); goto done; }
    const char *p = PyBytes_AS_STRING(path);
    Py_ssize_t n = arr.len / size;
    double *out = row.buf;
    int bad, error = 0;
    Py_BEGIN_ALLOW_THREADS
    Stats st = STATS_EMPTY;
    Walk w;
    if (!contiguous) walk_start(&w, arr.buf, arr.ndim, arr.shape, arr.strides, size);
    int fd = new_file(p);
    bad = fd < 0 || write_all(fd, head.buf, head.len) < 0;
    for (Py_ssize_t at = 0; !bad && at < n; at += SPILL_PIECE) {
        Py_ssize_t m = MIN(n - at, SPILL_PIECE);
        const char *piece = (const char *)arr.buf + at * size;
        if (!contiguous) {
            walk_gather(&w, m, piece_buf);
            piece = piece_buf;
        }
        stats_add(piece, kind[0], m, &st);
        bad = write_all(fd, piece, m * size) < 0;
    }
    error = errno;
    if (fd >= 0 && close(fd) < 0 && !bad) { bad = 1; error = errno; }
    stats_out(&st, out);
    out[7] = (double)n;
    Py_END_ALLOW_THREADS
    free(piece_buf);
    if (bad) os_error(error, p);
    else { Py_INCREF(Py_None); result = Py_None; }
done:
    Py_DECREF(path);
    PyBuffer_Release(&head);
    if (got) PyBuffer_Release(&arr);
    PyBuffer_Release(&row);
    return result;
}
