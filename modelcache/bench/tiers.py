"""Tier benchmark: open latency per path, and promotion throughput next to `cp`.

    modelcache bench tiers [--model resnet50] [--big vgg16] [--runs 5] [--out DIR]

Open latency (the `open` request: what a client waits for before building its session):
  host hit     the model is resident in shared memory
  disk miss    evicted first: promoted from the repository
  remote miss  removed from the repository first: fetched from a remote store (HTTP on
               loopback here), verified, then promoted
Promotion throughput: `load` of the big model after an eviction (disk -> /dev/shm),
interleaved with `cp` of the same weights file into /dev/shm, in the same run; and the
same load by a second daemon over the same repository with verification off
(MODELCACHE_VERIFY_PROMOTION=0), alternating which goes first: what checking every
copied byte against its checksum costs. On a shared machine the wall-clock medians move with
other load, so the report adds the median of the per-run ratios (each pair measured back to
back) and the daemon's CPU seconds per promotion, which other load hardly changes.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..measure import managed_daemon, save_results, summary
from ..usage import Parser


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def main(argv=None) -> int:
    ap = Parser(prog="modelcache bench tiers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet50", help="model for open latency (default resnet50)")
    ap.add_argument("--big", default="vgg16", help="model for promotion throughput (default vgg16)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", help="write results.json and report.txt here")
    args = ap.parse_args(argv)

    from .. import zoo
    from ..client.connection import connect
    from ..store.packing import pack
    from ..tiers.remote import publish

    with tempfile.TemporaryDirectory(prefix="modelcache-tiers-") as tmp:
        tmp = Path(tmp)
        store = tmp / "store"
        for name in dict.fromkeys([args.model, args.big]):
            src = tmp / f"{name}.onnx"
            zoo.save(zoo.build(name), str(src))
            print(f"packing {name} into the remote store ...", file=sys.stderr, flush=True)
            pack(str(src), store, name, 1)
        publish(store)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(store)))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        os.environ["MODELCACHE_REMOTE"] = url  # the private daemon inherits it
        socket = f"ipc://{tmp}/daemon.sock"
        lat = {"host hit": [], "disk miss": [], "remote miss": []}
        promote_mbs, unverified_mbs, cp_mbs = [], [], []
        cpu_s = {"verified": [], "unverified": []}
        try:
            with managed_daemon(socket, str(tmp / "repo")), connect(socket) as c, contextlib.ExitStack() as more:
                def open_close():
                    c.release(c.open(args.model).lease_id)

                for r in range(args.runs):
                    if any(m["name"] == args.model for m in c.list()):
                        c.remove(args.model, 1)
                    lat["remote miss"].append(_timed(open_close))
                    lat["host hit"].append(_timed(open_close))
                    c.evict(args.model)
                    lat["disk miss"].append(_timed(open_close))
                c.load(args.big)  # fetched once; from here on it is a disk -> host promotion
                big = next(m for m in c.list() if m["name"] == args.big)
                blob = tmp / "repo" / args.big / "1" / "weights.bin"
                size_mb = blob.stat().st_size / 1e6
                os.environ["MODELCACHE_VERIFY_PROMOTION"] = "0"   # the second daemon inherits it
                try:
                    unverified = more.enter_context(managed_daemon(f"ipc://{tmp}/unverified.sock", str(tmp / "repo")))
                finally:
                    del os.environ["MODELCACHE_VERIFY_PROMOTION"]
                u = more.enter_context(connect(unverified))
                u.load(args.big)

                import psutil
                procs = {id(c): psutil.Process(c.stats().pid), id(u): psutil.Process(u.stats().pid)}

                def promote_mb_s(client, cpu_out) -> float:
                    client.evict(args.big)
                    before = sum(procs[id(client)].cpu_times()[:2])
                    mb_s = big["bytes"] / 1e6 / (_timed(lambda: client.load(args.big)) / 1e3)
                    cpu_out.append(sum(procs[id(client)].cpu_times()[:2]) - before)
                    return mb_s

                for r in range(args.runs):
                    pairs = ((c, promote_mbs, cpu_s["verified"]), (u, unverified_mbs, cpu_s["unverified"]))
                    for client, out, cpu_out in pairs[::1 if r % 2 == 0 else -1]:
                        out.append(promote_mb_s(client, cpu_out))
                    dst = Path("/dev/shm") / f"modelcache-bench-cp-{os.getpid()}"
                    try:
                        cp_ms = _timed(lambda: subprocess.run(["cp", str(blob), str(dst)], check=True))
                    finally:
                        dst.unlink(missing_ok=True)
                    cp_mbs.append(size_mb / (cp_ms / 1e3))
        finally:
            server.shutdown()
            server.server_close()

    lines = [f"open latency of {args.model} (the open request), {args.runs} runs: median [min-max] ms"]
    lines += [f"  {path:<12} {summary(v):>26}" for path, v in lat.items()]
    ratio = statistics.median(promote_mbs) / statistics.median(cp_mbs)
    lines += [f"promotion of {args.big} disk -> host: {summary(promote_mbs)} MB/s; "
              f"cp of its weights into /dev/shm: {summary(cp_mbs)} MB/s; promotion = {ratio:.2f}x cp"]
    verified_ratio = statistics.median(promote_mbs) / statistics.median(unverified_mbs)
    paired = [v / n for v, n in zip(promote_mbs, unverified_mbs)]
    lines += [f"  the same promotion with verification off: {summary(unverified_mbs)} MB/s; "
              f"verified = {verified_ratio:.2f}x unverified (ratio of medians), "
              f"{statistics.median(paired):.2f}x [{min(paired):.2f}-{max(paired):.2f}] (per-run pairs)",
              f"  daemon CPU per promotion: verified {summary([1e3 * x for x in cpu_s['verified']])} ms, "
              f"unverified {summary([1e3 * x for x in cpu_s['unverified']])} ms"]
    print("\n".join(lines))
    save_results(args.out, "tiers", argv, {"open_ms": lat, "promote_mb_s": promote_mbs,
                                           "promote_unverified_mb_s": unverified_mbs, "cp_mb_s": cp_mbs,
                                           "promote_cpu_s": cpu_s},
                 lambda data, f: f.write("\n".join(lines) + "\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
