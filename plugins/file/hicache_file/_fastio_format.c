/*
 * hicache_file._fastio: the page header, built in C for the batch calls that take a page's
 * path and payload and derive its header (publish_pages_xxh3, read_verify_pages). The format is
 * defined, and documented, by hicache_file._format; tests/file/test_file_native.py checks that
 * both build the same bytes.
 */
#include "_fastio.h"

#include <string.h>

static const unsigned char MAGIC[4] = {'H', 'C', 'F', 'P'};
#define FORMAT_VERSION 2
#define ALGO_XXH3_64 1

size_t hc_header_size(size_t klen) {
    return (HC_FIXED_HEADER + klen + HC_PAYLOAD_ALIGN - 1) & ~(size_t)(HC_PAYLOAD_ALIGN - 1);
}

static void put_le(unsigned char *dst, uint64_t v, int n) {
    for (int k = 0; k < n; k++) dst[k] = (unsigned char)(v >> (8 * k));
}

void hc_build_header(unsigned char *dst, const char *key, size_t klen, uint64_t payload_len) {
    size_t hsize = hc_header_size(klen);
    memcpy(dst, MAGIC, 4);
    dst[4] = FORMAT_VERSION;
    dst[5] = ALGO_XXH3_64;
    put_le(dst + 6, (uint64_t)klen, 2);
    put_le(dst + 8, payload_len, 8);
    memset(dst + 16, 0, 8); /* the checksum: filled in before the write, ignored when verifying */
    memcpy(dst + HC_FIXED_HEADER, key, klen);
    memset(dst + HC_FIXED_HEADER + klen, 0, hsize - HC_FIXED_HEADER - klen);
}
