/* The replies of the native RESP loop (run_batch, _wire_resp.c), parsed from the lines and
 * payloads that the reader (_wire_io.c) receives, in one of two ways.
 * With the GIL (a callable sink): read_reply makes each reply's Python object, a bulk reply
 * received into what the sink returns for it (or fresh memory).
 * Without the GIL (no sink, or a list of places): places_take takes every place's buffers up
 * front; receive_record receives a reply into its place when its length is the place's total,
 * else keeps it in C memory (record_t); record_object makes its Python object at the end,
 * with the GIL.
 * Both ways: a bulk reply longer than the batch accepts is refused unread (refuse_bulk), an
 * error reply (-ERR ...) becomes make_error(text), an array reply (EXEC's, a script's) its
 * length or make_error(its first error element's text) (skim_array), a reply of no kind known
 * is ValueError;
 * semantics are those of RespReader (lmcache_remote/storage/wire/resp.py).
 */
#include "_wire_resp.h"

#include <string.h>

#define MAX_DESTS 16

/* A bulk reply announced longer than the batch accepts: refused before anything is allocated
 * or read for it (a server cannot make the engine allocate what it announces). -1, an error
 * set with the GIL. */
static int refuse_bulk(reader_t *r, long long length) {
    gil_take(r);
    PyErr_Format(PyExc_ValueError,
                 "protocol error: a bulk reply of %lld bytes, more than the %lld expected",
                 length, r->max_bulk);
    return -1;
}

/* Sets the error for a reply line of no kind this reader knows (its first 20 bytes shown);
 * needs the GIL. */
static void unexpected_reply(const char *line, Py_ssize_t len) {
    Py_ssize_t show = len < 20 ? len : 20;
    PyObject *shown = PyBytes_FromStringAndSize(line, show);
    if (shown != NULL) {
        PyErr_Format(PyExc_ValueError, "protocol error: unexpected reply %R", shown);
        Py_DECREF(shown);
    }
}

/* Reads the `n` elements of an array reply (nested arrays too) and keeps only what the
 * batch needs of it: nothing of its values, the text of its first error element (a
 * PyMem_RawMalloc'd copy in *err, NUL-terminated, or NULL). Runs with or without the GIL.
 * Returns 0, or -1 with the GIL and an error set. */
static int skim_array(reader_t *r, long long n, char **err, Py_ssize_t *errlen, int depth) {
    if (depth > 8) {
        return fail(r, PyExc_ValueError, "protocol error: arrays nested too deep");
    }
    for (long long k = 0; k < n; k++) {
        const char *line;
        Py_ssize_t len;
        long long value;
        if (read_line(r, &line, &len) < 0) {
            return -1;
        }
        if (len < 1) {
            return fail(r, PyExc_ValueError, "protocol error: empty reply line");
        }
        switch (line[0]) {
        case '$':
            if (parse_int(line + 1, len - 1, &value) < 0) {
                return fail(r, PyExc_ValueError, "protocol error: bad bulk length");
            }
            if (value > r->max_bulk) {
                return refuse_bulk(r, value);
            }
            if (value > 0) {
                void *scratch = PyMem_RawMalloc((size_t)value);
                if (scratch == NULL) {
                    gil_take(r);
                    PyErr_NoMemory();
                    return -1;
                }
                Py_buffer into;
                memset(&into, 0, sizeof(into));
                into.buf = scratch;
                into.len = (Py_ssize_t)value;
                int rc = read_payload(r, &into, 1);
                PyMem_RawFree(scratch);
                if (rc < 0) {
                    return -1;
                }
            }
            break;
        case '*':
            if (parse_int(line + 1, len - 1, &value) < 0) {
                return fail(r, PyExc_ValueError, "protocol error: bad array length");
            }
            if (value > 0 && skim_array(r, value, err, errlen, depth + 1) < 0) {
                return -1;
            }
            break;
        case '-':
            if (*err == NULL) {
                *err = PyMem_RawMalloc((size_t)len);
                if (*err == NULL) {
                    gil_take(r);
                    PyErr_NoMemory();
                    return -1;
                }
                memcpy(*err, line + 1, (size_t)(len - 1));
                (*err)[len - 1] = '\0';
                *errlen = len - 1;
            }
            break;
        case ':':
        case '+':
        case '_':
            break;
        default:
            gil_take(r);
            unexpected_reply(line, len);
            return -1;
        }
    }
    return 0;
}

/* One bulk reply of `length` bytes: its destination from the sink (or a fresh bytearray),
 * filled. Returns a new reference to the reply object. */
static PyObject *bulk_reply(reader_t *r, Py_ssize_t index, Py_ssize_t length, PyObject *sink) {
    PyObject *dest = Py_None;
    Py_INCREF(dest);
    if (sink != Py_None) {
        Py_DECREF(dest);
        dest = PyObject_CallFunction(sink, "nn", index, length);
        if (dest == NULL) {
            return NULL;
        }
    }
    PyObject *items[MAX_DESTS];
    int nitems = 0;
    PyObject *reply = NULL;
    if (dest == Py_None) {
        Py_DECREF(dest);
        PyObject *fresh = PyByteArray_FromStringAndSize(NULL, length);
        if (fresh == NULL) {
            return NULL;
        }
        dest = PyMemoryView_FromObject(fresh);
        Py_DECREF(fresh);
        if (dest == NULL) {
            return NULL;
        }
    }
    if (PyList_Check(dest)) {
        Py_ssize_t n = PyList_GET_SIZE(dest);
        if (n < 1 || n > MAX_DESTS) {
            PyErr_Format(PyExc_ValueError, "sink returned %zd buffers (1 to %d allowed)", n,
                         MAX_DESTS);
            Py_DECREF(dest);
            return NULL;
        }
        for (Py_ssize_t k = 0; k < n; k++) {
            items[nitems++] = PyList_GET_ITEM(dest, k);
        }
        reply = n == 1 ? PyList_GET_ITEM(dest, 0) : dest;
    } else {
        items[nitems++] = dest;
        reply = dest;
    }
    Py_buffer views[MAX_DESTS];
    int got = 0;
    Py_ssize_t total = 0;
    int rc = -1;
    for (; got < nitems; got++) {
        if (PyObject_GetBuffer(items[got], &views[got], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            goto done;
        }
        total += views[got].len;
    }
    if (total != length) {
        PyErr_SetString(PyExc_ValueError,
                        "sink returned buffers that do not add up to the reply length");
        goto done;
    }
    rc = read_payload(r, views, nitems);
done:
    for (int k = 0; k < got; k++) {
        PyBuffer_Release(&views[k]);
    }
    if (rc < 0) {
        Py_DECREF(dest);
        return NULL;
    }
    Py_INCREF(reply);
    Py_DECREF(dest);
    return reply;
}

/* One reply of any kind, from its first line on; a new reference. Needs the GIL. */
static PyObject *reply_from_line(reader_t *r, Py_ssize_t index, const char *line,
                                 Py_ssize_t len, PyObject *sink, PyObject *make_error) {
    if (len < 1) {
        PyErr_SetString(PyExc_ValueError, "protocol error: empty reply line");
        return NULL;
    }
    char kind = line[0];
    long long value;
    switch (kind) {
    case '$':
        if (parse_int(line + 1, len - 1, &value) < 0) {
            PyErr_SetString(PyExc_ValueError, "protocol error: bad bulk length");
            return NULL;
        }
        if (value < 0) {
            Py_RETURN_NONE;
        }
        if (value > r->max_bulk) {
            refuse_bulk(r, value);
            return NULL;
        }
        return bulk_reply(r, index, (Py_ssize_t)value, sink);
    case ':':
        if (parse_int(line + 1, len - 1, &value) < 0) {
            PyErr_SetString(PyExc_ValueError, "protocol error: bad integer reply");
            return NULL;
        }
        return PyLong_FromLongLong(value);
    case '+':
        return PyBytes_FromStringAndSize(line + 1, len - 1);
    case '-':
        return PyObject_CallFunction(make_error, "s#", line + 1, len - 1);
    case '_':
        Py_RETURN_NONE;
    case '*': {
        if (parse_int(line + 1, len - 1, &value) < 0) {
            PyErr_SetString(PyExc_ValueError, "protocol error: bad array length");
            return NULL;
        }
        if (value < 0) {
            Py_RETURN_NONE;
        }
        char *err = NULL;
        Py_ssize_t errlen = 0;
        if (skim_array(r, value, &err, &errlen, 0) < 0) {
            PyMem_RawFree(err);
            return NULL;
        }
        if (err != NULL) {
            PyObject *error = PyObject_CallFunction(make_error, "s#", err, errlen);
            PyMem_RawFree(err);
            return error;
        }
        return PyLong_FromLongLong(value);
    }
    default:
        unexpected_reply(line, len);
        return NULL;
    }
}

/* One reply of any kind; a new reference. */
PyObject *read_reply(reader_t *r, Py_ssize_t index, PyObject *sink, PyObject *make_error) {
    const char *line;
    Py_ssize_t len;
    if (read_line(r, &line, &len) < 0) {
        return NULL;
    }
    return reply_from_line(r, index, line, len, sink, make_error);
}

void places_free(places_t *p) {
    for (Py_ssize_t k = 0; k < p->taken; k++) {
        PyBuffer_Release(&p->views[k]);
    }
    PyMem_Free(p->views);
    PyMem_Free(p->first);
    PyMem_Free(p->n);
    PyMem_Free(p->total);
}

/* Takes the buffers of every place of a list sink (None: no place; a writable buffer or a
 * list of 1 to MAX_DESTS of them). Returns 0, or -1 with an error set. */
int places_take(places_t *p, PyObject *sink, Py_ssize_t count) {
    memset(p, 0, sizeof(*p));
    if (PyList_GET_SIZE(sink) != count) {
        PyErr_SetString(PyExc_ValueError, "a list sink needs one place per command");
        return -1;
    }
    Py_ssize_t nviews = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *place = PyList_GET_ITEM(sink, i);
        nviews += PyList_Check(place) ? PyList_GET_SIZE(place) : place != Py_None;
    }
    size_t slots = SLOTS(count);
    p->views = PyMem_Malloc(sizeof(Py_buffer) * SLOTS(nviews));
    p->first = PyMem_Malloc(sizeof(Py_ssize_t) * slots);
    p->n = PyMem_Malloc(sizeof(int) * slots);
    p->total = PyMem_Malloc(sizeof(Py_ssize_t) * slots);
    if (p->views == NULL || p->first == NULL || p->n == NULL || p->total == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *place = PyList_GET_ITEM(sink, i);
        int is_list = PyList_Check(place);
        Py_ssize_t n = is_list ? PyList_GET_SIZE(place) : place != Py_None;
        if (is_list && (n < 1 || n > MAX_DESTS)) {
            PyErr_Format(PyExc_ValueError, "place %zd has %zd buffers (1 to %d allowed)", i, n,
                         MAX_DESTS);
            return -1;
        }
        p->first[i] = p->taken;
        p->n[i] = (int)n;
        p->total[i] = 0;
        for (Py_ssize_t k = 0; k < n; k++) {
            PyObject *item = is_list ? PyList_GET_ITEM(place, k) : place;
            Py_buffer *view = &p->views[p->taken];
            if (PyObject_GetBuffer(item, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
                return -1;
            }
            p->taken++;
            p->total[i] += view->len;
        }
    }
    return 0;
}

/* The reply object of a filled place: the buffer, or a list of more than one. */
static PyObject *place_reply(PyObject *place) {
    PyObject *reply = PyList_Check(place) && PyList_GET_SIZE(place) == 1
                          ? PyList_GET_ITEM(place, 0) : place;
    Py_INCREF(reply);
    return reply;
}

void records_free(record_t *recs, Py_ssize_t count) {
    for (Py_ssize_t i = 0; recs != NULL && i < count; i++) {
        PyMem_RawFree(recs[i].data);
    }
    PyMem_Free(recs);
}

/* Copies a line's text into a record (no GIL needed); -1 with the GIL and an error. */
static int record_text(reader_t *r, record_t *rec, char kind, const char *text, Py_ssize_t len) {
    rec->data = PyMem_RawMalloc(SLOTS(len));
    if (rec->data == NULL) {
        gil_take(r);
        PyErr_NoMemory();
        return -1;
    }
    memcpy(rec->data, text, (size_t)len);
    rec->len = len;
    rec->kind = kind;
    return 0;
}

/* One reply, without the GIL, into `rec`: a bulk reply whose length is its place's total
 * lands there; any other is kept in C memory until the end. -1 with the GIL and an error. */
int receive_record(reader_t *r, record_t *rec, places_t *places, Py_ssize_t i) {
    const char *line;
    Py_ssize_t len;
    long long value;
    if (read_line(r, &line, &len) < 0) {
        return -1;
    }
    if (len < 1) {
        return fail(r, PyExc_ValueError, "protocol error: empty reply line");
    }
    switch (line[0]) {
    case '$':
        if (parse_int(line + 1, len - 1, &value) < 0) {
            return fail(r, PyExc_ValueError, "protocol error: bad bulk length");
        }
        if (value < 0) {
            rec->kind = 'N';
            return 0;
        }
        if (places->n != NULL && places->n[i] > 0 && value == places->total[i]) {
            if (read_payload(r, places->views + places->first[i], places->n[i]) < 0) {
                return -1;
            }
            rec->kind = 'P';
            return 0;
        }
        if (value > r->max_bulk) { /* refused before anything is allocated for it */
            return refuse_bulk(r, value);
        }
        rec->data = PyMem_RawMalloc(SLOTS(value));
        if (rec->data == NULL) {
            gil_take(r);
            PyErr_NoMemory();
            return -1;
        }
        rec->len = (Py_ssize_t)value;
        Py_buffer into;
        memset(&into, 0, sizeof(into));
        into.buf = rec->data;
        into.len = rec->len;
        if (read_payload(r, &into, 1) < 0) {
            return -1;
        }
        rec->kind = 'B';
        return 0;
    case ':':
        if (parse_int(line + 1, len - 1, &value) < 0) {
            return fail(r, PyExc_ValueError, "protocol error: bad integer reply");
        }
        rec->kind = 'I';
        rec->value = value;
        return 0;
    case '+':
        return record_text(r, rec, 'S', line + 1, len - 1);
    case '-':
        return record_text(r, rec, 'E', line + 1, len - 1);
    case '_':
        rec->kind = 'N';
        return 0;
    case '*': {
        if (parse_int(line + 1, len - 1, &value) < 0) {
            return fail(r, PyExc_ValueError, "protocol error: bad array length");
        }
        if (value < 0) {
            rec->kind = 'N';
            return 0;
        }
        char *err = NULL;
        Py_ssize_t errlen = 0;
        if (skim_array(r, value, &err, &errlen, 0) < 0) {
            PyMem_RawFree(err);
            return -1;
        }
        if (err != NULL) {
            rec->data = err;
            rec->len = errlen;
            rec->kind = 'E';
            return 0;
        }
        rec->kind = 'I';
        rec->value = value;
        return 0;
    }
    default:
        gil_take(r);
        unexpected_reply(line, len);
        return -1;
    }
}

/* The Python object of a record (a new reference); needs the GIL. */
PyObject *record_object(record_t *rec, PyObject *place, PyObject *make_error) {
    switch (rec->kind) {
    case 'P':
        return place_reply(place);
    case 'B': {
        PyObject *fresh = PyByteArray_FromStringAndSize(rec->data, rec->len);
        if (fresh == NULL) {
            return NULL;
        }
        PyObject *view = PyMemoryView_FromObject(fresh);
        Py_DECREF(fresh);
        return view;
    }
    case 'I':
        return PyLong_FromLongLong(rec->value);
    case 'S':
        return PyBytes_FromStringAndSize(rec->data, rec->len);
    case 'E':
        return PyObject_CallFunction(make_error, "s#", rec->data, rec->len);
    default:
        Py_RETURN_NONE;
    }
}
