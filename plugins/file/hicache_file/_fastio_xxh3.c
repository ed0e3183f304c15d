/*
 * hicache_file._fastio: XXH3-64 as implemented by python-xxhash (a dependency of this package,
 * which Python uses for the same checksums), resolved at import from its already loaded
 * extension module, whose xxHash functions are exported. Its *_dispatch entry points pick
 * SSE2/AVX2/AVX-512 at run time: measured here 38-50 GB/s on cached 16 KiB-2 MiB buffers,
 * against 8-13 GB/s for the Debian libxxhash0 (built for baseline SSE2).
 */
#include "_fastio.h"

#include <dlfcn.h>
#include <string.h>

typedef unsigned (*xxh_version_fn)(void);

Xxh3 hc_xxh3;

/* The first of two symbols that `lib` exports (the SIMD-dispatching one first). */
static void *either(void *lib, const char *a, const char *b) {
    void *f = dlsym(lib, a);
    return f != NULL ? f : dlsym(lib, b);
}

/* dlopen handle of python-xxhash's extension module (already imported), or NULL. */
static void *python_xxhash(void) {
    void *lib = NULL;
    PyObject *mod = PyImport_ImportModule("xxhash._xxhash");
    PyObject *file = mod != NULL ? PyModule_GetFilenameObject(mod) : NULL;
    const char *path = file != NULL ? PyUnicode_AsUTF8(file) : NULL;
    if (path != NULL) lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    Py_XDECREF(file);
    Py_XDECREF(mod);
    PyErr_Clear(); /* not found: Python computes the checksums */
    return lib;
}

int hc_load_xxh3(void) {
    void *lib = python_xxhash();
    if (lib == NULL) return 0;
    xxh_version_fn version = (xxh_version_fn)dlsym(lib, "XXH_versionNumber");
    if (version == NULL || version() < 800) return 0; /* XXH3 output is stable from 0.8.0 */
    hc_xxh3.oneshot = (xxh3_fn)either(lib, "XXH3_64bits_dispatch", "XXH3_64bits");
    hc_xxh3.create = (xxh3_new_fn)dlsym(lib, "XXH3_createState");
    hc_xxh3.release = (xxh3_free_fn)dlsym(lib, "XXH3_freeState");
    hc_xxh3.reset = (xxh3_reset_fn)dlsym(lib, "XXH3_64bits_reset");
    hc_xxh3.update = (xxh3_update_fn)either(lib, "XXH3_64bits_update_dispatch", "XXH3_64bits_update");
    hc_xxh3.digest = (xxh3_digest_fn)dlsym(lib, "XXH3_64bits_digest");
    if (!hc_xxh3.oneshot || !hc_xxh3.create || !hc_xxh3.release || !hc_xxh3.reset || !hc_xxh3.update ||
        !hc_xxh3.digest) {
        memset(&hc_xxh3, 0, sizeof(hc_xxh3));
        return 0;
    }
    return 1;
}

int hc_require_xxh3(void) {
    if (hc_xxh3.oneshot != NULL) return 0;
    PyErr_SetString(PyExc_NotImplementedError, "no XXH3 implementation was found (HAVE_XXH3 is 0)");
    return -1;
}

