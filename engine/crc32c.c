/* CRC-32C: SSE4.2 instruction in three lanes when present (chosen once at run time), slicing-by-8
   table otherwise; and combining crcs of consecutive pieces (for the write engine's segments). */
#include "crc32c.h"
#include <pthread.h>
#include <string.h>

#define POLY 0x82F63B78u

static uint32_t table[8][256];
static int hw;
static pthread_once_t once = PTHREAD_ONCE_INIT; /* the engine's threads may be the first callers */

static void init_table(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xff];
}

static uint32_t crc_sw(uint32_t crc, const unsigned char *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) { crc = table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8); n--; }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= crc;
        crc = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^ table[5][(w >> 16) & 0xff] ^
              table[4][(w >> 24) & 0xff] ^ table[3][(w >> 32) & 0xff] ^ table[2][(w >> 40) & 0xff] ^
              table[1][(w >> 48) & 0xff] ^ table[0][w >> 56];
        p += 8; n -= 8;
    }
    while (n--) crc = table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return crc;
}

/* GF(2) polynomial arithmetic modulo POLY, bit-reflected (zlib's crc32_combine, for CRC-32C). */
static uint32_t x2n_table[32]; /* x^(2^n) mod POLY */

static uint32_t multmodp(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ POLY : b >> 1;
    }
    return p;
}

/* x^(n * 2^k) mod POLY */
static uint32_t x2nmodp(uint64_t n, unsigned k) {
    uint32_t p = 1u << 31; /* x^0 */
    while (n) {
        if (n & 1) p = multmodp(x2n_table[k & 31], p);
        n >>= 1;
        k++;
    }
    return p;
}

/* Shifting a crc register over len zero bytes is linear: one table per byte of the register. */
#define LONG 8192
#define SHORT 256
static uint32_t shift_long[4][256], shift_short[4][256];

static void init_shift(uint32_t t[4][256], uint64_t len) {
    uint32_t k = x2nmodp(len, 3);
    for (int i = 0; i < 4; i++)
        for (uint32_t b = 0; b < 256; b++) t[i][b] = multmodp(k, b << (8 * i));
}

static inline uint64_t shift(uint32_t t[4][256], uint64_t c) {
    return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][(c >> 24) & 0xff];
}

#if defined(__x86_64__)
#include <nmmintrin.h>
/* The crc32 instruction has a latency of 3 cycles and a throughput of 1: three independent lanes over
   consecutive blocks, joined by shifting (Mark Adler's crc32c.c), run ~3x faster than one. */
__attribute__((target("sse4.2"))) static uint64_t lanes3(uint64_t c, const unsigned char **pp, size_t *np,
                                                         size_t len, uint32_t t[4][256]) {
    const unsigned char *p = *pp;
    while (*np >= 3 * len) {
        uint64_t c1 = 0, c2 = 0, w0, w1, w2;
        for (const unsigned char *end = p + len; p < end; p += 8) {
            memcpy(&w0, p, 8);
            memcpy(&w1, p + len, 8);
            memcpy(&w2, p + 2 * len, 8);
            c = _mm_crc32_u64(c, w0);
            c1 = _mm_crc32_u64(c1, w1);
            c2 = _mm_crc32_u64(c2, w2);
        }
        c = shift(t, shift(t, c) ^ c1) ^ c2;
        p += 2 * len;
        *np -= 3 * len;
    }
    *pp = p;
    return c;
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const unsigned char *p, size_t n) {
    uint64_t c = crc;
    while (n && ((uintptr_t)p & 7)) { c = _mm_crc32_u8((uint32_t)c, *p++); n--; }
    c = lanes3(c, &p, &n, LONG, shift_long);
    c = lanes3(c, &p, &n, SHORT, shift_short);
    while (n >= 8) { uint64_t w; memcpy(&w, p, 8); c = _mm_crc32_u64(c, w); p += 8; n -= 8; }
    while (n--) c = _mm_crc32_u8((uint32_t)c, *p++);
    return (uint32_t)c;
}
#endif

static void init(void) {
    init_table();
    uint32_t p = 1u << 30; /* x^1 */
    x2n_table[0] = p;
    for (int n = 1; n < 32; n++) x2n_table[n] = p = multmodp(p, p);
    init_shift(shift_long, LONG);
    init_shift(shift_short, SHORT);
#if defined(__x86_64__)
    __builtin_cpu_init();
    hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#else
    hw = 0;
#endif
}

int ucl_crc32c_hw(void) {
    pthread_once(&once, init);
    return hw;
}

uint32_t ucl_crc32c(uint32_t crc, const void *buf, size_t n) {
    pthread_once(&once, init);
    crc = ~crc;
#if defined(__x86_64__)
    if (hw) return ~crc_hw(crc, (const unsigned char *)buf, n);
#endif
    return ~crc_sw(crc, (const unsigned char *)buf, n);
}

uint32_t ucl_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2) {
    pthread_once(&once, init);
    return multmodp(x2nmodp(len2, 3), crc1) ^ crc2;
}
