/*
 * hicache_file._fastio: the file backend's per-page syscalls for a whole batch, run with the
 * GIL released.
 *
 * Moving one small page costs a handful of syscalls (open, writev, linkat, close; or open,
 * readv, close). Done from Python, every one of them drops and retakes the GIL, so I/O threads
 * spend their time handing the GIL to each other instead of overlapping in the kernel. Here one
 * call takes the buffers of a whole batch (with the GIL), then releases the GIL once and issues
 * every syscall of the batch on `threads` threads (the caller's included), each taking the next
 * unclaimed page until none is left. The *_pages calls also build each page's header (and
 * checksum it) here, so that Python makes no pass over the pages of a batch; Python keeps
 * everything else: paths, the format's definition, and every error decision (see
 * hicache_file._native_io).
 *
 * Every function takes an optional `threads` (default 1; at most MAX_THREADS are used, never
 * more than there are items) and returns one result per item, in item order.
 *
 *   publish_batch(items) -> list[int]
 *       items: sequence of (shard_dir: str, path: str, buffers: sequence, check_exists: bool).
 *       Per item: if check_exists and path exists -> 1. Else open an unnamed O_TMPFILE inode in
 *       shard_dir (creating shard_dir, and its parent, when they are missing), write all
 *       buffers (gathered), link it to path (linkat with AT_EMPTY_PATH when the process may,
 *       else through /proc/self/fd) and close it. Result 0 = published,
 *       1 = already present (skipped, or EEXIST from the link: another writer won and its page
 *       is kept), -errno = failed (nothing is left behind: an unlinked O_TMPFILE inode is freed
 *       by the kernel on close).
 *
 *   publish_pages_xxh3(items) -> list[int]
 *       publish_batch of whole pages, headers built here. items: sequence of (path: str,
 *       payload buffers: sequence, check_exists: bool); the shard dir is the path up to its
 *       last '/', and the key what follows it. Each file is the page header (the format of
 *       hicache_file._format: magic, version, algorithm, key length, payload length, the
 *       XXH3-64 (seed 0) of the payload computed just before the write with the GIL released,
 *       the key, zero padding to 64 bytes), then the payload. An item skipped because its path
 *       exists is not hashed. Available when HAVE_XXH3 is 1.
 *
 *   read_batch(items) -> list[int]
 *       items: sequence of (path: str, buffers: sequence of writable buffers).
 *       Per item: open, fill the buffers in order with readv until every buffer but the last is
 *       full or EOF, close. The last buffer is a probe (one spare byte): it is filled only by the
 *       readv that fills the others, so a file longer than expected shows up as extra bytes
 *       without a second readv per page just to see EOF.
 *       Result: bytes read (>= 0) or -errno (-ENOENT for a missing page).
 *
 *   read_verify_pages(items) -> list[int]
 *       items: sequence of (path: str, payload: sequence of writable buffers). Per item: open,
 *       readv into [header scratch, *payload, probe byte], close, then check the page: exactly
 *       header size + len(payload) bytes, the header equal to the one publish_pages_xxh3 writes
 *       for this path and payload length (its checksum field aside), and the XXH3-64 of the
 *       payload equal to that checksum. Result: 0 = a valid page, 1 = present but not a valid
 *       page of this size (the caller classifies it: another size, or corruption), -errno =
 *       failed (-ENOENT for a missing page). Available when HAVE_XXH3 is 1.
 *
 *   exists_batch(paths) -> list[bool]
 *       access(path, F_OK) == 0 for each path (a str): what os.access returns, without the GIL.
 *
 *   page_header(key: bytes, payload_len: int) -> bytes
 *       The header publish_pages_xxh3 and read_verify_pages build, with a zero checksum: the
 *       Python side checks it against _format's before it uses them.
 *
 *   xxh3_64(buffer) -> int
 *       The XXH3-64 (seed 0) of one buffer (GIL held), by the implementation that
 *       publish_pages_xxh3 and read_verify_pages use: the Python side checks it against
 *       xxhash.xxh3_64_intdigest before it uses them.
 *
 * All raise ValueError for a malformed item or threads < 1, TypeError for a non-buffer and BufferError for a
 * read-only buffer given to read_batch; they never raise for an I/O failure (that is a per-item
 * result). Durable (fsync) publishing stays on the Python path, where the fsync dominates.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "_fastio.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>


typedef struct {
    Item *items;
    Py_ssize_t nitems;
    Py_buffer *views;
    struct iovec *iov;
    Py_ssize_t nviews; /* views acquired so far (released on cleanup) */
    PyObject **refs;   /* strong references to the path strings used without the GIL */
    Py_ssize_t nrefs;
    unsigned char *arena; /* the *_pages shapes: each item's header (and publish: shard dir) */
} Batch;

static void batch_free(Batch *b) {
    for (Py_ssize_t i = 0; i < b->nviews; i++)
        if (b->views[i].obj != NULL) PyBuffer_Release(&b->views[i]); /* verify's empty slots */
    for (Py_ssize_t i = 0; i < b->nrefs; i++) Py_DECREF(b->refs[i]);
    PyMem_Free(b->items);
    PyMem_Free(b->views);
    PyMem_Free(b->iov);
    PyMem_Free(b->refs);
    PyMem_Free(b->arena);
    memset(b, 0, sizeof(*b));
}

static const char *keep_str(Batch *b, PyObject *s, const char *what) {
    if (!PyUnicode_Check(s)) {
        PyErr_Format(PyExc_TypeError, "%s must be a str, got %.80s", what, Py_TYPE(s)->tp_name);
        return NULL;
    }
    const char *out = PyUnicode_AsUTF8(s);
    if (out == NULL) return NULL;
    Py_INCREF(s);
    b->refs[b->nrefs++] = s;
    return out;
}

/* The item shapes batch_parse accepts. */
typedef enum {
    SHAPE_READ,          /* (path, writable buffers) */
    SHAPE_PUBLISH,       /* (shard_dir, path, buffers, check_exists) */
    SHAPE_PUBLISH_PAGES, /* (path, payload buffers, check_exists): header and shard dir from the path */
    SHAPE_VERIFY_PAGES,  /* (path, writable payload buffers): expected header from the path */
    SHAPE_PATHS,         /* a bare path: no buffers */
} Shape;

/* The key of a page path (what follows its last '/'): its byte offset in the path's UTF-8, with
 * the path's byte length in *len; -1 with an exception when there is no key or it is longer
 * than a header can hold. */
static Py_ssize_t key_offset(PyObject *path, Py_ssize_t i, Py_ssize_t *len_out) {
    Py_ssize_t len = 0;
    const char *p = PyUnicode_Check(path) ? PyUnicode_AsUTF8AndSize(path, &len) : NULL;
    if (p == NULL) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "item %zd: path must be a str", i);
        return -1;
    }
    const char *slash = strrchr(p, '/');
    Py_ssize_t at = slash == NULL ? 0 : slash - p + 1;
    if (slash == NULL || len - at < 1 || len - at > HC_MAX_KEY) {
        PyErr_Format(PyExc_ValueError, "item %zd: path must end with '/<key>' (1..%d bytes)", i, HC_MAX_KEY);
        return -1;
    }
    *len_out = len;
    return at;
}

/* Parse `items` into `b`. The *_pages shapes get a header slot before the payload buffers (the
 * header built here, in b->arena, from the key that ends the path and the payload length), and
 * SHAPE_VERIFY_PAGES also a probe slot after them, filled at read time; `count` includes them.
 * Returns 0, or -1 with an exception. */
static int batch_parse(Batch *b, PyObject *items, Shape shape) {
    memset(b, 0, sizeof(*b));
    PyObject *seq = PySequence_Fast(items, "items must be a sequence");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **elems = PySequence_Fast_ITEMS(seq);
    int publish = shape == SHAPE_PUBLISH || shape == SHAPE_PUBLISH_PAGES;
    int verify = shape == SHAPE_VERIFY_PAGES;
    int pages = shape == SHAPE_PUBLISH_PAGES || verify;
    Py_ssize_t arity = shape == SHAPE_PUBLISH ? 4 : shape == SHAPE_PUBLISH_PAGES ? 3 : 2;
    Py_ssize_t at_bufs = shape == SHAPE_PUBLISH ? 2 : 1;
    Py_ssize_t extra = verify ? 2 : pages ? 1 : 0;
    Py_ssize_t total = 0;
    size_t arena = 0;
    int paths = shape == SHAPE_PATHS;
    for (Py_ssize_t i = 0; i < n && !paths; i++) {
        PyObject *it = elems[i];
        if (!PyTuple_Check(it) || PyTuple_GET_SIZE(it) != arity) {
            PyErr_Format(PyExc_ValueError, "item %zd must be a tuple of %zd fields", i, arity);
            goto fail;
        }
        PyObject *bufs = PyTuple_GET_ITEM(it, at_bufs);
        if (!PyList_Check(bufs) && !PyTuple_Check(bufs)) {
            PyErr_Format(PyExc_TypeError, "item %zd: buffers must be a list or tuple", i);
            goto fail;
        }
        Py_ssize_t k = PySequence_Fast_GET_SIZE(bufs);
        if (k < 1 || k + extra > IOV_MAX) {
            PyErr_Format(PyExc_ValueError, "item %zd: %zd buffers (1..%zd allowed)", i, k, IOV_MAX - extra);
            goto fail;
        }
        total += k + extra;
        if (pages) {
            Py_ssize_t len, at = key_offset(PyTuple_GET_ITEM(it, 0), i, &len);
            if (at < 0) goto fail;
            arena += hc_header_size((size_t)(len - at)) + (publish ? (size_t)at + 1 : 0);
        }
    }
    b->items = PyMem_Calloc(n ? n : 1, sizeof(Item));
    b->views = PyMem_Calloc(total ? total : 1, sizeof(Py_buffer));
    b->iov = PyMem_Calloc(total ? total : 1, sizeof(struct iovec));
    b->refs = PyMem_Calloc(2 * n + 1, sizeof(PyObject *));
    b->arena = pages ? PyMem_Malloc(arena ? arena : 1) : NULL;
    if (!b->items || !b->views || !b->iov || !b->refs || (pages && !b->arena)) {
        PyErr_NoMemory();
        goto fail;
    }
    b->nitems = n;
    Py_ssize_t at = 0;
    unsigned char *next = b->arena;
    int flags = publish ? PyBUF_SIMPLE : PyBUF_WRITABLE;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *it = elems[i];
        Item *item = &b->items[i];
        if (paths) {
            item->path = keep_str(b, it, "path");
            if (item->path == NULL) goto fail;
            continue;
        }
        if (shape == SHAPE_PUBLISH) {
            item->dir = keep_str(b, PyTuple_GET_ITEM(it, 0), "shard_dir");
            if (item->dir == NULL) goto fail;
            item->path = keep_str(b, PyTuple_GET_ITEM(it, 1), "path");
        } else {
            item->path = keep_str(b, PyTuple_GET_ITEM(it, 0), "path");
        }
        if (item->path == NULL) goto fail;
        if (publish) {
            int chk = PyObject_IsTrue(PyTuple_GET_ITEM(it, arity - 1));
            if (chk < 0) goto fail;
            item->check_exists = chk;
        }
        PyObject *bufs = PyTuple_GET_ITEM(it, at_bufs);
        Py_ssize_t k = PySequence_Fast_GET_SIZE(bufs);
        PyObject **bv = PySequence_Fast_ITEMS(bufs);
        item->first = at;
        item->count = k + extra;
        if (pages) b->nviews = ++at; /* the header slot: no view (its iov is set below) */
        uint64_t payload = 0;
        for (Py_ssize_t j = 0; j < k; j++) {
            if (PyObject_GetBuffer(bv[j], &b->views[at], flags | PyBUF_C_CONTIGUOUS) < 0) goto fail;
            b->nviews = at + 1;
            b->iov[at].iov_base = b->views[at].buf;
            b->iov[at].iov_len = (size_t)b->views[at].len;
            payload += (uint64_t)b->views[at].len;
            at++;
        }
        if (verify) b->nviews = ++at; /* the probe slot */
        if (pages) { /* the header, and for a publish the shard dir: both from the path */
            const char *key = strrchr(item->path, '/') + 1; /* key_offset checked it */
            size_t klen = strlen(key), dlen = (size_t)(key - item->path);
            item->hdr = next;
            item->hdr_len = hc_header_size(klen);
            hc_build_header(next, key, klen, payload);
            next += item->hdr_len;
            b->iov[item->first].iov_base = item->hdr;
            b->iov[item->first].iov_len = item->hdr_len;
            if (publish) {
                memcpy(next, item->path, dlen);
                next[dlen] = '\0';
                item->dir = (const char *)next;
                next += dlen + 1;
            }
        }
    }
    Py_DECREF(seq);
    return 0;
fail:
    Py_DECREF(seq);
    batch_free(b);
    return -1;
}

static PyObject *batch_results(Batch *b, int as_bool) {
    PyObject *out = PyList_New(b->nitems);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < b->nitems; i++) {
        long r = b->items[i].result;
        PyObject *v = as_bool ? PyBool_FromLong(r) : PyLong_FromLong(r);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

static PyObject *xxh3_64(PyObject *self, PyObject *args) {
    Py_buffer view;
    (void)self;
    if (hc_require_xxh3() < 0 || !PyArg_ParseTuple(args, "y*:xxh3_64", &view)) return NULL;
    uint64_t sum = hc_xxh3.oneshot(view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong((unsigned long long)sum);
}

/* XXH3-64 of views[first + 1 .. first + count - probe): the payload after the header (and
 * before the probe of a read). */
static uint64_t payload_xxh3(Batch *b, Item *it, void *state, int probe) {
    Py_ssize_t lo = it->first + 1, hi = it->first + it->count - probe;
    if (hi - lo == 1) return hc_xxh3.oneshot(b->views[lo].buf, (size_t)b->views[lo].len);
    hc_xxh3.reset(state);
    for (Py_ssize_t j = lo; j < hi; j++) hc_xxh3.update(state, b->views[j].buf, (size_t)b->views[j].len);
    return hc_xxh3.digest(state);
}

/* ------------------------------------------------------------------ parallel runs
 * One call moves a whole batch: its items are shared out among `threads` threads (the caller's
 * included) that take the next unclaimed item until none is left, so a slow page (a cold
 * directory block, a page fault) never leaves a thread idle while another has a backlog. Each
 * thread has its own XXH3 state and header scratch; every item has its own buffers and result
 * slot, so no two threads touch the same memory. */
#define MAX_THREADS 64

typedef struct {
    void *state;            /* XXH3 streaming state, when the run checksums */
    unsigned char *scratch; /* header scratch + probe byte, when the run verifies */
} Local;

typedef struct Run Run;
typedef long (*item_fn)(Run *r, Item *it, Local *loc);
struct Run {
    Batch *b;
    item_fn fn;
    int sums;       /* the threads need an XXH3 state */
    size_t scratch; /* bytes of scratch per thread (0: none) */
    Py_ssize_t next;
};

static int local_init(const Run *r, Local *loc) {
    loc->state = r->sums ? hc_xxh3.create() : NULL;
    loc->scratch = r->scratch ? PyMem_RawMalloc(r->scratch) : NULL;
    if ((r->sums && loc->state == NULL) || (r->scratch && loc->scratch == NULL)) {
        if (loc->state != NULL) hc_xxh3.release(loc->state);
        PyMem_RawFree(loc->scratch);
        return -1;
    }
    return 0;
}

static void local_free(Local *loc) {
    if (loc->state != NULL) hc_xxh3.release(loc->state);
    PyMem_RawFree(loc->scratch);
}

static void drain(Run *r, Local *loc) {
    for (;;) {
        Py_ssize_t i = __atomic_fetch_add(&r->next, 1, __ATOMIC_RELAXED);
        if (i >= r->b->nitems) return;
        r->b->items[i].result = r->fn(r, &r->b->items[i], loc);
    }
}

static void *worker(void *arg) {
    Run *r = arg;
    Local loc;
    if (local_init(r, &loc) == 0) { /* else the other threads take its share */
        drain(r, &loc);
        local_free(&loc);
    }
    return NULL;
}

/* Run r->fn on every item of r->b with up to `threads` threads, the GIL released. 0, or -1
 * with MemoryError (nothing was run). A thread that cannot start leaves its share to the
 * others: the caller's thread drains the queue whatever happens. */
static int run_items(Run *r, int threads) {
    Local loc;
    if (local_init(r, &loc) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    if (threads > r->b->nitems) threads = (int)r->b->nitems;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    pthread_t tid[MAX_THREADS];
    int started = 0;
    r->next = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int t = 1; t < threads; t++)
        if (pthread_create(&tid[started], NULL, worker, r) == 0) started++;
    drain(r, &loc);
    for (int t = 0; t < started; t++) pthread_join(tid[t], NULL);
    Py_END_ALLOW_THREADS
    local_free(&loc);
    return 0;
}

/* The `threads` argument: 1..MAX_THREADS (a larger count is capped). -1 with ValueError. */
static int check_threads(int threads) {
    if (threads >= 1) return 0;
    PyErr_Format(PyExc_ValueError, "threads must be >= 1, got %d", threads);
    return -1;
}

/* Parse, run with `fn`, and return the per-item results (list[int], or list[bool] with
 * `as_bool`). */
static PyObject *run_batch(PyObject *items, Shape shape, item_fn fn, int sums, int threads, int as_bool) {
    Batch b;
    if (check_threads(threads) < 0 || batch_parse(&b, items, shape) < 0) return NULL;
    Run r = {&b, fn, sums, 0, 0};
    if (shape == SHAPE_VERIFY_PAGES) {
        size_t cap = HC_FIXED_HEADER;
        for (Py_ssize_t i = 0; i < b.nitems; i++)
            if (b.items[i].hdr_len > cap) cap = b.items[i].hdr_len;
        r.scratch = cap + 1;
    }
    PyObject *out = run_items(&r, threads) < 0 ? NULL : batch_results(&b, as_bool);
    batch_free(&b);
    return out;
}

#ifdef O_TMPFILE
static long publish_item(Run *r, Item *it, Local *loc) {
    if (hc_item_exists(it)) return 1;
    if (r->sums) { /* store the payload's XXH3-64 in the header just before the write */
        uint64_t sum = payload_xxh3(r->b, it, loc->state, 0);
        for (int k = 0; k < 8; k++) it->hdr[16 + k] = (unsigned char)(sum >> (8 * k));
    }
    return hc_publish_one(it, &r->b->iov[it->first]);
}
#endif

static PyObject *publish_common(PyObject *items, int with_sums, int threads) {
#ifndef O_TMPFILE
    (void)items;
    (void)with_sums;
    (void)threads;
    PyErr_SetString(PyExc_NotImplementedError, "O_TMPFILE is not available on this platform");
    return NULL;
#else
    return run_batch(items, with_sums ? SHAPE_PUBLISH_PAGES : SHAPE_PUBLISH, publish_item, with_sums, threads, 0);
#endif
}

static PyObject *publish_batch(PyObject *self, PyObject *args) {
    PyObject *items;
    int threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "O|i:publish_batch", &items, &threads)) return NULL;
    return publish_common(items, 0, threads);
}

static PyObject *publish_pages_xxh3(PyObject *self, PyObject *args) {
    PyObject *items;
    int threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "O|i:publish_pages_xxh3", &items, &threads)) return NULL;
    if (hc_require_xxh3() < 0) return NULL;
    return publish_common(items, 1, threads);
}

static long read_item(Run *r, Item *it, Local *loc) {
    (void)loc;
    return hc_read_one(it, &r->b->iov[it->first]);
}

/* Read one item of a SHAPE_VERIFY_PAGES batch into its payload buffers and check it against
 * its expected header (it->hdr). */
static long verify_item(Run *r, Item *it, Local *loc) {
    Batch *b = r->b;
    struct iovec *iov = &b->iov[it->first];
    const unsigned char *want = it->hdr;
    size_t hsize = it->hdr_len, payload = 0;
    unsigned char *scratch = loc->scratch, *probe = loc->scratch + r->scratch - 1;
    for (Py_ssize_t j = it->first + 1; j < it->first + it->count - 1; j++) payload += (size_t)b->views[j].len;
    iov[0].iov_base = scratch;
    iov[0].iov_len = hsize;
    iov[it->count - 1].iov_base = probe;
    iov[it->count - 1].iov_len = 1;
    long n = hc_read_one(it, iov);
    if (n < 0) return n;
    if ((size_t)n != hsize + payload || memcmp(scratch, want, 16) != 0 ||
        memcmp(scratch + 24, want + 24, hsize - 24) != 0)
        return 1;
    uint64_t stored = 0;
    for (int k = 7; k >= 0; k--) stored = (stored << 8) | scratch[16 + k];
    return payload_xxh3(b, it, loc->state, 1) == stored ? 0 : 1;
}

static PyObject *read_verify_pages(PyObject *self, PyObject *args) {
    PyObject *items;
    int threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "O|i:read_verify_pages", &items, &threads)) return NULL;
    if (hc_require_xxh3() < 0) return NULL;
    return run_batch(items, SHAPE_VERIFY_PAGES, verify_item, 1, threads, 0);
}

static PyObject *page_header(PyObject *self, PyObject *args) {
    const char *key;
    Py_ssize_t klen;
    unsigned long long payload;
    (void)self;
    if (!PyArg_ParseTuple(args, "y#K:page_header", &key, &klen, &payload)) return NULL;
    if (klen < 1 || klen > HC_MAX_KEY) {
        PyErr_Format(PyExc_ValueError, "key must be 1..%d bytes", HC_MAX_KEY);
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)hc_header_size((size_t)klen));
    if (out == NULL) return NULL;
    hc_build_header((unsigned char *)PyBytes_AS_STRING(out), key, (size_t)klen, payload);
    return out;
}

static PyObject *read_batch(PyObject *self, PyObject *args) {
    PyObject *items;
    int threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "O|i:read_batch", &items, &threads)) return NULL;
    return run_batch(items, SHAPE_READ, read_item, 0, threads, 0);
}

static long exists_item(Run *r, Item *it, Local *loc) {
    (void)r;
    (void)loc;
    return access(it->path, F_OK) == 0;
}

static PyObject *exists_batch(PyObject *self, PyObject *args) {
    PyObject *paths;
    int threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "O|i:exists_batch", &paths, &threads)) return NULL;
    return run_batch(paths, SHAPE_PATHS, exists_item, 0, threads, 1);
}

static PyMethodDef methods[] = {
    {"publish_batch", publish_batch, METH_VARARGS,
     "publish_batch(items, threads=1) -> list[int]: O_TMPFILE + linkat publish of a batch, GIL\n"
     "released. items: (shard_dir, path, buffers, check_exists) tuples. Per item: 0 published, 1\n"
     "already present, -errno failed."},
    {"publish_pages_xxh3", publish_pages_xxh3, METH_VARARGS,
     "publish_pages_xxh3(items, threads=1) -> list[int]: publish_batch of whole pages: items are\n"
     "(path, payload buffers, check_exists); the shard dir is the path's, and the header (key =\n"
     "the path's last component, payload length, XXH3-64 of the payload) is built in C."},
    {"xxh3_64", xxh3_64, METH_VARARGS,
     "xxh3_64(buffer) -> int: the XXH3-64 (seed 0) publish_pages_xxh3 and read_verify_pages use (GIL held)."},
    {"read_verify_pages", read_verify_pages, METH_VARARGS,
     "read_verify_pages(items, threads=1) -> list[int]: read each page and check its header (built\n"
     "in C from the path's key and the payload length) and checksum, GIL released. items: (path,\n"
     "payload buffers). Per item: 0 valid, 1 present but not a valid page of this size, -errno\n"
     "failed (-ENOENT: missing)."},
    {"page_header", page_header, METH_VARARGS,
     "page_header(key: bytes, payload_len: int) -> bytes: the header the *_pages calls build (checksum\n"
     "0); hicache_file._native_io checks it against _format's at import."},
    {"read_batch", read_batch, METH_VARARGS,
     "read_batch(items, threads=1) -> list[int]: open + readv + close of a batch, GIL released.\n"
     "items: (path, writable buffers) tuples. Per item: bytes read, or -errno."},
    {"exists_batch", exists_batch, METH_VARARGS,
     "exists_batch(paths, threads=1) -> list[bool]: access(path, F_OK) of each path, GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "hicache_file._fastio",
    "Batched page-file syscalls with the GIL released (see _fastio.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastio(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
#ifdef O_TMPFILE
    if (PyModule_AddIntConstant(m, "HAVE_TMPFILE", 1) < 0) goto fail;
#else
    if (PyModule_AddIntConstant(m, "HAVE_TMPFILE", 0) < 0) goto fail;
#endif
    if (PyModule_AddIntConstant(m, "IOV_MAX", IOV_MAX) < 0) goto fail;
    if (PyModule_AddIntConstant(m, "MAX_THREADS", MAX_THREADS) < 0) goto fail;
    if (PyModule_AddIntConstant(m, "HAVE_XXH3", hc_load_xxh3()) < 0) goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
