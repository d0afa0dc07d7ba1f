/* Delta syncs in C: compare and encode (sender), apply (receiver).
 *
 * A delta plan keeps the version it last sent ("kept", packed in the one-
 * block layout, in the sent dtype). A put compares the current packed
 * values with it word by word, bitwise (so NaN payloads and -0.0 are exact),
 * writes the changed words into the kept version, and encodes them per
 * chunk (a stretch of at most CHUNK_WORDS words of one element size). Each
 * changed chunk becomes one record, in the smallest of three encodings:
 *
 *   header   8 bytes: uint32 chunk index, uint8 kind, uint8 0, uint16 count
 *   POSITIONS  uint16 index of each changed word (ascending), then the
 *              words' values
 *   BITMAP     one bit a word of the chunk, then the changed words' values
 *   WHOLE      every word of the chunk
 *
 * each part padded to 8 bytes. Unchanged chunks write nothing. The chunk
 * table (offset, words, word size) is computed from the layout on both
 * sides (plans/_delta.py), so records carry only the chunk's index.
 *
 * The current values are given as runs (stream position, address, length),
 * ascending: the pool block of a snapshot put (one run), or the tensors'
 * own memory of a snapshot=False put (a run per tensor or merged views).
 * The receiver applies records through its plan's runs (stream position ->
 * its targets' addresses). Everything a receiver reads is checked: chunk
 * indices ascend and exist, counts and positions fit the chunk, a bitmap
 * holds exactly count bits, no part reads past the delta's end.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* 4096 words: a position fits in uint16 and a bitmap is 512 bytes, 1/16 of
 * a bfloat16 chunk; a chunk of 8 to 32 KiB stays in L1/L2 while encoded. */
#define CHUNK_WORDS 4096
#define KIND_POSITIONS 1
#define KIND_BITMAP 2
#define KIND_WHOLE 3
#define HEADER 8

static inline size_t al8(size_t n) { return (n + 7) & ~(size_t)7; }

static inline int word_ne(const char *a, const char *b, size_t w)
{
    switch (w) {
    case 1: return a[0] != b[0];
    case 2: { uint16_t x, y; memcpy(&x, a, 2); memcpy(&y, b, 2); return x != y; }
    case 4: { uint32_t x, y; memcpy(&x, a, 4); memcpy(&y, b, 4); return x != y; }
    default: { uint64_t x, y; memcpy(&x, a, 8); memcpy(&y, b, 8); return x != y; }
    }
}

static inline void copy_word(char *d, const char *s, size_t w)
{
    switch (w) {
    case 1: *d = *s; break;
    case 2: memcpy(d, s, 2); break;
    case 4: memcpy(d, s, 4); break;
    default: memcpy(d, s, 8); break;
    }
}

/* Indices of the words of cur that differ from kept (n words of w bytes).
 * 64 bytes at a time: a mask of the bytes that differ (SSE2, x86-64's
 * baseline), folded to one bit a word, whose set bits are the indices. */
static size_t diff_words(const char *cur, const char *kept, size_t n, size_t w, uint16_t *idx)
{
    size_t count = 0, nbytes = n * w, i = 0;
#if defined(__SSE2__)
    /* Bit b of a word's fold is set when any of its bytes differs; the word
     * bits sit at multiples of w. */
    const uint64_t word_bits = w == 1 ? ~0ull : w == 2 ? 0x5555555555555555ull : w == 4 ? 0x1111111111111111ull : 0x0101010101010101ull;
    const unsigned shift = w == 1 ? 0 : w == 2 ? 1 : w == 4 ? 2 : 3;
    for (; i + 64 <= nbytes; i += 64) {
        uint64_t eq = 0;
        for (int k = 0; k < 4; k++) {
            __m128i a = _mm_loadu_si128((const __m128i *)(cur + i + 16 * k));
            __m128i b = _mm_loadu_si128((const __m128i *)(kept + i + 16 * k));
            eq |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(a, b)) << (16 * k);
        }
        uint64_t ne = ~eq;
        if (ne == 0)
            continue;
        for (size_t f = 1; f < w; f <<= 1)
            ne |= ne >> f;
        ne &= word_bits;
        size_t first = i / w;
        while (ne) {
            idx[count++] = (uint16_t)(first + ((size_t)__builtin_ctzll(ne) >> shift));
            ne &= ne - 1;
        }
    }
#endif
    for (; i < nbytes; i += w)
        if (word_ne(cur + i, kept + i, w))
            idx[count++] = (uint16_t)(i / w);
    return count;
}

/* bfloat16 of float32 bits u as torch rounds (nearest even; every NaN
 * becomes `nan`, the pattern torch writes: see _memcpy.c's bf16_bits). */
static inline uint16_t bf16_of(uint32_t u, uint16_t nan)
{
    uint16_t r = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7fffffffu) > 0x7f800000u ? nan : r;
}

/* Runs of stream bytes: position, address, length (stream bytes), and
 * (the sender's current values) how each run's bytes are made: RAW, or
 * BF16 (float32 at the address, converted). */
#define RUN_RAW 0
#define RUN_BF16 1
typedef struct {
    const int64_t *pos, *addr, *len, *kind;
    Py_ssize_t count, at; /* at: the cursor (runs are visited in ascending order) */
    uint16_t nan;
} Runs;

/* The run holding stream bytes [o, o + n), or -1 if no one run holds them. */
static Py_ssize_t run_of(Runs *r, int64_t o, int64_t n)
{
    if (r->at >= r->count || r->pos[r->at] > o) {
        /* Not ahead of the cursor: binary search from the start. */
        Py_ssize_t lo = 0, hi = r->count;
        while (lo < hi) {
            Py_ssize_t mid = (lo + hi) / 2;
            if (r->pos[mid] + r->len[mid] <= o)
                lo = mid + 1;
            else
                hi = mid;
        }
        r->at = lo;
    }
    while (r->at < r->count && r->pos[r->at] + r->len[r->at] <= o)
        r->at++;
    if (r->at >= r->count || r->pos[r->at] > o || o + n > r->pos[r->at] + r->len[r->at])
        return -1;
    return r->at;
}

/* Copy stream bytes [o, o + n) between runs' memory and a flat buffer
 * (to_runs: buffer -> runs). -1 where a byte is in no run. */
static int gather_scatter(Runs *r, int64_t o, int64_t n, char *buf, int to_runs)
{
    while (n > 0) {
        Py_ssize_t i = run_of(r, o, 1);
        if (i < 0)
            return -1;
        int64_t take = r->pos[i] + r->len[i] - o;
        if (take > n)
            take = n;
        if (r->kind != NULL && r->kind[i] == RUN_BF16) {
            const uint32_t *f = (const uint32_t *)(uintptr_t)(r->addr[i] + 2 * (o - r->pos[i]));
            uint16_t *h = (uint16_t *)buf, nan = r->nan;
            for (int64_t j = 0; j < take / 2; j++)
                h[j] = bf16_of(f[j], nan);
        } else {
            char *mem = (char *)(uintptr_t)(r->addr[i] + (o - r->pos[i]));
            if (to_runs)
                memcpy(mem, buf, (size_t)take);
            else
                memcpy(buf, mem, (size_t)take);
        }
        o += take;
        n -= take;
        buf += take;
    }
    return 0;
}

/* Buffer -> runs for stream bytes [o, o + n), only the bytes some run
 * holds (a receiver that reads part of the stream: a sharded get). */
static void scatter_covered(Runs *r, int64_t o, int64_t n, const char *buf)
{
    Py_ssize_t lo = 0, hi = r->count;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (r->pos[mid] + r->len[mid] <= o)
            lo = mid + 1;
        else
            hi = mid;
    }
    for (Py_ssize_t i = lo; i < r->count && r->pos[i] < o + n; i++) {
        int64_t a = r->pos[i] > o ? r->pos[i] : o, b = r->pos[i] + r->len[i] < o + n ? r->pos[i] + r->len[i] : o + n;
        if (b > a)
            memcpy((char *)(uintptr_t)(r->addr[i] + (a - r->pos[i])), buf + (a - o), (size_t)(b - a));
    }
}

/* encode(kept, pos, addr, len, kind, nruns, coff, cwords, cw, lo, hi, out, cap, nan, ends):
 * chunks [lo, hi) of the current values (the runs) against the kept
 * version at address kept (the one-block layout), which is updated to the
 * current values. Records go to out while they fit in cap bytes; past
 * that (and with cap < 0 from the start) the chunks are copied into the
 * kept version, not compared. All
 * arrays int64, by address. Returns (bytes written, or -1 if they did not
 * fit: then the words changed before it stopped comparing). kind: 0, or an int64 array of RUN_RAW / RUN_BF16 a
 * run (nan: the bfloat16 a NaN becomes). ends: 0, or an int64 array, one
 * entry a chunk, given each compared chunk's end in out (the bytes
 * written up to and with its record): a sharded receiver's index of where
 * each chunk's record is. Without the GIL. */
static PyObject *encode(PyObject *self, PyObject *args)
{
    unsigned long long kept_at, pos_at, addr_at, len_at, kind_at, coff_at, cwords_at, cw_at, out_at, ends_at = 0;
    Py_ssize_t nruns, lo, hi, cap;
    unsigned int nan = 0x7fc0;
    if (!PyArg_ParseTuple(args, "KKKKKnKKKnnKn|IK", &kept_at, &pos_at, &addr_at, &len_at, &kind_at, &nruns, &coff_at, &cwords_at, &cw_at,
                          &lo, &hi, &out_at, &cap, &nan, &ends_at))
        return NULL;
    int64_t *ends = (int64_t *)(uintptr_t)ends_at;
    if (nruns < 0 || lo < 0 || hi < lo) {
        PyErr_SetString(PyExc_ValueError, "encode: negative count or range");
        return NULL;
    }
    const int64_t *coff = (const int64_t *)(uintptr_t)coff_at, *cwords = (const int64_t *)(uintptr_t)cwords_at;
    const int64_t *cw = (const int64_t *)(uintptr_t)cw_at;
    for (Py_ssize_t c = lo; c < hi; c++)
        if (cwords[c] < 1 || cwords[c] > CHUNK_WORDS || (cw[c] != 1 && cw[c] != 2 && cw[c] != 4 && cw[c] != 8)) {
            PyErr_Format(PyExc_ValueError, "encode: chunk %zd has %lld words of %lld bytes", c, (long long)cwords[c], (long long)cw[c]);
            return NULL;
        }
    Runs r = {(const int64_t *)(uintptr_t)pos_at, (const int64_t *)(uintptr_t)addr_at, (const int64_t *)(uintptr_t)len_at,
              (const int64_t *)(uintptr_t)kind_at, nruns, 0, (uint16_t)nan};
    char *kept = (char *)(uintptr_t)kept_at, *out = (char *)(uintptr_t)out_at;
    size_t used = 0;
    int fits = 1, missing = 0;
    long long changed = 0;
    Py_BEGIN_ALLOW_THREADS
    uint16_t idx[CHUNK_WORDS];
    char tmp[CHUNK_WORDS * 8];
    for (Py_ssize_t c = lo; c < hi; c++) {
        size_t n = (size_t)cwords[c], w = (size_t)cw[c], nb = n * w;
        char *k = kept + coff[c];
        const char *cur;
        if (cap < 0 || !fits) {
            /* A refresh, or past a delta too large to send: the values
             * into the kept version, not compared (a copy costs less than
             * comparing a dense chunk word by word). */
            if (gather_scatter(&r, coff[c], (int64_t)nb, k, 0) < 0) {
                missing = 1;
                break;
            }
            continue;
        }
        Py_ssize_t ri = run_of(&r, coff[c], (int64_t)nb);
        if (ri >= 0 && (r.kind == NULL || r.kind[ri] == RUN_RAW)) {
            cur = (const char *)(uintptr_t)(r.addr[ri] + (coff[c] - r.pos[ri]));
        } else {
            if (gather_scatter(&r, coff[c], (int64_t)nb, tmp, 0) < 0) {
                missing = 1;
                break;
            }
            cur = tmp;
        }
        size_t count = diff_words(cur, k, n, w, idx);
        if (ends != NULL)
            ends[c] = (int64_t)used;
        if (count == 0)
            continue;
        changed += (long long)count;
        size_t values = al8(count * w);
        size_t by_pos = HEADER + al8(count * 2) + values, by_map = HEADER + al8((n + 7) / 8) + values, whole = HEADER + al8(nb);
        int kind = KIND_WHOLE;
        size_t size = whole;
        if (by_pos < size) { kind = KIND_POSITIONS; size = by_pos; }
        if (by_map < size) { kind = KIND_BITMAP; size = by_map; }
        if (fits && used + size > (size_t)cap)
            fits = 0;
        if (fits) {
            char *o = out + used;
            uint32_t chunk = (uint32_t)c;
            uint16_t cnt = (uint16_t)(kind == KIND_WHOLE ? n : count);
            memset(o, 0, size);
            memcpy(o, &chunk, 4);
            o[4] = (char)kind;
            memcpy(o + 6, &cnt, 2);
            o += HEADER;
            if (kind == KIND_WHOLE) {
                memcpy(o, cur, nb);
            } else {
                if (kind == KIND_POSITIONS) {
                    memcpy(o, idx, count * 2);
                    o += al8(count * 2);
                } else {
                    unsigned char *bits = (unsigned char *)o;
                    for (size_t j = 0; j < count; j++)
                        bits[idx[j] >> 3] |= (unsigned char)(1u << (idx[j] & 7));
                    o += al8((n + 7) / 8);
                }
                for (size_t j = 0; j < count; j++)
                    copy_word(o + j * w, cur + (size_t)idx[j] * w, w);
            }
            used += size;
            if (ends != NULL)
                ends[c] = (int64_t)used;
        }
        if (count * 8 > n)
            memcpy(k, cur, nb);
        else
            for (size_t j = 0; j < count; j++)
                copy_word(k + (size_t)idx[j] * w, cur + (size_t)idx[j] * w, w);
    }
    Py_END_ALLOW_THREADS
    if (missing) {
        PyErr_SetString(PyExc_ValueError, "encode: a chunk's bytes are outside the current values' runs");
        return NULL;
    }
    return Py_BuildValue("(nL)", fits && cap >= 0 ? (Py_ssize_t)used : (Py_ssize_t)-1, changed);
}

/* apply(delta, nbytes, pos, addr, len, nruns, coff, cwords, cw, nchunks, partial):
 * the records of a delta (nbytes at address delta, from the network:
 * checked) written through the runs (stream position -> address); with
 * partial, words no run holds are skipped (a sharded receiver's runs hold
 * its ranges of the stream only), else they are an error.
 * Returns the words written. Raises ValueError on a malformed delta (what
 * was applied before it stays: the caller drops its version). */
static PyObject *apply(PyObject *self, PyObject *args)
{
    unsigned long long delta_at, pos_at, addr_at, len_at, coff_at, cwords_at, cw_at;
    Py_ssize_t nbytes, nruns, nchunks;
    int partial = 0;
    if (!PyArg_ParseTuple(args, "KnKKKnKKKn|p", &delta_at, &nbytes, &pos_at, &addr_at, &len_at, &nruns, &coff_at, &cwords_at, &cw_at, &nchunks,
                          &partial))
        return NULL;
    if (nbytes < 0 || nruns < 0 || nchunks < 0) {
        PyErr_SetString(PyExc_ValueError, "apply: negative size or count");
        return NULL;
    }
    const int64_t *coff = (const int64_t *)(uintptr_t)coff_at, *cwords = (const int64_t *)(uintptr_t)cwords_at;
    const int64_t *cw = (const int64_t *)(uintptr_t)cw_at;
    Runs r = {(const int64_t *)(uintptr_t)pos_at, (const int64_t *)(uintptr_t)addr_at, (const int64_t *)(uintptr_t)len_at, NULL, nruns, 0, 0};
    const char *d = (const char *)(uintptr_t)delta_at;
    size_t at = 0, end = (size_t)nbytes;
    long long prev = -1, written = 0;
    const char *err = NULL;
    long long err_at = 0;
    Py_BEGIN_ALLOW_THREADS
    while (at < end) {
        uint32_t chunk;
        uint16_t count;
        if (end - at < HEADER) { err = "a truncated record header"; break; }
        memcpy(&chunk, d + at, 4);
        memcpy(&count, d + at + 6, 2);
        int kind = (unsigned char)d[at + 4];
        err_at = (long long)at;
        if ((long long)chunk <= prev || (Py_ssize_t)chunk >= nchunks) { err = "a chunk index out of order or out of range"; break; }
        prev = chunk;
        size_t n = (size_t)cwords[chunk], w = (size_t)cw[chunk], nb = n * w;
        int64_t base = coff[chunk];
        if (count == 0 || count > n) { err = "a count that does not fit its chunk"; break; }
        at += HEADER;
        if (kind == KIND_WHOLE) {
            if (count != n || end - at < al8(nb)) { err = "a whole chunk of the wrong size"; break; }
            if (partial)
                scatter_covered(&r, base, (int64_t)nb, d + at);
            else if (gather_scatter(&r, base, (int64_t)nb, (char *)(d + at), 1) < 0) { err = "a chunk outside the plan's runs"; break; }
            at += al8(nb);
            written += (long long)n;
            continue;
        }
        size_t index_nbytes = kind == KIND_POSITIONS ? al8((size_t)count * 2) : kind == KIND_BITMAP ? al8((n + 7) / 8) : 0;
        if (index_nbytes == 0) { err = "an unknown encoding"; break; }
        if (end - at < index_nbytes + al8((size_t)count * w)) { err = "a record longer than the delta"; break; }
        const char *index = d + at, *values = d + at + index_nbytes;
        size_t j = 0;
        /* A chunk inside one run (most): its words' addresses by offset. */
        Py_ssize_t whole_run = run_of(&r, base, (int64_t)nb);
        char *dst = whole_run >= 0 ? (char *)(uintptr_t)(r.addr[whole_run] + (base - r.pos[whole_run])) : NULL;
        if (kind == KIND_POSITIONS) {
            long long last = -1;
            for (; j < count; j++) {
                uint16_t p;
                memcpy(&p, index + 2 * j, 2);
                if ((long long)p <= last || p >= n)
                    break;
                last = p;
                if (dst != NULL) {
                    copy_word(dst + (size_t)p * w, values + j * w, w);
                    continue;
                }
                int64_t o = base + (int64_t)p * (int64_t)w;
                Py_ssize_t ri = run_of(&r, o, (int64_t)w);
                if (ri < 0 && partial)
                    continue;
                if (ri < 0)
                    break;
                copy_word((char *)(uintptr_t)(r.addr[ri] + (o - r.pos[ri])), values + j * w, w);
            }
            if (j < count) { err = "a position out of order, out of its chunk or outside the plan's runs"; break; }
        } else {
            for (size_t q = 0; q < index_nbytes / 8 && j <= count; q++) {
                uint64_t bits;
                memcpy(&bits, index + 8 * q, 8);
                while (bits) {
                    size_t p = q * 64 + (size_t)__builtin_ctzll(bits);
                    bits &= bits - 1;
                    if (p >= n || j >= count) { j = count + 1; break; }
                    if (dst != NULL) {
                        copy_word(dst + p * w, values + j * w, w);
                        j++;
                        continue;
                    }
                    int64_t o = base + (int64_t)p * (int64_t)w;
                    Py_ssize_t ri = run_of(&r, o, (int64_t)w);
                    if (ri < 0 && partial) { j++; continue; }
                    if (ri < 0) { j = count + 1; break; }
                    copy_word((char *)(uintptr_t)(r.addr[ri] + (o - r.pos[ri])), values + j * w, w);
                    j++;
                }
            }
            if (j != count) { err = "a bitmap whose bits do not match its count, its chunk or the plan's runs"; break; }
        }
        at += index_nbytes + al8((size_t)count * w);
        written += count;
    }
    Py_END_ALLOW_THREADS
    if (err != NULL) {
        PyErr_Format(PyExc_ValueError, "apply: the delta has %s (record at byte %lld of %zd)", err, err_at, nbytes);
        return NULL;
    }
    return PyLong_FromLongLong(written);
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_VARARGS,
     "encode(kept, pos, addr, len, kind, nruns, coff, cwords, cw, lo, hi, out, cap, nan=0x7fc0, ends=0) -> (nbytes or -1, words changed): compare, update the kept version, encode."},
    {"apply", apply, METH_VARARGS,
     "apply(delta, nbytes, pos, addr, len, nruns, coff, cwords, cw, nchunks, partial=False) -> words written: a delta's records through a plan's runs."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tensorferry.plans._diff",
    "Delta syncs: bitwise compare and per-chunk encode against a kept version, and apply through a plan's runs.", -1, methods,
};

PyMODINIT_FUNC PyInit__diff(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "CHUNK_WORDS", CHUNK_WORDS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
