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
 *
 * convert_runs does the same for float32 -> bfloat16 / float16 conversions
 * (a kept plan's dtype=): torch's copy_ of 1 GiB float32 into bfloat16 took
 * longer here than a 1 GiB copy, though it writes half the bytes, because
 * its stores go through the cache.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* The x86 paths use GCC/Clang's target attributes and CPU checks. */
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
#include <immintrin.h>
#define TF_STREAMING 1
#else
#define TF_STREAMING 0
#endif

/* AVX512-BF16 intrinsics came with GCC 10 and Clang 11: an older compiler
 * builds the module without that path rather than failing it whole. */
#if TF_STREAMING && ((defined(__clang__) && __clang_major__ >= 11) || (!defined(__clang__) && __GNUC__ >= 10))
#define TF_AVX512BF16 1
#else
#define TF_AVX512BF16 0
#endif

#define STREAM_MIN_RUN 1024

#if TF_STREAMING
/* One 64-byte line, loaded and stored by streaming (non-temporal) stores. */
static inline void stream_line(char *d, const char *s)
{
    __m128i a0 = _mm_loadu_si128((const __m128i *)s);
    __m128i a1 = _mm_loadu_si128((const __m128i *)(s + 16));
    __m128i a2 = _mm_loadu_si128((const __m128i *)(s + 32));
    __m128i a3 = _mm_loadu_si128((const __m128i *)(s + 48));
    _mm_stream_si128((__m128i *)d, a0);
    _mm_stream_si128((__m128i *)(d + 16), a1);
    _mm_stream_si128((__m128i *)(d + 32), a2);
    _mm_stream_si128((__m128i *)(d + 48), a3);
}

#define STREAM_PAGE 4096
#define STREAM_PAGES 4

/* At least this distance from the source up to the destination within a
 * page, ((d - s) mod 4096), for the four-page loop (see stream_copy). */
#define INTERLEAVE_MIN_APART 1024

/* memcpy of n bytes (no overlap), the line-aligned body by streaming
 * stores. Runs of four pages and more go four pages at a time, a line of
 * each in turn, with the loads prefetched a few lines ahead: four streams
 * of reads and writes keep more of the memory system busy than one. On
 * this machine's 256 MiB copy: 25 ms against 30 ms line after line, the
 * speed of glibc's own large-copy loop (which it takes only above its
 * non-temporal threshold, three quarters of the last-level cache: here
 * over 200 MiB, so runs of 64 MiB went through the cache at 42 ms).
 *
 * Except where the destination lies less than INTERLEAVE_MIN_APART bytes
 * past the source within a page: there the load of one page's line
 * follows the store of the line just before it to the same place in a
 * page (the same low 12 address bits), and a load waits behind such a
 * store ("4K aliasing"). A 256 MiB copy 0-256 bytes apart so took 85-125
 * ms against 18-20 ms, and a 41 MB weight and its place in a pool often
 * lie so (both 64 bytes into a page). Line after line (the loads run
 * ahead of the stores) the same copy takes 19-23 ms. */
static void stream_copy(char *d, const char *s, size_t n)
{
    size_t head = (64 - ((uintptr_t)d & 63)) & 63;
    if (head > n)
        head = n;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    const size_t chunk = STREAM_PAGE * STREAM_PAGES;
    size_t chunks = n / chunk;
    if ((((uintptr_t)d - (uintptr_t)s) & (STREAM_PAGE - 1)) < INTERLEAVE_MIN_APART)
        chunks = 0;
    for (size_t c = 0; c < chunks; c++, d += chunk, s += chunk)
        for (size_t line = 0; line < STREAM_PAGE; line += 64)
            for (size_t p = 0; p < STREAM_PAGES; p++) {
                _mm_prefetch(s + p * STREAM_PAGE + line + 256, _MM_HINT_T0);
                stream_line(d + p * STREAM_PAGE + line, s + p * STREAM_PAGE + line);
            }
    n -= chunks * chunk;
    size_t lines = n / 64;
    for (size_t b = 0; b < lines; b++, d += 64, s += 64)
        stream_line(d, s);
    memcpy(d, s, n - lines * 64);
}
#endif

/* -1 with ValueError set if the count or a length is negative (a size_t
 * would read it as huge), else 0. */
static int check_lengths(const int64_t *lengths, Py_ssize_t count, const char *what)
{
    if (count < 0) {
        PyErr_Format(PyExc_ValueError, "%s: count must be >= 0, not %zd", what, count);
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++)
        if (lengths[i] < 0) {
            PyErr_Format(PyExc_ValueError, "%s[%zd] is %lld: lengths cannot be negative", what, i, (long long)lengths[i]);
            return -1;
        }
    return 0;
}

/* A batch of runs as Python passes it: three int64 arrays by address. */
typedef struct {
    const int64_t *dst, *src, *len;
} Runs;

/* ``r`` over the arrays at these addresses; -1 with ValueError set if the
 * count or a length is negative (check_lengths), else 0. */
static int runs_at(Runs *r, unsigned long long dst_at, unsigned long long src_at, unsigned long long len_at, Py_ssize_t count, const char *what)
{
    r->dst = (const int64_t *)(uintptr_t)dst_at;
    r->src = (const int64_t *)(uintptr_t)src_at;
    r->len = (const int64_t *)(uintptr_t)len_at;
    return check_lengths(r->len, count, what);
}

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
    Runs r;
    if (runs_at(&r, dst_at, src_at, nbytes_at, count, "copy_runs: nbytes") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        char *d = (char *)(uintptr_t)(r.dst[i] + dst_base);
        const char *s = (const char *)(uintptr_t)(r.src[i] + src_base);
        size_t n = (size_t)r.len[i];
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

/* ---- float32 -> bfloat16 / float16 ------------------------------------- */

#define KIND_BFLOAT16 0
#define KIND_FLOAT16 1

/* A run is converted in blocks of 32 elements: 64 bytes written, one whole
 * cache line (the head is converted one by one up to a line boundary), which
 * streaming stores write without reading it. */
#define BLOCK_ELEMS 32

/* bfloat16 of float32 bits u, rounded to nearest even, as torch's
 * round_to_nearest_even: add 0x7fff plus the lowest kept bit, keep the top
 * half. Finite values that round past the largest bfloat16 carry into the
 * exponent and become inf, as in torch; no finite u overflows 32 bits (the
 * largest, -inf's 0xff800000, is not NaN). Every NaN becomes `nan`: torch
 * writes one fixed pattern whatever the payload (0xffff from its vectorised
 * kernels, 0x7fc0 from its scalar one; the caller passes what torch does). */
static inline uint16_t bf16_bits(uint32_t u, uint16_t nan)
{
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return nan;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if TF_STREAMING
/* 8 floats -> 8 bfloat16 (SSE2). The arithmetic shift leaves each result
 * sign-extended from 16 bits, so the signed saturating pack keeps it whole
 * (SSE2 has no unsigned 32 -> 16 pack). */
static inline __m128i bf16x4_sse2(__m128 x, __m128i nan32)
{
    const __m128i bias = _mm_set1_epi32(0x7fff), one = _mm_set1_epi32(1);
    __m128i u = _mm_castps_si128(x);
    __m128i r = _mm_add_epi32(u, _mm_add_epi32(bias, _mm_and_si128(_mm_srli_epi32(u, 16), one)));
    r = _mm_srai_epi32(r, 16);
    __m128i isnan = _mm_castps_si128(_mm_cmpunord_ps(x, x));
    return _mm_or_si128(_mm_and_si128(isnan, nan32), _mm_andnot_si128(isnan, r));
}

static inline void bf16_block_sse2(char *d, const char *s, int stream, __m128i nan32)
{
    for (int k = 0; k < 4; k++) {
        __m128i lo = bf16x4_sse2(_mm_loadu_ps((const float *)(s + 32 * k)), nan32);
        __m128i hi = bf16x4_sse2(_mm_loadu_ps((const float *)(s + 32 * k + 16)), nan32);
        __m128i out = _mm_packs_epi32(lo, hi);
        if (stream)
            _mm_stream_si128((__m128i *)(d + 16 * k), out);
        else
            _mm_storeu_si128((__m128i *)(d + 16 * k), out);
    }
}

__attribute__((target("avx2"))) static inline __m256i bf16x8_avx2(__m256 x, __m256i nan32)
{
    const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
    __m256i u = _mm256_castps_si256(x);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
    r = _mm256_srai_epi32(r, 16);
    __m256i isnan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, nan32, isnan);
}

__attribute__((target("avx2"))) static inline void bf16_block_avx2(char *d, const char *s, int stream, __m128i nan32_128)
{
    __m256i nan32 = _mm256_broadcastsi128_si256(nan32_128);
    for (int k = 0; k < 2; k++) {
        __m256i a = bf16x8_avx2(_mm256_loadu_ps((const float *)(s + 64 * k)), nan32);
        __m256i b = bf16x8_avx2(_mm256_loadu_ps((const float *)(s + 64 * k + 32)), nan32);
        /* packs works within 128-bit lanes: a0 b0 a1 b1, put back in order. */
        __m256i out = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8);
        if (stream)
            _mm256_stream_si256((__m256i *)(d + 32 * k), out);
        else
            _mm256_storeu_si256((__m256i *)(d + 32 * k), out);
    }
}

#if TF_AVX512BF16
/* AVX512-BF16 converts 32 floats in one instruction, rounding to nearest
 * even as above, but flushes float32 denormals to zero and keeps NaN
 * payloads, where torch keeps denormals and writes one NaN. A block holding
 * either (one fpclass test per 16 floats) is converted by the AVX2 loop. */
__attribute__((target("avx2,avx512f,avx512bw,avx512dq,avx512bf16"))) static inline void bf16_block_avx512(char *d, const char *s, int stream, __m128i nan32)
{
    __m512 lo = _mm512_loadu_ps((const float *)s), hi = _mm512_loadu_ps((const float *)(s + 64));
    /* 0x01 quiet NaN, 0x80 signalling NaN, 0x20 denormal */
    if (_mm512_fpclass_ps_mask(lo, 0xa1) | _mm512_fpclass_ps_mask(hi, 0xa1)) {
        bf16_block_avx2(d, s, stream, nan32);
        return;
    }
    __m512i out = (__m512i)_mm512_cvtne2ps_pbh(hi, lo); /* lo's values first */
    if (stream)
        _mm512_stream_si512((__m512i *)d, out);
    else
        _mm512_storeu_si512((__m512i *)d, out);
}
#endif

/* float16 by F16C: IEEE round to nearest even, the instruction torch's
 * vectorised kernels use (so NaNs keep their sign and top payload bits as
 * there). Without F16C float16 stays with torch. */
__attribute__((target("avx,f16c"))) static inline void f16_block_f16c(char *d, const char *s, int stream)
{
    for (int k = 0; k < 4; k++) {
        __m128i out = _mm256_cvtps_ph(_mm256_loadu_ps((const float *)(s + 32 * k)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        if (stream)
            _mm_stream_si128((__m128i *)(d + 16 * k), out);
        else
            _mm_storeu_si128((__m128i *)(d + 16 * k), out);
    }
}

__attribute__((target("avx,f16c"))) static void f16_scalar_f16c(char *d, const char *s, size_t n)
{
    for (size_t j = 0; j < n; j++) {
        float f;
        memcpy(&f, s + 4 * j, 4);
        uint16_t h = (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        memcpy(d + 2 * j, &h, 2);
    }
}
#endif

static void bf16_scalar(char *d, const char *s, size_t n, uint16_t nan)
{
    for (size_t j = 0; j < n; j++) {
        uint32_t u;
        memcpy(&u, s + 4 * j, 4);
        uint16_t h = bf16_bits(u, nan);
        memcpy(d + 2 * j, &h, 2);
    }
}

#if TF_STREAMING
/* The body of a run, `blocks` blocks, a loop per instruction set (the
 * blocks inlined: a call per 64 bytes cost a third of the in-cache speed). */
typedef void (*body_fn)(char *, const char *, size_t, int, __m128i);

static void bf16_body_sse2(char *d, const char *s, size_t blocks, int stream, __m128i nan32)
{
    for (size_t b = 0; b < blocks; b++)
        bf16_block_sse2(d + 2 * BLOCK_ELEMS * b, s + 4 * BLOCK_ELEMS * b, stream, nan32);
}

__attribute__((target("avx2"))) static void bf16_body_avx2(char *d, const char *s, size_t blocks, int stream, __m128i nan32)
{
    for (size_t b = 0; b < blocks; b++)
        bf16_block_avx2(d + 2 * BLOCK_ELEMS * b, s + 4 * BLOCK_ELEMS * b, stream, nan32);
}

#if TF_AVX512BF16
__attribute__((target("avx2,avx512f,avx512bw,avx512dq,avx512bf16"))) static void bf16_body_avx512(char *d, const char *s, size_t blocks, int stream, __m128i nan32)
{
    for (size_t b = 0; b < blocks; b++)
        bf16_block_avx512(d + 2 * BLOCK_ELEMS * b, s + 4 * BLOCK_ELEMS * b, stream, nan32);
}
#endif

__attribute__((target("avx,f16c"))) static void f16_body_f16c(char *d, const char *s, size_t blocks, int stream, __m128i unused)
{
    (void)unused;
    for (size_t b = 0; b < blocks; b++)
        f16_block_f16c(d + 2 * BLOCK_ELEMS * b, s + 4 * BLOCK_ELEMS * b, stream);
}

static body_fn bf16_body = bf16_body_sse2;
static body_fn f16_body = NULL; /* set where the CPU has F16C */
#endif

/* Convert n floats at s into 2-byte values at d: the head elements one by
 * one until d is at a cache line (a d at an odd address never is: it gets
 * unaligned plain stores), the body a block at a time, the tail one by one. */
static void convert_run(char *d, const char *s, size_t n, int kind, int stream, uint16_t nan)
{
#if TF_STREAMING
    body_fn body = kind == KIND_BFLOAT16 ? bf16_body : f16_body;
    size_t head = ((uintptr_t)d & 1) ? 0 : ((64 - ((uintptr_t)d & 63)) & 63) / 2;
    if (head > n)
        head = n;
    int streamed = stream && !((uintptr_t)d & 1) && 2 * n >= STREAM_MIN_RUN;
    __m128i nan32 = _mm_set1_epi32((int32_t)(int16_t)nan);
    size_t blocks = (n - head) / BLOCK_ELEMS;
    size_t tail_at = head + blocks * BLOCK_ELEMS;
    if (kind == KIND_BFLOAT16) {
        bf16_scalar(d, s, head, nan);
        bf16_scalar(d + 2 * tail_at, s + 4 * tail_at, n - tail_at, nan);
    } else {
        f16_scalar_f16c(d, s, head);
        f16_scalar_f16c(d + 2 * tail_at, s + 4 * tail_at, n - tail_at);
    }
    body(d + 2 * head, s + 4 * head, blocks, streamed, nan32);
#else
    (void)kind;
    (void)stream;
    bf16_scalar(d, s, n, nan);
#endif
}

static int kind_supported(int kind)
{
#if TF_STREAMING
    return kind == KIND_BFLOAT16 || (kind == KIND_FLOAT16 && f16_body != NULL);
#else
    return kind == KIND_BFLOAT16;
#endif
}

/* convert_runs(dst, src, nelems, count, kind, stream, dst_base=0, src_base=0, nan=0x7fc0):
 * convert nelems[i] float32 values at src_base + src[i] into bfloat16
 * (kind 0) or float16 (kind 1) at dst_base + dst[i], for i < count, without
 * the GIL; the arrays are int64, as copy_runs'. A run's destination must not
 * overlap its source. nan: the bfloat16 bits every NaN becomes.
 * Raises ValueError for float16 where the CPU has no F16C. */
static PyObject *convert_runs(PyObject *self, PyObject *args)
{
    unsigned long long dst_at, src_at, nelems_at;
    Py_ssize_t count;
    int kind, stream;
    long long dst_base = 0, src_base = 0;
    long nan = 0x7fc0;
    if (!PyArg_ParseTuple(args, "KKKnip|LLl", &dst_at, &src_at, &nelems_at, &count, &kind, &stream, &dst_base, &src_base, &nan))
        return NULL;
    if (!kind_supported(kind)) {
        PyErr_Format(PyExc_ValueError, "convert_runs: kind %d is not one this CPU converts (0: bfloat16; 1: float16, with F16C)", kind);
        return NULL;
    }
    if (nan < 0 || nan > 0xffff) {
        PyErr_Format(PyExc_ValueError, "convert_runs: nan=%ld is not 16 bits", nan);
        return NULL;
    }
    Runs r;
    if (runs_at(&r, dst_at, src_at, nelems_at, count, "convert_runs: nelems") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++)
        convert_run((char *)(uintptr_t)(r.dst[i] + dst_base), (const char *)(uintptr_t)(r.src[i] + src_base), (size_t)r.len[i], kind, stream, (uint16_t)nan);
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
    {"convert_runs", convert_runs, METH_VARARGS,
     "convert_runs(dst, src, nelems, count, kind, stream, dst_base=0, src_base=0, nan=0x7fc0): convert a batch of float32 runs to bfloat16 (kind 0) or float16 (kind 1, F16C CPUs), without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tensorferry.copy._memcpy",
    "Batched byte copies (a C loop of memmove; streaming stores for large batches) and float32 conversions.", -1, methods,
};

PyMODINIT_FUNC PyInit__memcpy(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
#if TF_STREAMING
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2"))
        bf16_body = bf16_body_avx2;
#if TF_AVX512BF16
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bf16"))
        bf16_body = bf16_body_avx512;
#endif
    if (__builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c"))
        f16_body = f16_body_f16c;
#endif
    /* The kinds convert_runs takes. */
    if (PyModule_AddIntConstant(m, "BFLOAT16", KIND_BFLOAT16) < 0 || PyModule_AddIntConstant(m, "FLOAT16", KIND_FLOAT16) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
