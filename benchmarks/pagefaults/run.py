"""What mapping the host tier's pages costs a fresh client: first touch of a shared file, per directory.

    PYTHONPATH=. python benchmarks/pagefaults/run.py [--mib 512] [--runs 5] [--dirs /dev/shm /mnt/modelcache-huge]

A client maps a model's segment and ORT reads every weight on the first run, so each 4 KiB page
of the segment is mapped into the client on that run: a page fault (or part of one, with the
kernel's fault-around) per page. This writes a file of --mib MiB in each directory, then in
fresh mappings times the first read of every page and a second read (the pages then mapped).
A tmpfs mounted with `huge=within_size` (or `always`) maps 2 MiB at a time; point the daemon's
`shm_dir` at one to give clients those mappings (README, "Known limits").
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time


def first_and_second_touch(path: str) -> tuple[float, float]:
    import numpy as np
    fd = os.open(path, os.O_RDONLY)
    try:
        m = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    pages = np.frombuffer(m, dtype=np.uint8)[::mmap.PAGESIZE]   # one byte of each page
    t0 = time.perf_counter()
    int(pages.sum())
    t1 = time.perf_counter()
    int(pages.sum())
    t2 = time.perf_counter()
    del pages
    m.close()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/pagefaults/run.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512, help="file size (VGG16's weights: 528 MiB)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dirs", nargs="+", default=["/dev/shm"], help="directories on the file systems to compare")
    args = ap.parse_args(argv)
    paths = [os.path.join(d, f"modelcache-pagefaults-{os.getpid()}") for d in args.dirs]
    try:
        for p in paths:
            with open(p, "wb") as f:
                for _ in range(args.mib):
                    f.write(os.urandom(1 << 20))
        times: dict[str, list] = {p: [] for p in paths}
        for _ in range(args.runs):   # interleaved, so machine drift hits every directory alike
            for p in paths:
                times[p].append(first_and_second_touch(p))
        pages = (args.mib << 20) // mmap.PAGESIZE
        print(f"{'directory':<28} {'first touch ms':>22} {'us/page':>8} {'second touch ms':>16}")
        for d, p in zip(args.dirs, paths):
            first = [t[0] for t in times[p]]
            second = [t[1] for t in times[p]]
            print(f"{d:<28} {statistics.median(first):>10.1f} [{min(first):.1f}-{max(first):.1f}]"
                  f" {statistics.median(first) * 1e3 / pages:>8.2f} {statistics.median(second):>16.1f}")
    finally:
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
