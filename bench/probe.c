/* The device probes of bench/peers.py and bench/save.py: what the disk takes and gives with nothing of
   ucl's in the way. Built by bench/_common.py (probe_binary) with the system cc; no Python, no ucl.

     probe write DIR SIZE... [-t THREADS] [-b BLOCK] [-s fdatasync|syncfs|none] [-4]
         Creates DIR/p0, DIR/p1, ... of the given sizes (bytes, each a multiple of 4096), timed from the
         first open to the last close: open O_DIRECT, fallocate, BLOCK-sized pwrites from pre-touched
         aligned memory (one block per thread, no copy, no checksum), THREADS requests in flight over all
         files, then fdatasync each file as its last block lands (or one syncfs at the end), close.
         The sources are in transparent huge pages (-4: in 4 KiB pages, as engine/devbench.c's): a
         request is built of the buffer's physical runs, at most max_segments of them (254 on virtio-blk),
         so 4 KiB pages cap one at ~1 MiB; measured here, 1.5-2x slower on a throttled virtual disk.
     probe read FILE... [-t THREADS] [-b BLOCK]
         Reads the files with O_DIRECT, BLOCK-sized preads, THREADS in flight, into one pre-touched
         aligned destination (each file at a 4 KiB boundary), timed from the first open to the last close.

   Prints one JSON line: {"seconds": s, "joined": s (the last request done), "bytes": n, "files": k, "threads": t, "block": b}. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    int fd;
    uint64_t size, dest;      /* dest: offset of the file in the read destination */
    uint64_t left;            /* bytes not yet written/read (atomic) */
} file_t;

static file_t *files;
static int nfiles, writing, sync_each;
static size_t block;
static uint64_t next_unit; /* atomic: a global counter over (file, block) units in file order */
static uint64_t *unit_start; /* first unit of each file (nfiles + 1 entries) */
static char *dest;
static int first_err;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void set_err(int e) { __atomic_compare_exchange_n(&first_err, &(int){0}, e, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED); }

static void *lane(void *arg) {
    char *buf = arg;
    int f = 0;
    for (;;) {
        uint64_t u = __atomic_fetch_add(&next_unit, 1, __ATOMIC_RELAXED);
        if (u >= unit_start[nfiles] || __atomic_load_n(&first_err, __ATOMIC_RELAXED)) return NULL;
        while (unit_start[f + 1] <= u) f++;
        file_t *fl = &files[f];
        uint64_t off = (u - unit_start[f]) * block;
        size_t n = fl->size - off < block ? (size_t)(fl->size - off) : block;
        size_t span = writing ? n : (n + 4095) & ~(size_t)4095; /* reads: whole pages, the tail short */
        char *p = writing ? buf : dest + fl->dest + off;
        for (size_t done = 0; done < span;) {
            ssize_t k = writing ? pwrite(fl->fd, p + done, n - done, (off_t)(off + done))
                                : pread(fl->fd, p + done, span - done, (off_t)(off + done));
            if (k < 0 && errno == EINTR) continue;
            if (k < 0) {
                set_err(errno);
                return NULL;
            }
            if (k == 0) break; /* the end of a read file */
            done += (size_t)k;
        }
        if (__atomic_sub_fetch(&fl->left, n, __ATOMIC_ACQ_REL) == 0 && writing && sync_each && fdatasync(fl->fd))
            set_err(errno);
    }
}

static size_t parse_size(const char *s) {
    char *end;
    double v = strtod(s, &end);
    if (*end == 'K' || *end == 'k') v *= 1024;
    else if (*end == 'M' || *end == 'm') v *= 1 << 20;
    else if (*end == 'G' || *end == 'g') v *= 1 << 30;
    return (size_t)v;
}

int main(int argc, char **argv) {
    if (argc < 3 || (strcmp(argv[1], "write") && strcmp(argv[1], "read"))) {
        fprintf(stderr, "usage: probe write DIR SIZE... | probe read FILE... [-t N] [-b BYTES] [-s fdatasync|syncfs|none]\n");
        return 2;
    }
    writing = !strcmp(argv[1], "write");
    int threads = 4, huge = 1;
    const char *sync_mode = "fdatasync";
    block = 8u << 20;
    char **args = calloc((size_t)argc, sizeof *args);
    int nargs = 0;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "-t") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-b") && i + 1 < argc) block = parse_size(argv[++i]);
        else if (!strcmp(argv[i], "-s") && i + 1 < argc) sync_mode = argv[++i];
        else if (!strcmp(argv[i], "-4")) huge = 0; /* sources in 4 KiB pages, not huge ones */
        else args[nargs++] = argv[i];
    }
    const char *dir = writing ? args[0] : NULL;
    char **names = writing ? args + 1 : args;
    nfiles = writing ? nargs - 1 : nargs;
    if (nfiles < 1 || threads < 1 || !block || block % 4096) {
        fprintf(stderr, "probe: nothing to do, or a bad -t/-b\n");
        return 2;
    }
    sync_each = !strcmp(sync_mode, "fdatasync");
    files = calloc((size_t)nfiles, sizeof *files);
    unit_start = calloc((size_t)nfiles + 1, sizeof *unit_start);
    uint64_t total = 0, span = 0;
    for (int i = 0; i < nfiles; i++) {
        if (writing) files[i].size = parse_size(names[i]);
        else {
            struct stat st;
            if (stat(names[i], &st)) {
                perror(names[i]);
                return 1;
            }
            files[i].size = (uint64_t)st.st_size;
        }
        files[i].left = files[i].size;
        files[i].dest = span;
        span += (files[i].size + 4095) & ~(uint64_t)4095;
        total += files[i].size;
        unit_start[i + 1] = unit_start[i] + (files[i].size + block - 1) / block;
    }
    /* sources (write) or the destination (read): aligned, huge pages where allowed, every page touched */
    char **bufs = calloc((size_t)threads, sizeof *bufs);
    if (writing) {
        for (int i = 0; i < threads; i++) {
            if (posix_memalign((void **)&bufs[i], 1 << 21, block)) return 1;
            if (huge) madvise(bufs[i], block, MADV_HUGEPAGE);
            memset(bufs[i], 0x5a + i, block);
        }
    } else if (span) {
        dest = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (dest == MAP_FAILED) return 1;
        madvise(dest, span, MADV_HUGEPAGE);
        for (uint64_t o = 0; o < span; o += 4096) dest[o] = 1;
    }
    char path[4096];
    double t0 = now();
    for (int i = 0; i < nfiles && !first_err; i++) {
        if (writing) {
            snprintf(path, sizeof path, "%s/p%d", dir, i);
            files[i].fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0644);
            if (files[i].fd < 0 || (files[i].size && fallocate(files[i].fd, 0, 0, (off_t)files[i].size))) set_err(errno);
        } else if ((files[i].fd = open(names[i], O_RDONLY | O_DIRECT | O_CLOEXEC)) < 0) set_err(errno);
    }
    pthread_t *t = calloc((size_t)threads, sizeof *t);
    int started = 0;
    for (; !first_err && started < threads; started++)
        if (pthread_create(&t[started], NULL, lane, bufs[started])) break;
    for (int i = 0; i < started; i++) pthread_join(t[i], NULL);
    double joined = now() - t0; /* every request done (with -s fdatasync: every file synced too) */
    if (writing && !first_err && !strcmp(sync_mode, "syncfs") && syncfs(files[0].fd)) set_err(errno);
    for (int i = 0; i < nfiles; i++)
        if (files[i].fd > 0 && close(files[i].fd)) set_err(errno);
    double seconds = now() - t0;
    if (first_err) {
        fprintf(stderr, "probe: %s\n", strerror(first_err));
        return 1;
    }
    printf("{\"seconds\": %.6f, \"joined\": %.6f, \"bytes\": %llu, \"files\": %d, \"threads\": %d, \"block\": %zu, \"sync\": \"%s\"}\n",
           seconds, joined, (unsigned long long)total, nfiles, threads, block, writing ? sync_mode : "-");
    return 0;
}
