/* Delta chunk codec (spec/delta.md §5): one inner chunk of a delta step, as
       mode byte || zstd stream of the byte-plane shuffle of (values | new XOR base | new - base).
   Pure functions on memory: no I/O, no Python, safe to call from any thread. Each thread keeps its zstd
   contexts and two grow-only scratch buffers (each at most 64 MiB) between calls, freed when the thread
   exits or calls ucl_delta_thread_release(). The Python binding (ucl._delta) is at the end of delta.c, compiled only with
   UCL_DELTA_PYTHON defined. */
#ifndef UCL_DELTA_H
#define UCL_DELTA_H
#include <stddef.h>
#include <stdint.h>

/* Payload modes (first byte). */
enum { UCL_DELTA_MODE_FULL = 0, UCL_DELTA_MODE_XOR = 1, UCL_DELTA_MODE_SUB = 2 };

/* Errors (negative return values). */
enum {
    UCL_DELTA_E_ARG = -1,       /* word not 1/2/4/8, nbytes not a multiple of word, out too small */
    UCL_DELTA_E_NOMEM = -2,     /* malloc or a zstd context failed */
    UCL_DELTA_E_EMPTY = -3,     /* payload of zero bytes */
    UCL_DELTA_E_MODE = -4,      /* unknown mode byte */
    UCL_DELTA_E_NOBASE = -5,    /* a delta payload but no base given */
    UCL_DELTA_E_FRAME = -6,     /* not a zstd frame, a dictionary or skippable frame, no content size */
    UCL_DELTA_E_ZSTD = -7,      /* zstd failed to decode a frame (corrupt or truncated) */
    UCL_DELTA_E_SIZE = -8,      /* the frames decode to more or fewer bytes than the chunk holds */
};

/* The largest payload ucl_delta_encode writes for a chunk of nbytes with words of `word` bytes. */
size_t ucl_delta_bound(size_t nbytes, int word);

/* Encode `nbytes` of new values against `base` (NULL: no base, full values only) with words of `word`
   bytes (1, 2, 4 or 8) and delta encoding `encoding` (UCL_DELTA_MODE_XOR or _SUB). Writes whichever of
   the delta and the full payload is (estimated, and when close measured) smaller into out[0:return].
   Returns the payload length (> 0), 0 when new and base are identical bit for bit (store nothing), or a
   negative UCL_DELTA_E_*. `level` is the zstd level for planes with long runs (1 is a good default).
   scratch: NULL (allocated per call) or nbytes of memory the caller reuses between calls (a thread's). */
int64_t ucl_delta_encode(const void *new_, const void *base, size_t nbytes, int word, int encoding, int level,
                         void *out, size_t out_cap, void *scratch);

/* Decode a payload into out[0:nbytes] (words of `word` bytes), using base[0:nbytes] for delta modes.
   base may alias out (in-place update of the parent's values). Returns 0 or a negative UCL_DELTA_E_*;
   on error out holds unspecified bytes. The mode byte is returned in *mode when mode is not NULL.
   scratch: NULL (allocated per call) or nbytes of memory the caller reuses; it must not overlap out. */
int ucl_delta_decode(const void *payload, size_t len, const void *base, void *out, size_t nbytes, int word,
                     int *mode, void *scratch);

/* The two halves of ucl_delta_decode, for readers that rebuild a chunk through a chain of payloads:
   ucl_delta_unpack checks a payload exactly as ucl_delta_decode does (same errors, except that it needs no
   base) and decodes its frames into planes[0:nbytes] (the byte-plane shuffle S of spec/delta.md §5.2),
   or, to share the work of one payload among `nparts` threads, only the frames whose index is `part`
   modulo `nparts`: each call returns the error of the headers and sizes and sets *failed when one of its
   frames does not decode; the payload's error is then UCL_DELTA_E_ZSTD when any call failed, else that
   (common) return value;
   ucl_delta_apply then rebuilds words [start, start + count) of out from k unpacked payloads, oldest
   first: out = base op_0 D_0 op_1 D_1 ... (op_j: the mode of payload j; a mode-0 payload replaces what
   precedes it; base is needed unless modes[0] is 0 and may alias out). Both are safe to run on several
   threads at once, apply on disjoint word ranges of the same out. Returns 0 or a negative UCL_DELTA_E_*. */
int ucl_delta_unpack(const void *payload, size_t len, void *planes, size_t nbytes, int word, int part, int nparts,
                     int *mode, int *failed);
int ucl_delta_apply(const void *const *planes, const int *modes, int k, const void *base, void *out, size_t nbytes,
                    int word, size_t start, size_t count);

/* Byte-plane shuffle primitives (exposed for tests and the reference cross-check). */
void ucl_delta_shuffle(const void *src, void *dst, size_t nbytes, int word);
void ucl_delta_unshuffle(const void *src, void *dst, size_t nbytes, int word);

/* Free the calling thread's cached zstd contexts and scratch buffers (they come back on next use). */
void ucl_delta_thread_release(void);

/* Version of the zstd library in use (e.g. 10504). */
unsigned ucl_delta_zstd_version(void);

#endif
