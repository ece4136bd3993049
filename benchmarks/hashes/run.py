"""Hash benchmark: which fast hash promotion verifies weights with, measured on this machine.

    PYTHONPATH=. python benchmarks/hashes/run.py [--mib 512] [--runs 5] [--out DIR]

Each candidate hashes the same buffer of random bytes in /dev/shm (mapped, as promotion
reads a segment it has just written), once whole and once per 4 MiB chunk; sha256 (what
the manifest already holds per tensor) is the reference. Runs are interleaved so that
load from other processes hits every candidate alike.

Then the copy promotion does, from a file in the page cache into /dev/shm: sendfile alone
(promotion without verification) against `files.copy_hashed` (read, hash, write on a
second thread), with wall time and this process's CPU time for each.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import shutil
import sys
import time
from pathlib import Path

from modelcache.measure import save_results, summary

CHUNK = 4 << 20


def _candidates() -> dict:
    import blake3
    import xxhash
    return {
        "xxh3_64": lambda: xxhash.xxh3_64(),
        "xxh3_128": lambda: xxhash.xxh3_128(),
        "blake3 (1 thread)": lambda: blake3.blake3(),
        "blake3 (auto threads)": lambda: blake3.blake3(max_threads=blake3.blake3.AUTO),
        "sha256": lambda: hashlib.sha256(),
    }


def _gb_s(make, view: memoryview, chunked: bool) -> float:
    t = time.perf_counter()
    h = make()
    if chunked:
        for off in range(0, len(view), CHUNK):
            h.update(view[off:off + CHUNK])
    else:
        h.update(view)
    h.digest()
    return len(view) / 1e9 / (time.perf_counter() - t)


def _copy_runs(src: Path, size: int, runs: int) -> dict:
    """MB/s and CPU ms of copying `src` into /dev/shm, without and with hashing on the way."""
    from modelcache.store import integrity
    from modelcache.tiers.files import copy_hashed, copy_range

    dst = Path("/dev/shm") / f"modelcache-bench-copy-{os.getpid()}"
    ways = {"sendfile (unverified)": lambda s, d: copy_range(s, d, 0, 0, size),
            "copy_hashed (verified)": lambda s, d: copy_hashed(s, d, [(0, 0, size)], integrity.new_hasher)}
    out: dict = {}
    try:
        for _ in range(runs):
            for label, copy in ways.items():
                dst.unlink(missing_ok=True)
                s_fd, d_fd = os.open(src, os.O_RDONLY), os.open(dst, os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    os.ftruncate(d_fd, size)
                    cpu, t = time.process_time(), time.perf_counter()
                    copy(s_fd, d_fd)
                    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
                finally:
                    os.close(s_fd)
                    os.close(d_fd)
                out.setdefault(f"{label} MB/s", []).append(size / 1e6 / wall)
                out.setdefault(f"{label} CPU ms", []).append(cpu * 1e3)
    finally:
        dst.unlink(missing_ok=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/hashes/run.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", help="write results.json and report.txt here")
    args = ap.parse_args(argv)

    path = Path("/dev/shm") / f"modelcache-bench-hash-{os.getpid()}"
    size = args.mib << 20
    results: dict = {}
    try:
        with open(path, "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(1 << 20))
        with open(path, "rb") as f:
            mapping = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
        view = memoryview(mapping)
        candidates = _candidates()
        for _ in range(args.runs):
            for name, make in candidates.items():
                for chunked in (False, True):
                    label = f"{name}{' per 4 MiB' if chunked else ''}"
                    results.setdefault(label, []).append(_gb_s(make, view, chunked))
        view.release()
        mapping.close()
        import tempfile
        with tempfile.NamedTemporaryFile(prefix="modelcache-bench-copy-") as disk:  # on disk, read from page cache
            with open(path, "rb") as f:
                shutil.copyfileobj(f, disk, 1 << 22)
            disk.flush()
            copies = _copy_runs(Path(disk.name), size, args.runs)
    finally:
        path.unlink(missing_ok=True)
    lines = [f"hash throughput over {args.mib} MiB in /dev/shm, {args.runs} runs: median [min-max] GB/s"]
    lines += [f"  {label:<32} {summary(v):>24}" for label, v in results.items()]
    lines += [f"copy of {args.mib} MiB, page cache -> /dev/shm, {args.runs} runs: median [min-max]"]
    lines += [f"  {label:<32} {summary(v):>24}" for label, v in copies.items()]
    print("\n".join(lines))
    save_results(args.out, "hashes", argv, {"gb_s": results, "copy": copies},
                 lambda data, f: f.write("\n".join(lines) + "\n"),
                 command="PYTHONPATH=. python benchmarks/hashes/run.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
