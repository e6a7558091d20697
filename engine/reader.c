/* The bulk read engine (reader.h). Each thread takes the next segment, reads its aligned span with
   O_DIRECT into its own buffer (continuing after short reads), compares the tail, checks each chunk's
   crc32c against the 4 bytes stored after it, and copies the chunk to its destination while it is still
   in cache. No lock: an atomic counter hands out the segments; each writes only its own outputs. */
#define _GNU_SOURCE
#include "reader.h"
#include "crc32c.h"
#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#define ALIGN 4096u

uint64_t ucl_read_span(const ucl_rseg *s) {
    uint64_t base = s->offset - s->offset % ALIGN;
    uint64_t end = s->offset + s->length + s->tail_len;
    return (end - base + ALIGN - 1) / ALIGN * ALIGN;
}

typedef struct {
    const ucl_rseg *segs;
    size_t nseg;
    const ucl_rchunk *chunks;
    const uint8_t *tails;
    int32_t *status;
    uint32_t *crcs;
    size_t buf_len;
    size_t next; /* atomic */
} shared;

typedef struct {
    shared *sh;
    char *buf;
} worker_arg;

static int one(shared *sh, size_t i, char *buf) {
    const ucl_rseg *s = &sh->segs[i];
    uint64_t base = s->offset - s->offset % ALIGN, span = ucl_read_span(s);
    if (span > sh->buf_len) return UCL_READ_NOMEM;
    uint64_t need = s->offset - base + s->length + s->tail_len, got = 0;
    while (got < need) {
        ssize_t n = pread((int)s->fd, buf + got, (size_t)(span - got), (off_t)(base + got));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return UCL_READ_IO;
        if (n == 0) break;
        got += (uint64_t)n;
        if ((uint64_t)n % ALIGN) break; /* an unaligned count only comes from the end of the file */
    }
    if (got < need) return UCL_READ_SHORT;
    const char *seg = buf + (s->offset - base);
    if (s->tail_len && memcmp(seg + s->length, sh->tails + s->tail_off, (size_t)s->tail_len)) return UCL_READ_TAIL;
    for (uint64_t k = 0; k < s->nchunks; k++) {
        const ucl_rchunk *c = &sh->chunks[s->first + k];
        const unsigned char *data = (const unsigned char *)seg + c->off;
        size_t n = (size_t)(c->nbytes - 4);
        uint32_t stored = (uint32_t)data[n] | (uint32_t)data[n + 1] << 8 | (uint32_t)data[n + 2] << 16 |
                          (uint32_t)data[n + 3] << 24;
        sh->crcs[s->first + k] = stored;
        if (ucl_crc32c(0, data, n) != stored) return UCL_READ_CRC;
        memcpy((void *)(uintptr_t)c->dst, data, n);
    }
    return UCL_READ_OK;
}

static void *worker(void *arg) {
    worker_arg *w = arg;
    shared *sh = w->sh;
    for (;;) {
        size_t i = __atomic_fetch_add(&sh->next, 1, __ATOMIC_RELAXED);
        if (i >= sh->nseg) break;
        sh->status[i] = one(sh, i, w->buf);
    }
    return NULL;
}

void ucl_read_segments(const ucl_rseg *segs, size_t nseg, const ucl_rchunk *chunks, const uint8_t *tails,
                       int32_t *status, uint32_t *crcs, char *const *bufs, int nbufs, size_t buf_len) {
    shared sh = {segs, nseg, chunks, tails, status, crcs, buf_len, 0};
    worker_arg args[64];
    pthread_t th[64];
    int n = nbufs < 1 ? 1 : nbufs > 64 ? 64 : nbufs, started = 0;
    if ((size_t)n > nseg) n = nseg ? (int)nseg : 1;
    for (int t = 0; t < n; t++) args[t] = (worker_arg){&sh, bufs[t]};
    for (int t = 1; t < n; t++) { /* this thread is the first worker */
        if (pthread_create(&th[t], NULL, worker, &args[t])) break;
        started = t;
    }
    worker(&args[0]);
    for (int t = 1; t <= started; t++) pthread_join(th[t], NULL);
}
