/* Delta chunk codec: see delta.h and spec/delta.md §5.
   Encode: (new XOR base | new - base | new) -> byte-plane shuffle -> one zstd frame per byte plane, the
   frame kind chosen per plane from a sampled byte histogram:
     - nearly random plane (entropy >= RAW_BITS):  a frame of raw blocks, written here (a memcpy)
     - plane of long runs (>= LZ_RUNS of its bytes
       end a run of 8 equal bytes), or ~constant:  ZSTD_compressCCtx at `level`
     - otherwise:                                  literals only (ZSTD_compressSequences with no
                                                   sequence: zstd's Huffman coder, no match search)
   Any zstd decoder reads all three; the decoder below reads any zstd frames with a content size. */
#include "delta.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "delta.c assumes a little-endian host (the format's words are little-endian)"
#endif

/* ---- the few zstd entry points we use (stable ABI of libzstd.so.1; the system has no zstd.h) ------ */
typedef struct ZSTD_CCtx_s ZSTD_CCtx;
typedef struct ZSTD_DCtx_s ZSTD_DCtx;
typedef struct {
    unsigned int offset, litLength, matchLength, rep;
} ZSTD_Sequence;
extern ZSTD_CCtx *ZSTD_createCCtx(void);
extern size_t ZSTD_freeCCtx(ZSTD_CCtx *);
extern size_t ZSTD_CCtx_setParameter(ZSTD_CCtx *, int param, int value);
extern size_t ZSTD_CCtx_reset(ZSTD_CCtx *, int directive);
extern size_t ZSTD_compressCCtx(ZSTD_CCtx *, void *dst, size_t cap, const void *src, size_t n, int level);
extern size_t ZSTD_compressSequences(ZSTD_CCtx *, void *dst, size_t cap, const ZSTD_Sequence *seqs, size_t nseqs,
                                     const void *src, size_t n);
extern ZSTD_DCtx *ZSTD_createDCtx(void);
extern size_t ZSTD_freeDCtx(ZSTD_DCtx *);
extern size_t ZSTD_decompressDCtx(ZSTD_DCtx *, void *dst, size_t cap, const void *src, size_t n);
extern unsigned long long ZSTD_getFrameContentSize(const void *src, size_t n);
extern size_t ZSTD_findFrameCompressedSize(const void *src, size_t n);
extern unsigned ZSTD_getDictID_fromFrame(const void *src, size_t n);
extern unsigned ZSTD_isError(size_t code);
extern unsigned ZSTD_versionNumber(void);
#define ZSTD_c_compressionLevel 100
#define ZSTD_reset_session_and_parameters 3
#define ZSTD_CONTENTSIZE_UNKNOWN (0ULL - 1)
#define ZSTD_CONTENTSIZE_ERROR (0ULL - 2)
#define ZSTD_MAGIC 0xFD2FB528u
#define ZSTD_BLOCK_MAX (128u * 1024u)

unsigned ucl_delta_zstd_version(void) { return ZSTD_versionNumber(); }

/* ---- plane selection thresholds (bits per byte, order-0 entropy of a sample) ---------------------- */
#define RAW_BITS 7.6  /* above: Huffman would save < 5%; store the plane raw */
#define LZ_RUNS 0.4   /* above: runs (zero rows, untouched embeddings): the match finder wins, and fast */
#define LZ_BITS 0.25  /* below: ~constant plane: LZ beats Huffman's floor of 1 bit per byte */
#define CLOSE 0.025   /* estimates within 2.5%: encode both, keep the smaller (estimates err by ~2%) */
#define BLK 512

/* ---- fused transform + byte-plane shuffle ----------------------------------------------------------
   Words are loaded with memcpy (any alignment); blocks of BLK words keep the temporaries in L1 and let
   gcc vectorise each loop. enc: 0 copy, 1 xor, 2 subtract (wrapping). */
#define DEF_KERNELS(W, T)                                                                              \
    static void fwd_##W(const uint8_t *a, const uint8_t *b, uint8_t *out, size_t n, int enc) {         \
        T t[BLK], u[BLK];                                                                              \
        for (size_t i0 = 0; i0 < n; i0 += BLK) {                                                       \
            size_t m = n - i0 < BLK ? n - i0 : BLK;                                                    \
            memcpy(t, a + i0 * W, m * W);                                                              \
            if (enc == 1) {                                                                            \
                memcpy(u, b + i0 * W, m * W);                                                          \
                for (size_t i = 0; i < m; i++) t[i] ^= u[i];                                           \
            } else if (enc == 2) {                                                                     \
                memcpy(u, b + i0 * W, m * W);                                                          \
                for (size_t i = 0; i < m; i++) t[i] = (T)(t[i] - u[i]);                                \
            }                                                                                          \
            for (int k = 0; k < W; k++) {                                                              \
                uint8_t *o = out + (size_t)k * n + i0;                                                 \
                for (size_t i = 0; i < m; i++) o[i] = (uint8_t)(t[i] >> (8 * k));                      \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
    static void inv_##W(const uint8_t *in, size_t stride, const uint8_t *b, uint8_t *out, size_t n,    \
                        int enc) {                                                                     \
        T t[BLK], u[BLK];                                                                              \
        for (size_t i0 = 0; i0 < n; i0 += BLK) {                                                       \
            size_t m = n - i0 < BLK ? n - i0 : BLK;                                                    \
            for (size_t i = 0; i < m; i++) t[i] = in[i0 + i];                                          \
            for (int k = 1; k < W; k++) {                                                              \
                const uint8_t *p = in + (size_t)k * stride + i0;                                       \
                for (size_t i = 0; i < m; i++) t[i] |= (T)((T)p[i] << (8 * k));                        \
            }                                                                                          \
            if (enc == 1) {                                                                            \
                memcpy(u, b + i0 * W, m * W);                                                          \
                for (size_t i = 0; i < m; i++) t[i] ^= u[i];                                           \
            } else if (enc == 2) {                                                                     \
                memcpy(u, b + i0 * W, m * W);                                                          \
                for (size_t i = 0; i < m; i++) t[i] = (T)(t[i] + u[i]);                                \
            }                                                                                          \
            memcpy(out + i0 * W, t, m * W);                                                            \
        }                                                                                              \
    }
DEF_KERNELS(1, uint8_t)
DEF_KERNELS(2, uint16_t)
DEF_KERNELS(4, uint32_t)
DEF_KERNELS(8, uint64_t)

#ifdef __SSE2__
/* SSE2 (every x86-64) kernels for 2- and 4-byte words, 16 words a step; the tail goes to the generic
   kernels above. Byte planes are gathered with masks, shifts and saturating packs (exact because the
   values packed fit the signed range after the shifts), and scattered back with unpacks. */
#include <emmintrin.h>

static inline __m128i ld(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }
static inline void st(uint8_t *p, __m128i v) { _mm_storeu_si128((__m128i *)p, v); }
static inline __m128i apply(__m128i v, __m128i b, int enc, int w) {
    if (enc == 1) return _mm_xor_si128(v, b);
    if (enc == 2) return w == 2 ? _mm_sub_epi16(v, b) : _mm_sub_epi32(v, b);
    return v;
}
static inline __m128i unapply(__m128i v, __m128i b, int enc, int w) {
    if (enc == 1) return _mm_xor_si128(v, b);
    if (enc == 2) return w == 2 ? _mm_add_epi16(v, b) : _mm_add_epi32(v, b);
    return v;
}
/* 16 words of 2 bytes in x, y -> plane 0 (low bytes) and plane 1 (high bytes). */
static inline void split16(__m128i x, __m128i y, __m128i *lo, __m128i *hi) {
    const __m128i m = _mm_set1_epi16(0x00FF);
    *lo = _mm_packus_epi16(_mm_and_si128(x, m), _mm_and_si128(y, m));
    *hi = _mm_packus_epi16(_mm_srli_epi16(x, 8), _mm_srli_epi16(y, 8));
}

static void fwd_sse_2(const uint8_t *a, const uint8_t *b, uint8_t *out, size_t n, int enc) {
    size_t v = n & ~(size_t)15;
    uint8_t *p0 = out, *p1 = out + n;
    for (size_t i = 0; i < v; i += 16) {
        __m128i x = ld(a + 2 * i), y = ld(a + 2 * i + 16);
        if (enc) {
            x = apply(x, ld(b + 2 * i), enc, 2);
            y = apply(y, ld(b + 2 * i + 16), enc, 2);
        }
        __m128i lo, hi;
        split16(x, y, &lo, &hi);
        st(p0 + i, lo);
        st(p1 + i, hi);
    }
    if (v < n) { /* tail: generic kernel on a compact copy, then placed into the planes */
        uint8_t ta[32], tb[32] = {0}, to[32];
        size_t m = n - v;
        memcpy(ta, a + 2 * v, 2 * m);
        if (enc) memcpy(tb, b + 2 * v, 2 * m);
        fwd_2(ta, tb, to, m, enc);
        memcpy(p0 + v, to, m);
        memcpy(p1 + v, to + m, m);
    }
}

static void inv_sse_2(const uint8_t *in, size_t stride, const uint8_t *b, uint8_t *out, size_t n, int enc) {
    size_t v = n & ~(size_t)15;
    const uint8_t *p0 = in, *p1 = in + stride;
    for (size_t i = 0; i < v; i += 16) {
        __m128i lo = ld(p0 + i), hi = ld(p1 + i);
        __m128i x = _mm_unpacklo_epi8(lo, hi), y = _mm_unpackhi_epi8(lo, hi);
        if (enc) {
            x = unapply(x, ld(b + 2 * i), enc, 2);
            y = unapply(y, ld(b + 2 * i + 16), enc, 2);
        }
        st(out + 2 * i, x);
        st(out + 2 * i + 16, y);
    }
    if (v < n) {
        uint8_t ti[32], tb[32] = {0}, to[32];
        size_t m = n - v;
        memcpy(ti, p0 + v, m);
        memcpy(ti + m, p1 + v, m);
        if (enc) memcpy(tb, b + 2 * v, 2 * m);
        inv_2(ti, m, tb, to, m, enc);
        memcpy(out + 2 * v, to, 2 * m);
    }
}

static void fwd_sse_4(const uint8_t *a, const uint8_t *b, uint8_t *out, size_t n, int enc) {
    size_t v = n & ~(size_t)15;
    uint8_t *p0 = out, *p1 = out + n, *p2 = out + 2 * n, *p3 = out + 3 * n;
    for (size_t i = 0; i < v; i += 16) {
        __m128i w[4];
        for (int k = 0; k < 4; k++) {
            w[k] = ld(a + 4 * i + 16 * k);
            if (enc) w[k] = apply(w[k], ld(b + 4 * i + 16 * k), enc, 4);
        }
        /* low and high 16-bit halves of words 0-7 and 8-15, sign-extended so packs_epi32 is exact */
        __m128i l0 = _mm_packs_epi32(_mm_srai_epi32(_mm_slli_epi32(w[0], 16), 16), _mm_srai_epi32(_mm_slli_epi32(w[1], 16), 16));
        __m128i l1 = _mm_packs_epi32(_mm_srai_epi32(_mm_slli_epi32(w[2], 16), 16), _mm_srai_epi32(_mm_slli_epi32(w[3], 16), 16));
        __m128i h0 = _mm_packs_epi32(_mm_srai_epi32(w[0], 16), _mm_srai_epi32(w[1], 16));
        __m128i h1 = _mm_packs_epi32(_mm_srai_epi32(w[2], 16), _mm_srai_epi32(w[3], 16));
        __m128i q0, q1, q2, q3;
        split16(l0, l1, &q0, &q1);
        split16(h0, h1, &q2, &q3);
        st(p0 + i, q0);
        st(p1 + i, q1);
        st(p2 + i, q2);
        st(p3 + i, q3);
    }
    if (v < n) {
        uint8_t ta[64], tb[64] = {0}, to[64];
        size_t m = n - v;
        memcpy(ta, a + 4 * v, 4 * m);
        if (enc) memcpy(tb, b + 4 * v, 4 * m);
        fwd_4(ta, tb, to, m, enc);
        for (int k = 0; k < 4; k++) memcpy(out + (size_t)k * n + v, to + (size_t)k * m, m);
    }
}

static void inv_sse_4(const uint8_t *in, size_t stride, const uint8_t *b, uint8_t *out, size_t n, int enc) {
    size_t v = n & ~(size_t)15;
    const uint8_t *p0 = in, *p1 = in + stride, *p2 = in + 2 * stride, *p3 = in + 3 * stride;
    for (size_t i = 0; i < v; i += 16) {
        __m128i q0 = ld(p0 + i), q1 = ld(p1 + i), q2 = ld(p2 + i), q3 = ld(p3 + i);
        __m128i a0 = _mm_unpacklo_epi8(q0, q1), a1 = _mm_unpackhi_epi8(q0, q1); /* bytes 0,1 */
        __m128i c0 = _mm_unpacklo_epi8(q2, q3), c1 = _mm_unpackhi_epi8(q2, q3); /* bytes 2,3 */
        __m128i w[4] = {_mm_unpacklo_epi16(a0, c0), _mm_unpackhi_epi16(a0, c0), _mm_unpacklo_epi16(a1, c1),
                        _mm_unpackhi_epi16(a1, c1)};
        for (int k = 0; k < 4; k++) {
            if (enc) w[k] = unapply(w[k], ld(b + 4 * i + 16 * k), enc, 4);
            st(out + 4 * i + 16 * k, w[k]);
        }
    }
    if (v < n) {
        uint8_t ti[64], tb[64] = {0}, to[64];
        size_t m = n - v;
        for (int k = 0; k < 4; k++) memcpy(ti + (size_t)k * m, in + (size_t)k * stride + v, m);
        if (enc) memcpy(tb, b + 4 * v, 4 * m);
        inv_4(ti, m, tb, to, m, enc);
        memcpy(out + 4 * v, to, 4 * m);
    }
}
#define FWD2 fwd_sse_2
#define FWD4 fwd_sse_4
#define INV2 inv_sse_2
#define INV4 inv_sse_4
#else
#define FWD2 fwd_2
#define FWD4 fwd_4
#define INV2 inv_2
#define INV4 inv_4
#endif

static void fwd(const void *a, const void *b, void *out, size_t nbytes, int word, int enc) {
    size_t n = nbytes / (size_t)word;
    switch (word) {
    case 1: fwd_1(a, b, out, n, enc); break;
    case 2: FWD2(a, b, out, n, enc); break;
    case 4: FWD4(a, b, out, n, enc); break;
    default: fwd_8(a, b, out, n, enc); break;
    }
}

/* Words [0, n) from byte planes `stride` bytes apart (plane k of word i at in[k * stride + i]).
   base may alias out: every kernel reads a block of base before it writes that block of out. */
static void inv_words(const uint8_t *in, size_t stride, const uint8_t *b, uint8_t *out, size_t n, int word,
                      int enc) {
    switch (word) {
    case 1: inv_1(in, stride, b, out, n, enc); break;
    case 2: INV2(in, stride, b, out, n, enc); break;
    case 4: INV4(in, stride, b, out, n, enc); break;
    default: inv_8(in, stride, b, out, n, enc); break;
    }
}

static void inv(const void *in, const void *b, void *out, size_t nbytes, int word, int enc) {
    size_t n = nbytes / (size_t)word;
    inv_words(in, n, b, out, n, word, enc);
}

void ucl_delta_shuffle(const void *src, void *dst, size_t nbytes, int word) { fwd(src, NULL, dst, nbytes, word, 0); }
void ucl_delta_unshuffle(const void *src, void *dst, size_t nbytes, int word) { inv(src, NULL, dst, nbytes, word, 0); }

static int word_ok(int word) { return word == 1 || word == 2 || word == 4 || word == 8; }

/* ---- sampled byte histograms -> order-0 entropy per plane ----------------------------------------- */
#define SAMPLE_BLOCKS 16
#define SAMPLE_RUN 256 /* words per sampled run: 4096 words, enough for entropy within ~0.05 bit */

static uint64_t load_word(const uint8_t *p, int word) {
    uint64_t v = 0;
    memcpy(&v, p, (size_t)word);
    return v;
}

static double entropy(const uint32_t *h, uint32_t total) {
    if (total == 0) return 0.0;
    double s = 0.0;
    for (int i = 0; i < 256; i++)
        if (h[i]) s += (double)h[i] * log2((double)h[i]);
    return log2((double)total) - s / (double)total;
}

/* What the sample says of a byte plane: order-0 entropy (bits per byte) and the fraction of its bytes
   that end a run of 8 equal bytes (what LZ matches cheaply and Huffman cannot go below 1 bit for). */
struct pstat {
    double bits, runs;
};

static void plane_stats(uint32_t (*h)[256], uint32_t *long_runs, uint32_t total, int word, struct pstat *out) {
    for (int k = 0; k < word; k++) {
        out[k].bits = entropy(h[k], total);
        out[k].runs = total ? (double)long_runs[k] / (double)total : 0.0;
    }
}

/* Stats of every plane for the full values and, when base, for the delta (else bits 8, runs 0). */
static void sample_planes(const uint8_t *a, const uint8_t *b, size_t n, int word, int enc, struct pstat *full,
                          struct pstat *delta) {
    static const uint64_t masks[9] = {0, 0xFFull, 0xFFFFull, 0, 0xFFFFFFFFull, 0, 0, 0, ~0ull};
    uint32_t hf[8][256], hd[8][256], lf[8] = {0}, ld[8] = {0};
    memset(hf, 0, sizeof(hf));
    memset(hd, 0, sizeof(hd));
    uint32_t total = 0;
    size_t runs = n <= (size_t)SAMPLE_BLOCKS * SAMPLE_RUN ? 1 : SAMPLE_BLOCKS;
    size_t run = runs == 1 ? n : SAMPLE_RUN;
    size_t stride = runs == 1 ? 0 : (n - run) / (runs - 1);
    for (size_t r = 0; r < runs; r++) {
        size_t i0 = r * stride;
        uint64_t pv = 0, pd = 0;
        uint32_t rf[8] = {0}, rd[8] = {0}; /* current run length per plane */
        for (size_t i = i0; i < i0 + run; i++) {
            uint64_t v = load_word(a + i * (size_t)word, word), x = v ^ pv;
            for (int k = 0; k < word; k++) {
                hf[k][(v >> (8 * k)) & 0xFF]++;
                rf[k] = ((x >> (8 * k)) & 0xFF) ? 0 : rf[k] + 1;
                lf[k] += rf[k] >= 7;
            }
            pv = v;
            if (b) {
                uint64_t w = load_word(b + i * (size_t)word, word);
                uint64_t d = enc == 1 ? (v ^ w) : ((v - w) & masks[word]), y = d ^ pd;
                for (int k = 0; k < word; k++) {
                    hd[k][(d >> (8 * k)) & 0xFF]++;
                    rd[k] = ((y >> (8 * k)) & 0xFF) ? 0 : rd[k] + 1;
                    ld[k] += rd[k] >= 7;
                }
                pd = d;
            }
        }
        total += (uint32_t)run;
    }
    plane_stats(hf, lf, total, word, full);
    if (b) {
        plane_stats(hd, ld, total, word, delta);
    } else {
        for (int k = 0; k < word; k++) delta[k] = (struct pstat){8.0, 0.0};
    }
}

enum { P_RAW, P_HUF, P_LZ };
static int plane_method(struct pstat st) {
    if (st.bits <= LZ_BITS || st.runs >= LZ_RUNS) return P_LZ;
    return st.bits >= RAW_BITS ? P_RAW : P_HUF;
}

/* ---- zstd frames ---------------------------------------------------------------------------------- */
static size_t raw_frame_size(size_t m) {
    size_t blocks = m ? (m + ZSTD_BLOCK_MAX - 1) / ZSTD_BLOCK_MAX : 1;
    return 4 + 1 + 8 + 3 * blocks + m;
}

/* A single-segment frame with an 8-byte content size and raw blocks. */
static size_t put_raw_frame(const uint8_t *src, size_t m, uint8_t *dst) {
    uint8_t *p = dst;
    uint32_t magic = ZSTD_MAGIC;
    memcpy(p, &magic, 4);
    p[4] = 0xE0; /* Frame_Content_Size_flag 3 (8 bytes), Single_Segment_flag 1 */
    uint64_t fcs = m;
    memcpy(p + 5, &fcs, 8);
    p += 13;
    size_t left = m;
    do {
        size_t bs = left < ZSTD_BLOCK_MAX ? left : ZSTD_BLOCK_MAX;
        uint32_t last = bs == left;
        uint32_t hdr = (uint32_t)(bs << 3) | last; /* Block_Type 0: raw */
        p[0] = (uint8_t)hdr;
        p[1] = (uint8_t)(hdr >> 8);
        p[2] = (uint8_t)(hdr >> 16);
        memcpy(p + 3, src, bs);
        p += 3 + bs;
        src += bs;
        left -= bs;
    } while (left);
    return (size_t)(p - dst);
}

/* One plane as one frame into dst (room for raw_frame_size(m)); returns its size. */
static size_t put_plane(ZSTD_CCtx *cctx, const uint8_t *src, size_t m, struct pstat st, int level, uint8_t *dst) {
    size_t cap = raw_frame_size(m);
    int method = plane_method(st);
    if (m == 0 || method == P_RAW) return put_raw_frame(src, m, dst);
    size_t r;
    if (method == P_LZ) {
        r = ZSTD_compressCCtx(cctx, dst, cap, src, m, level);
    } else {
        ZSTD_CCtx_reset(cctx, ZSTD_reset_session_and_parameters);
        ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, 1); /* literals Huffman-compressed */
        r = ZSTD_compressSequences(cctx, dst, cap, NULL, 0, src, m);
        if (ZSTD_isError(r)) r = ZSTD_compressCCtx(cctx, dst, cap, src, m, level);
    }
    if (ZSTD_isError(r) || r >= cap) return put_raw_frame(src, m, dst); /* incompressible after all */
    return r;
}

/* ---- per-thread zstd contexts and scratch buffers --------------------------------------------------
   Creating a zstd context and touching fresh scratch pages costs more than encoding a small chunk, so
   each thread keeps its contexts and two grow-only buffers (up to CACHE_MAX bytes each) until it exits
   (pthread key destructor) or calls ucl_delta_thread_release(). */
#include <pthread.h>
#define CACHE_MAX ((size_t)64 << 20)
struct tcache {
    ZSTD_CCtx *c;
    ZSTD_DCtx *d;
    uint8_t *buf[2];
    size_t cap[2];
};
static pthread_key_t tkey;
static pthread_once_t tonce = PTHREAD_ONCE_INIT;
static int tkey_ok;

static void tcache_free(void *p) {
    struct tcache *t = p;
    if (!t) return;
    if (t->c) ZSTD_freeCCtx(t->c);
    if (t->d) ZSTD_freeDCtx(t->d);
    free(t->buf[0]);
    free(t->buf[1]);
    free(t);
}
static void tkey_make(void) { tkey_ok = pthread_key_create(&tkey, tcache_free) == 0; }
static struct tcache *tcache(void) {
    pthread_once(&tonce, tkey_make);
    if (!tkey_ok) return NULL;
    struct tcache *t = pthread_getspecific(tkey);
    if (!t) {
        t = calloc(1, sizeof *t);
        if (!t) return NULL;
        if (pthread_setspecific(tkey, t) != 0) {
            free(t);
            return NULL;
        }
    }
    return t;
}
void ucl_delta_thread_release(void) {
    pthread_once(&tonce, tkey_make);
    if (!tkey_ok) return;
    tcache_free(pthread_getspecific(tkey));
    pthread_setspecific(tkey, NULL);
}
/* A buffer of n bytes: the thread's cached one when it fits under CACHE_MAX, else a fresh malloc
   (*owned = 1: the caller frees it). */
static uint8_t *tbuf(struct tcache *t, int i, size_t n, int *owned) {
    if (n == 0) n = 1;
    *owned = 0;
    if (!t || n > CACHE_MAX) {
        *owned = 1;
        return malloc(n);
    }
    if (t->cap[i] < n) {
        free(t->buf[i]);
        t->buf[i] = malloc(n);
        t->cap[i] = t->buf[i] ? n : 0;
    }
    return t->buf[i];
}

size_t ucl_delta_bound(size_t nbytes, int word) {
    if (!word_ok(word)) return 0;
    return 1 + (size_t)word * raw_frame_size(nbytes / (size_t)word);
}

/* mode byte + one frame per plane of the shuffled buffer `sh`. */
static size_t put_payload(ZSTD_CCtx *cctx, int mode, const uint8_t *sh, size_t nbytes, int word,
                          const struct pstat *st, int level, uint8_t *out) {
    size_t n = nbytes / (size_t)word, pos = 1;
    out[0] = (uint8_t)mode;
    for (int k = 0; k < word; k++) pos += put_plane(cctx, sh + (size_t)k * n, n, st[k], level, out + pos);
    return pos;
}

/* Estimated payload bytes: entropy for Huffman planes, entropy of what the runs leave for LZ planes. */
static double estimate(const struct pstat *st, int word, size_t n) {
    double s = 0.0;
    for (int k = 0; k < word; k++) {
        int method = plane_method(st[k]);
        double bits = method == P_RAW ? 8.0 : method == P_LZ ? st[k].bits * (1.0 - st[k].runs) : st[k].bits;
        s += bits * (double)n / 8.0;
    }
    return s;
}

int64_t ucl_delta_encode(const void *new_, const void *base, size_t nbytes, int word, int encoding, int level,
                         void *out, size_t out_cap, void *scratch) {
    if (!word_ok(word) || nbytes % (size_t)word || (encoding != 1 && encoding != 2) ||
        out_cap < ucl_delta_bound(nbytes, word))
        return UCL_DELTA_E_ARG;
    if (base && memcmp(new_, base, nbytes) == 0) return 0;
    size_t n = nbytes / (size_t)word;
    struct pstat bf[8], bd[8];
    sample_planes(new_, base, n, word, encoding, bf, bd);
    int try_delta = 1, try_full = 1;
    if (base) {
        double ef = estimate(bf, word, n), ed = estimate(bd, word, n);
        if (ed < ef * (1.0 - CLOSE)) try_full = 0;
        else if (ef < ed * (1.0 - CLOSE)) try_delta = 0;
    } else {
        try_delta = 0;
    }
    struct tcache *tc = tcache();
    int own_sh = 0, own_alt = 0;
    uint8_t *sh = scratch ? scratch : tbuf(tc, 0, nbytes, &own_sh);
    ZSTD_CCtx *cctx = tc ? tc->c : NULL;
    if (!cctx) {
        cctx = ZSTD_createCCtx();
        if (tc) tc->c = cctx;
    }
    uint8_t *alt = NULL;
    int64_t result = UCL_DELTA_E_NOMEM;
    if (!sh || !cctx) goto done;
    size_t len = 0;
    if (try_delta) {
        fwd(new_, base, sh, nbytes, word, encoding);
        len = put_payload(cctx, encoding, sh, nbytes, word, bd, level, out);
    }
    if (try_full) {
        fwd(new_, NULL, sh, nbytes, word, 0);
        if (try_delta) {
            alt = tbuf(tc, 1, out_cap, &own_alt);
            if (!alt) goto done;
            size_t lf = put_payload(cctx, UCL_DELTA_MODE_FULL, sh, nbytes, word, bf, level, alt);
            if (lf < len) {
                memcpy(out, alt, lf);
                len = lf;
            }
        } else {
            len = put_payload(cctx, UCL_DELTA_MODE_FULL, sh, nbytes, word, bf, level, out);
        }
    }
    result = (int64_t)len;
done:
    if (own_alt) free(alt);
    if (own_sh) free(sh);
    if (!tc && cctx) ZSTD_freeCCtx(cctx);
    return result;
}

/* unpack_frames split over `nparts` calls: every call checks every frame header in order as unpack_frames
   does and returns what unpack_frames would, but decompresses only the frames whose index is `part`
   modulo `nparts` (into their place in sh); *failed is set when one of them does not decompress. The
   parts together: UCL_DELTA_E_ZSTD when any failed (such a frame comes before any bad header, as frames
   after one are not decompressed), else the (common) return value. */
static int unpack_frames_part(ZSTD_DCtx *dctx, const uint8_t *p, size_t len, uint8_t *sh, size_t nbytes, int part,
                              int nparts, int *failed) {
    size_t pos = 1, got = 0;
    int frames = 0;
    *failed = 0;
    while (pos < len) {
        size_t rem = len - pos;
        uint32_t magic;
        if (rem < 4) return UCL_DELTA_E_FRAME;
        memcpy(&magic, p + pos, 4);
        if (magic != ZSTD_MAGIC) return UCL_DELTA_E_FRAME;
        unsigned long long fcs = ZSTD_getFrameContentSize(p + pos, rem);
        if (fcs == ZSTD_CONTENTSIZE_ERROR || fcs == ZSTD_CONTENTSIZE_UNKNOWN) return UCL_DELTA_E_FRAME;
        if (ZSTD_getDictID_fromFrame(p + pos, rem) != 0) return UCL_DELTA_E_FRAME;
        if (fcs > nbytes - got) return UCL_DELTA_E_SIZE;
        size_t fsz = ZSTD_findFrameCompressedSize(p + pos, rem);
        if (ZSTD_isError(fsz)) return UCL_DELTA_E_ZSTD;
        if (frames % nparts == part && !*failed) {
            size_t r = ZSTD_decompressDCtx(dctx, sh + got, (size_t)fcs, p + pos, fsz);
            if (ZSTD_isError(r) || r != fcs) *failed = 1;
        }
        got += (size_t)fcs;
        pos += fsz;
        frames++;
    }
    if (frames == 0) return UCL_DELTA_E_FRAME;
    if (got != nbytes) return UCL_DELTA_E_SIZE;
    return 0;
}

/* The frames of a payload (after its mode byte) decoded into sh[0:nbytes], each checked before anything
   is decoded: 0 or a negative UCL_DELTA_E_*. (unpack_frames_part with one part.) */
static int unpack_frames(ZSTD_DCtx *dctx, const uint8_t *p, size_t len, uint8_t *sh, size_t nbytes) {
    int failed;
    int rc = unpack_frames_part(dctx, p, len, sh, nbytes, 0, 1, &failed);
    return failed ? UCL_DELTA_E_ZSTD : rc;
}

/* The thread's cached decompression context (or a fresh one, *owned = 1: the caller frees it). */
static ZSTD_DCtx *thread_dctx(struct tcache *tc, int *owned) {
    *owned = 0;
    if (tc && tc->d) return tc->d;
    ZSTD_DCtx *d = ZSTD_createDCtx();
    if (tc) tc->d = d;
    else *owned = d != NULL;
    return d;
}

int ucl_delta_decode(const void *payload, size_t len, const void *base, void *out, size_t nbytes, int word,
                     int *mode_out, void *scratch) {
    const uint8_t *p = payload;
    if (!word_ok(word) || nbytes % (size_t)word) return UCL_DELTA_E_ARG;
    if (len < 1) return UCL_DELTA_E_EMPTY;
    int mode = p[0];
    if (mode_out) *mode_out = mode;
    if (mode > UCL_DELTA_MODE_SUB) return UCL_DELTA_E_MODE;
    if (mode != UCL_DELTA_MODE_FULL && !base) return UCL_DELTA_E_NOBASE;
    struct tcache *tc = tcache();
    int own_sh = 0, own_d = 0;
    uint8_t *sh = scratch ? scratch : tbuf(tc, 0, nbytes, &own_sh);
    ZSTD_DCtx *dctx = thread_dctx(tc, &own_d);
    int rc = UCL_DELTA_E_NOMEM;
    if (sh && dctx) {
        rc = unpack_frames(dctx, p, len, sh, nbytes);
        if (rc == 0) inv(sh, base, out, nbytes, word, mode);
    }
    if (own_sh) free(sh);
    if (own_d) ZSTD_freeDCtx(dctx);
    return rc;
}

int ucl_delta_unpack(const void *payload, size_t len, void *planes, size_t nbytes, int word, int part, int nparts,
                     int *mode_out, int *failed) {
    const uint8_t *p = payload;
    *failed = 0;
    if (!word_ok(word) || nbytes % (size_t)word || !planes || nparts < 1 || part < 0 || part >= nparts)
        return UCL_DELTA_E_ARG;
    if (len < 1) return UCL_DELTA_E_EMPTY;
    int mode = p[0];
    if (mode_out) *mode_out = mode;
    if (mode > UCL_DELTA_MODE_SUB) return UCL_DELTA_E_MODE;
    int own_d = 0;
    ZSTD_DCtx *dctx = thread_dctx(tcache(), &own_d);
    if (!dctx) return UCL_DELTA_E_NOMEM;
    int rc = unpack_frames_part(dctx, p, len, planes, nbytes, part, nparts, failed);
    if (own_d) ZSTD_freeDCtx(dctx);
    return rc;
}

#define APPLY_BLOCK 8192 /* words per pass of every payload: the block of out stays in L1/L2 between them */
int ucl_delta_apply(const void *const *planes, const int *modes, int k, const void *base, void *out, size_t nbytes,
                    int word, size_t start, size_t count) {
    if (!word_ok(word) || nbytes % (size_t)word || k < 1) return UCL_DELTA_E_ARG;
    size_t n = nbytes / (size_t)word;
    if (start > n || count > n - start) return UCL_DELTA_E_ARG;
    for (int j = 0; j < k; j++)
        if (modes[j] < UCL_DELTA_MODE_FULL || modes[j] > UCL_DELTA_MODE_SUB || !planes[j]) return UCL_DELTA_E_ARG;
    if (modes[0] != UCL_DELTA_MODE_FULL && !base) return UCL_DELTA_E_NOBASE;
    const uint8_t *b = base;
    uint8_t *o = out;
    for (size_t i0 = start; i0 < start + count; i0 += APPLY_BLOCK) {
        size_t m = start + count - i0 < APPLY_BLOCK ? start + count - i0 : APPLY_BLOCK;
        size_t at = i0 * (size_t)word;
        for (int j = 0; j < k; j++) {
            const uint8_t *src = (const uint8_t *)planes[j] + i0;
            inv_words(src, n, j == 0 ? (b ? b + at : NULL) : o + at, o + at, m, word, modes[j]);
        }
    }
    return 0;
}

/* ---- Python binding: ucl._delta ------------------------------------------------------------------- */
#ifdef UCL_DELTA_PYTHON
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* encode(new, base|None, word, encoding, level, out=None)
   -> without out: bytes | None (identical) | int (negative error)
   -> with out (a writable buffer of at least bound() bytes): int (length, 0 identical, negative error) */
static PyObject *py_encode(PyObject *self, PyObject *args) {
    Py_buffer nv, bv = {0}, ov = {0};
    PyObject *base_obj, *out_obj = Py_None;
    int word, enc, level;
    if (!PyArg_ParseTuple(args, "y*Oiii|O", &nv, &base_obj, &word, &enc, &level, &out_obj)) return NULL;
    if (base_obj != Py_None && PyObject_GetBuffer(base_obj, &bv, PyBUF_SIMPLE) < 0) goto fail;
    if (out_obj != Py_None && PyObject_GetBuffer(out_obj, &ov, PyBUF_WRITABLE) < 0) goto fail;
    size_t bound = ucl_delta_bound((size_t)nv.len, word);
    int64_t r = UCL_DELTA_E_ARG;
    PyObject *res = NULL;
    char *o = NULL;
    size_t cap = 0;
    if (ov.obj) {
        o = ov.buf;
        cap = (size_t)ov.len;
    } else if (bound) {
        res = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)bound);
        if (!res) goto fail;
        o = PyBytes_AS_STRING(res);
        cap = bound;
    }
    if (o && (!bv.obj || bv.len == nv.len)) {
        Py_BEGIN_ALLOW_THREADS
        r = ucl_delta_encode(nv.buf, bv.buf, (size_t)nv.len, word, enc, level, o, cap, NULL);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&nv);
    if (bv.obj) PyBuffer_Release(&bv);
    if (ov.obj) {
        PyBuffer_Release(&ov);
        return PyLong_FromLongLong(r);
    }
    if (r <= 0) {
        Py_XDECREF(res);
        if (r == 0) Py_RETURN_NONE;
        return PyLong_FromLongLong(r);
    }
    if (_PyBytes_Resize(&res, (Py_ssize_t)r) < 0) return NULL;
    return res;
fail:
    PyBuffer_Release(&nv);
    if (bv.obj) PyBuffer_Release(&bv);
    if (ov.obj) PyBuffer_Release(&ov);
    return NULL;
}

/* decode(payload, base|None, out, word) -> (rc, mode) */
static PyObject *py_decode(PyObject *self, PyObject *args) {
    Py_buffer pv, ov, bv = {0};
    PyObject *base_obj;
    int word, mode = -1;
    if (!PyArg_ParseTuple(args, "y*Ow*i", &pv, &base_obj, &ov, &word)) return NULL;
    if (base_obj != Py_None && PyObject_GetBuffer(base_obj, &bv, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&pv);
        PyBuffer_Release(&ov);
        return NULL;
    }
    int rc;
    if (bv.obj && bv.len != ov.len) {
        rc = UCL_DELTA_E_ARG;
    } else {
        Py_BEGIN_ALLOW_THREADS
        rc = ucl_delta_decode(pv.buf, (size_t)pv.len, bv.buf, ov.buf, (size_t)ov.len, word, &mode, NULL);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&pv);
    PyBuffer_Release(&ov);
    if (bv.obj) PyBuffer_Release(&bv);
    return Py_BuildValue("(ii)", rc, mode);
}

/* unpack(payload, planes, word, part=0, nparts=1) -> (rc, mode, failed): planes is a writable buffer of the
   chunk's size; the payload's error is UCL_DELTA_E_ZSTD when any part failed, else rc */
static PyObject *py_unpack(PyObject *self, PyObject *args) {
    Py_buffer pv, sv;
    int word, part = 0, nparts = 1, mode = -1, failed = 0;
    if (!PyArg_ParseTuple(args, "y*w*i|ii", &pv, &sv, &word, &part, &nparts)) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ucl_delta_unpack(pv.buf, (size_t)pv.len, sv.buf, (size_t)sv.len, word, part, nparts, &mode, &failed);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&pv);
    PyBuffer_Release(&sv);
    return Py_BuildValue("(iii)", rc, mode, failed);
}

/* apply(planes: sequence of buffers, modes: sequence of int, base|None, out, word, start, count) -> rc */
static PyObject *py_apply(PyObject *self, PyObject *args) {
    PyObject *planes_obj, *modes_obj, *base_obj;
    Py_buffer ov, bv = {0};
    int word;
    Py_ssize_t start, count;
    if (!PyArg_ParseTuple(args, "OOOw*inn", &planes_obj, &modes_obj, &base_obj, &ov, &word, &start, &count))
        return NULL;
    PyObject *planes = NULL, *modes = NULL, *res = NULL;
    Py_buffer *views = NULL;
    const void **ptrs = NULL;
    int *mv = NULL;
    Py_ssize_t k = 0, held = 0;
    planes = PySequence_Fast(planes_obj, "planes must be a sequence");
    modes = planes ? PySequence_Fast(modes_obj, "modes must be a sequence") : NULL;
    if (!modes) goto out;
    k = PySequence_Fast_GET_SIZE(planes);
    if (k < 1 || k > 1 << 20 || PySequence_Fast_GET_SIZE(modes) != k || start < 0 || count < 0) {
        res = PyLong_FromLong(UCL_DELTA_E_ARG);
        goto out;
    }
    views = PyMem_Calloc((size_t)k, sizeof *views);
    ptrs = PyMem_Calloc((size_t)k, sizeof *ptrs);
    mv = PyMem_Calloc((size_t)k, sizeof *mv);
    if (!views || !ptrs || !mv) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t j = 0; j < k; j++) {
        long m = PyLong_AsLong(PySequence_Fast_GET_ITEM(modes, j));
        if (m == -1 && PyErr_Occurred()) goto out;
        mv[j] = m < 0 || m > 2 ? -1 : (int)m;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(planes, j), &views[j], PyBUF_SIMPLE) < 0) goto out;
        held++;
        ptrs[j] = views[j].buf;
        if (views[j].len != ov.len) {
            res = PyLong_FromLong(UCL_DELTA_E_ARG);
            goto out;
        }
    }
    if (base_obj != Py_None) {
        if (PyObject_GetBuffer(base_obj, &bv, PyBUF_SIMPLE) < 0) goto out;
        if (bv.len != ov.len) {
            res = PyLong_FromLong(UCL_DELTA_E_ARG);
            goto out;
        }
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ucl_delta_apply(ptrs, mv, (int)k, bv.obj ? bv.buf : NULL, ov.buf, (size_t)ov.len, word, (size_t)start,
                         (size_t)count);
    Py_END_ALLOW_THREADS
    res = PyLong_FromLong(rc);
out:
    for (Py_ssize_t j = 0; j < held; j++) PyBuffer_Release(&views[j]);
    if (bv.obj) PyBuffer_Release(&bv);
    PyBuffer_Release(&ov);
    PyMem_Free(views);
    PyMem_Free(ptrs);
    PyMem_Free(mv);
    Py_XDECREF(planes);
    Py_XDECREF(modes);
    return res;
}

/* shuffle(src, dst, word) / unshuffle(src, dst, word) */
static PyObject *shuffle_impl(PyObject *args, int inverse) {
    Py_buffer sv, dv;
    int word;
    if (!PyArg_ParseTuple(args, "y*w*i", &sv, &dv, &word)) return NULL;
    int ok = word_ok(word) && sv.len == dv.len && sv.len % word == 0;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        if (inverse) ucl_delta_unshuffle(sv.buf, dv.buf, (size_t)sv.len, word);
        else ucl_delta_shuffle(sv.buf, dv.buf, (size_t)sv.len, word);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&sv);
    PyBuffer_Release(&dv);
    return PyBool_FromLong(ok);
}
static PyObject *py_shuffle(PyObject *self, PyObject *args) { return shuffle_impl(args, 0); }
static PyObject *py_unshuffle(PyObject *self, PyObject *args) { return shuffle_impl(args, 1); }

static PyObject *py_bound(PyObject *self, PyObject *args) {
    Py_ssize_t n;
    int word;
    if (!PyArg_ParseTuple(args, "ni", &n, &word)) return NULL;
    return PyLong_FromSize_t(n < 0 ? 0 : ucl_delta_bound((size_t)n, word));
}

static PyObject *py_release(PyObject *self, PyObject *noargs) {
    ucl_delta_thread_release();
    Py_RETURN_NONE;
}

static PyObject *py_zstd_version(PyObject *self, PyObject *noargs) { return PyLong_FromUnsignedLong(ucl_delta_zstd_version()); }

static PyMethodDef methods[] = {
    {"encode", py_encode, METH_VARARGS, NULL},
    {"decode", py_decode, METH_VARARGS, NULL},
    {"unpack", py_unpack, METH_VARARGS, NULL},
    {"apply", py_apply, METH_VARARGS, NULL},
    {"shuffle", py_shuffle, METH_VARARGS, NULL},
    {"unshuffle", py_unshuffle, METH_VARARGS, NULL},
    {"bound", py_bound, METH_VARARGS, NULL},
    {"zstd_version", py_zstd_version, METH_NOARGS, NULL},
    {"release", py_release, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "ucl._delta", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__delta(void) { return PyModule_Create(&moduledef); }
#endif
