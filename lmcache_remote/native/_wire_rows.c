/* The row copier of connectors' PagedKV (copy_rows): rows of one size copied between a
 * paged KV cache and chunk tensors by raw address, many jobs in one call that gives up the
 * GIL once for all of them. Every job is checked (an int64 index, every row inside the
 * cache) before the first byte is copied: a bad job raises (TypeError, ValueError,
 * IndexError) with nothing copied. The caller keeps the memory alive and sizes the chunks
 * (connectors/rows.py); nothing here touches a socket or a hash.
 */
#include "_wire.h"

#include <string.h>

/* One run of row copies: rows of `row_bytes` between a cache of `cache_rows` rows at
 * `cache` and a chunk of len(index) consecutive rows at `chunk`; index[k] is the cache row
 * of chunk row k. */
typedef struct {
    char *cache;
    char *chunk;
    long long cache_rows;
    long long row_bytes;
    Py_buffer index; /* int64, C-contiguous */
} rows_job_t;

/* copy_rows(jobs, gather): every job (cache_addr, cache_rows, chunk_addr, row_bytes, index)
 * at once, with the GIL given up once for all of them (connectors.PagedKV's CPU copies: one
 * call per copy thread instead of one GIL hand-off per layer, plane and chunk, each of which
 * waits up to the switch interval when another Python thread is busy). gather: chunk rows
 * from the cache; else cache rows from the chunk. Addresses are the tensors' data_ptr(): the
 * caller keeps the tensors alive and the chunk's extent right; every index is checked
 * against cache_rows here before anything is copied. */
PyObject *copy_rows(PyObject *self, PyObject *args) {
    PyObject *jobs;
    int gather;
    if (!PyArg_ParseTuple(args, "O!p", &PyList_Type, &jobs, &gather)) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(jobs);
    rows_job_t *js = PyMem_Calloc(SLOTS(n), sizeof(rows_job_t));
    if (js == NULL) {
        return PyErr_NoMemory();
    }
    Py_ssize_t taken = 0;
    PyObject *result = NULL;
    for (; taken < n; taken++) {
        rows_job_t *j = &js[taken];
        unsigned long long cache, chunk;
        PyObject *index;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(jobs, taken), "KLKLO", &cache, &j->cache_rows,
                              &chunk, &j->row_bytes, &index)) {
            goto done;
        }
        if (PyObject_GetBuffer(index, &j->index, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            goto done;
        }
        j->cache = (char *)(uintptr_t)cache;
        j->chunk = (char *)(uintptr_t)chunk;
        const char *fmt = j->index.format;
        if (j->index.itemsize != 8 || fmt == NULL || (strcmp(fmt, "q") && strcmp(fmt, "l")
                                                      && strcmp(fmt, "<q") && strcmp(fmt, "=q")
                                                      && strcmp(fmt, "<l") && strcmp(fmt, "=l"))) {
            taken++;
            PyErr_SetString(PyExc_TypeError, "copy_rows: index must be int64");
            goto done;
        }
        const long long *ix = (const long long *)j->index.buf;
        Py_ssize_t count = j->index.len / 8;
        if (j->row_bytes < 0 || j->cache_rows < 0 || (count && (cache == 0 || chunk == 0))) {
            taken++;
            PyErr_SetString(PyExc_ValueError, "copy_rows: bad job");
            goto done;
        }
        for (Py_ssize_t k = 0; k < count; k++) {
            if (ix[k] < 0 || ix[k] >= j->cache_rows) {
                taken++;
                PyErr_Format(PyExc_IndexError, "copy_rows: row %lld outside the cache's %lld",
                             ix[k], j->cache_rows);
                goto done;
            }
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t t = 0; t < n; t++) {
        rows_job_t *j = &js[t];
        const long long *ix = (const long long *)j->index.buf;
        Py_ssize_t count = j->index.len / 8;
        size_t rb = (size_t)j->row_bytes;
        for (Py_ssize_t k = 0; k < count; k++) {
            char *c = j->cache + (size_t)ix[k] * rb;
            char *h = j->chunk + (size_t)k * rb;
            if (gather) {
                memcpy(h, c, rb);
            } else {
                memcpy(c, h, rb);
            }
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    for (Py_ssize_t t = 0; t < taken && t < n; t++) {
        if (js[t].index.obj != NULL) {
            PyBuffer_Release(&js[t].index);
        }
    }
    PyMem_Free(js);
    return result;
}
