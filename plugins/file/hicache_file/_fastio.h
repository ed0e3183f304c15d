/*
 * Shared by the sources of hicache_file._fastio: _fastio.c (the module: batches, threads),
 * _fastio_page.c (the syscalls that move one page) and _fastio_xxh3.c (XXH3-64 resolved at
 * import from python-xxhash's extension module).
 */
#ifndef HICACHE_FASTIO_H
#define HICACHE_FASTIO_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

typedef uint64_t (*xxh3_fn)(const void *, size_t);
typedef void *(*xxh3_new_fn)(void);
typedef int (*xxh3_free_fn)(void *);
typedef int (*xxh3_reset_fn)(void *);
typedef int (*xxh3_update_fn)(void *, const void *, size_t);
typedef uint64_t (*xxh3_digest_fn)(const void *);

/* python-xxhash's XXH3-64 entry points; every member NULL when hc_load_xxh3 found none. The
 * functions are thread-safe (a streaming state belongs to one thread). */
typedef struct {
    xxh3_fn oneshot;
    xxh3_new_fn create;
    xxh3_free_fn release;
    xxh3_reset_fn reset;
    xxh3_update_fn update;
    xxh3_digest_fn digest;
} Xxh3;

#if defined(__GNUC__)
#define HC_INTERNAL __attribute__((visibility("hidden")))
#else
#define HC_INTERNAL
#endif

HC_INTERNAL extern Xxh3 hc_xxh3;

/* Resolve hc_xxh3 (GIL held, once at import). 1 found, 0 not found (no exception). */
HC_INTERNAL int hc_load_xxh3(void);

/* 0 when hc_load_xxh3 found XXH3, else -1 with NotImplementedError set. */
HC_INTERNAL int hc_require_xxh3(void);

/* One page of a batch: its path, and its buffers as a slice of the batch's shared arrays. */
typedef struct {
    const char *dir;  /* publish only */
    const char *path;
    int check_exists; /* publish only */
    Py_ssize_t first; /* index of the first buffer in the shared arrays */
    Py_ssize_t count; /* number of buffers */
    unsigned char *hdr; /* the page header: written (publish, checksum filled in) or expected (verify) */
    size_t hdr_len;
    long result;
} Item;

/* The page header (_fastio_format.c; the format is hicache_file._format's). */
#define HC_FIXED_HEADER 24
#define HC_PAYLOAD_ALIGN 64
#define HC_MAX_KEY 65535

/* Bytes before the payload for a key of klen bytes: a multiple of 64. */
HC_INTERNAL size_t hc_header_size(size_t klen);

/* Write the header of a page (key, payload length, checksum 0) into dst, hc_header_size(klen)
 * bytes: magic, version, algorithm, key length, payload length, checksum, key, zero padding. */
HC_INTERNAL void hc_build_header(unsigned char *dst, const char *key, size_t klen, uint64_t payload_len);

/* The per-page syscalls (_fastio_page.c); the GIL need not be held. Results: see _fastio.c. */
HC_INTERNAL long hc_publish_one(Item *it, struct iovec *iov);
HC_INTERNAL int hc_item_exists(const Item *it);
HC_INTERNAL long hc_read_one(Item *it, struct iovec *iov);

#endif
