/* XXH3-64 (seed 0) bound from the xxhash package's own extension (bind_xxh3), so the RESP
 * loop's seals and digests (_wire_send.c) are exactly the package's: the one-shot function
 * (its vector dispatch where exported) and, where the package has all of them and they agree
 * with it, the streaming functions. Until bound every pointer is NULL (the loop then makes
 * no digests and refuses seals) and xxh3() raises RuntimeError. native.py binds it once and
 * checks it against the package.
 */
#include "_wire.h"

#include <dlfcn.h>

xxh3_fn xxh3_64 = NULL;
xxh3_new_fn xxh3_new = NULL;
xxh3_free_fn xxh3_free = NULL;
xxh3_reset_fn xxh3_reset = NULL;
xxh3_update_fn xxh3_update = NULL;
xxh3_digest_fn xxh3_digest = NULL;

/* Whether the streaming functions, fed in uneven pieces, give xxh3_64's digest. */
static int stream_agrees(void) {
    unsigned char data[5000];
    for (size_t i = 0; i < sizeof(data); i++) {
        data[i] = (unsigned char)(i * 131 + 7);
    }
    void *state = xxh3_new();
    if (state == NULL) {
        return 0;
    }
    xxh3_reset(state);
    xxh3_update(state, data, 1234);
    xxh3_update(state, data + 1234, sizeof(data) - 1234);
    int same = xxh3_digest(state) == xxh3_64(data, sizeof(data));
    xxh3_free(state);
    return same;
}

PyObject *bind_xxh3(PyObject *self, PyObject *arg) {
    const char *path = PyUnicode_AsUTF8(arg);
    if (path == NULL) {
        return NULL;
    }
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD); /* loaded already */
    void *fn = NULL;
    if (lib != NULL) {
        fn = dlsym(lib, "XXH3_64bits_dispatch");
        if (fn == NULL) {
            fn = dlsym(lib, "XXH3_64bits");
        }
    }
    if (fn != NULL) {
        xxh3_64 = (xxh3_fn)fn; /* lib stays open: the package is imported for good */
        void *update = dlsym(lib, "XXH3_64bits_update_dispatch");
        if (update == NULL) {
            update = dlsym(lib, "XXH3_64bits_update");
        }
        void *made = dlsym(lib, "XXH3_createState"), *freed = dlsym(lib, "XXH3_freeState");
        void *reset = dlsym(lib, "XXH3_64bits_reset"), *digest = dlsym(lib, "XXH3_64bits_digest");
        if (update != NULL && made != NULL && freed != NULL && reset != NULL && digest != NULL) {
            xxh3_new = (xxh3_new_fn)made;
            xxh3_free = (xxh3_free_fn)freed;
            xxh3_reset = (xxh3_reset_fn)reset;
            xxh3_update = (xxh3_update_fn)update;
            xxh3_digest = (xxh3_digest_fn)digest;
            if (!stream_agrees()) { /* never seal with a digest that is not XXH3-64's */
                xxh3_new = NULL;
            }
        }
    } else if (lib != NULL) {
        dlclose(lib);
    }
    return PyBool_FromLong(xxh3_64 != NULL);
}

PyObject *xxh3(PyObject *self, PyObject *obj) {
    if (xxh3_64 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "no XXH3 bound (bind_xxh3)");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    uint64_t h = xxh3_64(view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}
