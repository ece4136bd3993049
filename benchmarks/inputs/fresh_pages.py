"""A memory file's fresh pages: how to allocate them, and what a memory limit does when they do not fit.

The HTTP front receives a large infer body into a memory file through its mapping (client/input_buffers.py,
`InputBuffers.receive`). Two questions decided how:

1. Speed: filling a fresh file of `--mb` MB through its mapping faults each page in; one fallocate first allocates
   them all in one call (each is still faulted into the mapping); madvise(MADV_POPULATE_WRITE) allocates and maps
   them in one call; pwrite (what `_File.write` does past a file's written pages) takes the page-cache path.
   Timed here, each way on a new file, medians [min-max] over `--runs`.
2. A memory limit: in a memory cgroup of `--limit-mb` (cgroup v1 or v2, made below this process's; root and a
   memory controller needed), a child fills a 256 MiB file each way, or allocates a bytearray that big: does it
   see an error (ENOMEM, which a request could report) or is it killed?

    python benchmarks/inputs/fresh_pages.py [--mb 48] [--runs 9] [--limit-mb 96]
"""

from __future__ import annotations

import argparse
import mmap
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

WAYS = ("mapping", "fallocate+mapping", "populate+mapping", "pwrite")
MADV_POPULATE_WRITE = 23   # (Linux 5.14; Python's mmap module does not name it)


def fill(way: str, nbytes: int, data: bytes) -> None:
    """A new memory file of nbytes, filled with `data` (repeated) the given way."""
    fd = os.memfd_create("fresh-pages")
    try:
        os.ftruncate(fd, nbytes)
        if way == "pwrite":
            for at in range(0, nbytes, len(data)):
                os.pwrite(fd, data[:nbytes - at], at)
            return
        if way == "fallocate+mapping":
            os.posix_fallocate(fd, 0, nbytes)
        with mmap.mmap(fd, nbytes) as m:
            if way == "populate+mapping":   # the pages allocated and mapped writable in one call: no fault a page
                m.madvise(MADV_POPULATE_WRITE, 0, nbytes)
            for at in range(0, nbytes, len(data)):
                m[at:at + len(data)] = data[:nbytes - at]
    finally:
        os.close(fd)


def timed(way: str, nbytes: int, data: bytes) -> float:
    t0 = time.perf_counter()
    fill(way, nbytes, data)
    return time.perf_counter() - t0


def timed_again(way: str, nbytes: int, data: bytes) -> float:
    """A file filled once, its mapping kept (as a pool keeps a file), then filled again `way`: timed, the second."""
    fd = os.memfd_create("fresh-pages")
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as m:
            for at in range(0, nbytes, len(data)):
                m[at:at + len(data)] = data[:nbytes - at]
            t0 = time.perf_counter()
            for at in range(0, nbytes, len(data)):
                if way == "pwrite":
                    os.pwrite(fd, data[:nbytes - at], at)
                else:
                    m[at:at + len(data)] = data[:nbytes - at]
            return time.perf_counter() - t0
    finally:
        os.close(fd)


def under_limit(way: str, limit_bytes: int) -> str:
    """What a child in a memory cgroup of limit_bytes sees allocating 256 MiB `way` (or as a bytearray)."""
    from modelcache import memlimit
    cg = memlimit.ChildCgroup.make(f"mc-fresh-pages-{os.getpid()}", limit_bytes)
    if cg is None:
        return f"not run: {memlimit.ChildCgroup.why}"
    script = ("import sys; sys.path.insert(0, %r)\n"
              "from benchmarks.inputs.fresh_pages import fill\n"
              "way = %r\n"
              "try:\n"
              "    bytearray(256 << 20) if way == 'bytearray' else fill(way, 256 << 20, b'x' * (1 << 20))\n"
              "    print('filled')\n"
              "except (OSError, MemoryError) as e:\n"
              "    print(f'error: {e!r}')\n") % (str(Path(__file__).resolve().parents[2]), way)
    try:
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, preexec_fn=cg.enter,
                           timeout=120)
    finally:
        cg.remove()
    if r.returncode < 0:
        return f"killed by {signal.Signals(-r.returncode).name}"
    return r.stdout.strip() or f"exit {r.returncode}: {r.stderr.strip()[-200:]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=48)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--limit-mb", type=int, default=96)
    args = ap.parse_args(argv)
    from modelcache.measure import summary
    nbytes = int(args.mb * 1e6)
    data = os.urandom(1 << 20)
    times = {way: [] for way in WAYS}
    for _ in range(args.runs):   # alternated, so the machine's drift falls on every way alike
        for way in WAYS:
            times[way].append(timed(way, nbytes, data) * 1e3)
    again = {way: [] for way in ("mapping", "pwrite")}
    for _ in range(args.runs):
        for way in again:
            again[way].append(timed_again(way, nbytes, data) * 1e3)
    print(f"a fresh memory file of {args.mb:g} MB filled, {args.runs} runs alternated (ms, median [min-max]):")
    for way in WAYS:
        print(f"  {way:<20} {summary(times[way], '.1f'):>24}")
    print(f"the same file filled again, its mapping kept (ms):")
    for way in again:
        print(f"  {way:<20} {summary(again[way], '.1f'):>24}")
    print(f"256 MiB in a memory cgroup of {args.limit_mb} MiB:")
    for way in (*WAYS, "bytearray"):
        print(f"  {way:<20} {under_limit(way, args.limit_mb << 20)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
