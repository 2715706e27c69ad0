/* The dump's writer thread (kernels.write.NativeWriter). */
#include "kernels.h"

/* One step: an index (its statistics and text, written to index_path) and a set of files,
 * parsed with the GIL by submit(), written by the thread without it, and released with the
 * GIL again by done(). */
typedef struct Job {
    struct Job *next;
    long long ticket;
    int has_index;
    Index index;
    PyObject *index_path;           /* bytes */
    Files files;
    int error;                      /* errno of the failure, 0 when written */
    const char *failed;             /* its path (owned by the job), NULL when written */
    int skipped;                    /* not written: an earlier job had failed */
} Job;

typedef struct {
    PyObject_HEAD
    pthread_t thread;
    int started, stop, failed;
    pthread_mutex_t lock;
    pthread_cond_t work, room;      /* the thread waits for work, submit() and flush() for room */
    Job *queue, *queue_tail, *done, *done_tail;
    Py_ssize_t pending, max_pending;
    long long tickets;
} Writer;

static void job_free(Job *j)
{
    if (j->has_index) index_release(&j->index);
    Py_XDECREF(j->index_path);
    files_release(&j->files);
    PyMem_RawFree(j);
}

/* The thread's part of a step: its directories, links and files, then its index, then the
 * renames, so that a directory appears whole, index included. */
static void job_run(Job *j, Scratch *scratch)
{
    if (files_write(&j->files, &j->failed, &j->error) < 0) return;
    if (j->has_index) {
        Py_ssize_t len = index_run(&j->index, scratch);
        const char *path = PyBytes_AS_STRING(j->index_path);
        struct iovec one = {scratch->text, (size_t)(len > 0 ? len : 0)};
        if (len < 0) { j->failed = path; j->error = ENOMEM; return; }
        if (write_file(path, &one, 1) < 0) { j->failed = path; j->error = errno; return; }
    }
    files_rename(&j->files, &j->failed, &j->error);
}

/* How the idle thread looks for work: submit(..., wake=False) queues a step without waking
 * it, since waking a sleeping thread costs the waker a system call and an interrupt to the
 * other core (18-25 us on a virtual machine, where the interrupt leaves the guest), and the
 * training thread is the waker: worth it for a step of tensor files, whose writing may take
 * as long as a training step, not for a statistics step's few small files. The thread looks
 * again after 1 ms, then after twice as long each time it finds nothing, up to 64 ms; a step
 * found resets it. A queue that is full (back-pressure), flush() and close() wake it. */
#define POLL_FIRST_NS 1000000L
#define POLL_LAST_NS 64000000L

static void wait_for_work(Writer *w, long *poll)
{
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_nsec += *poll;
    until.tv_sec += until.tv_nsec / 1000000000L;
    until.tv_nsec %= 1000000000L;
    if (pthread_cond_timedwait(&w->work, &w->lock, &until) == ETIMEDOUT && !w->queue)
        *poll = MIN(2 * *poll, POLL_LAST_NS);
}

static void *writer_main(void *arg)
{
    Writer *w = arg;
    Scratch scratch = {0};
    long poll = POLL_FIRST_NS;
    pthread_mutex_lock(&w->lock);
    for (;;) {
        while (!w->queue && !w->stop) wait_for_work(w, &poll);
        if (!w->queue) break;
        poll = POLL_FIRST_NS;
        Job *j = w->queue;
        w->queue = j->next;
        if (!w->queue) w->queue_tail = NULL;
        int skip = w->failed;
        pthread_mutex_unlock(&w->lock);
        if (skip) j->skipped = 1;
        else job_run(j, &scratch);
        pthread_mutex_lock(&w->lock);
        if (j->failed) w->failed = 1;
        j->next = NULL;
        if (w->done_tail) w->done_tail->next = j;
        else w->done = j;
        w->done_tail = j;
        w->pending--;
        pthread_cond_broadcast(&w->room);
    }
    pthread_mutex_unlock(&w->lock);
    scratch_free(&scratch);
#ifdef __linux__
    /* a joined thread stays listed in /proc for a moment while the kernel finishes its exit:
     * renamed first, it is not taken for a running writer (native.writer_running) */
    pthread_setname_np(pthread_self(), "pt-dump-ended");
#endif
    return NULL;
}

static PyObject *Writer_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Py_ssize_t max_pending = 2;
    if (!PyArg_ParseTuple(args, "|n", &max_pending)) return NULL;
    if (max_pending < 1) {
        PyErr_SetString(PyExc_ValueError, "Writer: max_pending must be at least 1");
        return NULL;
    }
    Writer *w = (Writer *)type->tp_alloc(type, 0);
    if (!w) return NULL;
    w->max_pending = max_pending;
    pthread_condattr_t monotonic;       /* the idle thread's timed waits (wait_for_work) */
    pthread_condattr_init(&monotonic);
    pthread_condattr_setclock(&monotonic, CLOCK_MONOTONIC);
    pthread_mutex_init(&w->lock, NULL);
    pthread_cond_init(&w->work, &monotonic);
    pthread_cond_init(&w->room, NULL);
    pthread_condattr_destroy(&monotonic);
    if (pthread_create(&w->thread, NULL, writer_main, w) != 0) {
        Py_DECREF(w);
        PyErr_SetString(PyExc_OSError, "Writer: cannot start its thread");
        return NULL;
    }
    w->started = 1;
#ifdef __linux__
    /* found by this name in /proc (native.writer_running), from the moment it exists */
    pthread_setname_np(w->thread, "pt-dump-writer");
#endif
    return (PyObject *)w;
}

/* submit(index, files, wake=True): queue a step, waking the thread if asked
 * (wait_for_work); blocks (without the GIL) while max_pending steps are queued or being
 * written. index: None or (arrays, kinds, stats, stamps, literal, cuts,
 * refs, path); files: (paths, headers, arrays, converts, links, renames, dirs) as
 * write_files takes them, the renames done after the index is written. Returns the step's
 * ticket. */
static PyObject *Writer_submit(Writer *w, PyObject *args)
{
    PyObject *index, *files;
    int wake = 1;
    if (!PyArg_ParseTuple(args, "OO|p", &index, &files, &wake)) return NULL;
    if (w->stop) {
        PyErr_SetString(PyExc_ValueError, "Writer: closed");
        return NULL;
    }
    Job *j = PyMem_RawCalloc(1, sizeof(Job));
    if (!j) return PyErr_NoMemory();
    PyObject *i[8] = {0}, *f[7] = {0};
    if (index != Py_None) {
        if (!PyArg_ParseTuple(index, "OOOOOOOO", &i[0], &i[1], &i[2], &i[3], &i[4], &i[5],
                              &i[6], &i[7]) ||
            !PyUnicode_FSConverter(i[7], &j->index_path) ||
            index_parse(&j->index, i[0], i[1], i[2], i[3], i[4], i[5], i[6]) < 0) {
            Py_XDECREF(j->index_path);
            PyMem_RawFree(j);
            return NULL;
        }
        j->has_index = 1;
    }
    if (!PyArg_ParseTuple(files, "OOOOOOO", &f[0], &f[1], &f[2], &f[3], &f[4], &f[5], &f[6]) ||
        files_parse(&j->files, f[0], f[1], f[2], f[3], f[4], f[5], f[6]) < 0) {
        if (j->has_index) index_release(&j->index);
        Py_XDECREF(j->index_path);
        PyMem_RawFree(j);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->lock);
    while (w->pending >= w->max_pending) {          /* full: the thread is woken to make room */
        pthread_cond_signal(&w->work);
        pthread_cond_wait(&w->room, &w->lock);
    }
    j->ticket = w->tickets++;
    if (w->queue_tail) w->queue_tail->next = j;
    else w->queue = j;
    w->queue_tail = j;
    w->pending++;
    if (wake) pthread_cond_signal(&w->work);        /* else it finds the step itself */
    pthread_mutex_unlock(&w->lock);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(j->ticket);
}

/* The steps written (or failed, or skipped after a failure) since the last call, as
 * (ticket, None | OSError | "skipped"); their arrays are let go. */
static PyObject *writer_collect(Writer *w)
{
    pthread_mutex_lock(&w->lock);
    Job *j = w->done;
    w->done = w->done_tail = NULL;
    pthread_mutex_unlock(&w->lock);
    PyObject *out = PyList_New(0);
    while (j) {
        Job *next = j->next;
        PyObject *outcome;
        if (j->skipped) outcome = PyUnicode_FromString("skipped");
        else if (j->failed) {
            PyObject *name = PyUnicode_DecodeFSDefault(j->failed);
            outcome = name ? PyObject_CallFunction(PyExc_OSError, "isO", j->error,
                                                   strerror(j->error), name) : NULL;
            Py_XDECREF(name);
        } else outcome = (Py_INCREF(Py_None), Py_None);
        PyObject *item = outcome ? Py_BuildValue("(LN)", j->ticket, outcome) : NULL;
        if (out && (!item || PyList_Append(out, item) < 0)) Py_CLEAR(out);
        Py_XDECREF(item);
        job_free(j);
        j = next;
    }
    return out;
}

static PyObject *Writer_done(Writer *w, PyObject *unused)
{
    return writer_collect(w);
}

/* flush(): wait (without the GIL) until every queued step is written; then done() */
static PyObject *Writer_flush(Writer *w, PyObject *unused)
{
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->lock);
    if (w->pending > 0) pthread_cond_signal(&w->work);
    while (w->pending > 0) pthread_cond_wait(&w->room, &w->lock);
    w->failed = 0;                  /* reported by this flush: later steps are written again */
    pthread_mutex_unlock(&w->lock);
    Py_END_ALLOW_THREADS
    return writer_collect(w);
}

static void writer_stop(Writer *w)
{
    if (!w->started) return;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->lock);
    w->stop = 1;
    pthread_cond_signal(&w->work);
    pthread_mutex_unlock(&w->lock);
    pthread_join(w->thread, NULL);
    Py_END_ALLOW_THREADS
    w->started = 0;
}

/* close(): write what is queued, stop the thread; then done() */
static PyObject *Writer_close(Writer *w, PyObject *unused)
{
    writer_stop(w);
    return writer_collect(w);
}

static void Writer_dealloc(Writer *w)
{
    writer_stop(w);
    PyObject *rest = writer_collect(w);
    Py_XDECREF(rest);
    pthread_mutex_destroy(&w->lock);
    pthread_cond_destroy(&w->work);
    pthread_cond_destroy(&w->room);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyMethodDef writer_methods[] = {
    {"submit", (PyCFunction)Writer_submit, METH_VARARGS,
     "submit(index, files, wake=True) -> ticket: queue a step (blocks while max_pending are "
     "queued); wake=False leaves the idle thread to find it within its polling interval."},
    {"done", (PyCFunction)Writer_done, METH_NOARGS,
     "done() -> [(ticket, None | OSError | 'skipped')]: the steps finished since the last call."},
    {"flush", (PyCFunction)Writer_flush, METH_NOARGS,
     "flush() -> done(): wait until every queued step is written (a failure is then "
     "forgotten: later steps are written again)."},
    {"close", (PyCFunction)Writer_close, METH_NOARGS,
     "close() -> done(): write what is queued and stop the thread."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject WriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "precision_tool._reduce.Writer",
    .tp_basicsize = sizeof(Writer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Writer(max_pending=2): a thread that writes dump steps without the GIL.",
    .tp_new = Writer_new,
    .tp_dealloc = (destructor)Writer_dealloc,
    .tp_methods = writer_methods,
};
