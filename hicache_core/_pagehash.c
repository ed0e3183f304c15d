/*
 * hicache_core._pagehash -- chained per-page SHA-256 of token ids, in C.
 *
 * page_hashes(tokens, page_size, prior, check_sign) -> list[str]
 *
 *   tokens     list/tuple of ints, or a C-contiguous buffer holding 4-byte little-endian words
 *   page_size  tokens per page (> 0); a trailing partial page is ignored
 *   prior      None or the 32 raw bytes of the hash that precedes the first page
 *   check_sign the buffer holds int32 words: reject words with the sign bit set
 *
 * Page i's digest is sha256(digest[i-1] || le32(token) for each token of the page), with
 * digest[-1] = prior (absent when None), exactly as SGLang's get_hash_str chained per page.
 * Out-of-range ids raise OverflowError and non-integers TypeError; hicache_core._hashing
 * turns both into BatchShapeError.  The chain runs without the GIL for large inputs.
 *
 * SHA-256 uses the x86 SHA extensions when the CPU has them (runtime cpuid check), else a
 * portable C implementation.  No OpenSSL headers or libraries are needed.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HC_HAVE_SHANI 1
#include <cpuid.h>
#include <immintrin.h>
#endif

typedef void (*compress_fn)(uint32_t state[8], const uint8_t *data, size_t nblocks);

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static const uint32_t IV256[8] = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
};

/* ---- portable compression function ------------------------------------------------------ */

#define ROR32(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static inline uint32_t load_be32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}

static void compress_portable(uint32_t state[8], const uint8_t *data, size_t nblocks) {
    uint32_t w[64];
    while (nblocks--) {
        uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
        uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
        for (int i = 0; i < 16; i++) w[i] = load_be32(data + 4 * i);
        for (int i = 16; i < 64; i++) {
            uint32_t s0 = ROR32(w[i - 15], 7) ^ ROR32(w[i - 15], 18) ^ (w[i - 15] >> 3);
            uint32_t s1 = ROR32(w[i - 2], 17) ^ ROR32(w[i - 2], 19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16] + s0 + w[i - 7] + s1;
        }
        for (int i = 0; i < 64; i++) {
            uint32_t t1 = h + (ROR32(e, 6) ^ ROR32(e, 11) ^ ROR32(e, 25)) + ((e & f) ^ (~e & g)) + K256[i] + w[i];
            uint32_t t2 = (ROR32(a, 2) ^ ROR32(a, 13) ^ ROR32(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
        }
        state[0] += a; state[1] += b; state[2] += c; state[3] += d;
        state[4] += e; state[5] += f; state[6] += g; state[7] += h;
        data += 64;
    }
}

/* ---- x86 SHA-NI compression function ---------------------------------------------------- */

#ifdef HC_HAVE_SHANI
#define HC_SHA_TARGET __attribute__((target("sha,sse4.1,ssse3")))

/* Four rounds with schedule words W (group g of 16). */
#define RND4(W, g)                                                                   \
    do {                                                                             \
        __m128i m_ = _mm_add_epi32((W), _mm_loadu_si128((const __m128i *)&K256[4 * (g)])); \
        s1 = _mm_sha256rnds2_epu32(s1, s0, m_);                                      \
        m_ = _mm_shuffle_epi32(m_, 0x0E);                                            \
        s0 = _mm_sha256rnds2_epu32(s0, s1, m_);                                      \
    } while (0)

/* W0 <- next four schedule words from W0..W3 (the last 16 words, oldest first). */
#define SCHED(W0, W1, W2, W3)                                                                 \
    do {                                                                                      \
        W0 = _mm_add_epi32(_mm_sha256msg1_epu32(W0, W1), _mm_alignr_epi8(W3, W2, 4));         \
        W0 = _mm_sha256msg2_epu32(W0, W3);                                                    \
    } while (0)

HC_SHA_TARGET static void compress_shani(uint32_t state[8], const uint8_t *data, size_t nblocks) {
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i tmp = _mm_loadu_si128((const __m128i *)&state[0]);      /* DCBA */
    __m128i s1 = _mm_loadu_si128((const __m128i *)&state[4]);       /* HGFE */
    tmp = _mm_shuffle_epi32(tmp, 0xB1);                             /* CDAB */
    s1 = _mm_shuffle_epi32(s1, 0x1B);                               /* EFGH */
    __m128i s0 = _mm_alignr_epi8(tmp, s1, 8);                       /* ABEF */
    s1 = _mm_blend_epi16(s1, tmp, 0xF0);                            /* CDGH */
    while (nblocks--) {
        const __m128i abef = s0, cdgh = s1;
        __m128i w0 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(data + 0)), bswap);
        __m128i w1 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(data + 16)), bswap);
        __m128i w2 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(data + 32)), bswap);
        __m128i w3 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(data + 48)), bswap);
        RND4(w0, 0); RND4(w1, 1); RND4(w2, 2); RND4(w3, 3);
        SCHED(w0, w1, w2, w3); RND4(w0, 4);
        SCHED(w1, w2, w3, w0); RND4(w1, 5);
        SCHED(w2, w3, w0, w1); RND4(w2, 6);
        SCHED(w3, w0, w1, w2); RND4(w3, 7);
        SCHED(w0, w1, w2, w3); RND4(w0, 8);
        SCHED(w1, w2, w3, w0); RND4(w1, 9);
        SCHED(w2, w3, w0, w1); RND4(w2, 10);
        SCHED(w3, w0, w1, w2); RND4(w3, 11);
        SCHED(w0, w1, w2, w3); RND4(w0, 12);
        SCHED(w1, w2, w3, w0); RND4(w1, 13);
        SCHED(w2, w3, w0, w1); RND4(w2, 14);
        SCHED(w3, w0, w1, w2); RND4(w3, 15);
        s0 = _mm_add_epi32(s0, abef);
        s1 = _mm_add_epi32(s1, cdgh);
        data += 64;
    }
    tmp = _mm_shuffle_epi32(s0, 0x1B);                              /* FEBA */
    s1 = _mm_shuffle_epi32(s1, 0xB1);                               /* DCHG */
    s0 = _mm_blend_epi16(tmp, s1, 0xF0);                            /* DCBA */
    s1 = _mm_alignr_epi8(s1, tmp, 8);                               /* HGFE */
    _mm_storeu_si128((__m128i *)&state[0], s0);
    _mm_storeu_si128((__m128i *)&state[4], s1);
}

static int cpu_has_shani(void) {
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    if (!(c & (1u << 9)) || !(c & (1u << 19))) return 0; /* SSSE3, SSE4.1 */
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (b & (1u << 29)) != 0; /* SHA */
}
#endif

static compress_fn g_compress = compress_portable;

/* ---- one page: sha256(prev? || data[0:len]) ---------------------------------------------- */

static void hash_page(const uint8_t *prev, const uint8_t *data, size_t len, uint8_t out[32]) {
    uint32_t st[8];
    uint8_t buf[128];
    size_t fill = 0, off = 0;
    const uint64_t bits = ((uint64_t)len + (prev ? 32u : 0u)) * 8u;
    memcpy(st, IV256, sizeof st);
    if (prev) {
        size_t take = len < 32 ? len : 32;
        memcpy(buf, prev, 32);
        memcpy(buf + 32, data, take);
        off = take;
        fill = 32 + take;
        if (fill == 64) {
            g_compress(st, buf, 1);
            fill = 0;
        }
    }
    if (fill == 0) {
        size_t nblocks = (len - off) / 64;
        if (nblocks) {
            g_compress(st, data + off, nblocks);
            off += nblocks * 64;
        }
        fill = len - off;
        memcpy(buf, data + off, fill);
    }
    /* Padding: 0x80, zeros, 64-bit big-endian bit length. */
    buf[fill++] = 0x80;
    size_t end = fill + 8 <= 64 ? 64 : 128;
    memset(buf + fill, 0, end - fill - 8);
    for (int i = 0; i < 8; i++) buf[end - 1 - i] = (uint8_t)(bits >> (8 * i));
    g_compress(st, buf, end / 64);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(st[i] >> 24);
        out[4 * i + 1] = (uint8_t)(st[i] >> 16);
        out[4 * i + 2] = (uint8_t)(st[i] >> 8);
        out[4 * i + 3] = (uint8_t)st[i];
    }
}

static void hash_chain(const uint8_t *data, size_t page_bytes, size_t n_pages, const uint8_t *prior,
                       uint8_t *digests) {
    const uint8_t *prev = prior;
    for (size_t p = 0; p < n_pages; p++) {
        hash_page(prev, data + p * page_bytes, page_bytes, digests + 32 * p);
        prev = digests + 32 * p;
    }
}

/* Index of the first 4-byte LE word with its sign bit set, or -1. */
static Py_ssize_t first_negative(const uint8_t *data, size_t n_words) {
    for (size_t i = 0; i < n_words; i++)
        if (data[4 * i + 3] & 0x80) return (Py_ssize_t)i;
    return -1;
}

/* Convert a list/tuple of ints to LE uint32 words (with the GIL held). */
static int sequence_to_le32(PyObject *seq, uint8_t *out, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PySequence_Fast_GET_SIZE(seq) != n) {
            PyErr_SetString(PyExc_RuntimeError, "token_ids changed size while being hashed");
            return -1;
        }
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        unsigned long v;
        Py_INCREF(item);
        if (PyLong_Check(item)) {
            v = PyLong_AsUnsignedLong(item);
        } else {
            PyObject *idx = PyNumber_Index(item);
            if (idx == NULL) {
                Py_DECREF(item);
                PyErr_Format(PyExc_TypeError,
                             "token_ids[%zd] is a %.100s, not an int; token ids must be a flat (1-D) "
                             "sequence of ints",
                             i, Py_TYPE(item)->tp_name);
                return -1;
            }
            v = PyLong_AsUnsignedLong(idx);
            Py_DECREF(idx);
        }
        if ((v == (unsigned long)-1 && PyErr_Occurred()) || v > 0xFFFFFFFFUL) {
            PyErr_Clear();
            PyErr_Format(PyExc_OverflowError,
                         "token_ids[%zd] = %R is outside [0, 2**32); token ids are uint32 vocabulary "
                         "indices: drop padding/sentinel values (e.g. -1) before hashing",
                         i, item);
            Py_DECREF(item);
            return -1;
        }
        Py_DECREF(item);
        out[4 * i] = (uint8_t)v;
        out[4 * i + 1] = (uint8_t)(v >> 8);
        out[4 * i + 2] = (uint8_t)(v >> 16);
        out[4 * i + 3] = (uint8_t)(v >> 24);
    }
    return 0;
}

#define HC_NOGIL_MIN_BYTES (64 * 1024) /* below this, keep the GIL: re-acquiring it can cost ms */

static PyObject *hex_list(const uint8_t *digests, size_t n_pages) {
    static const char hexd[] = "0123456789abcdef";
    PyObject *list = PyList_New((Py_ssize_t)n_pages);
    if (list == NULL) return NULL;
    for (size_t p = 0; p < n_pages; p++) {
        PyObject *s = PyUnicode_New(64, 127);
        if (s == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        Py_UCS1 *dst = PyUnicode_1BYTE_DATA(s);
        const uint8_t *d = digests + 32 * p;
        for (int i = 0; i < 32; i++) {
            dst[2 * i] = (Py_UCS1)hexd[d[i] >> 4];
            dst[2 * i + 1] = (Py_UCS1)hexd[d[i] & 15];
        }
        PyList_SET_ITEM(list, (Py_ssize_t)p, s);
    }
    return list;
}

static PyObject *py_page_hashes(PyObject *self, PyObject *args) {
    PyObject *tokens, *prior_obj = Py_None, *result = NULL;
    Py_ssize_t page_size;
    int check_sign = 0;
    uint8_t prior[32], *digests = NULL, *owned = NULL;
    const uint8_t *data;
    Py_buffer view = {0};
    int have_view = 0;
    size_t n_words;
    (void)self;
    if (!PyArg_ParseTuple(args, "On|Op:page_hashes", &tokens, &page_size, &prior_obj, &check_sign)) return NULL;
    if (page_size <= 0 || page_size > PY_SSIZE_T_MAX / 4) {
        PyErr_Format(PyExc_ValueError, "page_size must be a positive int, got %zd", page_size);
        return NULL;
    }
    if (prior_obj != Py_None) {
        if (!PyBytes_Check(prior_obj) || PyBytes_GET_SIZE(prior_obj) != 32) {
            PyErr_SetString(PyExc_ValueError, "prior must be None or 32 raw digest bytes");
            return NULL;
        }
        memcpy(prior, PyBytes_AS_STRING(prior_obj), 32);
    }
    if (PyList_Check(tokens) || PyTuple_Check(tokens)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(tokens);
        n_words = (size_t)n;
        owned = PyMem_Malloc(n_words * 4 + 1);
        if (owned == NULL) return PyErr_NoMemory();
        if (sequence_to_le32(tokens, owned, n) < 0) goto done;
        data = owned;
    } else {
        if (PyObject_GetBuffer(tokens, &view, PyBUF_SIMPLE) < 0) goto done;
        have_view = 1;
        if (view.len % 4) {
            PyErr_Format(PyExc_ValueError, "token buffer is %zd bytes, not a whole number of 4-byte ids",
                         view.len);
            goto done;
        }
        n_words = (size_t)view.len / 4;
        data = (const uint8_t *)view.buf;
    }
    {
        const size_t page_bytes = (size_t)page_size * 4;
        const size_t n_pages = n_words / (size_t)page_size;
        Py_ssize_t bad = -1;
        digests = PyMem_Malloc(n_pages * 32 + 1);
        if (digests == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        if (n_words * 4 >= HC_NOGIL_MIN_BYTES) {
            Py_BEGIN_ALLOW_THREADS
            if (check_sign) bad = first_negative(data, n_words);
            if (bad < 0) hash_chain(data, page_bytes, n_pages, prior_obj == Py_None ? NULL : prior, digests);
            Py_END_ALLOW_THREADS
        } else {
            if (check_sign) bad = first_negative(data, n_words);
            if (bad < 0) hash_chain(data, page_bytes, n_pages, prior_obj == Py_None ? NULL : prior, digests);
        }
        if (bad >= 0) {
            const uint8_t *w = data + 4 * bad;
            const int32_t v = (int32_t)((uint32_t)w[0] | (uint32_t)w[1] << 8 | (uint32_t)w[2] << 16 |
                                        (uint32_t)w[3] << 24);
            PyErr_Format(PyExc_OverflowError,
                         "token_ids[%zd] = %ld is outside [0, 2**32); token ids are uint32 vocabulary "
                         "indices: drop padding/sentinel values (e.g. -1) before hashing",
                         bad, (long)v);
            goto done;
        }
        result = hex_list(digests, n_pages);
    }
done:
    if (have_view) PyBuffer_Release(&view);
    PyMem_Free(owned);
    PyMem_Free(digests);
    return result;
}

static const char *impl_name(void) { return g_compress == compress_portable ? "portable" : "sha-ni"; }

/* Test hook: select the compression function ("portable" or "sha-ni"); returns the previous one. */
static PyObject *py_set_sha256_impl(PyObject *self, PyObject *arg) {
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    PyObject *previous = PyUnicode_FromString(impl_name());
    (void)self;
    if (previous == NULL) return NULL;
    if (name != NULL && strcmp(name, "portable") == 0) {
        g_compress = compress_portable;
        return previous;
    }
#ifdef HC_HAVE_SHANI
    if (name != NULL && strcmp(name, "sha-ni") == 0 && cpu_has_shani()) {
        g_compress = compress_shani;
        return previous;
    }
#endif
    Py_DECREF(previous);
    PyErr_Format(PyExc_ValueError, "unsupported SHA-256 implementation %R on this CPU", arg);
    return NULL;
}

static PyMethodDef methods[] = {
    {"set_sha256_impl", py_set_sha256_impl, METH_O,
     "set_sha256_impl(name) -> previous name; 'portable' or 'sha-ni' (test hook)."},
    {"page_hashes", py_page_hashes, METH_VARARGS,
     "page_hashes(tokens, page_size, prior=None, check_sign=False) -> list[str]\n\n"
     "Chained per-page sha256 hex digests; see hicache_core._hashing.page_hashes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "hicache_core._pagehash",
    "Native chained page hashing for hicache_core._hashing.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__pagehash(void) {
#ifdef HC_HAVE_SHANI
    if (cpu_has_shani()) g_compress = compress_shani;
#endif
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    if (PyModule_AddStringConstant(m, "SHA256_IMPL", impl_name()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
