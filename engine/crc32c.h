/* CRC-32C (Castagnoli), as used by the zarr v3 crc32c codec. */
#ifndef UCL_CRC32C_H
#define UCL_CRC32C_H
#include <stddef.h>
#include <stdint.h>

/* Continue a CRC-32C over buf[0:n]; start with crc = 0. Hardware (SSE4.2) when the CPU has it. */
uint32_t ucl_crc32c(uint32_t crc, const void *buf, size_t n);
/* The CRC-32C of A||B from crc(A), crc(B) and len(B): lets threads checksum pieces of a file in any
   order and combine them in file order. O(log len2). */
uint32_t ucl_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2);
/* 1 when the hardware path is in use. */
int ucl_crc32c_hw(void);

#endif
