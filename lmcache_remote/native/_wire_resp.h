/* What the four parts of the native RESP loop (run_batch) share, and nothing else; only they
 * include it. The reader's state (reader_t: its socket and receive buffer, run by
 * _wire_io.c), a write batch's seals (seal_t, _wire_send.c), a list sink's places and the
 * replies received without the GIL (places_t, record_t, _wire_reply.c), BUF_SIZE (the
 * receive buffer's size, which run_batch allocates), and the functions each part gives the
 * others. Like _wire.h's names they are hidden from the extension's symbol table
 * (WIRE_INTERNAL).
 *
 * The parts: _wire_io.c (the reader's socket and buffer: deadline, GIL, waits, system calls,
 * lines, payloads), _wire_send.c (seals and the send path), _wire_reply.c (replies parsed
 * with the GIL, or without it into places and records), _wire_resp.c (run_batch, the batch
 * driver that puts them together).
 */
#ifndef LMCR_WIRE_RESP_H
#define LMCR_WIRE_RESP_H

#include "_wire.h"

#include <sys/uio.h>

#define BUF_SIZE (64 * 1024)   /* receive buffer: header lines and small replies */

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

/* The destinations of a list sink, taken up front: the buffers of place i are
 * views[first[i] .. first[i] + n[i]) and add up to total[i]; n[i] == 0 for no place. */
typedef struct {
    Py_buffer *views;
    Py_ssize_t *first;
    int *n;
    Py_ssize_t *total;
    Py_ssize_t taken; /* views acquired so far (released by places_free) */
} places_t;

/* A reply received without the GIL, made into its Python object at the end. */
typedef struct {
    char kind;       /* 'P' in its place, 'B' bulk (data), 'N' nil, 'I' integer, 'S' status,
                      * 'E' error (data: its text), 0 not received */
    long long value; /* 'I' */
    char *data;      /* 'B', 'S', 'E': PyMem_RawMalloc'd, len bytes */
    Py_ssize_t len;
} record_t;

/* _wire_io.c: the reader's socket and buffer. */
WIRE_INTERNAL double monotonic_s(void);
WIRE_INTERNAL void gil_take(reader_t *r);
WIRE_INTERNAL void gil_drop(reader_t *r);
WIRE_INTERNAL int fail(reader_t *r, PyObject *type, const char *message);
WIRE_INTERNAL void set_lowat(reader_t *r, int want);
WIRE_INTERNAL Py_ssize_t socket_io(reader_t *r, short events, struct iovec *iov, int iovcnt);
WIRE_INTERNAL int read_line(reader_t *r, const char **line, Py_ssize_t *len);
WIRE_INTERNAL int parse_int(const char *s, Py_ssize_t len, long long *out);
WIRE_INTERNAL int read_payload(reader_t *r, Py_buffer *views, int nviews);

/* _wire_send.c: seals and the send path. */
WIRE_INTERNAL void seals_free(seal_t *seals, Py_ssize_t count);
WIRE_INTERNAL int seal_take(seal_t *s, PyObject *item);
WIRE_INTERNAL int send_commands(reader_t *r, const struct iovec *iovs, const Py_ssize_t *first,
                                seal_t *seals, Py_ssize_t from, Py_ssize_t to);

/* _wire_reply.c: replies, places, records. */
WIRE_INTERNAL PyObject *read_reply(reader_t *r, Py_ssize_t index, PyObject *sink,
                                   PyObject *make_error);
WIRE_INTERNAL void places_free(places_t *p);
WIRE_INTERNAL int places_take(places_t *p, PyObject *sink, Py_ssize_t count);
WIRE_INTERNAL void records_free(record_t *recs, Py_ssize_t count);
WIRE_INTERNAL int receive_record(reader_t *r, record_t *rec, places_t *places, Py_ssize_t i);
WIRE_INTERNAL PyObject *record_object(record_t *rec, PyObject *place, PyObject *make_error);

#endif /* LMCR_WIRE_RESP_H */
