/*
 * hicache_core._pagehash: chained per-page SHA-256 of token ids (see hicache_core/_hashing.py).
 *
 * page_hashes(tokens, page_size, prior=None, check_sign=False) -> list[str]
 *   tokens: a list/tuple of ints, or a C-contiguous buffer of 4-byte little-endian words
 *   prior: None or the 32 raw bytes of the hash preceding the first page
 *   check_sign: the buffer holds int32 words; reject those with the sign bit set
 * Page i's digest is sha256(digest[i-1] || le32(t) for t in page i), digest[-1] = prior (absent if
 * None), exactly SGLang's get_hash_str chained per page; a trailing partial page is ignored.
 * Bad ids raise OverflowError / TypeError (mapped to BatchShapeError by the Python wrapper).
 * Buffers of >= 64 KiB are hashed without the GIL; lists are converted page by page with the GIL
 * held (reading them needs it) and each page hashed at once, overlapping conversion and hashing.
 * SHA-256 uses the x86 SHA extensions when cpuid reports them, else portable C; no OpenSSL needed.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#if PY_VERSION_HEX < 0x030B0000
#include <longintrepr.h>
#endif
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HC_HAVE_SHANI 1
#include <cpuid.h>
#include <immintrin.h>
#endif

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

/* ---- hex ---------------------------------------------------------------------------------- */

/* Lowercase hex of one 32-byte digest into 64 bytes of a compact ASCII str. */
static void hex32_portable(const uint8_t *d, Py_UCS1 *dst) {
    static const char hexd[] = "0123456789abcdef";
    for (int i = 0; i < 32; i++) {
        dst[2 * i] = (Py_UCS1)hexd[d[i] >> 4];
        dst[2 * i + 1] = (Py_UCS1)hexd[d[i] & 15];
    }
}

#ifdef HC_HAVE_SHANI
/* Lowercase hex of the 16 bytes in x into dst[0:32]. */
__attribute__((target("ssse3"))) static inline void hex16_ssse3(__m128i x, Py_UCS1 *dst) {
    const __m128i lut = _mm_setr_epi8('0', '1', '2', '3', '4', '5', '6', '7', '8', '9', 'a', 'b', 'c', 'd',
                                      'e', 'f');
    const __m128i low4 = _mm_set1_epi8(0x0f);
    __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(x, 4), low4));
    __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(x, low4));
    _mm_storeu_si128((__m128i *)dst, _mm_unpacklo_epi8(hi, lo));
    _mm_storeu_si128((__m128i *)(dst + 16), _mm_unpackhi_epi8(hi, lo));
}
#endif

/* The character buffer of item p of a private list of 64-char ASCII strs (safe without the GIL). */
#define HEX_DST(list, p) PyUnicode_1BYTE_DATA(PyList_GET_ITEM((list), (Py_ssize_t)(p)))

/* A chain in progress: pages hashed so far end with digest last (if have_last). */
typedef struct {
    size_t page_bytes;
    PyObject *list;   /* the result: one private 64-char str per page, written without the GIL */
    uint8_t *scratch; /* page_bytes + 128 bytes, for the portable chain */
    uint8_t last[32];
    int have_last;
} chain_t;

/* ---- portable SHA-256 -------------------------------------------------------------------- */

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
            uint32_t t1 = h + (ROR32(e, 6) ^ ROR32(e, 11) ^ ROR32(e, 25)) + ((e & f) ^ (~e & g));
            t1 += K256[i] + w[i];
            uint32_t t2 = (ROR32(a, 2) ^ ROR32(a, 13) ^ ROR32(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
        }
        state[0] += a; state[1] += b; state[2] += c; state[3] += d;
        state[4] += e; state[5] += f; state[6] += g; state[7] += h;
        data += 64;
    }
}

/* ---- x86 SHA-NI ------------------------------------------------------------------------- */

#ifdef HC_HAVE_SHANI
#define HC_SHA_TARGET __attribute__((target("sha,sse4.1,ssse3")))
#define HC_SHA_INLINE HC_SHA_TARGET static inline __attribute__((always_inline))

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

/* One 64-byte block; w0..w3 are the message words (lane i = word i) and s0/s1 the state. */
HC_SHA_INLINE void sha_block(__m128i *ps0, __m128i *ps1, __m128i w0, __m128i w1, __m128i w2, __m128i w3) {
    __m128i s0 = *ps0, s1 = *ps1;
    const __m128i abef = s0, cdgh = s1;
    RND4(w0, 0); RND4(w1, 1); RND4(w2, 2); RND4(w3, 3);
    for (int g = 4; g < 16; g += 4) {
        SCHED(w0, w1, w2, w3); RND4(w0, g);
        SCHED(w1, w2, w3, w0); RND4(w1, g + 1);
        SCHED(w2, w3, w0, w1); RND4(w2, g + 2);
        SCHED(w3, w0, w1, w2); RND4(w3, g + 3);
    }
    *ps0 = _mm_add_epi32(s0, abef);
    *ps1 = _mm_add_epi32(s1, cdgh);
}

#define LOADW(p) _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p)), bswap)

/* The ABEF/CDGH register layout used by sha256rnds2 -> state words a..d, e..h (lane i = word i). */
HC_SHA_INLINE void from_abef(__m128i s0, __m128i s1, __m128i *dcba, __m128i *hgfe) {
    __m128i tmp = _mm_shuffle_epi32(s0, 0x1B);                      /* FEBA */
    s1 = _mm_shuffle_epi32(s1, 0xB1);                               /* DCHG */
    *dcba = _mm_blend_epi16(tmp, s1, 0xF0);                         /* DCBA */
    *hgfe = _mm_alignr_epi8(s1, tmp, 8);                            /* HGFE */
}

/* Pages p0..p0+n_pages-1 with the state in registers; the previous digest feeds the next page's
 * first block as message words directly (no byte round trip).  Needs page_bytes >= 32. */
HC_SHA_TARGET static void chain_shani(chain_t *c, const uint8_t *data, size_t n_pages, size_t p0) {
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    const __m128i iv0 = _mm_set_epi32(0x6a09e667, (int)0xbb67ae85, 0x510e527f, (int)0x9b05688c); /* ABEF */
    const __m128i iv1 = _mm_set_epi32(0x3c6ef372, (int)0xa54ff53a, 0x1f83d9ab, 0x5be0cd19);      /* CDGH */
    const size_t page_bytes = c->page_bytes;
    __m128i pw0 = LOADW(c->last), pw1 = LOADW(c->last + 16);
    uint8_t tail[128];
    int have_prev = c->have_last, tail_for = -1; /* the have_prev value tail[]'s padding is for */
    size_t end = 64;
    for (size_t p = 0; p < n_pages; p++) {
        const uint8_t *src = data + p * page_bytes;
        size_t rem = page_bytes - (have_prev ? 32 : 0);
        __m128i s0 = iv0, s1 = iv1;
        if (tail_for != have_prev) { /* padding: 0x80, zeros, 64-bit big-endian bit length */
            const uint64_t bits = ((uint64_t)page_bytes + (have_prev ? 32u : 0u)) * 8u;
            const size_t r = rem % 64;
            end = r + 9 <= 64 ? 64 : 128;
            memset(tail, 0, sizeof tail);
            tail[r] = 0x80;
            for (int i = 0; i < 8; i++) tail[end - 1 - i] = (uint8_t)(bits >> (8 * i));
            tail_for = have_prev;
        }
        if (have_prev) {
            sha_block(&s0, &s1, pw0, pw1, LOADW(src), LOADW(src + 16));
            src += 32;
        }
        for (; rem >= 64; rem -= 64, src += 64)
            sha_block(&s0, &s1, LOADW(src), LOADW(src + 16), LOADW(src + 32), LOADW(src + 48));
        memcpy(tail, src, rem);
        sha_block(&s0, &s1, LOADW(tail), LOADW(tail + 16), LOADW(tail + 32), LOADW(tail + 48));
        if (end == 128)
            sha_block(&s0, &s1, LOADW(tail + 64), LOADW(tail + 80), LOADW(tail + 96), LOADW(tail + 112));
        from_abef(s0, s1, &pw0, &pw1);
        /* The hex output overlaps with the next page's latency-bound rounds. */
        hex16_ssse3(_mm_shuffle_epi8(pw0, bswap), HEX_DST(c->list, p0 + p));
        hex16_ssse3(_mm_shuffle_epi8(pw1, bswap), HEX_DST(c->list, p0 + p) + 32);
        have_prev = 1;
    }
    _mm_storeu_si128((__m128i *)c->last, _mm_shuffle_epi8(pw0, bswap));
    _mm_storeu_si128((__m128i *)(c->last + 16), _mm_shuffle_epi8(pw1, bswap));
    c->have_last = have_prev;
}

static int cpu_has_shani(void) {
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    if (!(c & (1u << 9)) || !(c & (1u << 19))) return 0; /* SSSE3, SSE4.1 */
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (b & (1u << 29)) != 0; /* SHA */
}
#else
static int cpu_has_shani(void) { return 0; }
#endif

static int g_use_shani = 0; /* chain_shani (for pages of >= 8 tokens) instead of chain_portable */

/* Portable chain: scratch receives prev || page || padding for each page. */
static void chain_portable(chain_t *c, const uint8_t *data, size_t n_pages, size_t p0) {
    const size_t page_bytes = c->page_bytes;
    uint8_t *scratch = c->scratch;
    for (size_t p = 0; p < n_pages; p++) {
        uint32_t st[8];
        size_t len = c->have_last ? 32 : 0, padded;
        memcpy(scratch, c->last, 32);
        memcpy(scratch + len, data + p * page_bytes, page_bytes);
        len += page_bytes;
        padded = (len + 9 + 63) / 64 * 64; /* 0x80, zeros, 64-bit big-endian bit length */
        memset(scratch + len, 0, padded - len);
        scratch[len] = 0x80;
        for (int i = 0; i < 8; i++) scratch[padded - 1 - i] = (uint8_t)(((uint64_t)len * 8u) >> (8 * i));
        memcpy(st, IV256, sizeof st);
        compress_portable(st, scratch, padded / 64);
        for (int i = 0; i < 32; i++) c->last[i] = (uint8_t)(st[i / 4] >> (24 - 8 * (i % 4)));
        hex32_portable(c->last, HEX_DST(c->list, p0 + p));
        c->have_last = 1;
    }
}

/* Hash pages p0..p0+n_pages-1 (their tokens at data) onto the chain.  No GIL needed. */
static void chain_pages(chain_t *c, const uint8_t *data, size_t n_pages, size_t p0) {
#ifdef HC_HAVE_SHANI
    if (g_use_shani && c->page_bytes >= 32) {
        chain_shani(c, data, n_pages, p0);
        return;
    }
#endif
    chain_portable(c, data, n_pages, p0);
}

/* Index of the first LE int32 word with the sign bit set, or -1. */
static Py_ssize_t first_negative(const uint8_t *data, size_t n_words) {
    for (size_t i = 0; i < n_words; i++)
        if (data[4 * i + 3] & 0x80) return (Py_ssize_t)i;
    return -1;
}

/* Exact ints that fit in one machine word: read the value without a call (CPython internals). */
static inline int small_int_value(PyObject *item, long *out) {
#if PY_VERSION_HEX >= 0x030C0000
    if (PyLong_CheckExact(item) && PyUnstable_Long_IsCompact((PyLongObject *)item)) {
        *out = (long)PyUnstable_Long_CompactValue((PyLongObject *)item);
        return 1;
    }
#else
    if (PyLong_CheckExact(item) && (Py_SIZE(item) == 0 || Py_SIZE(item) == 1)) {
        *out = Py_SIZE(item) ? (long)((PyLongObject *)item)->ob_digit[0] : 0;
        return 1;
    }
#endif
    return 0;
}

static int token_error(Py_ssize_t i, PyObject *item) {
    int not_int = PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_OverflowError);
    PyErr_Clear();
    if (not_int)
        return PyErr_Format(PyExc_TypeError,
                            "token_ids[%zd] is a %.100s, not an int; token ids must be a flat (1-D) sequence "
                            "of ints", i, Py_TYPE(item)->tp_name), -1;
    PyErr_Format(PyExc_OverflowError,
                 "token_ids[%zd] = %R is outside [0, 2**32); token ids are uint32 vocabulary indices: drop "
                 "padding/sentinel values (e.g. -1) before hashing",
                 i, item);
    return -1;
}

/* Convert seq[start:end] (a list/tuple of n ints) to LE uint32 words at out, with the GIL held.
 * Items `ahead` positions on are prefetched: int objects are scattered over the heap. */
static int sequence_to_le32(PyObject *seq, Py_ssize_t n, Py_ssize_t start, Py_ssize_t end, Py_ssize_t ahead,
                            uint8_t *out) {
    for (Py_ssize_t i = start; i < end; i++, out += 4) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        long small;
        unsigned long v;
#if defined(__GNUC__) || defined(__clang__)
        if (i + ahead < n) __builtin_prefetch(PySequence_Fast_GET_ITEM(seq, i + ahead));
#endif
        if (small_int_value(item, &small)) {
            if (small < 0 || (unsigned long)small > 0xFFFFFFFFUL) return token_error(i, item);
            v = (unsigned long)small;
        } else {
            /* __index__ may run Python code that mutates the list: hold the item, recheck the size. */
            PyObject *idx;
            Py_INCREF(item);
            idx = PyNumber_Index(item);
            v = idx ? PyLong_AsUnsignedLong(idx) : (unsigned long)-1;
            Py_XDECREF(idx);
            if ((v == (unsigned long)-1 && PyErr_Occurred()) || v > 0xFFFFFFFFUL) token_error(i, item);
            Py_DECREF(item);
            if (PyErr_Occurred()) return -1;
            if (PySequence_Fast_GET_SIZE(seq) != n) {
                PyErr_SetString(PyExc_RuntimeError, "token_ids changed size while being hashed");
                return -1;
            }
        }
        for (int k = 0; k < 4; k++) out[k] = (uint8_t)(v >> (8 * k));
    }
    return 0;
}

#define HC_NOGIL_MIN_BYTES (64 * 1024) /* below this, keep the GIL: re-acquiring it can cost ms */

/* A list of n uninitialised 64-char ASCII strs, filled in by the chain. */
static PyObject *new_hex_list(size_t n_pages) {
    PyObject *list = PyList_New((Py_ssize_t)n_pages);
    for (size_t p = 0; list != NULL && p < n_pages; p++) {
        PyObject *s = PyUnicode_New(64, 127);
        if (s == NULL) Py_CLEAR(list);
        else PyList_SET_ITEM(list, (Py_ssize_t)p, s);
    }
    return list;
}

/* list/tuple input: convert each page (GIL held, as reading the list requires) and hash it right
 * away, so the memory-bound conversion overlaps the latency-bound SHA rounds of the previous page. */
static int hash_sequence(chain_t *c, PyObject *seq, size_t page_size) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), ps = (Py_ssize_t)page_size;
    const Py_ssize_t ahead = ps < 16 ? 16 : ps > 1024 ? 1024 : ps;
    uint8_t *page = PyMem_Malloc((size_t)(n < ps ? n : ps) * 4 + 4);
    int rc = 0;
    if (page == NULL) return PyErr_NoMemory(), -1;
    for (Py_ssize_t p = 0; rc == 0 && p < n / ps; p++) {
        rc = sequence_to_le32(seq, n, p * ps, (p + 1) * ps, ahead, page);
        if (rc == 0) chain_pages(c, page, 1, (size_t)p);
    }
    if (rc == 0) rc = sequence_to_le32(seq, n, n - n % ps, n, ahead, page); /* validate the partial page */
    PyMem_Free(page);
    return rc;
}

/* Buffer input: hash it all, without the GIL when large. */
static int hash_buffer(chain_t *c, const uint8_t *data, size_t n_words, size_t page_size, int check_sign) {
    Py_ssize_t bad = -1;
    if (n_words * 4 >= HC_NOGIL_MIN_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        if (check_sign) bad = first_negative(data, n_words);
        if (bad < 0) chain_pages(c, data, n_words / page_size, 0);
        Py_END_ALLOW_THREADS
    } else {
        if (check_sign) bad = first_negative(data, n_words);
        if (bad < 0) chain_pages(c, data, n_words / page_size, 0);
    }
    if (bad >= 0) {
        const uint8_t *w = data + 4 * bad;
        const uint32_t u = (uint32_t)w[0] | (uint32_t)w[1] << 8 | (uint32_t)w[2] << 16 | (uint32_t)w[3] << 24;
        PyObject *v = PyLong_FromLong((long)(int32_t)u);
        if (v != NULL) token_error(bad, v);
        Py_XDECREF(v);
        return -1;
    }
    return 0;
}

static PyObject *py_page_hashes(PyObject *self, PyObject *args) {
    PyObject *tokens, *prior = Py_None;
    Py_ssize_t page_size, n_words;
    int check_sign = 0, rc, is_seq;
    Py_buffer view = {0};
    chain_t c = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "On|Op:page_hashes", &tokens, &page_size, &prior, &check_sign)) return NULL;
    if (page_size <= 0 || page_size > PY_SSIZE_T_MAX / 4)
        return PyErr_Format(PyExc_ValueError, "page_size must be a positive int, got %zd", page_size);
    if (prior != Py_None && (!PyBytes_Check(prior) || PyBytes_GET_SIZE(prior) != 32))
        return PyErr_Format(PyExc_ValueError, "prior must be None or 32 raw digest bytes");
    if (prior != Py_None) memcpy(c.last, PyBytes_AS_STRING(prior), 32);
    c.have_last = prior != Py_None;
    c.page_bytes = (size_t)page_size * 4;
    is_seq = PyList_Check(tokens) || PyTuple_Check(tokens);
    if (is_seq) {
        n_words = PySequence_Fast_GET_SIZE(tokens);
    } else {
        if (PyObject_GetBuffer(tokens, &view, PyBUF_SIMPLE) < 0) return NULL;
        n_words = view.len / 4;
        if (view.len % 4) {
            PyBuffer_Release(&view);
            return PyErr_Format(PyExc_ValueError, "token buffer: %zd bytes, not whole 4-byte ids", view.len);
        }
    }
    c.list = new_hex_list((size_t)(n_words / page_size));
    c.scratch = n_words >= page_size ? PyMem_Malloc(c.page_bytes + 128) : NULL;
    if (c.list == NULL || (n_words >= page_size && c.scratch == NULL)) {
        if (c.list != NULL) PyErr_NoMemory();
        rc = -1;
    } else if (is_seq) {
        rc = hash_sequence(&c, tokens, (size_t)page_size);
    } else {
        rc = hash_buffer(&c, view.buf, (size_t)n_words, (size_t)page_size, check_sign);
    }
    if (!is_seq) PyBuffer_Release(&view);
    PyMem_Free(c.scratch);
    if (rc < 0) Py_CLEAR(c.list);
    return c.list;
}

static const char *impl_name(void) { return g_use_shani ? "sha-ni" : "portable"; }

/* Test hook: select "portable" or "sha-ni" (if the CPU has it); returns the previous name. */
static PyObject *py_set_sha256_impl(PyObject *self, PyObject *arg) {
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    const char *previous = impl_name();
    (void)self;
    if (name != NULL && strcmp(name, "portable") == 0)
        g_use_shani = 0;
    else if (name != NULL && strcmp(name, "sha-ni") == 0 && cpu_has_shani())
        g_use_shani = 1;
    else
        return PyErr_Format(PyExc_ValueError, "unsupported SHA-256 implementation %R on this CPU", arg);
    return PyUnicode_FromString(previous);
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
    g_use_shani = cpu_has_shani();
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    if (PyModule_AddStringConstant(m, "SHA256_IMPL", impl_name()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
