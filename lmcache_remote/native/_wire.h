/* What the C sources of lmcache_remote.native._wire share, and nothing else: the Python headers
 * (included first, with PY_SSIZE_T_CLEAN, as Python asks), SLOTS (an allocation's element
 * count), the XXH3-64 functions that _wire_xxh3.c binds and the RESP loop calls, and the
 * entry points each source gives the module table in _wire.c. Names shared between the
 * sources are hidden from the extension's symbol table (WIRE_INTERNAL).
 *
 * The sources: _wire.c (the module: its table, `address`), _wire_resp.c (the bulk data
 * path's RESP send / receive loop, run_batch, with its parts _wire_io.c, _wire_send.c and
 * _wire_reply.c, which share _wire_resp.h), _wire_rows.c (PagedKV's row copier, copy_rows),
 * _wire_xxh3.c (XXH3-64 bound from the xxhash package: bind_xxh3, xxh3).
 */
#ifndef LMCR_WIRE_H
#define LMCR_WIRE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>

#define WIRE_INTERNAL __attribute__((visibility("hidden")))

/* The element count to allocate for n items: n, or 1 when n is 0 (an allocation of 0 bytes
 * may give NULL, which reads as out of memory). */
#define SLOTS(n) ((size_t)((n) ? (n) : 1))

/* XXH3-64 (seed 0), the very function the xxhash package runs: bind_xxh3() looks it up in
 * that package's extension (XXH3_64bits_dispatch, its AVX2/AVX-512 dispatch, else
 * XXH3_64bits), which native.py then checks against the package. NULL until bound, and then
 * no digests are made (Python hashes). The system's libxxhash is not used: distributions
 * build it without the vector dispatch, and it ran 4-5x slower here. */
typedef uint64_t (*xxh3_fn)(const void *data, size_t len);
extern WIRE_INTERNAL xxh3_fn xxh3_64;
/* The same package's streaming XXH3-64 (the same digest, fed piece by piece): a seal hashes
 * a big source one piece at a time, each piece just before it is sent (see
 * _wire_send.c's send_commands).
 * All NULL when the package lacks one of them: each source is then hashed whole. */
typedef void *(*xxh3_new_fn)(void);
typedef int (*xxh3_free_fn)(void *state);
typedef int (*xxh3_reset_fn)(void *state);
typedef int (*xxh3_update_fn)(void *state, const void *data, size_t len);
typedef uint64_t (*xxh3_digest_fn)(const void *state);
extern WIRE_INTERNAL xxh3_new_fn xxh3_new;
extern WIRE_INTERNAL xxh3_free_fn xxh3_free;
extern WIRE_INTERNAL xxh3_reset_fn xxh3_reset;
extern WIRE_INTERNAL xxh3_update_fn xxh3_update;
extern WIRE_INTERNAL xxh3_digest_fn xxh3_digest;

/* The module's functions (METH_VARARGS or METH_O), one source each. */
WIRE_INTERNAL PyObject *run_batch(PyObject *self, PyObject *args);  /* _wire_resp.c */
WIRE_INTERNAL PyObject *copy_rows(PyObject *self, PyObject *args);  /* _wire_rows.c */
WIRE_INTERNAL PyObject *bind_xxh3(PyObject *self, PyObject *arg);   /* _wire_xxh3.c */
WIRE_INTERNAL PyObject *xxh3(PyObject *self, PyObject *obj);        /* _wire_xxh3.c */

#endif /* LMCR_WIRE_H */
