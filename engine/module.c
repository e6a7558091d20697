/* ucl._engine: the thin C layer. Parse arguments, release the GIL, do the work, return.
   Docstrings, argument checks and error mapping live in the Python wrappers (ucl/_native.py). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include "crc32c.h"
#include "reader.h"
#include "writer.h"

/* crc32c(buffer, value=0) -> int */
static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned int value = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &view, &value)) return NULL;
    uint32_t crc;
    if (view.len >= 65536) {
        Py_BEGIN_ALLOW_THREADS
        crc = ucl_crc32c(value, view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        crc = ucl_crc32c(value, view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *py_crc32c_hw(PyObject *self, PyObject *noargs) { return PyBool_FromLong(ucl_crc32c_hw()); }

/* ---- Pool: the write engine ------------------------------------------------------------------
   The buffers of a job are acquired at submit and released when the job is reaped, with the GIL
   held, exactly once (nviews drops to 0). Job bookkeeping here is guarded by the GIL alone. */
typedef struct pyjob {
    struct pyjob *next;
    long long id;
    ucl_job *job;
    Py_buffer *views;
    Py_ssize_t nviews;
    int claimed; /* a wait() has it, with the GIL released */
} pyjob;

typedef struct {
    PyObject_HEAD
    ucl_pool *pool;
    pyjob *jobs, *last; /* oldest first: waits in submission order find theirs at the head */
    long long next_id;
} PoolObject;

static void release_views(pyjob *pj) {
    for (Py_ssize_t i = 0; i < pj->nviews; i++) PyBuffer_Release(&pj->views[i]);
    pj->nviews = 0;
}

static void drop_job(PoolObject *self, pyjob *pj) {
    pyjob **link = &self->jobs, *prev = NULL;
    while (*link != pj) {
        prev = *link;
        link = &(*link)->next;
    }
    *link = pj->next;
    if (self->last == pj) self->last = prev;
    release_views(pj);
    PyMem_Free(pj->views);
    ucl_job_free(pj->job);
    PyMem_Free(pj);
}

/* An errno from the engine, outside any job. */
static PyObject *raise_errno(int err) {
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

static int started(PoolObject *self) {
    if (!self->pool) PyErr_SetString(PyExc_RuntimeError, "Pool was not started");
    return self->pool != NULL;
}

static int pool_init(PoolObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"threads", "direct", "segment", "sync", NULL};
    int threads, direct, sync = 1;
    Py_ssize_t segment;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "ipn|p", kwlist, &threads, &direct, &segment, &sync)) return -1;
    if (self->pool) {
        PyErr_SetString(PyExc_RuntimeError, "Pool already started");
        return -1;
    }
    ucl_pool *pool;
    Py_BEGIN_ALLOW_THREADS
    pool = ucl_pool_start(threads, direct, (size_t)segment, sync);
    Py_END_ALLOW_THREADS
    if (!pool) {
        raise_errno(errno);
        return -1;
    }
    self->pool = pool;
    self->next_id = 1;
    return 0;
}

/* submit(path: bytes, buffers: sequence, checksum: bool = True) -> job id */
static PyObject *pool_submit(PoolObject *self, PyObject *args) {
    if (!started(self)) return NULL;
    const char *path;
    PyObject *buffers;
    int checksum = 1;
    if (!PyArg_ParseTuple(args, "yO|p", &path, &buffers, &checksum)) return NULL;
    PyObject *seq = PySequence_Fast(buffers, "buffers must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    pyjob *pj = PyMem_Calloc(1, sizeof *pj);
    Py_buffer *views = PyMem_Calloc(n ? (size_t)n : 1, sizeof *views);
    ucl_job *job = ucl_job_new(path, (size_t)n);
    if (!pj || !views || !job) {
        PyErr_NoMemory();
        goto fail;
    }
    pj->views = views;
    pj->job = job;
    ucl_job_set_checksum(job, checksum);
    ucl_span *spans = ucl_job_spans(job);
    for (; pj->nviews < n; pj->nviews++) {
        Py_buffer *v = &views[pj->nviews];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, pj->nviews), v, PyBUF_SIMPLE)) goto fail;
        spans[pj->nviews] = (ucl_span){v->buf, (size_t)v->len};
    }
    int err = ucl_pool_submit(self->pool, job);
    if (err) {
        raise_errno(err);
        goto fail;
    }
    Py_DECREF(seq);
    pj->id = self->next_id++;
    if (self->last) self->last->next = pj;
    else self->jobs = pj;
    self->last = pj;
    return PyLong_FromLongLong(pj->id);
fail:
    if (pj) release_views(pj);
    PyMem_Free(views);
    ucl_job_free(job);
    PyMem_Free(pj);
    Py_DECREF(seq);
    return NULL;
}

static pyjob *find_job(PoolObject *self, long long id) {
    for (pyjob *pj = self->jobs; pj; pj = pj->next)
        if (pj->id == id) return pj;
    return NULL;
}

/* wait(job, timeout: float, < 0 forever) -> None on timeout, else
   (errno, op, offset, nbytes, crc, direct, path); the job is reaped. */
static PyObject *pool_wait(PoolObject *self, PyObject *args) {
    if (!started(self)) return NULL;
    long long id;
    double timeout;
    if (!PyArg_ParseTuple(args, "Ld", &id, &timeout)) return NULL;
    pyjob *pj = find_job(self, id);
    if (!pj || pj->claimed) {
        PyErr_Format(PyExc_KeyError, "no job %lld to wait for", id);
        return NULL;
    }
    ucl_result res;
    int rc;
    pj->claimed = 1;
    Py_BEGIN_ALLOW_THREADS
    rc = ucl_job_wait(self->pool, pj->job, timeout, &res);
    Py_END_ALLOW_THREADS
    pj->claimed = 0;
    if (rc) Py_RETURN_NONE;
    PyObject *out = Py_BuildValue("isKKkiy", res.err, res.err ? res.op : "", (unsigned long long)res.offset,
                                  (unsigned long long)res.nbytes, (unsigned long)res.crc, res.direct,
                                  ucl_job_path(pj->job));
    drop_job(self, pj);
    return out;
}

/* jobs() -> list of the ids not yet reaped, oldest first */
static PyObject *pool_jobs(PoolObject *self, PyObject *noargs) {
    if (!started(self)) return NULL;
    PyObject *out = PyList_New(0);
    for (pyjob *pj = self->jobs; out && pj; pj = pj->next) {
        PyObject *id = PyLong_FromLongLong(pj->id);
        if (!id || PyList_Append(out, id)) Py_CLEAR(out);
        Py_XDECREF(id);
    }
    return out;
}

/* Releases the buffers of every finished job; their results stay for wait(). */
static void release_done(PoolObject *self) {
    for (pyjob *pj = self->jobs; pj; pj = pj->next)
        if (pj->nviews && ucl_job_done(self->pool, pj->job)) release_views(pj);
}

/* hold(on: bool): while held, the threads start nothing new (ucl_pool_hold) */
static PyObject *pool_hold(PoolObject *self, PyObject *args) {
    if (!started(self)) return NULL;
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    ucl_pool_hold(self->pool, on);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* close(timeout: float, < 0 forever) -> True once every thread is joined, False on timeout */
static PyObject *pool_close(PoolObject *self, PyObject *args) {
    if (!started(self)) return NULL;
    double timeout;
    if (!PyArg_ParseTuple(args, "d", &timeout)) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ucl_pool_close(self->pool, timeout);
    Py_END_ALLOW_THREADS
    release_done(self);
    return PyBool_FromLong(rc == 0);
}

static void pool_dealloc(PoolObject *self) {
    if (self->pool) {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = ucl_pool_close(self->pool, 10.0); /* a backstop: FileWriter.close() comes first */
        Py_END_ALLOW_THREADS
        if (rc == 0) {
            while (self->jobs) drop_job(self, self->jobs);
            ucl_pool_free(self->pool);
        } else {
            /* A thread is still in a system call: leak the pool, and the buffers it may still read. */
            release_done(self);
        }
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef pool_methods[] = {
    {"submit", (PyCFunction)pool_submit, METH_VARARGS, NULL},
    {"wait", (PyCFunction)pool_wait, METH_VARARGS, NULL},
    {"jobs", (PyCFunction)pool_jobs, METH_NOARGS, NULL},
    {"close", (PyCFunction)pool_close, METH_VARARGS, NULL},
    {"hold", (PyCFunction)pool_hold, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ucl._engine.Pool",
    .tp_basicsize = sizeof(PoolObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)pool_init,
    .tp_dealloc = (destructor)pool_dealloc,
    .tp_methods = pool_methods,
};

/* ---- functions ------------------------------------------------------------------------------ */
/* fsync_dir(path: bytes) -> errno (0: done) */
static PyObject *py_fsync_dir(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "y", &path)) return NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = ucl_fsync_dir(path);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(err);
}

/* map_file(buffer: writable, at: int, length: int, fd: int, offset: int) -> errno (0: done)
   Maps [offset, offset + length) of fd copy-on-write over bytes [at, at + length) of buffer, which must
   be a mapping of its own (an anonymous mmap object that keeps it: closing it unmaps all of it); the
   bytes are then the file's page-cache pages, no copy. Page-aligned, checked here. */
static PyObject *py_map_file(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t at, length;
    int fd;
    long long offset;
    if (!PyArg_ParseTuple(args, "w*nniL", &view, &at, &length, &fd, &offset)) return NULL;
    long page = sysconf(_SC_PAGESIZE);
    char *addr = (char *)view.buf + at;
    int err = 0;
    if (at < 0 || length <= 0 || at + length > view.len || offset < 0 || (uintptr_t)addr % (uintptr_t)page ||
        length % page || offset % page) {
        err = EINVAL;
    } else {
        void *got;
        Py_BEGIN_ALLOW_THREADS
        got = mmap(addr, (size_t)length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd, (off_t)offset);
        Py_END_ALLOW_THREADS
        if (got == MAP_FAILED) err = errno;
    }
    PyBuffer_Release(&view);
    return PyLong_FromLong(err);
}

/* inject_fault(kind: int, nth: int, errno: int) */
static PyObject *py_inject_fault(PyObject *self, PyObject *args) {
    int kind, err;
    unsigned int nth;
    if (!PyArg_ParseTuple(args, "iIi", &kind, &nth, &err)) return NULL;
    ucl_fault_set(kind, nth, err);
    Py_RETURN_NONE;
}

/* device_write(path: bytes, nbytes, block, inflight) -> (errno, seconds) */
static PyObject *py_device_write(PyObject *self, PyObject *args) {
    const char *path;
    unsigned long long nbytes;
    Py_ssize_t block;
    int inflight, err;
    double seconds = 0;
    if (!PyArg_ParseTuple(args, "yKni", &path, &nbytes, &block, &inflight)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    err = ucl_device_write(path, nbytes, (size_t)block, inflight, &seconds);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("id", err, seconds);
}

/* json_lint(buffer) -> (depth, wide_int): the nesting depth of a JSON text (arrays and objects, the
 * outermost counted as 1) and whether it holds an integer token outside [-2^63, 2^64) (spec/core.md
 * §8.4), in one pass over the bytes, before a parser recurses or converts 20,000-digit numbers. Strings
 * are skipped with their escapes; the text is not otherwise checked (the parser does that). */
static PyObject *py_json_lint(PyObject *self, PyObject *args) {
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "y*", &buf)) return NULL;
    const unsigned char *p = buf.buf, *end = p + buf.len;
    long long depth = 0, deepest = 0;
    int wide = 0;
    Py_BEGIN_ALLOW_THREADS
    while (p < end) {
        unsigned char c = *p;
        if (c == '"') {
            for (p++; p < end && *p != '"'; p++)
                if (*p == '\\') p++;
            p++;
        } else if (c == '[' || c == '{') {
            if (++depth > deepest) deepest = depth;
            p++;
        } else if (c == ']' || c == '}') {
            depth--;
            p++;
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            int neg = c == '-', frac = 0;
            if (neg) p++;
            const unsigned char *d = p;
            while (p < end && *p >= '0' && *p <= '9') p++;
            size_t nd = (size_t)(p - d);
            while (p < end && (*p == '.' || *p == 'e' || *p == 'E' || *p == '+' || *p == '-' ||
                               (*p >= '0' && *p <= '9'))) {
                frac = 1;
                p++;
            }
            if (!frac && nd >= 19) {  /* 2^63 = 9223372036854775808, 2^64 - 1 = 18446744073709551615 */
                const char *lim = neg ? "9223372036854775808" : "18446744073709551615";
                size_t nl = strlen(lim);
                if (nd > nl || (nd == nl && memcmp(d, lim, nl) > 0)) wide = 1;
            }
        } else {
            p++;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    return Py_BuildValue("Li", deepest, wide);
}

/* read_segments(segs, chunks, tails, status, crcs, bufs, buf_len) -> None: the bulk read engine
   (reader.h) over packed tables (ucl/read/bulk.py builds them). The tables are checked against each
   other here, so that no index or offset in them reaches outside a buffer; destination addresses are the
   caller's (memory it holds for the call). */
static PyObject *py_read_segments(PyObject *self, PyObject *args) {
    Py_buffer v[6];
    Py_ssize_t buf_len;
    memset(v, 0, sizeof v);
    if (!PyArg_ParseTuple(args, "y*y*y*w*w*y*n", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &buf_len))
        return NULL;
    const ucl_rseg *segs = v[0].buf;
    const ucl_rchunk *chunks = v[1].buf;
    size_t nseg = (size_t)v[0].len / sizeof(ucl_rseg), nchunk = (size_t)v[1].len / sizeof(ucl_rchunk);
    size_t nbufs = (size_t)v[5].len / sizeof(uint64_t);
    const char *bad = NULL;
    if ((size_t)v[0].len % sizeof(ucl_rseg) || (size_t)v[1].len % sizeof(ucl_rchunk) || (size_t)v[5].len % 8)
        bad = "a table's size is not a multiple of its entry's";
    else if ((size_t)v[3].len < nseg * 4 || (size_t)v[4].len < nchunk * 4)
        bad = "an output is smaller than its table";
    else if (nbufs < 1 || buf_len < 0 || buf_len % 4096)
        bad = "no buffer, or a buffer length that is not a multiple of 4096";
    for (size_t i = 0; !bad && i < nseg; i++) {
        const ucl_rseg *s = &segs[i];
        if (s->first > nchunk || s->nchunks > nchunk - s->first) bad = "a segment's chunks outside the chunk table";
        else if (s->tail_off > (uint64_t)v[2].len || s->tail_len > (uint64_t)v[2].len - s->tail_off)
            bad = "a segment's tail outside the tails";
        else if (s->length > (1ull << 40) || s->tail_len > (1ull << 40) || s->offset > (1ull << 62))
            bad = "a segment too large";
        else if (ucl_read_span(s) > (uint64_t)buf_len) bad = "a segment larger than the buffers";
        for (uint64_t k = 0; !bad && k < s->nchunks; k++) {
            const ucl_rchunk *c = &chunks[s->first + k];
            if (c->nbytes < 4 || c->off > s->length || c->nbytes > s->length - c->off)
                bad = "a chunk outside its segment";
        }
    }
    if (!bad) {
        char *bufs[64];
        int n = nbufs > 64 ? 64 : (int)nbufs;
        for (int t = 0; t < n; t++) bufs[t] = (char *)(uintptr_t)((const uint64_t *)v[5].buf)[t];
        for (int t = 0; t < n && !bad; t++)
            if ((uintptr_t)bufs[t] % 4096) bad = "a buffer that is not 4 KiB-aligned";
        if (!bad) {
            Py_BEGIN_ALLOW_THREADS
            ucl_read_segments(segs, nseg, chunks, v[2].buf, v[3].buf, v[4].buf, bufs, n, (size_t)buf_len);
            Py_END_ALLOW_THREADS
        }
    }
    for (int i = 0; i < 6; i++) PyBuffer_Release(&v[i]);
    if (bad) {
        PyErr_Format(PyExc_ValueError, "read_segments: %s", bad);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"crc32c", py_crc32c, METH_VARARGS, NULL},
    {"crc32c_hw", py_crc32c_hw, METH_NOARGS, NULL},
    {"fsync_dir", py_fsync_dir, METH_VARARGS, NULL},
    {"map_file", py_map_file, METH_VARARGS, NULL},
    {"inject_fault", py_inject_fault, METH_VARARGS, NULL},
    {"device_write", py_device_write, METH_VARARGS, NULL},
    {"json_lint", py_json_lint, METH_VARARGS, NULL},
    {"read_segments", py_read_segments, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, .m_name = "ucl._engine", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__engine(void) {
    if (PyType_Ready(&PoolType)) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Pool", (PyObject *)&PoolType) ||
        PyModule_AddIntConstant(m, "FAULT_NONE", UCL_FAULT_NONE) ||
        PyModule_AddIntConstant(m, "FAULT_PWRITE", UCL_FAULT_PWRITE) ||
        PyModule_AddIntConstant(m, "FAULT_SHORT_WRITE", UCL_FAULT_SHORT_WRITE) ||
        PyModule_AddIntConstant(m, "FAULT_FDATASYNC", UCL_FAULT_FDATASYNC) ||
        PyModule_AddIntConstant(m, "FAULT_NO_DIRECT", UCL_FAULT_NO_DIRECT) ||
        PyModule_AddIntConstant(m, "FAULT_STALL", UCL_FAULT_STALL) ||
        PyModule_AddIntConstant(m, "READ_OK", UCL_READ_OK)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
