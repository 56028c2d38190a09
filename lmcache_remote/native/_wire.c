/* The module lmcache_remote.native._wire (optional: see setup.py and native.py): its method table
 * and init, and `address`, the one helper that is neither the RESP loop nor the row copier.
 * It promises what each function's docstring says; the work is in _wire_resp.c (run_batch,
 * with its parts _wire_io.c, _wire_send.c, _wire_reply.c), _wire_rows.c (copy_rows) and
 * _wire_xxh3.c (bind_xxh3, xxh3), sharing _wire.h.
 */
#include "_wire.h"

static PyObject *address(PyObject *self, PyObject *obj) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    void *at = view.buf;
    PyBuffer_Release(&view);
    return PyLong_FromVoidPtr(at);
}

static PyMethodDef methods[] = {
    {"address", address, METH_O,
     "address(buffer) -> int\n\nWhere a contiguous buffer's memory starts."},
    {"run_batch", run_batch, METH_VARARGS,
     "run_batch(fd, timeout, commands, reply_sizes, inflight, sink, make_error, digests=None,\n"
     "seals=None) -> replies\n\n"
     "Sends the packed commands (all at once, or as replies come in when reply_sizes is a\n"
     "list and inflight > 0) and reads one reply per command. sink: None, a callable\n"
     "(index, length) -> destination, or a list of one place (destination or None) per\n"
     "command. digests: None, or a list (one item per command) where each reply received\n"
     "into its place gets the XXH3-64 of its place's last buffer (once bind_xxh3 found\n"
     "it). seals: None, or a list (one item per command) of None or (dest, sources, offsets,\n"
     "sum_at): before the command is sent, the XXH3-64 of each source is written at its\n"
     "offset in dest, then the low 32 bits of dest[:sum_at]'s at sum_at (if >= 0); see\n"
     "lmcache_remote/native/_wire_resp.c."},
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(jobs, gather) -> None\n\nRow copies between a paged cache and chunks, every\n"
     "job (cache_addr, cache_rows, chunk_addr, row_bytes, int64 index) without the GIL; see\n"
     "lmcache_remote/native/_wire_rows.c."},
    {"bind_xxh3", bind_xxh3, METH_O,
     "bind_xxh3(path) -> bool\n\nLooks XXH3-64 up in the loaded shared object at path (the\n"
     "xxhash package's extension); whether one is bound."},
    {"xxh3", xxh3, METH_O,
     "xxh3(buffer) -> int\n\nXXH3-64 (seed 0) of the bytes, by the bound function."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "lmcache_remote.native._wire",
    "The native receive loop of the bulk data path (see storage/wire/bulk.py) and the row copier\n"
    "of connectors' PagedKV (see connectors/rows.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__wire(void) { return PyModule_Create(&module); }
