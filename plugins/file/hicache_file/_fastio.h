/*
 * Shared by the two sources of hicache_file._fastio: _fastio.c (the batched page syscalls) and
 * _fastio_xxh3.c (XXH3-64 resolved at import from python-xxhash's extension module).
 */
#ifndef HICACHE_FASTIO_H
#define HICACHE_FASTIO_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>

typedef uint64_t (*xxh3_fn)(const void *, size_t);
typedef void *(*xxh3_new_fn)(void);
typedef int (*xxh3_free_fn)(void *);
typedef int (*xxh3_reset_fn)(void *);
typedef int (*xxh3_update_fn)(void *, const void *, size_t);
typedef uint64_t (*xxh3_digest_fn)(const void *);

/* python-xxhash's XXH3-64 entry points; every member NULL when load_xxh3 found none. The
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

#endif
