/* Huffman coding of one byte plane: plane codec 2 of "bytegroup/2" (docs/FORMAT.md, "Codec stages";
 * the payload around it: codec/bytegroup.py).
 *
 * Why our own coder: the exponent plane of a float tensor is a stream of a few distinct bytes
 * (≈ 2.7 bits of entropy in 8 for bf16 weights). zstd, set up to act as a literal coder, codes it at
 * ≈ 0.6 GB/s of plane (its match finder, literal histogram and Huffman stage all run); an order-0
 * Huffman code reaches the same size (0.3260 against zstd's 0.3259 on N(0, 0.02) bf16 exponents) at
 * 1.43 GB/s encoding and 2.54 GB/s decoding on one core (zstd: 0.64 and 1.84; benchmarks/
 * plane_coder.py), because it does only that:
 *   - the histogram is taken from a sample of the plane when it is 256 KiB or more: 4 KiB blocks,
 *     at least 16, 1 in 4 to 1 in 16 of the plane (a 1 MiB plane: 1 in 16). The byte values seen
 *     get codes, and so do (count 1) the values the sample may have missed: zero, those up to 16
 *     below and 3 above a value seen (an exponent's rare values are the small magnitudes just below
 *     its common ones), and the caller's alphabet (a 256-bit set: the values earlier frames of the
 *     same tensor held). Should the plane hold a value outside all of these (the encoder's pair
 *     table marks those pairs, bit 31), it is coded again from the histogram of the whole plane, and
 *     that plane's values join the alphabet. Measured on the exponent planes of the benchmark's
 *     512 MiB bf16 state (260 frames of 1 MiB): 1.32-1.34 GB/s at 0.3260 of the plane with 1-in-16
 *     samples, 1.15-1.17 GB/s at 0.3261 with 1-in-4; without the neighbours, every tensor's first
 *     frame missed (0.99-1.03 GB/s with a whole histogram there); giving all 256 values a code
 *     (counts + 1) cost 5 % of the size (226 unused 11-bit codes take 11 % of the code space);
 *   - code lengths come from Huffman's algorithm (two queues over the sorted counts), limited to
 *     MAX_LEN = 11 bits by halving the counts and building again (the classic JPEG-style limit;
 *     exponent planes seldom need it: their codes are 2-10 bits long);
 *   - codes are canonical (shorter first, then by symbol value; Deflate's rule, RFC 1951 §3.2.2),
 *     written least significant bit first, so a reader rebuilds them from the 256 lengths alone;
 *   - the encoder looks two symbols up at once (a 65,536-entry table of code pairs); the decoder
 *     looks up MAX_LEN bits and gets the one to three whole codes they start with at once, four
 *     streams interleaved so the CPU overlaps their lookups.
 *
 * Layout of a coded plane of `count` bytes (all integers little-endian):
 *   offset 0    u8        MAX_LEN, 11
 *   offset 1    128 B     code length of each symbol, 4 bits: symbol 2j in the low nibble of byte
 *                         j, symbol 2j+1 in the high nibble; 0 = the symbol does not occur. The
 *                         lengths must form a complete prefix code (Kraft sum exactly 1) of at
 *                         least two symbols.
 *   offset 129  3 x u32   bytes of streams 0, 1 and 2; stream 3 is the rest of the plane
 *   offset 141  streams   stream k codes symbols [k*q, (k+1)*q) of the plane, q = count / 4
 *                         (stream 3: [3q, count)); each is its symbols' codes, LSB first, the last
 *                         byte padded with zero bits; it must end exactly in its last byte.
 *
 *   encode(src, dst, work, alphabet, whole=False) -> int
 *                                   bytes written to dst, or -1 when one byte value is at least
 *                                   3/4 of the (sampled) plane: zstd's runs code that far better;
 *                                   alphabet: a writable 32-byte bit set (bit v of byte v / 8), read
 *                                   and extended as above; whole: take the whole plane's histogram at
 *                                   once (for benchmarks: slower, 0.2 % smaller)
 *   decode(src, dst)                the plane into dst (len(dst) == count); ValueError on any
 *                                   malformed field, length or stream (input treated as hostile)
 * dst of encode must hold encode_bound(count) = 141 + (11 * count + 7) / 8 + 16 bytes; work is a
 * writable scratch buffer of at least 262,144 bytes (the pair table). The GIL is released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define KERNEL __attribute__((target_clones("avx2", "default"))) static
#else
#define KERNEL static
#endif

#define MAX_LEN 11
#define TSIZE (1u << MAX_LEN)
#define TMASK (TSIZE - 1)
#define HEAD 141
#define SAMPLE_MIN (256u << 10)
#define WORK_BYTES (65536u * 4u)
#define DOWN_REACH 16
#define UP_REACH 3

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define LE64(v) __builtin_bswap64(v)
#else
#define LE64(v) (v)
#endif

static inline uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return LE64(v);
}

static inline void store64(uint8_t *p, uint64_t v) {
    v = LE64(v);
    memcpy(p, &v, 8);
}

static inline uint32_t load32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* -- code lengths --------------------------------------------------------------------------------- */

static void count_block(const uint8_t *s, size_t n, uint32_t c[4][256]) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w = load64(s + i);
        c[0][w & 255]++;
        c[1][(w >> 8) & 255]++;
        c[2][(w >> 16) & 255]++;
        c[3][(w >> 24) & 255]++;
        c[0][(w >> 32) & 255]++;
        c[1][(w >> 40) & 255]++;
        c[2][(w >> 48) & 255]++;
        c[3][w >> 56]++;
    }
    for (; i < n; i++) c[0][s[i]]++;
}

/* counts of each byte value: all of the plane below SAMPLE_MIN, else a sample of 4 KiB blocks;
 * returns whether it sampled */
static int histogram(const uint8_t *s, size_t n, uint64_t *cnt) {
    uint32_t c[4][256];
    memset(c, 0, sizeof c);
    int sampled = n >= SAMPLE_MIN;
    if (sampled) {
        /* at least 16 blocks of 4 KiB, 1 in 4 to 1 in 16 of the plane (a 1 MiB plane: 1 in 16) */
        size_t stride = (n / 16) & ~(size_t)4095;
        stride = stride < 16384 ? 16384 : stride > 65536 ? 65536 : stride;
        for (size_t b = 0; b + 4096 <= n; b += stride) count_block(s + b, 4096, c);
    } else {
        count_block(s, n, c);
    }
    for (int k = 0; k < 256; k++) cnt[k] = (uint64_t)c[0][k] + c[1][k] + c[2][k] + c[3][k];
    return sampled;
}

typedef struct {
    uint64_t w;
    int sym;
} leaf_t;

static int leaf_cmp(const void *a, const void *b) {
    const leaf_t *x = a, *y = b;
    if (x->w != y->w) return x->w < y->w ? -1 : 1;
    return x->sym - y->sym;
}

/* Huffman code lengths of the symbols with cnt > 0 (at least two); returns the longest */
static int huffman_lengths(const uint64_t *cnt, uint8_t *len) {
    leaf_t leaves[256];
    int n = 0;
    for (int k = 0; k < 256; k++)
        if (cnt[k]) leaves[n++] = (leaf_t){cnt[k], k};
    qsort(leaves, (size_t)n, sizeof(leaf_t), leaf_cmp);
    /* nodes 0..n-1 leaves (sorted), n..2n-2 internal, created in non-decreasing weight order */
    uint64_t w[511];
    int parent[511];
    for (int i = 0; i < n; i++) w[i] = leaves[i].w;
    int li = 0, ii = n, next = n;
    for (; next < 2 * n - 1; next++) {
        int pick[2];
        for (int j = 0; j < 2; j++) {
            if (li < n && (ii >= next || w[li] <= w[ii])) pick[j] = li++;
            else pick[j] = ii++;
        }
        w[next] = w[pick[0]] + w[pick[1]];
        parent[pick[0]] = parent[pick[1]] = next;
    }
    int depth[511];
    depth[2 * n - 2] = 0;
    for (int i = 2 * n - 3; i >= 0; i--) depth[i] = depth[parent[i]] + 1;
    int longest = 0;
    memset(len, 0, 256);
    for (int i = 0; i < n; i++) {
        int d = depth[i];
        len[leaves[i].sym] = (uint8_t)(d > 255 ? 255 : d);
        if (d > longest) longest = d;
    }
    return longest;
}

/* lengths of at most MAX_LEN bits for cnt (at least two symbols with cnt > 0) */
static void limited_lengths(uint64_t *cnt, uint8_t *len) {
    while (huffman_lengths(cnt, len) > MAX_LEN)
        for (int k = 0; k < 256; k++)
            if (cnt[k]) cnt[k] = (cnt[k] >> 1) | 1;
}

/* canonical codes (LSB first) from lengths; -1 unless they form a complete code of >= 2 symbols */
static int canonical(const uint8_t *len, uint32_t *code) {
    uint32_t bl[MAX_LEN + 1] = {0};
    for (int k = 0; k < 256; k++) {
        if (len[k] > MAX_LEN) return -1;
        if (len[k]) bl[len[k]]++;
    }
    uint32_t kraft = 0, used = 0;
    for (int l = 1; l <= MAX_LEN; l++) {
        kraft += bl[l] << (MAX_LEN - l);
        used += bl[l];
    }
    if (kraft != TSIZE || used < 2) return -1;
    uint32_t next[MAX_LEN + 1];
    uint32_t c = 0;
    for (int l = 1; l <= MAX_LEN; l++) {
        next[l] = c;
        c = (c + bl[l]) << 1;
    }
    for (int k = 0; k < 256; k++) {
        code[k] = 0;
        if (!len[k]) continue;
        uint32_t v = next[len[k]]++, r = 0;
        for (int b = 0; b < len[k]; b++) r |= ((v >> b) & 1u) << (len[k] - 1 - b);
        code[k] = r;
    }
    return 0;
}

/* -- encode --------------------------------------------------------------------------------------- */

/* pt[a | b << 8] = (code[a] | code[b] << len[a]) << 5 | (len[a] + len[b]) */
KERNEL void pair_table(const uint32_t *code, const uint8_t *len, uint32_t *pt) {
    uint32_t l32[256], miss[256];
    for (int a = 0; a < 256; a++) {
        l32[a] = len[a];
        miss[a] = len[a] ? 0 : 1u << 31;  /* a value without a code: the pair is marked */
    }
    for (int b = 0; b < 256; b++) {
        uint32_t cb = code[b], lb = len[b], mb = miss[b];
        uint32_t *row = pt + ((size_t)b << 8);
        for (int a = 0; a < 256; a++) row[a] = (((code[a] | (cb << l32[a])) << 5) | (l32[a] + lb)) | miss[a] | mb;
    }
}

#define PUT_PAIR(e)                       \
    do {                                  \
        uint32_t e_ = (e);                \
        acc |= (uint64_t)(e_ >> 5) << nb; \
        nb += e_ & 31;                    \
        seen |= e_;                       \
    } while (0)
#define FLUSH()                \
    do {                       \
        store64(p, acc);       \
        p += nb >> 3;          \
        acc >>= (nb & ~7u);    \
        nb &= 7;               \
    } while (0)

/* the codes of s[0..n) from p on; returns the end (needs 8 writable bytes past the last one), or NULL
 * when a value of s has no code (the bytes written are then garbage) */
static uint8_t *encode_stream(const uint8_t *s, size_t n, const uint32_t *pt, const uint32_t *code,
                              const uint8_t *len, uint8_t *p) {
    uint64_t acc = 0;
    unsigned nb = 0;
    uint32_t seen = 0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {  /* two pairs (<= 44 bits) between flushes: nb stays <= 51 */
        uint64_t w = load64(s + i);
        PUT_PAIR(pt[w & 0xffff]);
        PUT_PAIR(pt[(w >> 16) & 0xffff]);
        FLUSH();
        PUT_PAIR(pt[(w >> 32) & 0xffff]);
        PUT_PAIR(pt[w >> 48]);
        FLUSH();
    }
    for (; i < n; i++) {
        if (!len[s[i]]) return NULL;
        acc |= (uint64_t)code[s[i]] << nb;
        nb += len[s[i]];
        FLUSH();
    }
    if (seen >> 31) return NULL;
    if (nb) *p++ = (uint8_t)acc;
    return p;
}

/* returns bytes written, or -1 (one value is >= 3/4 of the plane: leave it to zstd) */
static Py_ssize_t encode_plane(const uint8_t *s, size_t n, uint8_t *dst, uint32_t *pt, uint8_t *alphabet, int whole) {
    uint64_t cnt[256], total = 0, top = 0;
    int sampled = 0;
    if (whole) {
        uint32_t c[4][256];
        memset(c, 0, sizeof c);
        count_block(s, n, c);
        for (int k = 0; k < 256; k++) cnt[k] = (uint64_t)c[0][k] + c[1][k] + c[2][k] + c[3][k];
    } else {
        sampled = histogram(s, n, cnt);
    }
    for (int k = 0; k < 256; k++) {
        total += cnt[k];
        if (cnt[k] > top) top = cnt[k];
    }
    if (top * 4 >= total * 3) return -1;  /* also: a single value */
    if (sampled) {
        /* values the sample may have missed get a code (count 1): the tensor's alphabet, and the
         * neighbours of every value seen, DOWN_REACH below and UP_REACH above (a float's exponent
         * byte: the frequency of small magnitudes halves per exponent step down, so the rare values
         * of a plane lie just below the common ones) */
        uint8_t near[256] = {0};
        for (int k = 0; k < 256; k++) {
            if (!cnt[k]) continue;
            int lo = k - DOWN_REACH < 0 ? 0 : k - DOWN_REACH, hi = k + UP_REACH > 255 ? 255 : k + UP_REACH;
            for (int j = lo; j <= hi; j++) near[j] = 1;
        }
        near[0] = 1;  /* zero (and the smallest subnormals): rare in a plane, common across tensors */
        for (int k = 0; k < 256; k++)
            if (!cnt[k] && (near[k] || ((alphabet[k >> 3] >> (k & 7)) & 1))) cnt[k] = 1;
    } else {
        for (int k = 0; k < 256; k++)
            if (cnt[k]) alphabet[k >> 3] |= (uint8_t)(1u << (k & 7));
    }
    uint8_t len[256];
    uint32_t code[256];
    limited_lengths(cnt, len);
    if (canonical(len, code) < 0) return -1;  /* not reached: Huffman lengths are complete */
    pair_table(code, len, pt);
    dst[0] = MAX_LEN;
    for (int j = 0; j < 128; j++) dst[1 + j] = (uint8_t)(len[2 * j] | (len[2 * j + 1] << 4));
    size_t q = n / 4;
    uint8_t *p = dst + HEAD;
    for (int k = 0; k < 4; k++) {
        const uint8_t *from = s + (size_t)k * q;
        size_t m = k < 3 ? q : n - 3 * q;
        uint8_t *start = p;
        p = encode_stream(from, m, pt, code, len, p);
        if (p == NULL) return whole ? -1 : encode_plane(s, n, dst, pt, alphabet, 1);  /* a value the sample missed */
        if (k < 3) {
            uint32_t b = (uint32_t)(p - start);
            uint8_t *f = dst + 129 + 4 * k;
            f[0] = (uint8_t)b;
            f[1] = (uint8_t)(b >> 8);
            f[2] = (uint8_t)(b >> 16);
            f[3] = (uint8_t)(b >> 24);
        }
    }
    return (Py_ssize_t)(p - dst);
}

/* -- decode --------------------------------------------------------------------------------------- */

typedef struct {
    uint8_t sym, len;
} dent_t;

/* t1: one symbol per MAX_LEN-bit index; t2: the one to three whole codes at the start of the index
 * (sym0 | sym1 << 8 | sym2 << 16 | bits << 24 | nsym << 28) */
static void decode_tables(const uint8_t *len, const uint32_t *code, dent_t *t1, uint32_t *t2) {
    for (int k = 0; k < 256; k++) {
        if (!len[k]) continue;
        for (uint32_t i = code[k]; i < TSIZE; i += 1u << len[k]) t1[i] = (dent_t){(uint8_t)k, len[k]};
    }
    for (uint32_t i = 0; i < TSIZE; i++) {
        uint32_t e = 0, bits = 0, n = 0;
        for (; n < 3; n++) {
            dent_t d = t1[(i >> bits) & TMASK];
            if (bits + d.len > MAX_LEN) break;  /* the code runs past the index's known bits */
            e |= (uint32_t)d.sym << (8 * n);
            bits += d.len;
        }
        t2[i] = e | (bits << 24) | (n << 28);
    }
}

typedef struct {
    const uint8_t *in;
    size_t len;   /* bytes of the stream */
    size_t bp;    /* bits consumed */
    uint8_t *o, *oe;
} stream_t;

/* one lookup of stream k: one to three symbols out, their bits consumed (locals, not the struct: the
 * byte stores could alias it and force a reload after each) */
#define D2(k)                                         \
    do {                                              \
        uint32_t e_ = t2[v##k & TMASK];               \
        memcpy(o##k, &e_, 4); /* bytes past nsym: overwritten later */ \
        o##k += e_ >> 28;                             \
        unsigned b_ = (e_ >> 24) & 15;                \
        v##k >>= b_;                                  \
        bp##k += b_;                                  \
    } while (0)
#define LOAD(k) uint64_t v##k = load64(in##k + (bp##k >> 3)) >> (bp##k & 7)

/* iterations of the interleaved loop that stay in bounds from here on: one reads 8 bytes at each
 * stream's byte position and advances it by at most 7 (55 bits), and advances its output by at most
 * 15 symbols, writing at most 18 bytes (each lookup stores 4) */
static size_t safe_rounds(const stream_t *s) {
    size_t r = SIZE_MAX;
    for (int k = 0; k < 4; k++) {
        size_t at = s[k].bp >> 3, room = (size_t)(s[k].oe - s[k].o);
        if (at + 8 > s[k].len || room < 18) return 0;
        size_t a = (s[k].len - 8 - at) / 7 + 1, b = (room - 18) / 15 + 1;
        if (a < r) r = a;
        if (b < r) r = b;
    }
    return r;
}

/* the four streams interleaved while each has 8 bytes to read and room for 10 symbols; then each
 * stream's rest one symbol at a time with bounded reads. 0, or -1 when a stream is malformed */
static int decode_streams(stream_t *s, const dent_t *t1, const uint32_t *t2) {
    const uint8_t *in0 = s[0].in, *in1 = s[1].in, *in2 = s[2].in, *in3 = s[3].in;
    for (size_t rounds; (rounds = safe_rounds(s)) > 0;) {
        uint8_t *o0 = s[0].o, *o1 = s[1].o, *o2 = s[2].o, *o3 = s[3].o;
        size_t bp0 = s[0].bp, bp1 = s[1].bp, bp2 = s[2].bp, bp3 = s[3].bp;
        for (size_t r = 0; r < rounds; r++) {
            LOAD(0); LOAD(1); LOAD(2); LOAD(3);  /* 57 bits each; five lookups take at most 55 */
            D2(0); D2(1); D2(2); D2(3);
            D2(0); D2(1); D2(2); D2(3);
            D2(0); D2(1); D2(2); D2(3);
            D2(0); D2(1); D2(2); D2(3);
            D2(0); D2(1); D2(2); D2(3);
        }
        s[0].o = o0; s[1].o = o1; s[2].o = o2; s[3].o = o3;
        s[0].bp = bp0; s[1].bp = bp1; s[2].bp = bp2; s[3].bp = bp3;
    }
    for (int k = 0; k < 4; k++) {
        stream_t *t = &s[k];
        size_t bits = t->len * 8;
        while (t->o < t->oe) {
            size_t at = t->bp >> 3;
            uint64_t v = 0;
            if (at + 8 <= t->len) {
                v = load64(t->in + at);
            } else {
                for (size_t j = 0; at + j < t->len; j++) v |= (uint64_t)t->in[at + j] << (8 * j);
            }
            dent_t e = t1[(v >> (t->bp & 7)) & TMASK];
            *t->o++ = e.sym;
            t->bp += e.len;
            if (t->bp > bits) return -1;  /* ran past the stream */
        }
        if ((t->bp + 7) / 8 != t->len) return -1;  /* bytes left over (or none read of an empty one) */
        if ((t->bp & 7) && (t->in[t->len - 1] >> (t->bp & 7)) != 0) return -1;  /* non-zero padding */
    }
    return 0;
}

/* NULL, or the reason the plane is malformed */
static const char *decode_plane(const uint8_t *src, size_t n, uint8_t *dst, size_t count) {
    if (n < HEAD) return "shorter than its 141-byte header";
    if (src[0] != MAX_LEN) return "unknown maximum code length";
    uint8_t len[256];
    for (int j = 0; j < 128; j++) {
        len[2 * j] = src[1 + j] & 15;
        len[2 * j + 1] = src[1 + j] >> 4;
    }
    uint32_t code[256];
    if (canonical(len, code) < 0) return "code lengths do not form a complete code of two or more symbols";
    size_t q = count / 4, off = HEAD;
    stream_t s[4];
    for (int k = 0; k < 4; k++) {
        size_t b;
        if (k < 3) {
            b = load32(src + 129 + 4 * k);
            if (b > n - off) return "a stream runs past the end of the plane";
        } else {
            b = n - off;
        }
        size_t m = k < 3 ? q : count - 3 * q;
        if (m == 0 ? b != 0 : (b == 0 || b > m * MAX_LEN / 8 + 1)) return "a stream's length does not fit its symbols";
        s[k] = (stream_t){src + off, b, 0, dst + (size_t)k * q, dst + (size_t)k * q + m};
        off += b;
    }
    dent_t t1[TSIZE];
    uint32_t t2[TSIZE];
    decode_tables(len, code, t1, t2);
    if (decode_streams(s, t1, t2) < 0) return "a stream does not decode to exactly its symbols";
    return NULL;
}

/* -- Python --------------------------------------------------------------------------------------- */

static Py_ssize_t bound(Py_ssize_t count) { return HEAD + (MAX_LEN * count + 7) / 8 + 16; }

static PyObject *huff_encode(PyObject *self, PyObject *args) {
    Py_buffer src, dst, work, alpha;
    int whole = 0;
    if (!PyArg_ParseTuple(args, "y*w*w*w*|p:encode", &src, &dst, &work, &alpha, &whole)) return NULL;
    PyObject *res = NULL;
    if (dst.len < bound(src.len) || work.len < (Py_ssize_t)WORK_BYTES || src.len < 4 || alpha.len != 32
        || src.len > ((Py_ssize_t)1 << 31)) {  /* a stream's u32 length and the u32 counts must not wrap */
        PyErr_Format(PyExc_ValueError,
                     "encode: dst (%zd bytes) must hold %zd, work (%zd bytes) %u, src (%zd bytes) 4 to 2 GiB, "
                     "alphabet (%zd bytes) 32", dst.len, bound(src.len), work.len, WORK_BYTES, src.len, alpha.len);
        goto done;
    }
    Py_ssize_t n;
    uint32_t *pt = (uint32_t *)work.buf;
    if (((uintptr_t)pt & 3) != 0) {
        PyErr_SetString(PyExc_ValueError, "encode: work must be 4-byte aligned");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    n = encode_plane((const uint8_t *)src.buf, (size_t)src.len, (uint8_t *)dst.buf, pt, (uint8_t *)alpha.buf, whole);
    Py_END_ALLOW_THREADS
    res = PyLong_FromSsize_t(n);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&work);
    PyBuffer_Release(&alpha);
    return res;
}

static PyObject *huff_decode(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, "y*w*:decode", &src, &dst)) return NULL;
    const char *why;
    Py_BEGIN_ALLOW_THREADS
    why = decode_plane((const uint8_t *)src.buf, (size_t)src.len, (uint8_t *)dst.buf, (size_t)dst.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (why != NULL) {
        PyErr_SetString(PyExc_ValueError, why);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *huff_bound(PyObject *self, PyObject *arg) {
    Py_ssize_t count = PyLong_AsSsize_t(arg);
    if (count == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromSsize_t(bound(count));
}

static PyMethodDef huff_methods[] = {
    {"encode", huff_encode, METH_VARARGS,
     "encode(src, dst, work, alphabet, whole=False) -> bytes written to dst, or -1 (leave the plane to zstd)."},
    {"decode", huff_decode, METH_VARARGS, "decode(src, dst): the coded plane src into dst; ValueError if malformed."},
    {"bound", huff_bound, METH_O, "bound(count) -> bytes dst of encode must hold for a plane of count bytes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef huff_module = {
    PyModuleDef_HEAD_INIT, "_huff", "Huffman coding of one byte plane (docs/FORMAT.md, Codec stages: bytegroup/2).", -1,
    huff_methods,
};

PyMODINIT_FUNC PyInit__huff(void) {
    PyObject *m = PyModule_Create(&huff_module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "MAX_LEN", MAX_LEN) < 0 || PyModule_AddIntConstant(m, "HEAD", HEAD) < 0 ||
        PyModule_AddIntConstant(m, "WORK_BYTES", WORK_BYTES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
