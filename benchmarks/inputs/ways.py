"""How should a serve client hand a large input to the daemon? The ways there are, side by side, before choosing one.

Two processes over a Unix stream socket, as a client and the daemon's lane. The client makes a float32 tensor of
each size, hands it over each way in turn, and waits for the answer; the receiver makes it an array, reads every
byte of it once (as ORT's run would: np.sum) and answers. Timed: the client's round trip.

- `file`:   what serve mode did up to now: a file in /dev/shm, its path in the message; the receiver opens it as
            wire.tensors.read_io_file does (checks, then a copy into its own memory); the client unlinks it after.
            A client in another mount namespace (a container with its own /dev/shm) cannot use it at all.
- `memfd-map`:  a memory file (memfd_create), sealed against shrinking and writing, passed as a descriptor
            (SCM_RIGHTS) with the message; the receiver checks the seals and maps it read-only: no copy. Sealed,
            the mapping cannot SIGBUS (the reason read_io_file copies).
- `memfd-copy`: the same descriptor, unsealed, copied out with readv as `file` is.
- `memfd-reused`: `memfd-map`, but the client keeps its memory file (sealed against shrinking and growing, not
            writing) and writes the next input over the last: the pages are the tmpfs's already.
- `memfd-mapped`: `memfd-reused`, written through a shared mapping the client keeps with the file (a memcpy into
            pages that are there) rather than with pwrite (the kernel's page-cache path, page by page): what the
            client does since (client/input_buffers.py, as far as earlier writes allocated the pages).
- `inline`: the bytes in the message itself, read into a buffer of the exact size. That is the bare socket's cost:
            on the lane a message's body is also packed by msgpack, framed and unpacked, copies this leaves out.

Chosen: `memfd-reused` (client/input_buffers.py), later written as `memfd-mapped`. `inline` is cheaper still up to a few MB here, but only as a bare
socket; the lane's messages pack and unpack their bodies.

    python benchmarks/inputs/ways.py --rounds 5 --out benchmarks/inputs
"""

from __future__ import annotations

import argparse
import array
import fcntl
import json
import mmap
import os
import socket
import statistics
import struct
import subprocess
import sys
import time

import numpy as np

WAYS = ("file", "memfd-map", "memfd-copy", "memfd-reused", "memfd-mapped", "inline")
SIZES_MB = (0.3, 0.6, 4.8, 48.0)
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
HEAD = struct.Struct("<BQH")   # way, nbytes, path length (then, for `file`, the path; for `inline`, the bytes)


def write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def read_exact(fd: int, nbytes: int) -> np.ndarray:
    out = np.empty(nbytes, np.uint8)
    view, done = memoryview(out), 0
    while done < nbytes:
        n = os.preadv(fd, [view[done:]], done)   # (at offsets: a passed descriptor shares the writer's)
        if n == 0:
            raise EOFError
        done += n
    return out


def recv_exact(sock: socket.socket, nbytes: int) -> bytearray:
    buf = bytearray(nbytes)
    view, done = memoryview(buf), 0
    while done < nbytes:
        n = sock.recv_into(view[done:])
        if n == 0:
            raise EOFError
        done += n
    return buf


def receiver(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    while True:
        msg, ancdata, _, _ = sock.recvmsg(HEAD.size, socket.CMSG_SPACE(4))
        if not msg:
            return
        way, nbytes, path_len = HEAD.unpack_from(msg)
        fds = [f for level, kind, data in ancdata if kind == socket.SCM_RIGHTS for f in array.array("i", data)]
        if way == 0:
            path = recv_exact(sock, path_len).decode()
            f = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            os.fstat(f)
            arr = read_exact(f, nbytes)
            os.close(f)
        elif way == 1:
            f = fds[0]
            if not fcntl.fcntl(f, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK or os.fstat(f).st_size < nbytes:
                raise SystemExit("not sealed")
            m = mmap.mmap(f, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
            os.close(f)
            arr = np.frombuffer(m, np.uint8)
        elif way == 2:
            arr = read_exact(fds[0], nbytes)
            os.close(fds[0])
        else:
            arr = recv_exact(sock, nbytes)
            arr = np.frombuffer(arr, np.uint8)
        total = float(arr.view(np.float32).sum())   # every byte read once, as a model's first layer reads its input
        del arr
        if way == 1:
            m.close()
        sock.sendall(struct.pack("<d", total))


_reused: dict = {}   # nbytes -> the memory file `memfd-reused` writes into
_mapped: dict = {}   # nbytes -> (memory file, its writable mapping) that `memfd-mapped` writes into


def _reused_file(nbytes: int) -> int:
    f = os.memfd_create("modelcache-input", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(f, nbytes)
    fcntl.fcntl(f, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return f


def send_once(sock: socket.socket, way: str, tensor: np.ndarray, n: int) -> None:
    nbytes = tensor.nbytes
    if way == "file":
        path = f"/dev/shm/modelcache-io.ways.{os.getpid()}.{n}"
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
        write_all(f, tensor)
        os.close(f)
        try:
            sock.sendall(HEAD.pack(0, nbytes, len(path.encode())) + path.encode())
            recv_exact(sock, 8)
        finally:
            os.unlink(path)
    elif way in ("memfd-reused", "memfd-mapped"):
        if way == "memfd-reused":
            f = _reused.get(nbytes)
            if f is None:
                f = _reused[nbytes] = _reused_file(nbytes)
            view, done = memoryview(tensor).cast("B"), 0
            while done < nbytes:
                done += os.pwrite(f, view[done:], done)
        else:
            if nbytes not in _mapped:   # (the first write faults the pages in: a warm-up call, not timed)
                f = _reused_file(nbytes)
                _mapped[nbytes] = (f, mmap.mmap(f, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
            f, m = _mapped[nbytes]
            m[:] = memoryview(tensor).cast("B")
        sock.sendmsg([HEAD.pack(1, nbytes, 0)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [f]))])
        recv_exact(sock, 8)
    elif way in ("memfd-map", "memfd-copy"):
        f = os.memfd_create("modelcache-input", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            write_all(f, tensor)
            if way == "memfd-map":
                fcntl.fcntl(f, fcntl.F_ADD_SEALS, SEALS)
            sock.sendmsg([HEAD.pack(1 if way == "memfd-map" else 2, nbytes, 0)],
                         [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [f]))])
        finally:
            os.close(f)   # (the kernel holds it in flight; the receiver's copy is its own)
        recv_exact(sock, 8)
    else:
        sock.sendall(HEAD.pack(3, nbytes, 0))
        sock.sendall(memoryview(tensor).cast("B"))
        recv_exact(sock, 8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=0, help="calls per way, size and round (0: by size, ~0.5 s)")
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=list(SIZES_MB))
    ap.add_argument("--out", help="folder for report.txt and results.json")
    ap.add_argument("--receiver", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.receiver is not None:
        return receiver(args.receiver)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child = subprocess.Popen([sys.executable, __file__, "--receiver", str(theirs.fileno())], pass_fds=[theirs.fileno()])
    theirs.close()
    results = {}   # size -> way -> [median us per round]
    n = 0
    try:
        for size in args.sizes_mb:
            tensor = np.random.default_rng(0).standard_normal(int(size * 1e6) // 4).astype(np.float32)
            calls = args.calls or max(5, min(200, int(50 / size)))
            for r in range(args.rounds):
                order = WAYS[r % len(WAYS):] + WAYS[:r % len(WAYS)]   # rotated round by round
                for way in order:
                    times = []
                    for _ in range(calls + 2):
                        t0 = time.perf_counter()
                        send_once(ours, way, tensor, n)
                        times.append(time.perf_counter() - t0)
                        n += 1
                    results.setdefault(str(size), {}).setdefault(way, []).append(statistics.median(times[2:]) * 1e6)
    finally:
        ours.close()
        child.wait(10)
    lines = [f"$ python benchmarks/inputs/ways.py --rounds {args.rounds}",
             f"round trip, us: median over rounds [min-max] of each round's median; load average "
             f"{os.getloadavg()[0]:.1f} at the end", ""]
    lines.append(f"{'MB':>6}  " + "".join(f"{w:>22}" for w in WAYS) + "   per round: memfd-map / file, memfd-reused / file, "
                                                               "memfd-mapped / memfd-reused")
    for size, by_way in results.items():
        cells = "".join(f"{statistics.median(v):>10.0f} [{min(v):.0f}-{max(v):.0f}]".rjust(22) for v in by_way.values())
        ratios = []
        for way, base in (("memfd-map", "file"), ("memfd-reused", "file"), ("memfd-mapped", "memfd-reused")):
            r = [m / f for m, f in zip(by_way[way], by_way[base])]
            ratios.append(f"x{statistics.median(r):.2f} [{min(r):.2f}-{max(r):.2f}]")
        lines.append(f"{size:>6}  {cells}   {', '.join(ratios)}")
    report = "\n".join(lines)
    print(report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ways.txt"), "w") as f:
            f.write(report + "\n")
        with open(os.path.join(args.out, "ways.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
