/* Batched byte copies for tensorferry (see _copy.py).
 *
 * A sync of 100k tensors is 100k runs of bytes. Copied one ctypes.memmove
 * (or one torch call) at a time, each run costs 0.5 to 6 us of Python and
 * dispatch, more than its bytes when they are small (a bias, a norm, a step
 * counter). Here the loop over the runs is C: a run costs a memmove.
 *
 * Large copies also use non-temporal stores: glibc's memmove streams only
 * copies larger than its threshold (a few MiB), so 100k runs of 40 KiB go
 * through the cache, which reads every destination line before writing it.
 * A batch that moves more than the caller's threshold streams its runs of
 * at least STREAM_MIN_RUN bytes, and ends with a store fence.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define TF_STREAMING 1
#else
#define TF_STREAMING 0
#endif

#define STREAM_MIN_RUN 1024

#if TF_STREAMING
/* memcpy of n bytes (no overlap), the aligned body by 16-byte streaming stores. */
static void stream_copy(char *d, const char *s, size_t n)
{
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t blocks = n / 64;
    for (size_t b = 0; b < blocks; b++) {
        __m128i a0 = _mm_loadu_si128((const __m128i *)s);
        __m128i a1 = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i a2 = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i a3 = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a0);
        _mm_stream_si128((__m128i *)(d + 16), a1);
        _mm_stream_si128((__m128i *)(d + 32), a2);
        _mm_stream_si128((__m128i *)(d + 48), a3);
        d += 64;
        s += 64;
    }
    memcpy(d, s, n - blocks * 64);
}
#endif

/* copy_runs(dst, src, nbytes, count, stream, dst_base=0, src_base=0):
 * memmove(dst_base + dst[i], src_base + src[i], nbytes[i]) for i < count,
 * in order, without the GIL. dst, src and nbytes are the addresses of int64
 * arrays of count entries (numpy's .ctypes.data); the bases let a kept plan
 * reuse its arrays wherever the memory is this time. */
static PyObject *copy_runs(PyObject *self, PyObject *args)
{
    unsigned long long dst_at, src_at, nbytes_at;
    Py_ssize_t count;
    int stream;
    long long dst_base = 0, src_base = 0;
    if (!PyArg_ParseTuple(args, "KKKnp|LL", &dst_at, &src_at, &nbytes_at, &count, &stream, &dst_base, &src_base))
        return NULL;
    if (count < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_runs: count must be >= 0");
        return NULL;
    }
    const int64_t *dst = (const int64_t *)(uintptr_t)dst_at;
    const int64_t *src = (const int64_t *)(uintptr_t)src_at;
    const int64_t *nbytes = (const int64_t *)(uintptr_t)nbytes_at;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        char *d = (char *)(uintptr_t)(dst[i] + dst_base);
        const char *s = (const char *)(uintptr_t)(src[i] + src_base);
        size_t n = (size_t)nbytes[i];
#if TF_STREAMING
        /* Streaming needs the two ranges apart; memmove handles overlap. */
        if (stream && n >= STREAM_MIN_RUN && (d + n <= s || s + n <= d)) {
            stream_copy(d, s, n);
            continue;
        }
#endif
        memmove(d, s, n);
    }
#if TF_STREAMING
    if (stream)
        _mm_sfence();
#endif
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_runs", copy_runs, METH_VARARGS,
     "copy_runs(dst, src, nbytes, count, stream, dst_base=0, src_base=0): memmove a batch of runs given as int64 arrays' addresses (plus the bases), without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tensorferry._memcpy",
    "Batched byte copies (a C loop of memmove; streaming stores for large batches).", -1, methods,
};

PyMODINIT_FUNC PyInit__memcpy(void)
{
    return PyModule_Create(&module);
}
