/* The native RESP loop of the bulk data path (lmcache_remote.storage.bulk): run_batch, the
 * batch driver. Its parts, sharing _wire_resp.h: _wire_io.c (the reader's socket and
 * buffer), _wire_send.c (seals and the send path), _wire_reply.c (replies, places, records).
 *
 * One function, run_batch(), does what BulkPipeline._run_python does with the Python reader
 * (storage/wire/resp.py's RespReader) for a batch of commands (each packed as bytes, or as a list
 * of buffers whose big values are views of the caller's memory): it sends them, as the
 * replies come in when the replies are big (at most `inflight` reply bytes asked for and
 * unread), and parses every RESP reply, receiving each bulk string straight into its
 * destination: its place in a list given up front, what a Python sink returns for it, or
 * fresh memory.
 * With no sink or a list of places the whole batch runs without the GIL: replies that do
 * not land in a place are kept in C memory and made into Python objects at the end, and the
 * GIL is taken back only for that, an error or a signal. A read then never waits for Python
 * work on other threads (decoding the previous window, another lane, the engine's own
 * threads), where giving the GIL back and taking it again per system call waited up to the
 * switch interval (5 ms) each time another thread was busy. With a callable sink (called per
 * bulk reply) the GIL is released around every system call instead. Semantics are those of
 * the Python reader (RespReader in storage/wire/resp.py), which stays the fallback and the
 * reference: the tests run both.
 *
 * A write batch may carry seals (_wire_send.c): checksums that the loop computes as it sends
 * a command's parts and writes into the command's header before the header goes out.
 *
 * Errors: a timeout raises TimeoutError, a closed connection ConnectionResetError, a reply
 * this reader does not understand ValueError (bulk.py maps them to redis-py's errors and
 * disconnects the connection); an error reply (-ERR ...) becomes make_error(text) in the
 * list and reading goes on, so the connection stays in step.
 */
#include "_wire_resp.h"

#include <limits.h>
#include <string.h>
#include <sys/uio.h>

PyObject *run_batch(PyObject *self, PyObject *args) {
    int fd;
    double timeout;
    PyObject *commands, *sizes, *sink, *make_error, *digests = Py_None, *seal_list = Py_None;
    Py_ssize_t inflight;
    long long max_bulk = PY_SSIZE_T_MAX / 2;
    double left = -1.0; /* seconds the whole batch may take; < 0: no deadline */
    if (!PyArg_ParseTuple(args, "idO!OnOO|OOLd", &fd, &timeout, &PyList_Type, &commands,
                          &sizes, &inflight, &sink, &make_error, &digests, &seal_list,
                          &max_bulk, &left)) {
        return NULL;
    }
    if (max_bulk < 0 || max_bulk > PY_SSIZE_T_MAX / 2) {
        max_bulk = PY_SSIZE_T_MAX / 2;
    }
    Py_ssize_t count = PyList_GET_SIZE(commands);
    size_t slots = SLOTS(count);
    /* A list sink or none: the whole batch runs without the GIL (records); a callable sink
     * is called per bulk reply, with the GIL (read_reply). */
    int free_running = sink == Py_None || PyList_Check(sink);
    struct iovec *iovs = NULL;
    Py_ssize_t *first = PyMem_Malloc(sizeof(Py_ssize_t) * (slots + 1));
    Py_buffer *pieces = NULL; /* the buffers of commands given as lists */
    Py_ssize_t npieces = 0, taken = 0;
    long long *want = NULL;
    record_t *recs = NULL;
    uint64_t *digest = NULL; /* per placed reply: XXH3-64 of its last buffer */
    seal_t *seals = NULL;    /* per command, or NULL: no seals */
    places_t places;
    memset(&places, 0, sizeof(places));
    reader_t r;
    r.fd = fd;
    r.start = r.end = 0;
    r.lowat = r.want_lowat = 1;
    r.ts = NULL;
    r.buf = NULL;
    r.max_bulk = max_bulk;
    r.deadline = left < 0 ? -1.0 : monotonic_s() + left;
    PyObject *out = NULL;
    if (first == NULL) {
        return PyErr_NoMemory();
    }
    first[0] = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *item = PyList_GET_ITEM(commands, k);
        if (PyBytes_Check(item)) {
            first[k + 1] = first[k] + 1;
        } else if (PyList_Check(item)) {
            first[k + 1] = first[k] + PyList_GET_SIZE(item);
            npieces += PyList_GET_SIZE(item);
        } else {
            PyErr_SetString(PyExc_TypeError,
                            "run_batch takes packed commands (bytes, or lists of buffers)");
            goto fail;
        }
    }
    iovs = PyMem_Malloc(sizeof(struct iovec) * SLOTS(first[count]));
    pieces = PyMem_Malloc(sizeof(Py_buffer) * SLOTS(npieces));
    if (iovs == NULL || pieces == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *item = PyList_GET_ITEM(commands, k);
        if (PyBytes_Check(item)) {
            iovs[first[k]].iov_base = PyBytes_AS_STRING(item);
            iovs[first[k]].iov_len = (size_t)PyBytes_GET_SIZE(item);
            continue;
        }
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(item); j++) {
            if (PyObject_GetBuffer(PyList_GET_ITEM(item, j), &pieces[taken], PyBUF_SIMPLE) < 0) {
                goto fail;
            }
            iovs[first[k] + j].iov_base = pieces[taken].buf;
            iovs[first[k] + j].iov_len = (size_t)pieces[taken].len;
            taken++;
        }
    }
    if (sizes != Py_None) {
        if (!PyList_Check(sizes) || PyList_GET_SIZE(sizes) != count) {
            PyErr_SetString(PyExc_ValueError, "reply sizes must be a list, one per command");
            goto fail;
        }
        want = PyMem_Malloc(sizeof(long long) * slots);
        if (want == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        for (Py_ssize_t k = 0; k < count; k++) {
            want[k] = PyLong_AsLongLong(PyList_GET_ITEM(sizes, k));
            if (want[k] == -1 && PyErr_Occurred()) {
                goto fail;
            }
        }
    }
    if (seal_list != Py_None) {
        if (!PyList_Check(seal_list) || PyList_GET_SIZE(seal_list) != count) {
            PyErr_SetString(PyExc_ValueError, "seals must be a list, one per command");
            goto fail;
        }
        if (xxh3_64 == NULL) {
            PyErr_SetString(PyExc_RuntimeError, "seals need XXH3 bound (bind_xxh3)");
            goto fail;
        }
        seals = PyMem_Calloc(slots, sizeof(seal_t));
        if (seals == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        for (Py_ssize_t k = 0; k < count; k++) {
            PyObject *item = PyList_GET_ITEM(seal_list, k);
            if (item != Py_None && seal_take(&seals[k], item) < 0) {
                goto fail;
            }
        }
    }
    if (digests != Py_None && (!PyList_Check(digests) || PyList_GET_SIZE(digests) != count)) {
        PyErr_SetString(PyExc_ValueError, "digests must be a list, one per command");
        goto fail;
    }
    if (free_running) {
        recs = PyMem_Calloc(slots, sizeof(record_t));
        if (digests != Py_None && xxh3_64 != NULL && sink != Py_None) {
            digest = PyMem_Malloc(sizeof(uint64_t) * slots);
        }
        if (recs == NULL || (digests != Py_None && xxh3_64 != NULL && sink != Py_None &&
                             digest == NULL)) {
            PyErr_NoMemory();
            goto fail;
        }
        if (sink != Py_None && places_take(&places, sink, count) < 0) {
            goto fail;
        }
    }
    r.timeout_ms = timeout < 0 ? -1 : timeout * 1000.0 >= (double)INT_MAX ? INT_MAX
                                                : (int)(timeout * 1000.0 + 0.999);
    r.buf = PyMem_Malloc(BUF_SIZE);
    out = PyList_New(count);
    if (r.buf == NULL || out == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_NoMemory();
        }
        goto fail;
    }
    /* Free running, the loop takes the GIL back only to raise (an error, a signal) and at
     * the end: other Python threads run meanwhile, and this loop never waits for them. */
    if (free_running) {
        gil_drop(&r);
    }
    Py_ssize_t sent = 0;
    long long outstanding = 0;
    if (want == NULL || inflight <= 0) {
        if (send_commands(&r, iovs, first, seals, 0, count) < 0) {
            goto fail;
        }
        sent = count;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (sent < count) {
            Py_ssize_t end = sent;
            while (end < count && (end == i || outstanding + want[end] <= inflight)) {
                outstanding += want[end];
                end++;
            }
            if (end > sent) {
                if (send_commands(&r, iovs, first, seals, sent, end) < 0) {
                    goto fail;
                }
                sent = end;
            }
        }
        if (free_running) {
            if (receive_record(&r, &recs[i], &places, i) < 0) {
                goto fail;
            }
            if (digest != NULL && recs[i].kind == 'P') { /* hashed while still in the cache */
                Py_buffer *last = &places.views[places.first[i] + places.n[i] - 1];
                digest[i] = xxh3_64(last->buf, (size_t)last->len);
            }
        } else {
            PyObject *reply = read_reply(&r, i, sink, make_error);
            if (reply == NULL) {
                goto fail;
            }
            PyList_SET_ITEM(out, i, reply);
        }
        if (want != NULL) {
            outstanding -= want[i];
        }
    }
    gil_take(&r);
    if (r.start != r.end) {
        PyErr_SetString(PyExc_ValueError, "protocol error: unexpected bytes after the replies");
        goto fail;
    }
    for (Py_ssize_t i = 0; free_running && i < count; i++) {
        PyObject *reply = record_object(&recs[i], sink == Py_None ? Py_None
                                                  : PyList_GET_ITEM(sink, i), make_error);
        if (reply == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(out, i, reply);
        if (digest != NULL && recs[i].kind == 'P') {
            PyObject *value = PyLong_FromUnsignedLongLong(digest[i]);
            if (value == NULL || PyList_SetItem(digests, i, value) < 0) {
                goto fail;
            }
        }
    }
    set_lowat(&r, 1); /* the connection goes back to redis-py as it came */
    goto done;
fail:
    gil_take(&r);
    set_lowat(&r, 1);
    Py_CLEAR(out);
done:
    for (Py_ssize_t k = 0; k < taken; k++) {
        PyBuffer_Release(&pieces[k]);
    }
    places_free(&places);
    seals_free(seals, count);
    records_free(recs, count);
    PyMem_Free(digest);
    PyMem_Free(want);
    PyMem_Free(pieces);
    PyMem_Free(iovs);
    PyMem_Free(first);
    PyMem_Free(r.buf);
    return out;
}
