/* The native RESP loop of the bulk data path (lmcache_remote.storage.bulk): run_batch.
 *
 * One function, run_batch(), does what bulk._Reader and BulkPipeline._run do for a batch of
 * commands (each packed as bytes, or as a list of buffers whose big values are views of the
 * caller's memory): it sends them, as the replies come in when the replies are big (at most
 * `inflight` reply bytes asked for and unread), and parses every RESP reply, receiving each
 * bulk string straight into its destination: its place in a list given up front, what a
 * Python sink returns for it, or fresh memory.
 * The payload of a bulk reply is read with readv() into its destination and a small tail of
 * the receive buffer at once, so a reply costs about one system call and no second copy.
 * With no sink or a list of places the whole batch runs without the GIL: replies that do
 * not land in a place are kept in C memory and made into Python objects at the end, and the
 * GIL is taken back only for that, an error or a signal. A read then never waits for Python
 * work on other threads (decoding the previous window, another lane, the engine's own
 * threads), where giving the GIL back and taking it again per system call waited up to the
 * switch interval (5 ms) each time another thread was busy. With a callable sink (called per
 * bulk reply) the GIL is released around every system call instead. Semantics are those of
 * the Python reader (storage/bulk.py), which stays the fallback and the reference: the tests run
 * both.
 *
 * A write batch may carry seals: checksums that the loop computes as it sends a command's
 * parts and writes into the command's header before the header goes out (see seal_t), so
 * that the data is hashed while the kernel's copy of it into the socket can still find it in
 * the CPU cache.
 *
 * Errors: a timeout raises TimeoutError, a closed connection ConnectionResetError, a reply
 * this reader does not understand ValueError (bulk.py maps them to redis-py's errors and
 * disconnects the connection); an error reply (-ERR ...) becomes make_error(text) in the
 * list and reading goes on, so the connection stays in step.
 */
#include "_wire.h"

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>

#define BUF_SIZE (64 * 1024)   /* receive buffer: header lines and small replies */
#define TAIL_MAX (16 * 1024)   /* buffer bytes a payload read may also fill */
#define LINE_MAX_BYTES (64 * 1024)
#define MAX_IOV 64
#define SEND_IOV 1024          /* buffers per sendmsg (Linux's IOV_MAX) */
#define MAX_DESTS 16
#define LOWAT_MAX (512 * 1024) /* the most SO_RCVLOWAT is raised to */

typedef struct {
    int fd;
    int timeout_ms; /* -1: wait for ever */
    char *buf;
    Py_ssize_t start, end;
    int lowat;      /* the socket's SO_RCVLOWAT now */
    int want_lowat; /* what the next wait for input needs: 1, or part of a payload's rest */
    PyThreadState *ts; /* set while the loop runs without the GIL (a list sink), else NULL */
    long long max_bulk; /* the longest bulk reply accepted: a longer one is refused unread */
    double deadline;    /* CLOCK_MONOTONIC seconds the whole batch must end by; < 0: none */
} reader_t;

static double monotonic_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* How long the next wait may last: the socket's timeout, cut to what is left of the batch's
 * deadline (0 once it has passed: the wait then fails at once unless the socket is ready). */
static int wait_budget_ms(const reader_t *r) {
    if (r->deadline < 0) {
        return r->timeout_ms;
    }
    double left = (r->deadline - monotonic_s()) * 1000.0;
    int ms = left <= 0 ? 0 : left >= (double)INT_MAX ? INT_MAX : (int)(left + 0.999);
    return r->timeout_ms >= 0 && r->timeout_ms < ms ? r->timeout_ms : ms;
}

/* The GIL for a loop that runs without it (r->ts set): gil_take before anything that touches
 * a Python object or sets an error, gil_drop after. Both do nothing when already so. */
static void gil_take(reader_t *r) {
    if (r->ts != NULL) {
        PyEval_RestoreThread(r->ts);
        r->ts = NULL;
    }
}

static void gil_drop(reader_t *r) {
    if (r->ts == NULL) {
        r->ts = PyEval_SaveThread();
    }
}

/* Sets a Python error (taking the GIL first) and returns -1. */
static int fail(reader_t *r, PyObject *type, const char *message) {
    gil_take(r);
    PyErr_SetString(type, message);
    return -1;
}

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

/* Sets SO_RCVLOWAT to what the coming wait needs (no GIL needed). While a big payload is
 * coming, waking up for each 64 KiB that arrives costs a poll and a read each; with the low
 * mark at the bytes still due (up to LOWAT_MAX) the wait ends when they are there. Every byte
 * counted is sure to come (it is the rest of a reply being received), a closed connection
 * still wakes the wait, and the mark is 1 again before any wait for a reply's first line. */
static void set_lowat(reader_t *r, int want) {
    if (r->lowat != want &&
        setsockopt(r->fd, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof(want)) == 0) {
        r->lowat = want;
    }
}

/* Waits until fd is ready for `events`; called without the GIL. Returns 0, or -1 with errno
 * set (ETIMEDOUT when the wait ran out). */
static int wait_fd(int fd, short events, int timeout_ms) {
    struct pollfd p;
    p.fd = fd;
    p.events = events;
    p.revents = 0;
    int rc = poll(&p, 1, timeout_ms);
    if (rc == 0) {
        errno = ETIMEDOUT;
        return -1;
    }
    return rc < 0 ? -1 : 0;
}

/* Raises the Python error for a failed system call (errno) and returns -1; with the GIL. */
static int raise_errno(reader_t *r, const char *what) {
    int err = errno;
    gil_take(r);
    errno = err;
    if (errno == ETIMEDOUT) {
        PyErr_Format(PyExc_TimeoutError, "%s timed out", what);
    } else {
        PyErr_SetFromErrno(PyExc_OSError);
    }
    return -1;
}

/* One readv() (POLLIN) or sendmsg() (POLLOUT) over `iov`, waiting while the socket is not
 * ready (at most timeout_ms each time) and retrying after signals, without the GIL. Returns
 * the byte count (> 0 for a send, >= 0 for a read: 0 is the server closing), or -1 with a
 * Python error set (and the GIL held). A loop holding the GIL gives it up around the calls. */
static Py_ssize_t socket_io(reader_t *r, short events, struct iovec *iov, int iovcnt) {
    int free_running = r->ts != NULL;
    for (;;) {
        ssize_t n;
        int err = 0;
        PyThreadState *save = free_running ? NULL : PyEval_SaveThread();
        for (;;) {
            if (r->deadline >= 0 && monotonic_s() >= r->deadline) {
                n = -1; /* the whole batch's time is up, however fast bytes still trickle */
                err = ETIMEDOUT;
                break;
            }
            if (events == POLLIN) {
                n = readv(r->fd, iov, iovcnt);
            } else {
                struct msghdr msg;
                memset(&msg, 0, sizeof(msg));
                msg.msg_iov = iov;
                msg.msg_iovlen = (size_t)iovcnt;
                n = sendmsg(r->fd, &msg, MSG_NOSIGNAL);
            }
            if (n >= 0) {
                break;
            }
            err = errno;
            if (err == EAGAIN || err == EWOULDBLOCK) {
                if (events == POLLIN) {
                    set_lowat(r, r->want_lowat);
                }
                if (wait_fd(r->fd, events, wait_budget_ms(r)) == 0) {
                    continue;
                }
            }
            err = errno;
            break;
        }
        if (save != NULL) {
            PyEval_RestoreThread(save);
        }
        if (n >= 0) {
            return n;
        }
        if (err == EINTR) {
            gil_take(r);
            if (PyErr_CheckSignals() < 0) {
                return -1;
            }
            if (free_running) {
                gil_drop(r);
            }
            continue;
        }
        errno = err;
        return raise_errno(r, events == POLLIN ? "receive" : "send");
    }
}

/* Reads at least one byte into the buffers; a closed connection is ConnectionResetError. */
static Py_ssize_t read_some(reader_t *r, struct iovec *iov, int iovcnt) {
    Py_ssize_t n = socket_io(r, POLLIN, iov, iovcnt);
    if (n == 0) {
        return fail(r, PyExc_ConnectionResetError, "connection closed by the server");
    }
    return n;
}

/* Fills the receive buffer with at least one more byte (compacting it first). */
static int fill(reader_t *r) {
    if (r->start == r->end) {
        r->start = r->end = 0;
    } else if (r->start > 0) {
        memmove(r->buf, r->buf + r->start, (size_t)(r->end - r->start));
        r->end -= r->start;
        r->start = 0;
    }
    if (r->end == BUF_SIZE) {
        return fail(r, PyExc_ValueError, "protocol error: reply line too long");
    }
    struct iovec iov;
    iov.iov_base = r->buf + r->end;
    iov.iov_len = (size_t)(BUF_SIZE - r->end);
    r->want_lowat = 1;
    Py_ssize_t n = read_some(r, &iov, 1);
    if (n < 0) {
        return -1;
    }
    r->end += n;
    return 0;
}

/* The next line (without CRLF): its start in r->buf and its length; r->start moves past it. */
static int read_line(reader_t *r, const char **line, Py_ssize_t *len) {
    Py_ssize_t rel = 1; /* where to look for '\n', from r->start: after at least the '\r' */
    for (;;) {
        char *base = r->buf;
        Py_ssize_t from = r->start + rel;
        char *nl = from < r->end ? memchr(base + from, '\n', (size_t)(r->end - from)) : NULL;
        while (nl != NULL && nl[-1] != '\r') {
            nl = memchr(nl + 1, '\n', (size_t)(base + r->end - (nl + 1)));
        }
        if (nl != NULL) {
            *line = base + r->start;
            *len = (nl - 1) - (base + r->start);
            r->start = (nl - base) + 1;
            return 0;
        }
        if (r->end - r->start >= LINE_MAX_BYTES) {
            return fail(r, PyExc_ValueError, "protocol error: reply line too long");
        }
        rel = r->end - r->start > 1 ? r->end - r->start : 1;
        if (fill(r) < 0) {
            return -1;
        }
    }
}

static int parse_int(const char *s, Py_ssize_t len, long long *out) {
    if (len <= 0 || len > 20) {
        return -1;
    }
    int neg = 0;
    Py_ssize_t i = 0;
    if (s[0] == '-') {
        neg = 1;
        i = 1;
        if (len == 1) {
            return -1;
        }
    }
    long long v = 0;
    for (; i < len; i++) {
        if (s[i] < '0' || s[i] > '9') {
            return -1;
        }
        if (v > (LLONG_MAX - (s[i] - '0')) / 10) {
            return -1;
        }
        v = v * 10 + (s[i] - '0');
    }
    *out = neg ? -v : v;
    return 0;
}

/* Receives `length` payload bytes into the buffers, then the CRLF after them. */
static int read_payload(reader_t *r, Py_buffer *views, int nviews) {
    int d = 0;              /* current destination */
    Py_ssize_t pos = 0;     /* bytes of views[d] filled */
    /* What is buffered already goes first. */
    while (d < nviews && r->start < r->end) {
        Py_ssize_t want = views[d].len - pos;
        Py_ssize_t have = r->end - r->start;
        Py_ssize_t n = want < have ? want : have;
        if (n > 0) { /* at most BUF_SIZE bytes: not worth releasing the GIL */
            memcpy((char *)views[d].buf + pos, r->buf + r->start, (size_t)n);
        }
        r->start += n;
        pos += n;
        if (pos == views[d].len) {
            d++;
            pos = 0;
        }
    }
    if (r->start == r->end) {
        r->start = r->end = 0;
    }
    /* The rest straight from the socket, with a small tail of the buffer behind it (the CRLF
     * and the next reply's header come in the same call). */
    while (d < nviews) {
        struct iovec iov[MAX_IOV + 1];
        int cnt = 0;
        Py_ssize_t due = 0;
        for (int k = d; k < nviews && cnt < MAX_IOV; k++) {
            Py_ssize_t off = k == d ? pos : 0;
            if (views[k].len - off > 0) {
                iov[cnt].iov_base = (char *)views[k].buf + off;
                iov[cnt].iov_len = (size_t)(views[k].len - off);
                due += views[k].len - off;
                cnt++;
            }
        }
        r->want_lowat = due < LOWAT_MAX ? (int)due : LOWAT_MAX;
        if (cnt == 0) {
            break;
        }
        /* the buffer is empty here (everything buffered went into the destinations) */
        iov[cnt].iov_base = r->buf;
        iov[cnt].iov_len = TAIL_MAX;
        Py_ssize_t n = read_some(r, iov, cnt + 1);
        if (n < 0) {
            return -1;
        }
        while (n > 0 && d < nviews) {
            Py_ssize_t room = views[d].len - pos;
            Py_ssize_t take = n < room ? n : room;
            pos += take;
            n -= take;
            if (pos == views[d].len) {
                d++;
                pos = 0;
            }
        }
        if (n > 0) { /* went into the tail */
            r->start = 0;
            r->end = n;
        }
    }
    while (r->end - r->start < 2) {
        if (fill(r) < 0) {
            return -1;
        }
    }
    if (r->buf[r->start] != '\r' || r->buf[r->start + 1] != '\n') {
        return fail(r, PyExc_ValueError, "protocol error: bulk reply not terminated");
    }
    r->start += 2;
    return 0;
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
    default:
        unexpected_reply(line, len);
        return NULL;
    }
}

/* One reply of any kind; a new reference. */
static PyObject *read_reply(reader_t *r, Py_ssize_t index, PyObject *sink, PyObject *make_error) {
    const char *line;
    Py_ssize_t len;
    if (read_line(r, &line, &len) < 0) {
        return NULL;
    }
    return reply_from_line(r, index, line, len, sink, make_error);
}

/* The seals of a write batch, taken up front: before dest's bytes go out, seal k (if any)
 * writes the XXH3-64 of each source, little-endian, at its offset in dest (a header inside
 * command k), then, when sum_at >= 0, the low 32 bits of the XXH3-64 of dest[0:sum_at] at
 * sum_at. Each source is hashed as late as it can be, without the GIL: one that the command
 * sends before dest (a part ahead of the header) piece by piece, each piece just before it
 * goes out, so that the kernel's copy finds it still in the CPU cache; the others just
 * before dest goes out (send_commands). */
typedef struct {
    Py_buffer dest;
    Py_buffer *src;
    Py_ssize_t *at;
    unsigned char *hashed; /* per source: its digest is in dest */
    Py_ssize_t n, sum_at;
    int taken; /* dest held, src[0..n) held */
} seal_t;

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

static void seals_free(seal_t *seals, Py_ssize_t count) {
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
static int seal_take(seal_t *s, PyObject *item) {
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
static int send_commands(reader_t *r, const struct iovec *iovs, const Py_ssize_t *first,
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

/* The destinations of a list sink, taken up front: the buffers of place i are
 * views[first[i] .. first[i] + n[i]) and add up to total[i]; n[i] == 0 for no place. */
typedef struct {
    Py_buffer *views;
    Py_ssize_t *first;
    int *n;
    Py_ssize_t *total;
    Py_ssize_t taken; /* views acquired so far (released by places_free) */
} places_t;

static void places_free(places_t *p) {
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
static int places_take(places_t *p, PyObject *sink, Py_ssize_t count) {
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

/* A reply received without the GIL, made into its Python object at the end. */
typedef struct {
    char kind;       /* 'P' in its place, 'B' bulk (data), 'N' nil, 'I' integer, 'S' status,
                      * 'E' error (data: its text), 0 not received */
    long long value; /* 'I' */
    char *data;      /* 'B', 'S', 'E': PyMem_RawMalloc'd, len bytes */
    Py_ssize_t len;
} record_t;

static void records_free(record_t *recs, Py_ssize_t count) {
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
static int receive_record(reader_t *r, record_t *rec, places_t *places, Py_ssize_t i) {
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
    default:
        gil_take(r);
        unexpected_reply(line, len);
        return -1;
    }
}

/* The Python object of a record (a new reference); needs the GIL. */
static PyObject *record_object(record_t *rec, PyObject *place, PyObject *make_error) {
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
