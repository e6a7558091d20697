/* The write engine: a pthread pool that writes whole files from caller-owned memory.
   No Python in here: module.c owns the Python objects and hands over (pointer, length) spans that
   stay valid and unchanged until the job is done. */
#ifndef UCL_WRITER_H
#define UCL_WRITER_H
#include <stddef.h>
#include <stdint.h>

typedef struct { const void *buf; size_t len; } ucl_span;

/* The outcome of a job. err == 0: written, fdatasync'ed and closed. Otherwise err is an errno, op
   says what failed ("opening", "writing", ...) and offset where in the file. */
typedef struct {
    int err;
    const char *op;
    uint64_t offset;
    uint64_t nbytes;
    uint32_t crc;
    int direct; /* 1 when the bulk went through O_DIRECT */
} ucl_result;

typedef struct ucl_pool ucl_pool;
typedef struct ucl_job ucl_job;

/* direct: 1 tries O_DIRECT per file (falling back to buffered writes where open says EINVAL),
   0 buffered with early writeback. segment: bytes per unit of work, a multiple of 4096.
   Returns NULL with errno set on failure. */
ucl_pool *ucl_pool_start(int nthreads, int direct, size_t segment, int sync);
/* A job writing the concatenation of nspans spans to path; fill job_spans(job) before submit. It computes
   the content's crc32c on the way unless told not to before submit (a caller that checksums the bytes
   itself: its result's crc is then 0). */
ucl_job *ucl_job_new(const char *path, size_t nspans);
void ucl_job_set_checksum(ucl_job *job, int checksum);
ucl_span *ucl_job_spans(ucl_job *job);
const char *ucl_job_path(const ucl_job *job);
/* 0, or ESHUTDOWN once the pool is closing. The pool owns the job until it is done. */
int ucl_pool_submit(ucl_pool *pool, ucl_job *job);
/* on != 0: the threads start no new open or segment until a matching call with on == 0 (the holds
   nest); what is in flight goes on, and closing ignores holds. For a caller that needs the CPU for a
   moment (a save copying its state while the previous step is written). */
void ucl_pool_hold(ucl_pool *pool, int on);
/* Wait until the job is done (timeout < 0: forever). 0 and *res filled, or ETIMEDOUT. */
int ucl_job_wait(ucl_pool *pool, ucl_job *job, double timeout, ucl_result *res);
int ucl_job_done(ucl_pool *pool, ucl_job *job);
void ucl_job_free(ucl_job *job);
/* Stop: work not yet handed out is cancelled (ECANCELED), writes in flight finish, threads are
   joined within timeout (< 0: forever). 0, or ETIMEDOUT while some thread still runs (call again). */
int ucl_pool_close(ucl_pool *pool, double timeout);
/* Frees a pool that ucl_pool_close joined; returns EBUSY (and frees nothing) otherwise. */
int ucl_pool_free(ucl_pool *pool);

int ucl_fsync_dir(const char *path);

/* Test hook, inert until set: fail or shorten the nth pwrite, fail the nth fdatasync, or refuse the
   nth open with O_DIRECT (EINVAL, as tmpfs did before Linux 6.6), counted from this call over all
   threads (nth == 0: every call). */
enum { UCL_FAULT_NONE, UCL_FAULT_PWRITE, UCL_FAULT_SHORT_WRITE, UCL_FAULT_FDATASYNC, UCL_FAULT_NO_DIRECT,
       UCL_FAULT_STALL };
void ucl_fault_set(int kind, unsigned nth, int err);

/* The bench's reference: nbytes written sequentially with O_DIRECT in block-sized writes, inflight
   threads, then fdatasync. Returns 0 and *seconds, or an errno. */
int ucl_device_write(const char *path, uint64_t nbytes, size_t block, int inflight, double *seconds);

#endif
