/*
 * hicache_core._batchops: one-pass checks and builders for the controller's per-batch hot path
 * (see hicache_core/_batch.py, which holds the pure-Python twins of these functions).
 *
 * Right after a batch has moved megabytes the CPU caches are cold, and each pass the interpreter
 * makes over a batch costs tens of microseconds; each function here makes one. Each answers
 * only the usual case and returns None (or False) for anything else, so that the Python
 * caller falls back to its exact checks, which raise the typed error.
 *
 * valid_hashes(seq) -> bool
 *   seq is an exact list/tuple of exact str page hashes: 1-128 characters from [A-Za-z0-9_-],
 *   the first one from [A-Za-z0-9].
 * valid_keys(seq) -> bool
 *   seq is an exact list/tuple of exact str storage keys (hicache_core.check_key): 1-255
 *   characters from [A-Za-z0-9._-], the first one from [A-Za-z0-9], never "..".
 * index_tuple(seq, limit) -> tuple | None
 *   seq is an exact list/tuple of exact ints in [0, limit): those ints as a tuple (seq itself if
 *   it is a tuple).
 * page_keys(prefixes, hashes) -> list[tuple[str, ...]] | None
 *   [tuple(p + h for p in prefixes) for h in hashes] when prefixes is a tuple of ASCII str and
 *   hashes a list or tuple (a tuple subclass read as a tuple: callers pass only ValidHashes) of
 *   ASCII exact str.
 * bool_flags(obj, n) -> list | None
 *   obj is an exact list of n exact bools: a copy of it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define MAX_HASH_LEN 128
#define MAX_KEY_LEN 255

/* bit 1: [A-Za-z0-9_-] (in a hash); bit 2: [A-Za-z0-9] (may start a hash or key); bit 4:
 * [A-Za-z0-9._-] (in a key) */
static unsigned char char_class[256];

static void init_classes(void) {
    for (int c = 0; c < 256; c++) {
        int alnum = (c >= '0' && c <= '9') || (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z');
        int mark = c == '_' || c == '-';
        char_class[c] = (unsigned char)((alnum || mark ? 1 : 0) | (alnum ? 2 : 0) | (alnum || mark || c == '.' ? 4 : 0));
    }
}

static int is_seq(PyObject *obj) { return PyList_CheckExact(obj) || PyTuple_CheckExact(obj); }

/* 1: an exact ASCII str; 0: not one; -1: error set */
static int exact_ascii(PyObject *s) {
    if (!PyUnicode_CheckExact(s)) return 0;
    if (PyUnicode_READY(s) < 0) return -1;
    return PyUnicode_IS_ASCII(s) ? 1 : 0;
}

/* Whether seq is an exact list/tuple of exact ASCII str names of 1..max_len characters, the
 * first from [A-Za-z0-9], the others of class `body` (HASH_BODY or KEY_BODY, see char_class),
 * with no ".." when `no_dots`. 1 yes, 0 no, -1 error set. */
#define HASH_BODY 1
#define KEY_BODY 4
static int valid_names(PyObject *seq, Py_ssize_t max_len, unsigned char body, int no_dots) {
    if (!is_seq(seq)) return 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        int ok = exact_ascii(items[i]);
        if (ok <= 0) return ok;
        Py_ssize_t len = PyUnicode_GET_LENGTH(items[i]);
        if (len < 1 || len > max_len) return 0;
        const unsigned char *c = PyUnicode_1BYTE_DATA(items[i]);
        if (!(char_class[c[0]] & 2)) return 0;
        for (Py_ssize_t j = 1; j < len; j++) {
            if (!(char_class[c[j]] & body) || (no_dots && c[j] == '.' && c[j - 1] == '.')) return 0;
        }
    }
    return 1;
}

static PyObject *names_result(int ok) {
    if (ok < 0) return NULL;
    return PyBool_FromLong(ok);
}

static PyObject *py_valid_hashes(PyObject *self, PyObject *seq) {
    (void)self;
    return names_result(valid_names(seq, MAX_HASH_LEN, HASH_BODY, 0));
}

static PyObject *py_valid_keys(PyObject *self, PyObject *seq) {
    (void)self;
    return names_result(valid_names(seq, MAX_KEY_LEN, KEY_BODY, 1));
}

/* The (object, size) arguments of index_tuple and bool_flags. 0, or -1 with an exception. */
static int object_and_size(PyObject *const *args, Py_ssize_t nargs, const char *usage, PyObject **obj,
                           Py_ssize_t *size) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s takes 2 arguments", usage);
        return -1;
    }
    *obj = args[0];
    *size = PyLong_AsSsize_t(args[1]);
    return *size == -1 && PyErr_Occurred() ? -1 : 0;
}

static PyObject *py_index_tuple(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    PyObject *seq;
    Py_ssize_t limit;
    if (object_and_size(args, nargs, "index_tuple(seq, limit)", &seq, &limit) < 0) return NULL;
    if (!is_seq(seq)) Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = items[i];
        if (!PyLong_CheckExact(v)) Py_RETURN_NONE;
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow || x < 0 || x >= (long long)limit) Py_RETURN_NONE;
    }
    if (PyTuple_CheckExact(seq)) return Py_NewRef(seq);
    return PyList_AsTuple(seq);
}

/* prefix + h, both ASCII: one allocation and two copies */
static PyObject *concat_ascii(PyObject *prefix, PyObject *h) {
    Py_ssize_t lp = PyUnicode_GET_LENGTH(prefix), lh = PyUnicode_GET_LENGTH(h);
    PyObject *out = PyUnicode_New(lp + lh, 127);
    if (out == NULL) return NULL;
    unsigned char *dst = PyUnicode_1BYTE_DATA(out);
    memcpy(dst, PyUnicode_1BYTE_DATA(prefix), (size_t)lp);
    memcpy(dst + lp, PyUnicode_1BYTE_DATA(h), (size_t)lh);
    return out;
}

static PyObject *py_page_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "page_keys(prefixes, hashes) takes 2 arguments");
        return NULL;
    }
    PyObject *prefixes = args[0], *hashes = args[1];
    /* tuple subclasses too: the caller passes only ValidHashes, which iterates as a tuple */
    if (!PyTuple_CheckExact(prefixes) || !(PyList_CheckExact(hashes) || PyTuple_Check(hashes))) Py_RETURN_NONE;
    Py_ssize_t np = PyTuple_GET_SIZE(prefixes);
    for (Py_ssize_t j = 0; j < np; j++) {
        int ok = exact_ascii(PyTuple_GET_ITEM(prefixes, j));
        if (ok < 0) return NULL;
        if (!ok) Py_RETURN_NONE;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    PyObject **items = PySequence_Fast_ITEMS(hashes);
    for (Py_ssize_t i = 0; i < n; i++) {
        int ok = exact_ascii(items[i]);
        if (ok < 0) return NULL;
        if (!ok) Py_RETURN_NONE;
    }
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyTuple_New(np);
        if (row == NULL) goto fail;
        PyList_SET_ITEM(out, i, row);
        for (Py_ssize_t j = 0; j < np; j++) {
            PyObject *key = concat_ascii(PyTuple_GET_ITEM(prefixes, j), items[i]);
            if (key == NULL) goto fail;
            PyTuple_SET_ITEM(row, j, key);
        }
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *py_bool_flags(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    PyObject *obj;
    Py_ssize_t n;
    if (object_and_size(args, nargs, "bool_flags(obj, n)", &obj, &n) < 0) return NULL;
    if (!PyList_CheckExact(obj) || PyList_GET_SIZE(obj) != n) Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBool_Check(PyList_GET_ITEM(obj, i))) Py_RETURN_NONE;
    }
    return PyList_GetSlice(obj, 0, n);
}

static PyMethodDef methods[] = {
    {"valid_hashes", py_valid_hashes, METH_O,
     "valid_hashes(seq) -> bool: an exact list/tuple of valid page hashes (False: check in Python)."},
    {"valid_keys", py_valid_keys, METH_O,
     "valid_keys(seq) -> bool: an exact list/tuple of valid storage keys (False: check in Python)."},
    {"index_tuple", (PyCFunction)(void (*)(void))py_index_tuple, METH_FASTCALL,
     "index_tuple(seq, limit) -> tuple | None: exact ints in [0, limit) as a tuple."},
    {"page_keys", (PyCFunction)(void (*)(void))py_page_keys, METH_FASTCALL,
     "page_keys(prefixes, hashes) -> list[tuple[str, ...]] | None: ASCII prefix + hash per page."},
    {"bool_flags", (PyCFunction)(void (*)(void))py_bool_flags, METH_FASTCALL,
     "bool_flags(obj, n) -> list | None: a copy of an exact list of n bools."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "hicache_core._batchops",
    "One-pass batch checks and builders for the controller's hot path (see _batch.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__batchops(void) {
    init_classes();
    return PyModule_Create(&moduledef);
}
