/* Byte-group split and merge in one pass (docs/FORMAT.md, "bytegroup/1").
 *
 * The same bijection as ckptstore/codec/bytegroup.py's numpy _split/_merge, which stay the
 * reference and the fallback when this module is not built: element i of a W-byte little-endian
 * integer array, optionally rotated left by one bit (transform 1), has its byte k stored at
 * planes[k * count + i]. numpy needs three to six passes over every chunk for that (casts, shifts,
 * strided copies); here each element is read once and written once, and the loops are simple enough
 * for the compiler to vectorize. Byte order is explicit (byte k = bits 8k..8k+7), so the result does
 * not depend on the host's endianness. The GIL is released while a loop runs.
 *
 *   split(x, out, width, transform, exp=0):  x: count*W bytes  -> out: W planes of count bytes
 *                                     (W*count); with exp > 0 returns the count of elements whose
 *                                     bits without the top bit are >= exp (non-finite floats)
 *   merge(planes, out, width, transform): a sequence of W buffers of count bytes -> out: count*W bytes
 *
 * Errors: ValueError for a width outside 1, 2, 4, 8, a transform outside 0, 1, or buffer lengths
 * that do not match; BufferError/TypeError from the buffer protocol (out must be writable).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* x86-64 with GCC on Linux: each loop also in an AVX2 clone, picked at load time (ifunc); elsewhere
 * the compiler's baseline (SSE2 on x86-64, NEON on aarch64) */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define KERNEL __attribute__((target_clones("avx2", "default"))) static
#else
#define KERNEL static
#endif

#define ROTL(T, v, bits) ((T)(((T)(v) << 1) | ((T)(v) >> ((bits) - 1))))
#define ROTR(T, v, bits) ((T)(((T)(v) >> 1) | ((T)(v) << ((bits) - 1))))

/* each split also counts the elements whose bits without the top (sign) bit are >= exp: the
 * non-finite values of an IEEE float when exp is its all-ones exponent (codec/numerics.py); the
 * count rides on the loop's one read of each element (exp = 0: not wanted, the count is n) */
KERNEL Py_ssize_t split2(const uint8_t *x, uint8_t *o, Py_ssize_t n, int rot, uint16_t exp) {
    uint8_t *p0 = o, *p1 = o + n;
    Py_ssize_t bad = 0;
    if (!exp) {
        if (rot) {
            for (Py_ssize_t i = 0; i < n; i++) {
                uint16_t v = (uint16_t)(x[2 * i] | ((uint16_t)x[2 * i + 1] << 8));
                v = ROTL(uint16_t, v, 16);
                p0[i] = (uint8_t)v;
                p1[i] = (uint8_t)(v >> 8);
            }
        } else {
            for (Py_ssize_t i = 0; i < n; i++) {
                p0[i] = x[2 * i];
                p1[i] = x[2 * i + 1];
            }
        }
        return n;
    }
    /* blocks of at most 65,535 elements: a 16-bit count per block keeps the loop in 16-bit lanes */
    for (Py_ssize_t b = 0; b < n; b += 65535) {
        Py_ssize_t e = n - b < 65535 ? n : b + 65535;
        uint16_t c = 0;
        if (rot) {
            for (Py_ssize_t i = b; i < e; i++) {
                uint16_t v = (uint16_t)(x[2 * i] | ((uint16_t)x[2 * i + 1] << 8));
                c += (uint16_t)(v & 0x7FFF) >= exp;
                v = ROTL(uint16_t, v, 16);
                p0[i] = (uint8_t)v;
                p1[i] = (uint8_t)(v >> 8);
            }
        } else {
            for (Py_ssize_t i = b; i < e; i++) {
                uint16_t v = (uint16_t)(x[2 * i] | ((uint16_t)x[2 * i + 1] << 8));
                c += (uint16_t)(v & 0x7FFF) >= exp;
                p0[i] = (uint8_t)v;
                p1[i] = (uint8_t)(v >> 8);
            }
        }
        bad += c;
    }
    return bad;
}

KERNEL void merge2(const uint8_t *p0, const uint8_t *p1, uint8_t *o, Py_ssize_t n, int rot) {
    if (rot) {
        for (Py_ssize_t i = 0; i < n; i++) {
            uint16_t v = (uint16_t)(p0[i] | ((uint16_t)p1[i] << 8));
            v = ROTR(uint16_t, v, 16);
            o[2 * i] = (uint8_t)v;
            o[2 * i + 1] = (uint8_t)(v >> 8);
        }
    } else {
        for (Py_ssize_t i = 0; i < n; i++) {
            o[2 * i] = p0[i];
            o[2 * i + 1] = p1[i];
        }
    }
}

#define SPLIT4_BODY(COUNT)                                                                                  \
    for (Py_ssize_t i = b; i < end; i++) {                                                                  \
        const uint8_t *e = x + 4 * i;                                                                       \
        uint32_t v = (uint32_t)e[0] | ((uint32_t)e[1] << 8) | ((uint32_t)e[2] << 16) | ((uint32_t)e[3] << 24); \
        COUNT;                                                                                              \
        if (rot) v = ROTL(uint32_t, v, 32);                                                                 \
        p0[i] = (uint8_t)v;                                                                                 \
        p1[i] = (uint8_t)(v >> 8);                                                                          \
        p2[i] = (uint8_t)(v >> 16);                                                                         \
        p3[i] = (uint8_t)(v >> 24);                                                                         \
    }

KERNEL Py_ssize_t split4(const uint8_t *x, uint8_t *o, Py_ssize_t n, int rot, uint32_t exp) {
    uint8_t *p0 = o, *p1 = o + n, *p2 = o + 2 * n, *p3 = o + 3 * n;
    Py_ssize_t bad = 0;
    for (Py_ssize_t b = 0; b < n; b += (Py_ssize_t)1 << 30) {  /* a 32-bit count per block */
        Py_ssize_t end = n - b < ((Py_ssize_t)1 << 30) ? n : b + ((Py_ssize_t)1 << 30);
        uint32_t c = 0;
        if (exp) {
            SPLIT4_BODY(c += (v & 0x7FFFFFFFu) >= exp)
        } else {
            SPLIT4_BODY((void)0)
        }
        bad += exp ? (Py_ssize_t)c : end - b;
    }
    return bad;
}

KERNEL void merge4(const uint8_t *const *p, uint8_t *o, Py_ssize_t n, int rot) {
    const uint8_t *p0 = p[0], *p1 = p[1], *p2 = p[2], *p3 = p[3];
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t v = (uint32_t)p0[i] | ((uint32_t)p1[i] << 8) | ((uint32_t)p2[i] << 16) | ((uint32_t)p3[i] << 24);
        if (rot) v = ROTR(uint32_t, v, 32);
        uint8_t *e = o + 4 * i;
        e[0] = (uint8_t)v;
        e[1] = (uint8_t)(v >> 8);
        e[2] = (uint8_t)(v >> 16);
        e[3] = (uint8_t)(v >> 24);
    }
}

KERNEL Py_ssize_t split8(const uint8_t *x, uint8_t *o, Py_ssize_t n, int rot, uint64_t exp) {
    Py_ssize_t bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *e = x + 8 * i;
        uint64_t v = (uint64_t)e[0] | ((uint64_t)e[1] << 8) | ((uint64_t)e[2] << 16) | ((uint64_t)e[3] << 24) |
                     ((uint64_t)e[4] << 32) | ((uint64_t)e[5] << 40) | ((uint64_t)e[6] << 48) | ((uint64_t)e[7] << 56);
        bad += (v & 0x7FFFFFFFFFFFFFFFull) >= exp;
        if (rot) v = ROTL(uint64_t, v, 64);
        o[i] = (uint8_t)v;
        o[n + i] = (uint8_t)(v >> 8);
        o[2 * n + i] = (uint8_t)(v >> 16);
        o[3 * n + i] = (uint8_t)(v >> 24);
        o[4 * n + i] = (uint8_t)(v >> 32);
        o[5 * n + i] = (uint8_t)(v >> 40);
        o[6 * n + i] = (uint8_t)(v >> 48);
        o[7 * n + i] = (uint8_t)(v >> 56);
    }
    return bad;
}

KERNEL void merge8(const uint8_t *const *p, uint8_t *o, Py_ssize_t n, int rot) {
    const uint8_t *p0 = p[0], *p1 = p[1], *p2 = p[2], *p3 = p[3], *p4 = p[4], *p5 = p[5], *p6 = p[6], *p7 = p[7];
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v = (uint64_t)p0[i] | ((uint64_t)p1[i] << 8) | ((uint64_t)p2[i] << 16) | ((uint64_t)p3[i] << 24) |
                     ((uint64_t)p4[i] << 32) | ((uint64_t)p5[i] << 40) | ((uint64_t)p6[i] << 48) | ((uint64_t)p7[i] << 56);
        if (rot) v = ROTR(uint64_t, v, 64);
        uint8_t *e = o + 8 * i;
        e[0] = (uint8_t)v;
        e[1] = (uint8_t)(v >> 8);
        e[2] = (uint8_t)(v >> 16);
        e[3] = (uint8_t)(v >> 24);
        e[4] = (uint8_t)(v >> 32);
        e[5] = (uint8_t)(v >> 40);
        e[6] = (uint8_t)(v >> 48);
        e[7] = (uint8_t)(v >> 56);
    }
}

static int check_args(int width, int transform) {
    if (width != 1 && width != 2 && width != 4 && width != 8) {
        PyErr_Format(PyExc_ValueError, "width must be 1, 2, 4 or 8, not %d", width);
        return -1;
    }
    if (transform != 0 && transform != 1) {
        PyErr_Format(PyExc_ValueError, "transform must be 0 or 1, not %d", transform);
        return -1;
    }
    return 0;
}

static PyObject *planes_split(PyObject *self, PyObject *args) {
    Py_buffer x, out;
    int width, transform;
    unsigned long long exp = 0;
    if (!PyArg_ParseTuple(args, "y*w*ii|K:split", &x, &out, &width, &transform, &exp)) return NULL;
    PyObject *res = NULL;
    if (check_args(width, transform) < 0) goto done;
    if (x.len % width != 0 || out.len < x.len) {
        PyErr_Format(PyExc_ValueError, "split: %zd input bytes are not whole %d-byte elements, or out (%zd bytes) is too small",
                     x.len, width, out.len);
        goto done;
    }
    Py_ssize_t n = x.len / width;
    const uint8_t *src = (const uint8_t *)x.buf;
    uint8_t *dst = (uint8_t *)out.buf;
    Py_ssize_t bad = 0;
    Py_BEGIN_ALLOW_THREADS
    switch (width) {
    case 1: memcpy(dst, src, (size_t)n); break;
    case 2: bad = split2(src, dst, n, transform, (uint16_t)exp); break;
    case 4: bad = split4(src, dst, n, transform, (uint32_t)exp); break;
    default: bad = split8(src, dst, n, transform, (uint64_t)exp); break;
    }
    Py_END_ALLOW_THREADS
    res = exp && width > 1 ? PyLong_FromSsize_t(bad) : Py_NewRef(Py_None);
done:
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    return res;
}

static PyObject *planes_merge(PyObject *self, PyObject *args) {
    PyObject *seq;
    Py_buffer out;
    int width, transform;
    if (!PyArg_ParseTuple(args, "Ow*ii:merge", &seq, &out, &width, &transform)) return NULL;
    Py_buffer bufs[8];
    int got = 0;
    PyObject *res = NULL;
    PyObject *fast = NULL;
    if (check_args(width, transform) < 0) goto done;
    fast = PySequence_Fast(seq, "merge: planes must be a sequence of buffers");
    if (fast == NULL) goto done;
    if (PySequence_Fast_GET_SIZE(fast) != width) {
        PyErr_Format(PyExc_ValueError, "merge: %zd planes for width %d", PySequence_Fast_GET_SIZE(fast), width);
        goto done;
    }
    if (out.len % width != 0) {
        PyErr_Format(PyExc_ValueError, "merge: out (%zd bytes) is not whole %d-byte elements", out.len, width);
        goto done;
    }
    Py_ssize_t n = out.len / width;
    const uint8_t *p[8];
    for (int k = 0; k < width; k++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, k), &bufs[k], PyBUF_C_CONTIGUOUS) < 0) goto done;
        got++;
        if (bufs[k].len < n) {
            PyErr_Format(PyExc_ValueError, "merge: plane %d has %zd bytes, expected %zd", k, bufs[k].len, n);
            goto done;
        }
        p[k] = (const uint8_t *)bufs[k].buf;
    }
    uint8_t *dst = (uint8_t *)out.buf;
    Py_BEGIN_ALLOW_THREADS
    switch (width) {
    case 1: memmove(dst, p[0], (size_t)n); break;
    case 2: merge2(p[0], p[1], dst, n, transform); break;
    case 4: merge4(p, dst, n, transform); break;
    default: merge8(p, dst, n, transform); break;
    }
    Py_END_ALLOW_THREADS
    res = Py_NewRef(Py_None);
done:
    for (int k = 0; k < got; k++) PyBuffer_Release(&bufs[k]);
    Py_XDECREF(fast);
    PyBuffer_Release(&out);
    return res;
}

static PyMethodDef planes_methods[] = {
    {"split", planes_split, METH_VARARGS,
     "split(x, out, width, transform, exp=0): x (count*width bytes) -> width planes of count bytes in out; "
     "with exp > 0 (width 2, 4, 8) returns how many elements have (bits without the sign bit) >= exp."},
    {"merge", planes_merge, METH_VARARGS,
     "merge(planes, out, width, transform): width buffers of count bytes -> count*width bytes in out."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef planes_module = {
    PyModuleDef_HEAD_INIT, "_planes", "Byte-group split and merge in one pass (docs/FORMAT.md).", -1, planes_methods,
};

PyMODINIT_FUNC PyInit__planes(void) { return PyModule_Create(&planes_module); }
