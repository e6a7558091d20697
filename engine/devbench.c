/* The device limit for bench/device_limit.py: what the disk takes with nothing of ours in the way.
   One pre-touched aligned block per thread, O_DIRECT pwrites at increasing offsets (inflight
   threads, so that many requests are in flight), fdatasync. No checksum, no copy. */
#define _GNU_SOURCE
#include "writer.h"
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    int fd, err;
    uint64_t nbytes, next; /* next: atomic, the next offset to write */
    size_t block;
} shared;

typedef struct {
    shared *s;
    char *buf;
    pthread_t t;
} lane;

static void *run_lane(void *arg) {
    lane *l = arg;
    shared *s = l->s;
    for (;;) {
        uint64_t off = __atomic_fetch_add(&s->next, s->block, __ATOMIC_RELAXED);
        if (off >= s->nbytes) return NULL;
        size_t n = s->nbytes - off < s->block ? (size_t)(s->nbytes - off) : s->block;
        for (size_t done = 0; done < n;) {
            ssize_t k = pwrite(s->fd, l->buf + done, n - done, (off_t)(off + done));
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0) {
                __atomic_store_n(&s->err, k < 0 ? errno : EIO, __ATOMIC_RELAXED);
                return NULL;
            }
            done += (size_t)k;
        }
    }
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* nbytes and block: multiples of 4096. The file is allocated first, as the engine does. */
int ucl_device_write(const char *path, uint64_t nbytes, size_t block, int inflight, double *seconds) {
    shared s = {.fd = -1, .nbytes = nbytes, .block = block};
    lane *lanes = calloc((size_t)inflight, sizeof *lanes);
    if (!lanes) return ENOMEM;
    int err = 0, started = 0;
    for (int i = 0; i < inflight && !err; i++) {
        lanes[i].s = &s;
        if (posix_memalign((void **)&lanes[i].buf, 4096, block)) err = ENOMEM;
        else memset(lanes[i].buf, 0x5a + i, block); /* touched before the clock starts */
    }
    double t0 = now();
    if (!err && (s.fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0644)) < 0) err = errno;
    if (!err && nbytes && fallocate(s.fd, 0, 0, (off_t)nbytes)) err = errno;
    for (; !err && started < inflight; started++)
        if ((err = pthread_create(&lanes[started].t, NULL, run_lane, &lanes[started]))) break;
    for (int i = 0; i < started; i++) pthread_join(lanes[i].t, NULL);
    if (!err) err = s.err;
    if (!err && fdatasync(s.fd)) err = errno;
    if (s.fd >= 0 && close(s.fd) && !err) err = errno;
    *seconds = now() - t0;
    for (int i = 0; i < inflight; i++) free(lanes[i].buf);
    free(lanes);
    return err;
}
