/*
 * hicache_core.native._pagehash: chained per-page SHA-256 of token ids, the native twin of
 * hicache_core/paging/hashes.py (which validates arguments and maps errors to hicache errors).
 *
 * page_hashes(tokens, page_size, prior=None, check_sign=False) -> list[str]
 *   tokens:     an exact list or tuple of ints, or a C-contiguous 1-D buffer of 32-bit integers
 *               (format I/i/L/l with itemsize 4, or B) whose bytes are little-endian words
 *   page_size:  tokens per page, > 0
 *   prior:      None or the 32 raw bytes of the digest preceding the first page
 *   check_sign: the buffer holds int32 words: reject those with the sign bit set (always done
 *               for the signed formats i and l)
 * Page i's digest is sha256(digest[i-1] || le32(t) for t in page i), digest[-1] = prior (absent
 * if None): SGLang's get_hash_str chained per page. A trailing partial page is validated but not
 * hashed. Bad ids raise TypeError / OverflowError, a list that changes size while it is read
 * raises IndexError (hashes.py maps all three to BatchShapeError).
 *
 * Safety rules this file keeps:
 * - Only the documented public C API: no struct fields of Python objects and no _Py names
 *   (tests/core/test_native.py checks the source). Lists and tuples are read with the documented
 *   PyList_GET_ITEM / PyList_GET_SIZE (PyTuple_*) macros, which skip PyList_GetItem's call and
 *   checks: the one public way to read a list's items that the limited API lacks, worth about
 *   20 us per 64K tokens (benchmarks/README.md, "The core's page hashing").
 * - Every list/tuple index is checked against the sequence's length before it is read, and the
 *   length is read again after anything that can run Python code (an item's __index__, which
 *   may mutate the list, or an error, whose allocation may run the garbage collector); the item
 *   is then read again too. Token values are copied into memory owned by the call before they
 *   are hashed, so such code can only cause an error, never an out-of-bounds read. The length
 *   is checked against the starting one at the end.
 * - Buffers are read through a Py_buffer view held for the whole call, after checking ndim,
 *   shape, itemsize, format and length. Pages are hashed with the GIL held (each page's str is
 *   made while the next page is hashed), and after every YIELD_BYTES of input the GIL is
 *   released and taken back, so a thread waiting for it gets its turn as it would from Python
 *   code. Only the view or the call's own copy of a list's words is read meanwhile.
 * - The result list is created only once all its strs exist and is filled without allocating,
 *   so no Python code (a gc callback, say) can ever see it with an empty slot.
 * - SHA-256 is OpenSSL's (libcrypto's SHA256_Init/SHA256_Update/SHA256_Final, the same code,
 *   and the same SHA-NI/AVX2 dispatch, hashlib uses through EVP); each call uses its own
 *   SHA256_CTX, on its stack.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* SHA256_Init/_Update/_Final are deprecated in OpenSSL 3.0 (in favour of EVP) but still built and
 * maintained; OpenSSL's default provider implements EVP's SHA-256 with them. Per page, EVP added
 * a context copy, provider dispatch and a context cleanse: hashing 64-token pages took about 7%
 * longer. Unlike EVP they ignore OpenSSL's provider configuration (a FIPS provider, say), which
 * is fine for hashing token ids. These two macros keep them declared and silence the
 * deprecation warnings. */
#define OPENSSL_API_COMPAT 0x10100000L
#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <stdint.h>
#include <string.h>

#if defined(OPENSSL_NO_DEPRECATED_3_0)
#error "libcrypto was built without its deprecated APIs (SHA256_Init); hicache falls back to pure Python"
#endif

#define DIGEST_BYTES 32
#define HEX_CHARS 64
#define UINT32_MAX_UL 0xFFFFFFFFUL
/* The GIL is handed over after every this many bytes of input hashed (about 50 us of work):
 * hashing with the GIL held lets each page's str be made while the next page is hashed, and
 * handing it over bounds how long another thread waits, as the interpreter does for Python code
 * (measured in benchmarks/README.md, "The core's page hashing"). */
#define YIELD_BYTES (64 * 1024)
/* Pages up to this size are copied after the previous digest into one buffer and hashed with
 * a single SHA256_Update (whole blocks straight from the buffer); larger pages take two updates
 * (no copy). */
#define SCRATCH_PAGE_BYTES 2048

static const char RANGE_HINT[] =
    "token ids are uint32 vocabulary indices: drop padding/sentinel values (e.g. -1) before hashing";

/* ---- the chain (no Python API) --------------------------------------------------------------- */

typedef struct {
    SHA256_CTX ctx;      /* re-initialised for every page (SHA256_Init only sets 8 words) */
    size_t page_bytes;   /* page_size * 4 (0 when there is no full page) */
    const uint8_t *prev; /* the digest the next page chains to: NULL (none), prior or last */
    uint8_t prior[DIGEST_BYTES];
    uint8_t scratch[DIGEST_BYTES + SCRATCH_PAGE_BYTES];
} chain_t;

/* digest = sha256(prev || page), page being page_bytes bytes; the chain then continues from
 * digest, which must stay valid until the next call. Returns 0, or -1 if OpenSSL fails. */
static int chain_page(chain_t *c, const uint8_t *page, uint8_t *digest) {
    int ok = SHA256_Init(&c->ctx);
    if (ok && c->page_bytes <= SCRATCH_PAGE_BYTES) {
        size_t n = 0;
        if (c->prev != NULL) {
            memcpy(c->scratch, c->prev, DIGEST_BYTES);
            n = DIGEST_BYTES;
        }
        memcpy(c->scratch + n, page, c->page_bytes);
        ok = SHA256_Update(&c->ctx, c->scratch, n + c->page_bytes);
    } else if (ok) {
        ok = (c->prev == NULL || SHA256_Update(&c->ctx, c->prev, DIGEST_BYTES)) &&
             SHA256_Update(&c->ctx, page, c->page_bytes);
    }
    if (!ok || !SHA256_Final(digest, &c->ctx)) return -1;
    c->prev = digest;
    return 0;
}

/* Index of the first little-endian 32-bit word with its sign bit set, or -1. */
static Py_ssize_t first_negative(const uint8_t *data, size_t n_words) {
    for (size_t i = 0; i < n_words; i++)
        if (data[4 * i + 3] & 0x80) return (Py_ssize_t)i;
    return -1;
}

static uint32_t load_le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void store_le32(uint8_t *p, uint32_t v) {
#if PY_LITTLE_ENDIAN
    memcpy(p, &v, 4); /* one store; compilers do not always merge the byte stores below */
#else
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
#endif
}

/* ---- results and errors (GIL held) ------------------------------------------------------------ */

/* Lowercase hex of one digest. Branch-free nibble arithmetic, which compilers vectorise; a
 * lookup table took three times as long. */
static void hex_digest(const uint8_t *digest, char *hex) {
    for (int i = 0; i < DIGEST_BYTES; i++) {
        const uint8_t hi = digest[i] >> 4, lo = digest[i] & 15;
        hex[2 * i] = (char)(hi + (hi > 9 ? 'a' - 10 : '0'));
        hex[2 * i + 1] = (char)(lo + (lo > 9 ? 'a' - 10 : '0'));
    }
}

/* The result: a list of the lowercase hex strs of the n full pages of data, chained from c. It
 * makes each page's str after hashing the next page: a page's SHA-256 rounds each wait on the
 * previous one's result, and the CPU runs the str's allocation and copy in those gaps. The GIL
 * is held, and released for a moment after every yield_pages pages (see YIELD_BYTES); data is
 * a held buffer view or memory the call owns, so it stays valid meanwhile. All strs are made
 * before the list exists, and filling it allocates nothing, so no Python code (a gc callback,
 * say) can ever observe the list with empty slots. */
static PyObject *hex_list(chain_t *c, const uint8_t *data, size_t n) {
    PyObject **strs, *list = NULL;
    uint8_t digests[2][DIGEST_BYTES]; /* page p's digest is digests[p % 2], kept until its str */
    const size_t yield_pages = c->page_bytes == 0 || c->page_bytes >= YIELD_BYTES ? 1 : YIELD_BYTES / c->page_bytes;
    size_t made = 0;
    if (n > (size_t)PY_SSIZE_T_MAX / sizeof(PyObject *)) return PyErr_NoMemory();
    strs = PyMem_Malloc(n * sizeof(PyObject *) + 1);
    if (strs == NULL) return PyErr_NoMemory();
    for (size_t p = 0; p <= n; p++) {
        if (p < n && chain_page(c, data + p * c->page_bytes, digests[p % 2]) < 0) {
            PyErr_SetString(PyExc_RuntimeError, "OpenSSL SHA-256 failed");
            break;
        }
        if (p > 0) {
            char hex[HEX_CHARS];
            hex_digest(digests[(p - 1) % 2], hex);
            strs[p - 1] = PyUnicode_DecodeASCII(hex, HEX_CHARS, NULL);
            if (strs[p - 1] == NULL) break;
            made = p;
        }
        if (p % yield_pages == yield_pages - 1 && p + 1 < n) PyEval_RestoreThread(PyEval_SaveThread());
    }
    if (made == n) list = PyList_New((Py_ssize_t)n);
    if (list != NULL) {
        for (size_t p = 0; p < n; p++) PyList_SetItem(list, (Py_ssize_t)p, strs[p]); /* steals */
    } else {
        for (size_t p = 0; p < made; p++) Py_DECREF(strs[p]);
    }
    PyMem_Free(strs);
    return list;
}

/* The name of obj's type as a new str reference, or NULL with an exception set. */
static PyObject *type_name(PyObject *obj) {
    PyObject *name;
#if PY_VERSION_HEX >= 0x030B0000
    name = PyType_GetName(Py_TYPE(obj));
#else
    name = PyObject_GetAttrString((PyObject *)Py_TYPE(obj), "__name__");
#endif
    if (name != NULL && !PyUnicode_Check(name)) { /* a metaclass may make __name__ anything */
        Py_DECREF(name);
        PyErr_Clear();
        name = PyUnicode_FromString("?");
    }
    return name;
}

/* Raise TypeError: token_ids[i] is not an int. Replaces the pending exception. */
static void not_an_int(Py_ssize_t i, PyObject *item) {
    PyObject *name;
    PyErr_Clear();
    name = type_name(item);
    if (name == NULL) return;
    PyErr_Format(PyExc_TypeError,
                 "token_ids[%zd] is a %U, not an int; token ids must be a flat (1-D) sequence of ints", i,
                 name);
    Py_DECREF(name);
}

/* Raise OverflowError: token_ids[i] = value is out of range. value is an exact int, so reading
 * it runs no user code; values beyond 64 bits are described, not printed, as their decimal
 * form may exceed the interpreter's int-to-str digit limit. Replaces the pending exception. */
static void out_of_range(Py_ssize_t i, PyObject *value) {
    int overflow = 0;
    long long v;
    PyErr_Clear();
    v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (v == -1 && PyErr_Occurred()) return;
    if (overflow != 0)
        PyErr_Format(PyExc_OverflowError, "token_ids[%zd] = %s is outside [0, 2**32); %s", i,
                     overflow < 0 ? "<an int below -2**63>" : "<an int of 2**63 or more>", RANGE_HINT);
    else
        PyErr_Format(PyExc_OverflowError, "token_ids[%zd] = %lld is outside [0, 2**32); %s", i, v, RANGE_HINT);
}

/* out_of_range for an int (or int subclass) item: PyNumber_Index gives an exact copy of its
 * value without calling any of the subclass's methods. */
static void int_out_of_range(Py_ssize_t i, PyObject *item) {
    PyObject *exact;
    PyErr_Clear();
    exact = PyNumber_Index(item);
    if (exact == NULL) return;
    out_of_range(i, exact);
    Py_DECREF(exact);
}

static void changed_size(void) {
    PyErr_SetString(PyExc_IndexError,
                    "token_ids changed size while being hashed (an item's __index__ mutated the list)");
}

/* ---- sequences (GIL held) --------------------------------------------------------------------- */

/* The uint32 value of an item that is not an exact int (item: a strong reference). Int
 * subclasses are read without calling their methods; other objects go through __index__,
 * which may run arbitrary Python code. Returns 0, or -1 with an exception set. */
static int slow_token_value(Py_ssize_t i, PyObject *item, uint32_t *out) {
    PyObject *idx;
    unsigned long v;
    if (PyLong_Check(item)) {
        v = PyLong_AsUnsignedLong(item);
        if ((v == (unsigned long)-1 && PyErr_Occurred()) || v > UINT32_MAX_UL) {
            int_out_of_range(i, item);
            return -1;
        }
        *out = (uint32_t)v;
        return 0;
    }
    idx = PyNumber_Index(item);
    if (idx == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) not_an_int(i, item);
        return -1; /* any other exception raised by __index__ propagates unchanged */
    }
    v = PyLong_AsUnsignedLong(idx);
    if ((v == (unsigned long)-1 && PyErr_Occurred()) || v > UINT32_MAX_UL) {
        out_of_range(i, idx);
        Py_DECREF(idx);
        return -1;
    }
    Py_DECREF(idx);
    *out = (uint32_t)v;
    return 0;
}

#if defined(__GNUC__) || defined(__clang__)
#define ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE inline
#endif

/* The length of an exact list or tuple, or one of its items (a borrowed reference, valid only
 * until Python code runs); i must be checked against seq_size first. */
#define seq_size(seq, is_list) ((is_list) ? PyList_GET_SIZE(seq) : PyTuple_GET_SIZE(seq))
#define seq_item(seq, is_list, i) ((is_list) ? PyList_GET_ITEM(seq, i) : PyTuple_GET_ITEM(seq, i))

/* Convert an exact list or tuple of n items to little-endian uint32 words at out (n * 4 bytes,
 * owned by the caller). Items are read in order, as array('I', seq) reads them, so both
 * implementations see the same items; a list that is too short when an item is read, or whose
 * length is no longer n at the end, is an error. is_list is a constant at both call sites, so
 * each gets a loop without the list/tuple test. */
static ALWAYS_INLINE int items_to_le32(PyObject *seq, const int is_list, Py_ssize_t n, uint8_t *out) {
    /* The length as last read. Only the slow path below can run Python code: a successful
     * PyLong_AsUnsignedLong reads an int without allocating or calling anything. */
    Py_ssize_t size = n;
    for (Py_ssize_t i = 0; i < n; i++, out += 4) {
        PyObject *item;
        if (i >= size) {
            changed_size();
            return -1;
        }
        item = seq_item(seq, is_list, i);
        {
            /* Any int (an int subclass too: read without calling its methods) converts here;
             * anything else (not an int: PyLong_AsUnsignedLong raises without calling the
             * object), or a value out of range, takes the slow path. Where unsigned long has
             * 64 bits the error value is above the limit and the compiler drops PyErr_Occurred. */
            const unsigned long v = PyLong_AsUnsignedLong(item);
            if (v <= UINT32_MAX_UL && (v != (unsigned long)-1 || !PyErr_Occurred())) {
                store_le32(out, (uint32_t)v);
                continue;
            }
            PyErr_Clear();
        }
        {
            uint32_t slow = 0;
            int rc;
            /* Raising the error allocated: the garbage collector may have run Python code. */
            size = seq_size(seq, is_list);
            if (i >= size) {
                changed_size();
                return -1;
            }
            item = seq_item(seq, is_list, i);
            Py_INCREF(item); /* __index__ may drop the list's reference */
            rc = slow_token_value(i, item, &slow);
            Py_DECREF(item);
            if (rc < 0) return -1;
            store_le32(out, slow);
            size = seq_size(seq, is_list);
        }
    }
    if (size != n) {
        changed_size();
        return -1;
    }
    return 0;
}

static int sequence_to_le32(PyObject *seq, int is_list, Py_ssize_t n, uint8_t *out) {
    return is_list ? items_to_le32(seq, 1, n, out) : items_to_le32(seq, 0, n, out);
}

/* ---- buffers ---------------------------------------------------------------------------------- */

/* Check that view is a C-contiguous 1-D buffer of 32-bit integers (or of bytes holding them)
 * and set *is_signed. Returns 0, or -1 with TypeError set. */
static int check_buffer(const Py_buffer *view, int *is_signed) {
    const char *fmt = view->format != NULL ? view->format : "B";
    char code;
    if (view->ndim != 1 || view->shape == NULL || view->len < 0 || view->shape[0] < 0 ||
        view->itemsize <= 0 || view->shape[0] > PY_SSIZE_T_MAX / view->itemsize ||
        view->shape[0] * view->itemsize != view->len) {
        PyErr_SetString(PyExc_TypeError, "token buffer must be a C-contiguous 1-D buffer of token ids");
        return -1;
    }
    /* '<' is little-endian, and so is native order on the hosts hashes.py passes it from: on
     * big-endian hosts it byte-swaps the words first, so the bytes are little-endian anyway. */
    if (*fmt == '@' || *fmt == '=' || *fmt == '<') fmt++;
    code = *fmt;
    if (code == '\0' || fmt[1] != '\0' || strchr("IiLlB", code) == NULL ||
        view->itemsize != (code == 'B' ? 1 : 4) || view->len % 4 != 0) {
        PyErr_Format(PyExc_TypeError,
                     "token buffer has format '%s' and item size %zd; need 32-bit integers (format I, i, L "
                     "or l with 4-byte items, or B with a multiple of 4 bytes)",
                     view->format != NULL ? view->format : "B", view->itemsize);
        return -1;
    }
    *is_signed = code == 'i' || code == 'l';
    return 0;
}

/* Raise OverflowError for the first int32 word of data (n_words little-endian words) with its
 * sign bit set and return -1, or return 0 if there is none. */
static int check_signs(const uint8_t *data, size_t n_words) {
    const Py_ssize_t negative = first_negative(data, n_words);
    PyObject *value;
    if (negative < 0) return 0;
    value = PyLong_FromLong((long)(int32_t)load_le32(data + 4 * (size_t)negative));
    if (value != NULL) {
        out_of_range(negative, value);
        Py_DECREF(value);
    }
    return -1;
}

/* ---- the entry point -------------------------------------------------------------------------- */

static PyObject *py_page_hashes(PyObject *self, PyObject *args) {
    PyObject *tokens, *prior_obj = Py_None, *out = NULL;
    Py_ssize_t page_size;
    int check_sign = 0, have_view = 0;
    size_t n_words = 0, n_pages = 0;
    const uint8_t *data = NULL;
    uint8_t *owned = NULL; /* the words of a list or tuple */
    Py_buffer view;
    chain_t chain;
    (void)self;
    if (!PyArg_ParseTuple(args, "On|Op:page_hashes", &tokens, &page_size, &prior_obj, &check_sign))
        return NULL;
    if (page_size <= 0)
        return PyErr_Format(PyExc_ValueError, "page_size must be a positive int, got %zd", page_size);
    memset(&chain, 0, offsetof(chain_t, scratch));
    if (prior_obj != Py_None) {
        char *raw;
        Py_ssize_t raw_len;
        if (!PyBytes_Check(prior_obj) || PyBytes_AsStringAndSize(prior_obj, &raw, &raw_len) < 0 ||
            raw_len != DIGEST_BYTES) {
            PyErr_Clear();
            return PyErr_Format(PyExc_ValueError, "prior must be None or 32 raw digest bytes");
        }
        memcpy(chain.prior, raw, DIGEST_BYTES);
        chain.prev = chain.prior;
    }

    if (PyList_CheckExact(tokens) || PyTuple_CheckExact(tokens)) {
        /* Converted in full before hashing: item __index__ methods may run Python code. */
        const int is_list = PyList_CheckExact(tokens);
        const Py_ssize_t n = seq_size(tokens, is_list);
        if ((size_t)n > (size_t)PY_SSIZE_T_MAX / 4) {
            PyErr_NoMemory();
            goto done;
        }
        owned = PyMem_Malloc((size_t)n * 4 + 1);
        if (owned == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        if (sequence_to_le32(tokens, is_list, n, owned) < 0) goto done;
        data = owned;
        n_words = (size_t)n;
        check_sign = 0;
    } else {
        int is_signed = 0;
        if (PyObject_GetBuffer(tokens, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) goto done;
        have_view = 1;
        if (check_buffer(&view, &is_signed) < 0) goto done;
        data = view.buf;
        n_words = (size_t)view.len / 4;
        check_sign = check_sign || is_signed;
    }

    if (check_sign && check_signs(data, n_words) < 0) goto done;
    n_pages = n_words / (size_t)page_size; /* n_pages * 32 <= n_words * 8 <= 2 * PY_SSIZE_T_MAX */
    /* With a full page, page_size <= n_words <= PY_SSIZE_T_MAX / 4: the product cannot overflow. */
    chain.page_bytes = n_pages > 0 ? (size_t)page_size * 4 : 0;
    out = hex_list(&chain, data, n_pages);

done:
    if (have_view) PyBuffer_Release(&view);
    PyMem_Free(owned);
    return out;
}

static PyMethodDef methods[] = {
    {"page_hashes", py_page_hashes, METH_VARARGS,
     "page_hashes(tokens, page_size, prior=None, check_sign=False) -> list[str]\n\n"
     "Chained per-page sha256 hex digests; see hicache_core.paging.hashes.page_hashes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "hicache_core.native._pagehash",
    "Native chained page hashing (OpenSSL SHA-256) for hicache_core.paging.hashes.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__pagehash(void) {
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    if (PyModule_AddStringConstant(m, "SHA256_IMPL", OpenSSL_version(OPENSSL_VERSION)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
