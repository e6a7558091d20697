"""Byte I/O, knowing nothing of the format: stores (a local directory, any fsspec URL), the C engine's
binding (crc32c, the file writer), and the one reader of byte ranges of local files (O_DIRECT for cold
ranges, a process-wide pool of reusable buffers, destination prefaulting) that plain reads, delta-chain
reads and the validator share.
"""
