/* The send side of the native RESP loop (run_batch, _wire_resp.c): a write batch's seals and
 * the sending of commands. send_commands sends every byte of a range of commands (each a run
 * of buffers taken from the Python objects with the GIL), SEND_IOV buffers per sendmsg, over
 * the reader's socket_io (_wire_io.c), with or without the GIL as the loop runs.
 *
 * A write batch may carry seals: checksums that the loop computes as it sends a command's
 * parts and writes into the command's header before the header goes out (see seal_t in
 * _wire_resp.h), so that the data is hashed while the kernel's copy of it into the socket can
 * still find it in the CPU cache. seal_take takes and checks a seal (with the GIL) before
 * anything is sent, seals_free releases it. Errors: -1 with a Python error set (and the GIL
 * held).
 */
#include "_wire_resp.h"

#include <poll.h>
#include <sys/types.h>
#include <sys/uio.h>

#define SEND_IOV 1024          /* buffers per sendmsg (Linux's IOV_MAX) */

#define SEAL_FLUSH (256 * 1024) /* a sealed command goes out once this much is waiting */

static void put_le(unsigned char *p, uint64_t v, int width) {
    for (int i = 0; i < width; i++) {
        p[i] = (unsigned char)(v >> (8 * i));
    }
}

/* Every digest not written yet, then the header's own checksum: dest is ready to go. */
static void seal_apply(seal_t *s) {
    unsigned char *d = s->dest.buf;
    for (Py_ssize_t i = 0; i < s->n; i++) {
        if (!s->hashed[i]) {
            put_le(d + s->at[i], xxh3_64(s->src[i].buf, (size_t)s->src[i].len), 8);
            s->hashed[i] = 1;
        }
    }
    if (s->sum_at >= 0) {
        put_le(d + s->sum_at, xxh3_64(d, (size_t)s->sum_at) & 0xFFFFFFFFu, 4);
    }
}

/* The source of s that is exactly the buffer v and is not hashed yet, or -1. */
static Py_ssize_t seal_source(const seal_t *s, const struct iovec *v) {
    for (Py_ssize_t i = 0; i < s->n; i++) {
        if (!s->hashed[i] && s->src[i].buf == v->iov_base &&
            (size_t)s->src[i].len == v->iov_len) {
            return i;
        }
    }
    return -1;
}

/* Whether the buffer v is dest itself. */
static int seal_is_dest(const seal_t *s, const struct iovec *v) {
    return v->iov_base == s->dest.buf && v->iov_len == (size_t)s->dest.len;
}

/* Whether one of command's buffers is dest itself: only then can its sources go out before
 * it is sealed (else seal_apply runs before any byte of the command is sent). */
static int seal_sent_in(const seal_t *s, const struct iovec *iovs, Py_ssize_t count) {
    for (Py_ssize_t at = 0; at < count; at++) {
        if (seal_is_dest(s, &iovs[at])) {
            return 1;
        }
    }
    return 0;
}

void seals_free(seal_t *seals, Py_ssize_t count) {
    for (Py_ssize_t k = 0; seals != NULL && k < count; k++) {
        seal_t *s = &seals[k];
        for (Py_ssize_t i = 0; i < s->n && i < s->taken - 1; i++) {
            PyBuffer_Release(&s->src[i]);
        }
        if (s->taken > 0) {
            PyBuffer_Release(&s->dest);
        }
        PyMem_Free(s->src);
        PyMem_Free(s->at);
        PyMem_Free(s->hashed);
    }
    PyMem_Free(seals);
}

/* One seal from (dest, sources, offsets, sum_at), every offset checked against dest. */
int seal_take(seal_t *s, PyObject *item) {
    PyObject *dest, *sources, *offsets;
    if (!PyTuple_Check(item) ||
        !PyArg_ParseTuple(item, "OO!O!n", &dest, &PyList_Type, &sources, &PyList_Type,
                          &offsets, &s->sum_at)) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "a seal is (dest, sources, offsets, sum_at)");
        }
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(sources);
    if (PyList_GET_SIZE(offsets) != n) {
        PyErr_SetString(PyExc_ValueError, "a seal needs one offset per source");
        return -1;
    }
    if (PyObject_GetBuffer(dest, &s->dest, PyBUF_WRITABLE) < 0) {
        return -1;
    }
    s->taken = 1;
    s->src = PyMem_Malloc(sizeof(Py_buffer) * SLOTS(n));
    s->at = PyMem_Malloc(sizeof(Py_ssize_t) * SLOTS(n));
    s->hashed = PyMem_Calloc(SLOTS(n), 1);
    if (s->src == NULL || s->at == NULL || s->hashed == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    s->n = n;
    if (s->sum_at < -1 || s->sum_at > s->dest.len - 4) {
        PyErr_SetString(PyExc_ValueError, "a seal's checksum offset lies outside its buffer");
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        s->at[i] = PyLong_AsSsize_t(PyList_GET_ITEM(offsets, i));
        if (s->at[i] == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (s->at[i] < 0 || s->at[i] > s->dest.len - 8) {
            PyErr_SetString(PyExc_ValueError, "a seal's offset lies outside its buffer");
            return -1;
        }
        if (PyObject_GetBuffer(PyList_GET_ITEM(sources, i), &s->src[i], PyBUF_SIMPLE) < 0) {
            return -1;
        }
        s->taken++;
    }
    return 0;
}

/* Every byte of iov[0..cnt), with waits and EINTR handling (iov is consumed). */
static int send_all(reader_t *r, struct iovec *iov, int cnt) {
    int idx = 0;
    while (idx < cnt) {
        Py_ssize_t n = socket_io(r, POLLOUT, iov + idx, cnt - idx);
        if (n < 0) {
            return -1;
        }
        while (n > 0 && idx < cnt) {
            if ((size_t)n >= iov[idx].iov_len) {
                n -= (ssize_t)iov[idx].iov_len;
                idx++;
            } else {
                iov[idx].iov_base = (char *)iov[idx].iov_base + n;
                iov[idx].iov_len -= (size_t)n;
                n = 0;
            }
        }
    }
    return 0;
}

/* The send queue of send_commands: up to SEND_IOV buffers, sent in one sendmsg each time
 * it fills, or when flushed. */
typedef struct {
    struct iovec iov[SEND_IOV];
    int cnt;
    size_t waiting;
} sendq_t;

static int sendq_flush(reader_t *r, sendq_t *q) {
    int rc = send_all(r, q->iov, q->cnt);
    q->cnt = 0;
    q->waiting = 0;
    return rc;
}

static int sendq_add(reader_t *r, sendq_t *q, void *base, size_t len) {
    if (q->cnt == SEND_IOV && sendq_flush(r, q) < 0) {
        return -1;
    }
    q->iov[q->cnt].iov_base = base;
    q->iov[q->cnt].iov_len = len;
    q->cnt++;
    q->waiting += len;
    return 0;
}

/* Source i of s, hashed and queued SEAL_FLUSH bytes at a time, each piece sent right after it
 * was hashed (whole, then sent, without the streaming XXH3). */
static int send_hashed(reader_t *r, sendq_t *q, seal_t *s, Py_ssize_t i, void *state) {
    char *base = s->src[i].buf;
    size_t len = (size_t)s->src[i].len;
    if (state == NULL) {
        put_le((unsigned char *)s->dest.buf + s->at[i], xxh3_64(base, len), 8);
        s->hashed[i] = 1;
        return sendq_add(r, q, base, len);
    }
    xxh3_reset(state);
    for (size_t off = 0; off < len; off += SEAL_FLUSH) {
        size_t piece = len - off < SEAL_FLUSH ? len - off : SEAL_FLUSH;
        xxh3_update(state, base + off, piece);
        if (sendq_add(r, q, base + off, piece) < 0 ||
            (q->waiting >= SEAL_FLUSH && sendq_flush(r, q) < 0)) {
            return -1;
        }
    }
    put_le((unsigned char *)s->dest.buf + s->at[i], xxh3_digest(state), 8);
    s->hashed[i] = 1;
    return 0;
}

/* Sends every byte of commands[from:to]: command k is the buffers iovs[first[k] ..
 * first[k + 1]) (taken from the Python objects with the GIL), SEND_IOV buffers per sendmsg.
 * A sealed command's sources that go out before its header are hashed as they are sent
 * (send_hashed), the rest just before the header (seal_apply); a sealed command goes out
 * with what is waiting once that reaches SEAL_FLUSH, so that what its seal hashed is still
 * cached. */
int send_commands(reader_t *r, const struct iovec *iovs, const Py_ssize_t *first,
                         seal_t *seals, Py_ssize_t from, Py_ssize_t to) {
    sendq_t q;
    q.cnt = 0;
    q.waiting = 0;
    void *state = NULL;
    int rc = -1;
    for (Py_ssize_t k = from; k < to; k++) {
        seal_t *s = seals != NULL && seals[k].taken > 0 ? &seals[k] : NULL;
        int streamed = s != NULL && seal_sent_in(s, iovs + first[k], first[k + 1] - first[k]);
        if (s != NULL && !streamed) {
            seal_apply(s);
        }
        if (streamed && state == NULL && xxh3_new != NULL) {
            state = xxh3_new(); /* NULL (out of memory): hashed whole */
        }
        for (Py_ssize_t at = first[k]; at < first[k + 1]; at++) {
            const struct iovec *v = &iovs[at];
            if (v->iov_len == 0) {
                continue;
            }
            if (streamed) {
                if (seal_is_dest(s, v)) {
                    seal_apply(s);
                } else {
                    Py_ssize_t i = seal_source(s, v);
                    if (i >= 0) {
                        if (send_hashed(r, &q, s, i, state) < 0) {
                            goto done;
                        }
                        continue;
                    }
                }
            }
            if (sendq_add(r, &q, v->iov_base, v->iov_len) < 0) {
                goto done;
            }
        }
        if (s != NULL && q.waiting >= SEAL_FLUSH && sendq_flush(r, &q) < 0) {
            goto done;
        }
    }
    rc = sendq_flush(r, &q);
done:
    if (state != NULL) {
        xxh3_free(state);
    }
    return rc;
}
