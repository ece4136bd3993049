"""The I/O fault injector of the campaign (tests/test_io_faults.py): iofault.c, built here with the C compiler,
loaded into the daemon (and the packers it starts) by LD_PRELOAD, armed and read back through a shared file.

    faults = Injector.build(tmp_dir, prefixes=[repository, state_dir, shm_dir])   # None without a compiler
    env = {**os.environ, **faults.env}          # for the processes whose disk calls may fail
    faults.arm(nth=3, err=errno.EIO)            # the third matching call fails with EIO
    ... run one operation ...
    faults.disarm(); faults.fired, faults.what  # whether it was reached, and which call it was
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import shutil
import struct
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("iofault.c")
# The kinds of call a fault may hit (iofault.c's OP_*): every one that writes to a file system.
OPS = {"open": 1, "write": 2, "fsync": 4, "rename": 8, "unlink": 16, "mkdir": 32}
ALL = sum(OPS.values())
MAGIC = 0x10FA0175
_HEAD = struct.Struct("<IiiiIiii")     # magic, armed, nth, err, ops, count, fired, pad
_WHAT, _PREFIX, _PREFIXES = 512, 512, 6
SIZE = _HEAD.size + _WHAT + _PREFIX * _PREFIXES


def build(directory: Path) -> Path | None:
    """The compiled injector (built once per source text into `directory`); None where no C compiler is."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    so = Path(directory) / f"iofault-{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]}.so"
    if not so.exists():
        tmp = so.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(tmp), str(SOURCE), "-ldl"], check=True,
                       capture_output=True)
        os.replace(tmp, so)
    return so


class Injector:
    def __init__(self, library: Path, control: Path, prefixes: list):
        if len(prefixes) > _PREFIXES:
            raise ValueError(f"at most {_PREFIXES} directories")
        self.library, self.control = Path(library), Path(control)
        self.control.write_bytes(b"\0" * SIZE)
        fd = os.open(self.control, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        _HEAD.pack_into(self.map, 0, MAGIC, 0, 0, 0, 0, 0, 0, 0)
        for i, p in enumerate(prefixes):
            raw = os.path.realpath(p).rstrip("/").encode()
            assert len(raw) < _PREFIX, p
            at = _HEAD.size + _WHAT + i * _PREFIX
            self.map[at:at + len(raw) + 1] = raw + b"\0"

    @property
    def env(self) -> dict:
        """What a process needs in its environment for its calls to be counted and failed."""
        return {"LD_PRELOAD": str(self.library), "MODELCACHE_IOFAULT": str(self.control)}

    def arm(self, nth: int, err: int = errno.EIO, ops: int = ALL) -> None:
        """From now, the `nth` matching call fails with `err` (and only that one)."""
        _HEAD.pack_into(self.map, 0, MAGIC, 0, nth, err, ops, 0, 0, 0)
        self.map[_HEAD.size:_HEAD.size + _WHAT] = b"\0" * _WHAT
        struct.pack_into("<i", self.map, 4, 1)     # armed, last

    def disarm(self) -> None:
        struct.pack_into("<i", self.map, 4, 0)

    @property
    def count(self) -> int:
        return _HEAD.unpack_from(self.map, 0)[5]

    @property
    def fired(self) -> bool:
        return _HEAD.unpack_from(self.map, 0)[6] > 0

    @property
    def what(self) -> str:
        raw = self.map[_HEAD.size:_HEAD.size + _WHAT]
        return raw[:raw.index(b"\0")].decode(errors="replace")

    def close(self) -> None:
        self.map.close()
