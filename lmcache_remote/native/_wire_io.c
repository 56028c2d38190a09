/* The reader's socket and receive buffer, for the native RESP loop (run_batch, _wire_resp.c):
 * the batch's deadline and each wait's budget (CLOCK_MONOTONIC); taking and dropping the GIL
 * for a loop that runs without it; one readv() or sendmsg() at a time, waiting in poll() while
 * the socket is not ready and retrying after signals (socket_io, which the send side uses
 * too); SO_RCVLOWAT raised while a big payload comes; and on the receive side the buffer: a
 * reply's line (read_line), an integer (parse_int), a bulk reply's payload (read_payload).
 * The payload of a bulk reply is read with readv() into its destination and a small tail of
 * the receive buffer at once, so a reply costs about one system call and no second copy.
 *
 * Promises: no Python object is touched without the GIL; a failure returns -1 with a Python
 * error set and the GIL held: a timeout (the socket's, or the batch's deadline) TimeoutError,
 * another failed system call OSError, a closed connection ConnectionResetError, a line too
 * long or a payload not ended by CRLF ValueError.
 */
#include "_wire_resp.h"

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>

#define TAIL_MAX (16 * 1024)   /* buffer bytes a payload read may also fill */
#define LINE_MAX_BYTES (64 * 1024)
#define MAX_IOV 64
#define LOWAT_MAX (512 * 1024) /* the most SO_RCVLOWAT is raised to */

double monotonic_s(void) {
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
void gil_take(reader_t *r) {
    if (r->ts != NULL) {
        PyEval_RestoreThread(r->ts);
        r->ts = NULL;
    }
}

void gil_drop(reader_t *r) {
    if (r->ts == NULL) {
        r->ts = PyEval_SaveThread();
    }
}

/* Sets a Python error (taking the GIL first) and returns -1. */
int fail(reader_t *r, PyObject *type, const char *message) {
    gil_take(r);
    PyErr_SetString(type, message);
    return -1;
}

/* Sets SO_RCVLOWAT to what the coming wait needs (no GIL needed). While a big payload is
 * coming, waking up for each 64 KiB that arrives costs a poll and a read each; with the low
 * mark at the bytes still due (up to LOWAT_MAX) the wait ends when they are there. Every byte
 * counted is sure to come (it is the rest of a reply being received), a closed connection
 * still wakes the wait, and the mark is 1 again before any wait for a reply's first line. */
void set_lowat(reader_t *r, int want) {
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
Py_ssize_t socket_io(reader_t *r, short events, struct iovec *iov, int iovcnt) {
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
int read_line(reader_t *r, const char **line, Py_ssize_t *len) {
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

int parse_int(const char *s, Py_ssize_t len, long long *out) {
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
int read_payload(reader_t *r, Py_buffer *views, int nviews) {
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
