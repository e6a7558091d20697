/* The bulk read engine: segments of shard files read with O_DIRECT on C threads, every inner chunk's
   crc32c checked against the one stored after it, the checked bytes copied to their destinations, all
   without the GIL. The fast path of a bulk read (load, load_into); anything it cannot vouch for is
   reported per segment, and the caller reads that segment again its own way, which names the problem. */
#ifndef UCL_READER_H
#define UCL_READER_H
#include <stddef.h>
#include <stdint.h>

/* One segment: adjacent chunks of one file, and the bytes that must follow them (a predicted index). */
typedef struct {
    int64_t fd;        /* opened O_RDONLY | O_DIRECT */
    uint64_t offset;   /* file offset of the first chunk */
    uint64_t length;   /* the chunks' bytes, each with its 4-byte crc32c */
    uint64_t tail_off; /* into the tails buffer */
    uint64_t tail_len; /* 0: nothing to compare after the chunks */
    uint64_t first;    /* index of the first chunk in the chunk table */
    uint64_t nchunks;
} ucl_rseg;

/* One inner chunk of a segment: where it lies in it and where its bytes go. */
typedef struct {
    uint64_t off;    /* from the segment's offset */
    uint64_t nbytes; /* with its crc32c */
    uint64_t dst;    /* address of nbytes - 4 destination bytes */
} ucl_rchunk;

enum {
    UCL_READ_OK = 0,
    UCL_READ_SHORT = 1, /* the file ended before the segment (and its tail) */
    UCL_READ_TAIL = 2,  /* the bytes after the chunks are not the expected ones */
    UCL_READ_CRC = 3,   /* a chunk's crc32c differs from the one stored after it */
    UCL_READ_NOMEM = 4, /* a span larger than buf_len (ucl._engine.read_segments refuses such tables) */
    UCL_READ_IO = 5,    /* a read failed (the caller's own read of the segment names the error) */
};

/* Reads every segment on `nbufs` threads, one per buffer (4 KiB-aligned, buf_len bytes each, at least
   the largest segment's aligned span: the caller's, so that warm pages are reused), in table order,
   each thread taking the next. Writes each segment's status, and each chunk's stored crc32c
   (its little-endian value) to crcs. A chunk is copied only after its check passed; a failed segment's
   destinations may hold some of its checked chunks. */
void ucl_read_segments(const ucl_rseg *segs, size_t nseg, const ucl_rchunk *chunks, const uint8_t *tails,
                       int32_t *status, uint32_t *crcs, char *const *bufs, int nbufs,
                       size_t buf_len);

/* The aligned span a segment needs in a buffer. */
uint64_t ucl_read_span(const ucl_rseg *s);

#endif
