"""Copying byte ranges between files, kernel to kernel: the host tier's promotion and the simulated GPUs'."""

from __future__ import annotations

import os


def copy_range(src_fd: int, dst_fd: int, src_off: int, dst_off: int, nbytes: int) -> None:
    """sendfile(2): no Python buffers; the output position is set by seeking."""
    os.lseek(dst_fd, dst_off, os.SEEK_SET)
    while nbytes > 0:
        sent = os.sendfile(dst_fd, src_fd, src_off, min(nbytes, 1 << 30))
        if sent == 0:
            raise OSError(f"unexpected end of the source file at offset {src_off}")
        src_off += sent
        nbytes -= sent
