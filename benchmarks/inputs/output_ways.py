"""How a large output gets into a file the client lent, and out of it again (wire/lent_outputs.py).

The daemon writes an output into a memory file whose pages the client allocated (and reused: the pool keeps them).
Three ways to write, each into the same allocated file:
  pwrite      one call, the kernel's page-cache path (what LentFiles.place does)
  mapping     a fresh shared mapping of the file, then a copy into it (a write fault per page)
  populated   the same with MAP_POPULATE (the pages mapped in one call, then the copy)
Two ways for the client to read it, summing the array (a use of every byte):
  mapping     a fresh read-only mapping, the array a view of it (what Passing.decode does)
  pread       a copy into fresh memory first
and, for scale, `inline`: the bytes copied once into a fresh bytes object (the least an inline answer costs the
client; it paid about three such copies), and `sum only` (the array summed where it already is).

Medians [min-max] of `--runs` runs each, in ms.

    python benchmarks/inputs/output_ways.py [--mb 0.6 4.8 48] [--runs 30]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time

import numpy as np


def timed(fn, runs: int) -> str:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return f"{statistics.median(times):.2f} [{min(times):.2f}-{max(times):.2f}]"


def measure(mb: float, runs: int) -> list[tuple[str, str]]:
    nbytes = int(mb * 1e6) // 4 * 4
    a = np.random.default_rng(0).random(nbytes // 4, dtype=np.float32)
    data = memoryview(a).cast("B")
    fd = os.memfd_create("output-ways")
    try:
        os.ftruncate(fd, 1 << (nbytes - 1).bit_length())
        os.posix_fallocate(fd, 0, nbytes)

        def pwrite():
            done = 0
            while done < nbytes:
                done += os.pwrite(fd, data[done:], done)

        def mapped(flags):
            def write():
                m = mmap.mmap(fd, nbytes, mmap.MAP_SHARED | flags, mmap.PROT_READ | mmap.PROT_WRITE)
                m[:nbytes] = data
                m.close()
            return write

        def read_mapping():
            m = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
            y = np.frombuffer(m, np.float32)
            float(y.sum())
            del y
            m.close()

        def read_copy():
            b = bytearray(nbytes)
            os.preadv(fd, [b], 0)
            float(np.frombuffer(b, np.float32).sum())

        def inline():
            float(np.frombuffer(bytes(data), np.float32).sum())

        pwrite()
        return [("daemon: pwrite", timed(pwrite, runs)),
                ("daemon: mapping", timed(mapped(0), runs)),
                ("daemon: populated", timed(mapped(mmap.MAP_POPULATE), runs)),
                ("client: mapping + sum", timed(read_mapping, runs)),
                ("client: pread + sum", timed(read_copy, runs)),
                ("client: inline (one copy) + sum", timed(inline, runs)),
                ("client: sum only", timed(lambda: float(a.sum()), runs))]
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, nargs="+", default=[0.6, 4.8, 48])
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()
    print(f"$ python benchmarks/inputs/output_ways.py --mb {' '.join(f'{m:g}' for m in args.mb)} --runs {args.runs}")
    print(f"(load average {os.getloadavg()[0]:.2f} at the start; ms, median [min-max] of {args.runs} runs)")
    for mb in args.mb:
        print(f"{mb:g} MB:")
        for way, figure in measure(mb, args.runs):
            print(f"  {way:34} {figure}")


if __name__ == "__main__":
    main()
