"""Large outputs written into memory files the client lent with its request, instead of sent through the socket.

Inline, a large output was copied four times: msgpack packed it into the daemon's reply, the kernel carried it, the
client's lane gathered it out of its chunks, and msgpack copied it once more into bytes. `benchmarks/inputs`
(`--neg-mb`, y = -x) put a 4.8 MB output at 6.8 ms of the daemon's CPU and about 10 ms of the client's.

So a lane client lends a memory file with its Infer (client/input_buffers.py, `Passing.lend`): the message's last
`lent_fds` descriptors. The client has allocated the file's pages itself (fallocate), because a memory limit
charges a tmpfs page to whoever allocated it: the output's memory is the client's, as an inline answer's bytes were.
The daemon pwrites each output over INLINE_MAX_BYTES into the first lent file with room within its allocated bytes,
at a BODY_ALIGN boundary, and answers {"lent_at": [index among the lent files, offset]}. An output with no room
(the client's guess of the size was short, or it lent nothing) goes inline as before. The client maps the file
read-only and returns arrays over the mapping: nothing copied on its side at all.

pwrite rather than a mapping in the daemon: no page faults to take, no mapping to outlive the request, and no
SIGBUS to fear from a file that changes under it. `python benchmarks/inputs/output_ways.py` (output_ways.txt)
timed the daemon's copy of a 4.8 MB output into a lent file's allocated pages: pwrite 0.7 ms, a fresh shared
mapping 3.3 ms (a write fault per page), the mapping populated first 1.1 ms.
"""

from __future__ import annotations

import fcntl
import os
import stat

from ..errors import InputError

BODY_ALIGN = 64   # where an output starts in a lent file: a multiple of this (a cache line, and any dtype's alignment)
# A lent file must not grow (the daemon's pwrite cannot allocate past what the client did) and must take writes.
_GROW = fcntl.F_SEAL_GROW
_NO_WRITES = fcntl.F_SEAL_WRITE | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)


class LentFiles:
    """The memory files one request lent for its outputs (the daemon's side): `place(bytes)` writes an output into
    the first with room. Owns the descriptors: `close()` (or the object's end) closes them."""
    __slots__ = ("_files", "__weakref__")

    def __init__(self, fds: list):
        """Takes `fds` (closed here if one is refused: InputError, saying what a lent file must be)."""
        self._files: list[list] = []    # [fd, bytes it may take, bytes used] each
        try:
            for i, fd in enumerate(fds):
                self._files.append([fd, _capacity(i, fd), 0])
        except BaseException:
            for fd in fds:
                os.close(fd)
            self._files = []
            raise

    def place(self, data: memoryview) -> tuple[int, int] | None:
        """Write `data` (bytes) into the first lent file with room: (its index, the offset), or None (no room; a
        write that failed: the caller sends it inline)."""
        n = len(data)
        for index, entry in enumerate(self._files):
            fd, capacity, used = entry
            offset = -(-used // BODY_ALIGN) * BODY_ALIGN
            if offset + n > capacity:
                continue
            try:
                done = 0
                while done < n:
                    done += os.pwrite(fd, data[done:], offset + done)
            except OSError:   # (EIO; EPERM: sealed since): this one goes inline, and nothing more goes here
                entry[1] = 0
                return None
            entry[2] = offset + n
            return index, offset
        return None

    def close(self) -> None:
        files, self._files = self._files, []
        for fd, _, _ in files:
            os.close(fd)

    def __del__(self):
        self.close()

    def __len__(self) -> int:
        return len(self._files)


def _capacity(index: int, fd: int) -> int:
    """How many bytes of lent file `index` the daemon may write: its allocated bytes (st_blocks: a write into a hole
    would allocate a page charged to the daemon) within its size. InputError unless it is a memory file sealed
    against growing, open for writing, and not sealed against writes."""
    try:
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS) if stat.S_ISREG(st.st_mode) else 0
        writable = (fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE) in (os.O_RDWR, os.O_WRONLY)
    except OSError:   # (EINVAL: a file system without seals)
        seals, writable = 0, False
    if not seals & _GROW or seals & _NO_WRITES or not writable:
        raise InputError(f"lent descriptor {index} is not a writable memory file sealed against growing (memfd_create "
                         "with MFD_ALLOW_SEALING, F_ADD_SEALS F_SEAL_GROW, no write seal): the daemon writes outputs "
                         "into a lent file only within the pages its owner allocated")
    return min(st.st_size, st.st_blocks * 512)
