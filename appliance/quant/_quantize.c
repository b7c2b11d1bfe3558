/* appliance.quant._quantize: the fused CPU quantizers the WeightStore runs as it loads (quant_cpu.py).
 *
 * One pass per value over a small chunk that stays in the L1 cache: the value's bits widened to
 * fp32 (bf16 is the high half of an fp32), the absmax of its row (int8) or of its 64-value block
 * (nf4), the division, the code, the packing. The arithmetic is quant.py's definition in fp32,
 * operation for operation (tests compare the codes bit for bit with it), so:
 *   - no -ffast-math: the division stays a division, `(v + 1.5*2^23) - 1.5*2^23` stays two adds;
 *   - the absmax is taken on the integer bits (for IEEE floats |x| orders as its bits with the
 *     sign cleared, and an integer max vectorizes where a float max does not); a value whose
 *     bits reach those of inf (inf or NaN) stops the kernel, which returns where it was.
 *
 * Built by setup.py at install (a C compiler and Python's headers; an optional extension: where
 * it does not build, quant.py quantizes with its PyTorch functions, which give the same codes
 * ~5x slower). It replaces numba, whose import and first call cost ~0.4 s of every load and
 * which compiled its kernels again (~2 s) wherever its cache directory was not writable.
 * Each kernel releases the GIL: the WeightStore's reader threads quantize side by side.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define CHUNK 4096              /* values at a time: 16 KiB of fp32 */
#define NONFINITE 0x7F800000u   /* fp32 bits of +inf */
#define NF4_BLOCK 64

/* On x86-64 with glibc, each kernel is compiled for AVX-512, AVX2 and the baseline, and the
 * loader picks the widest the CPU has (GCC's function multi-versioning). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__)
#define CLONED 1
#define VERSIONS __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#include <immintrin.h>
#else
#define CLONED 0
#define VERSIONS
#endif

static inline float as_float(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* yi[0:n] = the fp32 bits of src[start : start + n] (bf16 bits as uint16, or fp32 bits). */
static inline void widen(const void *src, int itemsize, int64_t start, int64_t n, uint32_t *yi) {
    if (itemsize == 2) {
        const uint16_t *s = (const uint16_t *)src + start;
        for (int64_t i = 0; i < n; i++)
            yi[i] = (uint32_t)s[i] << 16;
    } else {
        memcpy(yi, (const uint32_t *)src + start, (size_t)n * sizeof *yi);
    }
}

/* ---- NF4: the code of y = w / absmax (in [-1, 1]) is how many of the 15 thresholds are <= y ----
 *
 * Counting them is most of the kernel's time (15 compares per value). Faster, and exact: a bin
 * of y, bin(y) = min(max(trunc(y * 16 + 16), 0), 31), is monotone in y (y * 16 is exact, the add
 * rounds monotonically), so every threshold in a lower bin is <= y and every one in a higher bin
 * is > y. With at most one threshold per bin (NF4's are >= 0.08 apart; the bins 1/16 wide),
 *     code(y) = base[bin] + (thr[bin] <= y)
 * where base[k] counts the thresholds in bins below k and thr[k] is the one in bin k (+inf if
 * none). Two table lookups per value: with AVX-512 one in-register permute each over 32 entries,
 * with AVX2 four permutes and three blends. Elsewhere (or for thresholds two of which share a bin)
 * the count itself. Tests hold every path to the definition. */

typedef struct {
    float thr[32];
    float base[32]; /* counts, as floats: permuted and blended like thr */
} nf4_table;

static inline int32_t nf4_bin(float y) {
    int32_t k = (int32_t)(y * 16.0f + 16.0f);
    return k < 0 ? 0 : (k > 31 ? 31 : k);
}

/* 0, or -1 when two thresholds share a bin (then only the count is exact). */
static int nf4_table_build(const float *t, nf4_table *tab) {
    for (int k = 0; k < 32; k++) {
        tab->thr[k] = INFINITY;
        tab->base[k] = 0.0f;
    }
    for (int j = 0; j < 15; j++) {
        int b = nf4_bin(t[j]);
        if (tab->thr[b] != INFINITY)
            return -1;
        tab->thr[b] = t[j];
        for (int k = b + 1; k < 32; k++)
            tab->base[k] += 1.0f;
    }
    return 0;
}

/* c[0:n] = the codes of y[0:n]; n is a multiple of 64 (whole NF4 blocks) */
typedef void (*nf4_codes_fn)(const float *y, int64_t n, const float *t, const nf4_table *tab,
                             uint8_t *c);

VERSIONS static void codes_by_count(const float *y, int64_t n, const float *t,
                                    const nf4_table *tab, uint8_t *c) {
    (void)tab;
    for (int64_t i = 0; i < n; i++) {
        float v = y[i];
        c[i] = (uint8_t)((t[0] <= v) + (t[1] <= v) + (t[2] <= v) + (t[3] <= v) + (t[4] <= v) +
                         (t[5] <= v) + (t[6] <= v) + (t[7] <= v) + (t[8] <= v) + (t[9] <= v) +
                         (t[10] <= v) + (t[11] <= v) + (t[12] <= v) + (t[13] <= v) +
                         (t[14] <= v));
    }
}

#if CLONED
__attribute__((target("arch=x86-64-v4"))) static void codes_by_table_avx512(
    const float *y, int64_t n, const float *t, const nf4_table *tab, uint8_t *c) {
    (void)t;
    const __m512 thr_lo = _mm512_loadu_ps(tab->thr), thr_hi = _mm512_loadu_ps(tab->thr + 16);
    const __m512 base_lo = _mm512_loadu_ps(tab->base), base_hi = _mm512_loadu_ps(tab->base + 16);
    const __m512 sixteen = _mm512_set1_ps(16.0f);
    const __m512i zero = _mm512_setzero_si512(), top = _mm512_set1_epi32(31);
    for (int64_t i = 0; i < n; i += 16) { /* n: whole 64-value blocks */
        __m512 v = _mm512_loadu_ps(y + i);
        __m512i k = _mm512_cvttps_epi32(_mm512_add_ps(_mm512_mul_ps(v, sixteen), sixteen));
        k = _mm512_min_epi32(_mm512_max_epi32(k, zero), top);
        __m512 thr = _mm512_permutex2var_ps(thr_lo, k, thr_hi);
        __m512i code = _mm512_cvttps_epi32(_mm512_permutex2var_ps(base_lo, k, base_hi));
        __mmask16 above = _mm512_cmp_ps_mask(thr, v, _CMP_LE_OQ);
        code = _mm512_mask_add_epi32(code, above, code, _mm512_set1_epi32(1));
        _mm_storeu_si128((__m128i *)(c + i), _mm512_cvtepi32_epi8(code));
    }
}

/* 32 entries from four registers of 8: a permute of each, blended by the index's high bits. */
__attribute__((target("arch=x86-64-v3"))) static inline __m256 pick32(
    const __m256 *table, __m256i k, __m256 from8, __m256 from16, __m256 from24) {
    __m256 r = _mm256_permutevar8x32_ps(table[0], k);
    r = _mm256_blendv_ps(r, _mm256_permutevar8x32_ps(table[1], k), from8);
    r = _mm256_blendv_ps(r, _mm256_permutevar8x32_ps(table[2], k), from16);
    return _mm256_blendv_ps(r, _mm256_permutevar8x32_ps(table[3], k), from24);
}

__attribute__((target("arch=x86-64-v3"))) static void codes_by_table_avx2(
    const float *y, int64_t n, const float *t, const nf4_table *tab, uint8_t *c) {
    (void)t;
    __m256 thr[4], base[4];
    for (int q = 0; q < 4; q++) {
        thr[q] = _mm256_loadu_ps(tab->thr + 8 * q);
        base[q] = _mm256_loadu_ps(tab->base + 8 * q);
    }
    const __m256 sixteen = _mm256_set1_ps(16.0f);
    const __m256i zero = _mm256_setzero_si256(), top = _mm256_set1_epi32(31);
    const __m256i c7 = _mm256_set1_epi32(7), c15 = _mm256_set1_epi32(15);
    const __m256i c23 = _mm256_set1_epi32(23);
    for (int64_t i = 0; i < n; i += 8) { /* n: whole 64-value blocks */
        __m256 v = _mm256_loadu_ps(y + i);
        __m256i k = _mm256_cvttps_epi32(_mm256_add_ps(_mm256_mul_ps(v, sixteen), sixteen));
        k = _mm256_min_epi32(_mm256_max_epi32(k, zero), top);
        __m256 from8 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(k, c7));
        __m256 from16 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(k, c15));
        __m256 from24 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(k, c23));
        __m256 above = _mm256_cmp_ps(pick32(thr, k, from8, from16, from24), v, _CMP_LE_OQ);
        __m256i code = _mm256_cvttps_epi32(pick32(base, k, from8, from16, from24));
        code = _mm256_sub_epi32(code, _mm256_castps_si256(above)); /* above: all ones = -1 */
        __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(code),
                                         _mm256_extracti128_si256(code, 1));
        _mm_storel_epi64((__m128i *)(c + i), _mm_packus_epi16(words, words));
    }
}
#endif

/* The ways to code NF4 this CPU can run, best first. */
static const char *const PATH_NAMES[] = {"x86-64-v4", "x86-64-v3", "count"};
static const nf4_codes_fn PATH_FNS[] = {
#if CLONED
    codes_by_table_avx512,
    codes_by_table_avx2,
#else
    NULL,
    NULL,
#endif
    codes_by_count,
};

static int path_runs_here(int p) {
#if CLONED
    __builtin_cpu_init();
    if (p == 0)
        return __builtin_cpu_supports("x86-64-v4");
    if (p == 1)
        return __builtin_cpu_supports("x86-64-v3");
#endif
    return p == 2;
}

/* NF4 codes (two per byte, the first value in the high nibble) and per-64 absmax of n values
 * (n % 64 == 0). t: the 15 thresholds between the 16 levels; a value's code is how many of them
 * are <= value / absmax (found by codes_of). Returns -1, or the index of a block holding a
 * non-finite value. */
VERSIONS static int64_t nf4(const void *src, int itemsize, int64_t n, const float *t,
                            uint8_t *codes, float *absmax, nf4_codes_fn codes_of,
                            const nf4_table *tab) {
    uint32_t yi[CHUNK];
    float y[CHUNK];
    uint8_t c[CHUNK];
    for (int64_t s = 0; s < n; s += CHUNK) {
        int64_t size = n - s < CHUNK ? n - s : CHUNK;
        widen(src, itemsize, s, size, yi);
        for (int64_t b = 0; b < size / NF4_BLOCK; b++) {
            const uint32_t *block = yi + b * NF4_BLOCK;
            uint32_t m = 0;
            for (int i = 0; i < NF4_BLOCK; i++) {
                uint32_t a = block[i] & 0x7FFFFFFFu;
                m = a > m ? a : m;
            }
            if (m >= NONFINITE)
                return s / NF4_BLOCK + b;
            float mv = as_float(m);
            absmax[s / NF4_BLOCK + b] = mv;
            float d = mv != 0.0f ? mv : 1.0f; /* a zero block: 0 / 1, every code that of 0.0 */
            for (int i = 0; i < NF4_BLOCK; i++)
                y[b * NF4_BLOCK + i] = as_float(block[i]) / d;
        }
        codes_of(y, size, t, tab, c);
        uint8_t *out = codes + s / 2;
        for (int64_t i = 0; i < size / 2; i++)
            out[i] = (uint8_t)((c[2 * i] << 4) | c[2 * i + 1]);
    }
    return -1;
}

/* int8 codes and per-row scales of rows x cols values: scale = max|w_row| / 127,
 * q = clamp(round_half_even(w / scale), -127, 127). yi: room for one row's fp32 bits (each row
 * is widened once, then read from the cache twice). Returns -1, or the index of a row holding a
 * non-finite value. */
VERSIONS static int64_t int8(const void *src, int itemsize, int64_t rows, int64_t cols,
                             int8_t *codes, float *scales, uint32_t *yi) {
    const float rounder = 12582912.0f; /* 1.5 * 2^23 */
    for (int64_t r = 0; r < rows; r++) {
        widen(src, itemsize, r * cols, cols, yi);
        uint32_t m = 0;
        for (int64_t i = 0; i < cols; i++) {
            uint32_t a = yi[i] & 0x7FFFFFFFu;
            m = a > m ? a : m;
        }
        if (m >= NONFINITE)
            return r;
        float scale = as_float(m) / 127.0f;
        scales[r] = scale;
        float d = scale != 0.0f ? scale : 1.0f; /* a zero row: 0 / 1, all zeros */
        int8_t *out = codes + r * cols;
        for (int64_t i = 0; i < cols; i++) {
            /* |v| <= 127 (+ rounding): adding and taking away 1.5 * 2^23 rounds it to an
             * integer in the FPU's own mode, nearest with ties to even, as torch.round */
            float v = as_float(yi[i]) / d;
            int32_t q = (int32_t)((v + rounder) - rounder);
            out[i] = (int8_t)(q < -127 ? -127 : (q > 127 ? 127 : q));
        }
    }
    return -1;
}

/* ---- Python bindings: buffers in (C-contiguous), the kernel's return value out ---- */

static int check_size(const char *what, Py_ssize_t have, Py_ssize_t need) {
    if (have < need) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, the kernel needs %zd", what, have, need);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(nf4_doc,
             "nf4(src, itemsize, thresholds, codes, absmax, path=None) -> -1 or the first bad "
             "block\n\n"
             "src: the values' bits (itemsize 2: bf16, 4: fp32), a whole number of 64-value "
             "blocks; thresholds: 15 fp32; codes: len(src) / 2 bytes; absmax: one fp32 per "
             "block. path: one of paths() (default: the first, the fastest here).");

static PyObject *py_nf4(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer src, thr, codes, absmax;
    int itemsize;
    const char *path = NULL;
    if (!PyArg_ParseTuple(args, "y*iy*w*w*|z", &src, &itemsize, &thr, &codes, &absmax, &path))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = itemsize > 0 ? src.len / itemsize : 0;
    int chosen = -1;
    for (int p = 0; p < 3 && chosen < 0; p++)
        if (path_runs_here(p) && (path == NULL || strcmp(path, PATH_NAMES[p]) == 0))
            chosen = p;
    if (chosen < 0) {
        PyErr_Format(PyExc_ValueError, "path %s: not one this CPU runs (see paths())", path);
    } else if (itemsize != 2 && itemsize != 4) {
        PyErr_Format(PyExc_ValueError, "itemsize %d: 2 (bf16) or 4 (fp32)", itemsize);
    } else if (src.len % ((Py_ssize_t)itemsize * NF4_BLOCK) != 0) {
        PyErr_Format(PyExc_ValueError, "src: %zd bytes, not a whole number of %d-value blocks",
                     src.len, NF4_BLOCK);
    } else if (check_size("thresholds", thr.len, 15 * (Py_ssize_t)sizeof(float)) == 0 &&
               check_size("codes", codes.len, n / 2) == 0 &&
               check_size("absmax", absmax.len, n / NF4_BLOCK * (Py_ssize_t)sizeof(float)) == 0) {
        const float *t = (const float *)thr.buf;
        nf4_table tab;
        nf4_codes_fn codes_of = PATH_FNS[chosen];
        if (nf4_table_build(t, &tab) != 0) /* thresholds the bins cannot separate: count them */
            codes_of = codes_by_count;
        int64_t bad;
        Py_BEGIN_ALLOW_THREADS
        bad = nf4(src.buf, itemsize, n, t, (uint8_t *)codes.buf, (float *)absmax.buf, codes_of,
                  &tab);
        Py_END_ALLOW_THREADS
        result = PyLong_FromLongLong(bad);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&thr);
    PyBuffer_Release(&codes);
    PyBuffer_Release(&absmax);
    return result;
}

PyDoc_STRVAR(paths_doc, "paths() -> the ways nf4() can code on this CPU, fastest first");

static PyObject *py_paths(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    PyObject *out = PyList_New(0);
    for (int p = 0; out != NULL && p < 3; p++) {
        if (!path_runs_here(p))
            continue;
        PyObject *name = PyUnicode_FromString(PATH_NAMES[p]);
        if (name == NULL || PyList_Append(out, name) != 0) {
            Py_XDECREF(name);
            Py_CLEAR(out);
            break;
        }
        Py_DECREF(name);
    }
    return out;
}

PyDoc_STRVAR(int8_doc,
             "int8(src, itemsize, rows, cols, codes, scales) -> -1 or the first bad row\n\n"
             "src: rows x cols values' bits (itemsize 2: bf16, 4: fp32); codes: rows x cols "
             "bytes; scales: one fp32 per row.");

static PyObject *py_int8(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer src, codes, scales;
    int itemsize;
    Py_ssize_t rows, cols;
    if (!PyArg_ParseTuple(args, "y*innw*w*", &src, &itemsize, &rows, &cols, &codes, &scales))
        return NULL;
    PyObject *result = NULL;
    if (itemsize != 2 && itemsize != 4) {
        PyErr_Format(PyExc_ValueError, "itemsize %d: 2 (bf16) or 4 (fp32)", itemsize);
    } else if (rows < 0 || cols < 0) {
        PyErr_Format(PyExc_ValueError, "rows %zd, cols %zd: not a shape", rows, cols);
    } else if (check_size("src", src.len, rows * cols * itemsize) == 0 &&
               check_size("codes", codes.len, rows * cols) == 0 &&
               check_size("scales", scales.len, rows * (Py_ssize_t)sizeof(float)) == 0) {
        uint32_t *row = PyMem_RawMalloc(cols > 0 ? (size_t)cols * sizeof *row : 1);
        if (row == NULL) {
            PyErr_NoMemory();
        } else {
            int64_t bad;
            Py_BEGIN_ALLOW_THREADS
            bad = int8(src.buf, itemsize, rows, cols, (int8_t *)codes.buf, (float *)scales.buf,
                       row);
            Py_END_ALLOW_THREADS
            PyMem_RawFree(row);
            result = PyLong_FromLongLong(bad);
        }
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&codes);
    PyBuffer_Release(&scales);
    return result;
}

PyDoc_STRVAR(isa_doc, "isa() -> the instruction set the kernels run with on this CPU");

static PyObject *py_isa(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
#if CLONED
    if (path_runs_here(0))
        return PyUnicode_FromString("x86-64-v4 (AVX-512)");
    if (path_runs_here(1))
        return PyUnicode_FromString("x86-64-v3 (AVX2)");
    return PyUnicode_FromString("x86-64 baseline (no AVX2: ~4x slower)");
#else
    return PyUnicode_FromString("the compiler's default for this machine");
#endif
}

static PyMethodDef methods[] = {
    {"nf4", py_nf4, METH_VARARGS, nf4_doc},
    {"int8", py_int8, METH_VARARGS, int8_doc},
    {"isa", py_isa, METH_NOARGS, isa_doc},
    {"paths", py_paths, METH_NOARGS, paths_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "appliance.quant._quantize",
    "Fused CPU quantizers (int8, NF4) for the WeightStore; see quant_cpu.py.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__quantize(void) { return PyModule_Create(&module); }
