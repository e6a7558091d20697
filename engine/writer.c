/* The write engine (writer.h). Units of work: opening a job's file (once), and writing one segment
   (segment bytes at a segment-aligned offset), so several threads write one large file with several
   requests in flight. Each segment's crc32c is kept apart and combined in file order at the end; the
   thread that completes the last segment syncs and closes the file. One mutex guards the queue and
   the jobs' bookkeeping, and is never held across a system call. */
#define _GNU_SOURCE
#include "writer.h"
#include "crc32c.h"
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define ALIGN 4096u
#define PIECE (256u << 10)    /* checksum a piece, then copy or write it while it is still in cache */
#define WRITEBACK (32u << 20) /* buffered files: start writeback every 32 MiB */
#define HUGE (2u << 20)       /* bounce buffers in (transparent) huge pages */

enum { QUEUED, OPENING, WRITING, DONE };

struct ucl_job {
    char *path;
    size_t nspans;
    ucl_span *spans;
    uint64_t *starts; /* file offset of each span */
    uint64_t size;
    int checksum; /* compute the content's crc32c (1, the default) */
    /* under pool->mu */
    int state;
    size_t nseg, next_seg, segs_left, inflight;
    ucl_job *next; /* in the queue while it has work to hand out */
    uint32_t *seg_crc;
    ucl_result res;
    /* set by the opener before any segment is handed out */
    int fd, fd_buf;    /* fd is O_DIRECT when res.direct; fd_buf is buffered (== fd otherwise) */
    uint64_t kicked;   /* buffered: writeback started up to here */
    uint64_t written;  /* atomic: paces writeback of buffered files */
};

struct ucl_pool {
    pthread_mutex_t mu;
    pthread_cond_t work, done; /* work: for the threads; done: a job finished or a thread exited */
    ucl_job *head, *tail;
    int closing, direct, nthreads, running, joined;
    int sync; /* fdatasync each file (0: the caller makes everything durable at once, e.g. syncfs) */
    int held; /* ucl_pool_hold: no new open or segment is started while > 0 (those in flight go on) */
    size_t segment;
    pthread_t *threads;
};

/* ---- fault injection (tests only; one relaxed load per call when inert) ---------------------- */
static struct { int kind, err; unsigned nth, count; } fault;

void ucl_fault_set(int kind, unsigned nth, int err) {
    __atomic_store_n(&fault.kind, UCL_FAULT_NONE, __ATOMIC_RELEASE);
    __atomic_store_n(&fault.nth, nth, __ATOMIC_RELAXED);
    __atomic_store_n(&fault.err, err, __ATOMIC_RELAXED);
    __atomic_store_n(&fault.count, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&fault.kind, kind, __ATOMIC_RELEASE);
}

static int fault_hit(int kind) {
    if (__atomic_load_n(&fault.kind, __ATOMIC_ACQUIRE) != kind) return 0;
    unsigned nth = __atomic_load_n(&fault.nth, __ATOMIC_RELAXED);
    return nth == 0 || __atomic_add_fetch(&fault.count, 1, __ATOMIC_RELAXED) == nth;
}

static int fault_errno(void) { return __atomic_load_n(&fault.err, __ATOMIC_RELAXED); }

static ssize_t xpwrite(int fd, const void *p, size_t n, uint64_t off, int direct) {
    if (fault_hit(UCL_FAULT_PWRITE)) {
        errno = fault_errno();
        return -1;
    }
    if (n > 1 && fault_hit(UCL_FAULT_SHORT_WRITE)) { /* a real write of fewer bytes, aligned for O_DIRECT */
        size_t k = direct ? (n / 2) & ~(size_t)(ALIGN - 1) : n / 2;
        if (k) n = k;
    }
    return pwrite(fd, p, n, (off_t)off);
}

static int xfdatasync(int fd) {
    if (fault_hit(UCL_FAULT_FDATASYNC)) {
        errno = fault_errno();
        return -1;
    }
    return fdatasync(fd);
}

/* ---- one job's I/O, outside the lock ------------------------------------------------------- */
static void fail(ucl_job *j, int err, const char *op, uint64_t offset) {
    if (j->res.err) return; /* the first error is the one reported */
    j->res.err = err;
    j->res.op = op;
    j->res.offset = offset;
}

/* mkdir -p of path's directory. */
static int mkdir_parents(const char *path) {
    char *d = strdup(path);
    if (!d) return ENOMEM;
    for (char *s = d + 1; *s; s++) {
        if (*s != '/') continue;
        *s = 0;
        if (mkdir(d, 0755) && errno != EEXIST) {
            int e = errno;
            free(d);
            return e;
        }
        *s = '/';
    }
    free(d);
    return 0;
}

static int xopen(const char *path, int flags) {
    while (__atomic_load_n(&fault.kind, __ATOMIC_ACQUIRE) == UCL_FAULT_STALL) { /* a job that hangs (tests) */
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    if ((flags & O_DIRECT) && fault_hit(UCL_FAULT_NO_DIRECT)) {
        errno = EINVAL;
        return -1;
    }
    return open(path, flags, 0644);
}

static int open_mkdir(const char *path, int flags, const char **op) {
    int fd = xopen(path, flags);
    if (fd < 0 && errno == ENOENT) {
        int e = mkdir_parents(path);
        if (e) {
            *op = "creating the directory of";
            errno = e;
            return -1;
        }
        fd = xopen(path, flags);
    }
    if (fd < 0) *op = "opening";
    return fd;
}

static void do_open(ucl_pool *p, ucl_job *j) {
    const char *op = "opening";
    /* never through a symlink planted at the name, never blocking on a FIFO (ENXIO without a reader) */
    int flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK;
    int direct = p->direct && j->size >= ALIGN; /* a smaller file is all tail */
    int fd = open_mkdir(j->path, flags | (direct ? O_DIRECT : 0), &op);
    if (fd < 0 && direct && errno == EINVAL) { /* no O_DIRECT on this filesystem (tmpfs, ...) */
        direct = 0;
        fd = open_mkdir(j->path, flags, &op);
    }
    if (fd < 0) return fail(j, errno, op, 0);
    struct stat st;
    if (fstat(fd, &st)) {
        int e = errno;
        close(fd);
        return fail(j, e, "opening", 0);
    }
    if (!S_ISREG(st.st_mode)) { /* a device node: never written */
        close(fd);
        return fail(j, EINVAL, "opening (not a regular file)", 0);
    }
    j->fd = j->fd_buf = fd;
    /* Allocating the whole file first reports a full disk before any write, and makes the segment
       writes overwrites, which ext4 runs in parallel (O_DIRECT writes past the end are serialised). */
    if (j->size && fallocate(fd, 0, 0, (off_t)j->size) &&
        (errno == ENOSPC || errno == EDQUOT || errno == EFBIG || errno == EIO))
        return fail(j, errno, "allocating", 0);
    if (direct) { /* the unaligned tail goes through a buffered fd */
        j->fd_buf = open(j->path, O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
        if (j->fd_buf < 0) {
            j->fd_buf = fd;
            return fail(j, errno, "opening", 0);
        }
    }
    j->res.direct = direct;
}

/* Writes p[0:n] at off, continuing after short writes: through the O_DIRECT fd while address, offset
   and length allow it, the rest (the file's unaligned tail, or what follows a short write that
   ended unaligned) through the buffered fd, so no byte is lost. */
static int write_all(ucl_job *j, const char *p, size_t n, uint64_t off, uint64_t *at) {
    while (n) {
        int direct = j->fd != j->fd_buf && ((uintptr_t)p | off) % ALIGN == 0 && n >= ALIGN;
        size_t len = direct ? n & ~(size_t)(ALIGN - 1) : n;
        ssize_t k = xpwrite(direct ? j->fd : j->fd_buf, p, len, off, direct);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            *at = off;
            return k < 0 ? errno : EIO;
        }
        p += k;
        off += (uint64_t)k;
        n -= (size_t)k;
    }
    return 0;
}

static int do_segment(ucl_pool *p, ucl_job *j, size_t seg, char **bounce, uint32_t *crc_out, uint64_t *at) {
    uint64_t off = (uint64_t)seg * p->segment;
    size_t len = j->size - off < p->segment ? (size_t)(j->size - off) : p->segment;
    /* The last span starting at or before off holds it (this skips empty spans). */
    size_t i = 0, hi = j->nspans - 1;
    while (i < hi) {
        size_t mid = (i + hi + 1) / 2;
        if (j->starts[mid] <= off) i = mid;
        else hi = mid - 1;
    }
    size_t in = (size_t)(off - j->starts[i]);
    int direct = j->res.direct, err = 0;
    uint32_t crc = 0;
    const char *src = (const char *)j->spans[i].buf + in;
    if (direct && j->spans[i].len - in >= len && (uintptr_t)src % ALIGN == 0) { /* aligned: no copy */
        if (j->checksum) crc = ucl_crc32c(0, src, len);
        err = write_all(j, src, len, off, at);
    } else {
        if (direct && !*bounce) {
            /* In huge pages where the kernel has them: an O_DIRECT request is built of the buffer's
               physical runs (at most max_segments of them, 254 on virtio-blk), so 4 KiB pages cap a
               request at ~1 MiB where huge pages give the whole 4 MiB the queue takes; measured with
               bench/probe.c (-4: 4 KiB pages) on a throttled virtual disk, 1.5-2x the throughput. */
            void *b;
            size_t n = (p->segment + HUGE - 1) / HUGE * HUGE;
            if (posix_memalign(&b, HUGE, n)) {
                *at = off;
                return ENOMEM;
            }
#ifdef MADV_HUGEPAGE
            madvise(b, n, MADV_HUGEPAGE); /* advice: no huge pages, no harm */
#endif
            *bounce = b;
        }
        for (size_t done = 0; done < len && !err;) {
            size_t n = j->spans[i].len - in;
            if (!n) {
                i++;
                in = 0;
                continue;
            }
            if (n > len - done) n = len - done;
            if (n > PIECE && j->checksum) n = PIECE; /* without a checksum, a span's run in one copy */
            src = (const char *)j->spans[i].buf + in;
            if (j->checksum) crc = ucl_crc32c(crc, src, n);
            if (direct) memcpy(*bounce + done, src, n);
            else err = write_all(j, src, n, off + done, at);
            done += n;
            in += n;
        }
        if (direct && !err) err = write_all(j, *bounce, len, off, at);
    }
    /* Buffered: start writeback of each 32 MiB written (its segments come one at a time, in order),
       so that fdatasync finds little left to do. Measured: naming the range matters; asking for the
       whole file each time was several times slower. */
    if (!err && !direct && off + len - j->kicked >= WRITEBACK) {
        sync_file_range(j->fd_buf, (off_t)j->kicked, (off_t)(off + len - j->kicked), SYNC_FILE_RANGE_WRITE);
        j->kicked = off + len;
    }
    *crc_out = crc;
    return err;
}

static void finish(ucl_pool *p, ucl_job *j) {
    if (j->fd >= 0) {
        if (p->sync && !j->res.err && xfdatasync(j->fd)) fail(j, errno, "syncing", j->size);
        if (j->fd_buf != j->fd && close(j->fd_buf) && errno != EINTR) fail(j, errno, "closing", j->size);
        if (close(j->fd) && errno != EINTR) fail(j, errno, "closing", j->size);
        j->fd = j->fd_buf = -1;
    }
    if (j->res.err) return;
    uint32_t crc = 0;
    for (size_t s = 0; j->checksum && s < j->nseg; s++) {
        uint64_t len = s + 1 < j->nseg ? p->segment : j->size - (uint64_t)s * p->segment;
        crc = s ? ucl_crc32c_combine(crc, j->seg_crc[s], len) : j->seg_crc[0];
    }
    j->res.crc = crc;
    j->res.nbytes = j->size;
}

/* ---- the pool ------------------------------------------------------------------------------ */
static void unqueue(ucl_pool *p, ucl_job *j) {
    ucl_job **link = &p->head, *prev = NULL;
    while (*link != j) {
        prev = *link;
        link = &(*link)->next;
    }
    *link = j->next;
    if (p->tail == j) p->tail = prev;
    j->next = NULL;
}

static void *worker(void *arg) {
    ucl_pool *p = arg;
    char *bounce = NULL; /* one aligned segment for O_DIRECT copies: allocated on first use, reused */
    pthread_mutex_lock(&p->mu);
    for (;;) {
        /* Nothing to hand out from a job being opened; nor from a buffered one with a segment in
           flight: ext4 serialises buffered writes to a file, and threads contending for its lock
           burnt several times the CPU for a fraction of the throughput (measured). */
        ucl_job *j = p->held && !p->closing ? NULL : p->head;
        while (j && (j->state == OPENING || (j->state == WRITING && !j->res.direct && j->inflight))) j = j->next;
        if (!j) {
            if (p->closing) break;
            pthread_cond_wait(&p->work, &p->mu);
            continue;
        }
        int cancel = p->closing || j->res.err; /* on close, or after a failed segment: skip the I/O */
        if (j->state == QUEUED) {
            j->state = OPENING;
            pthread_mutex_unlock(&p->mu);
            if (cancel) fail(j, ECANCELED, "opening", 0);
            else do_open(p, j);
            pthread_mutex_lock(&p->mu);
            if (!j->res.err && j->nseg) {
                j->state = WRITING;
                pthread_cond_broadcast(&p->work);
                continue;
            }
            unqueue(p, j);
        } else {
            size_t seg = j->next_seg++;
            j->inflight++;
            if (j->next_seg == j->nseg) unqueue(p, j);
            uint32_t crc = 0;
            uint64_t at = (uint64_t)seg * p->segment;
            int err = ECANCELED;
            pthread_mutex_unlock(&p->mu);
            if (!cancel) err = do_segment(p, j, seg, &bounce, &crc, &at);
            pthread_mutex_lock(&p->mu);
            j->seg_crc[seg] = crc;
            if (err) fail(j, err, "writing", at);
            j->inflight--; /* a buffered job's next segment: this thread takes it as it loops */
            if (--j->segs_left) continue;
        }
        /* Nothing of this job is in flight any more: sync, close, publish. */
        pthread_mutex_unlock(&p->mu);
        finish(p, j);
        pthread_mutex_lock(&p->mu);
        j->state = DONE;
        pthread_cond_broadcast(&p->done);
    }
    p->running--;
    pthread_cond_broadcast(&p->done);
    pthread_mutex_unlock(&p->mu);
    free(bounce);
    return NULL;
}

static void deadline_after(struct timespec *ts, double seconds) {
    if (!(seconds < 1e9)) seconds = 1e9; /* inf and nan too: 31 years is forever enough */
    clock_gettime(CLOCK_MONOTONIC, ts);
    double s = (double)ts->tv_sec + (double)ts->tv_nsec * 1e-9 + seconds;
    ts->tv_sec = (time_t)s;
    ts->tv_nsec = (long)((s - (double)ts->tv_sec) * 1e9);
}

/* With p->mu held: wait on p->done until *v == want; 0, or ETIMEDOUT. */
static int wait_until(ucl_pool *p, const int *v, int want, double timeout) {
    struct timespec dl;
    if (timeout >= 0) deadline_after(&dl, timeout);
    int rc = 0;
    while (*v != want && rc != ETIMEDOUT)
        rc = timeout < 0 ? pthread_cond_wait(&p->done, &p->mu) : pthread_cond_timedwait(&p->done, &p->mu, &dl);
    return *v == want ? 0 : ETIMEDOUT;
}

ucl_pool *ucl_pool_start(int nthreads, int direct, size_t segment, int sync) {
    ucl_pool *p = calloc(1, sizeof *p);
    pthread_t *threads = calloc((size_t)nthreads, sizeof *threads);
    if (!p || !threads || nthreads < 1 || !segment || segment % ALIGN) {
        free(p);
        free(threads);
        errno = !p || !threads ? ENOMEM : EINVAL;
        return NULL;
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work, NULL);
    pthread_cond_init(&p->done, &ca);
    pthread_condattr_destroy(&ca);
    p->direct = direct;
    p->sync = sync;
    p->segment = segment;
    p->threads = threads;
    /* Signals go to the interpreter's threads, never to ours (nor interrupt our system calls). */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int err = 0;
    for (; p->nthreads < nthreads; p->nthreads++) {
        if ((err = pthread_create(&threads[p->nthreads], NULL, worker, p))) break;
        p->running++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err) {
        ucl_pool_close(p, -1);
        ucl_pool_free(p);
        errno = err;
        return NULL;
    }
    return p;
}

void ucl_pool_hold(ucl_pool *p, int on) {
    pthread_mutex_lock(&p->mu);
    if (on) p->held++;
    else if (p->held && !--p->held) pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->mu);
}

ucl_job *ucl_job_new(const char *path, size_t nspans) {
    ucl_job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    j->path = strdup(path);
    j->spans = calloc(nspans ? nspans : 1, sizeof *j->spans);
    j->starts = calloc(nspans ? nspans : 1, sizeof *j->starts);
    j->nspans = nspans;
    j->checksum = 1;
    j->fd = j->fd_buf = -1;
    if (!j->path || !j->spans || !j->starts) {
        ucl_job_free(j);
        return NULL;
    }
    return j;
}

ucl_span *ucl_job_spans(ucl_job *j) { return j->spans; }
void ucl_job_set_checksum(ucl_job *j, int checksum) { j->checksum = checksum != 0; }
const char *ucl_job_path(const ucl_job *j) { return j->path; }

void ucl_job_free(ucl_job *j) {
    if (!j) return;
    free(j->path);
    free(j->spans);
    free(j->starts);
    free(j->seg_crc);
    free(j);
}

int ucl_pool_submit(ucl_pool *p, ucl_job *j) {
    uint64_t size = 0;
    for (size_t i = 0; i < j->nspans; i++) {
        j->starts[i] = size;
        size += j->spans[i].len;
    }
    j->size = size;
    j->nseg = j->segs_left = (size_t)((size + p->segment - 1) / p->segment);
    j->seg_crc = calloc(j->nseg ? j->nseg : 1, sizeof *j->seg_crc);
    if (!j->seg_crc) return ENOMEM;
    pthread_mutex_lock(&p->mu);
    if (p->closing) {
        pthread_mutex_unlock(&p->mu);
        return ESHUTDOWN;
    }
    if (p->tail) p->tail->next = j;
    else p->head = j;
    p->tail = j;
    pthread_cond_signal(&p->work); /* its opener broadcasts once there are segments */
    pthread_mutex_unlock(&p->mu);
    return 0;
}

int ucl_job_wait(ucl_pool *p, ucl_job *j, double timeout, ucl_result *res) {
    pthread_mutex_lock(&p->mu);
    int rc = wait_until(p, &j->state, DONE, timeout);
    if (!rc) *res = j->res;
    pthread_mutex_unlock(&p->mu);
    return rc;
}

int ucl_job_done(ucl_pool *p, ucl_job *j) {
    pthread_mutex_lock(&p->mu);
    int done = j->state == DONE;
    pthread_mutex_unlock(&p->mu);
    return done;
}

int ucl_pool_close(ucl_pool *p, double timeout) {
    pthread_mutex_lock(&p->mu);
    p->closing = 1;
    pthread_cond_broadcast(&p->work);
    int rc = wait_until(p, &p->running, 0, timeout);
    int join = !rc && !p->joined; /* one caller joins */
    if (join) p->joined = 1;
    pthread_mutex_unlock(&p->mu);
    if (join) /* every thread has left its loop: these return at once */
        for (int i = 0; i < p->nthreads; i++) pthread_join(p->threads[i], NULL);
    return rc;
}

int ucl_pool_free(ucl_pool *p) {
    if (!p->joined) return EBUSY;
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->work);
    pthread_cond_destroy(&p->done);
    free(p->threads);
    free(p);
    return 0;
}

int ucl_fsync_dir(const char *path) {
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return errno;
    int err = fsync(fd) ? errno : 0;
    close(fd);
    return err;
}
