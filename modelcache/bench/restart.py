"""Warm restart: SIGKILL the daemon under clients holding sessions, start a new one on the same
directories, and time the first open of the model (a host hit when the tier was re-adopted).

    modelcache bench restart [--model resnet50] [--clients 3] [--runs 5]

Per run: kill -9, start, then the first `open` from a fresh connection (ms, with its hit flag)
and the re-adoption's check of the tier (the daemon's log: MiB checked, seconds). One cold run
for comparison: the dead tier deleted before the start, so the first open promotes from disk.
The clients' sessions stay open throughout; at the end each one runs once more on the mapping
it opened before the first kill, and reports whether its client reconnected on its own.
"""

from __future__ import annotations

import argparse
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..measure import summary
from ..usage import Parser

# A client process: open a drop-in session, say so, wait; on a line from us run once and report.
HOLDER = """
import sys, modelcache
from modelcache import zoo
from modelcache.client import connection
sess = modelcache.InferenceSession(sys.argv[1])
feeds = zoo.sample_inputs(sys.argv[2])
sess.run(None, feeds)
print("OPEN", flush=True)
sys.stdin.readline()
out = sess.run(None, feeds)[0]
print("RAN", out.shape, "reconnected:", connection.shared_client().stats().pid != int(sys.argv[3]), flush=True)
"""


def _start(env: dict, log) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "modelcache.cli", "daemon"], env=env,
                            stdout=subprocess.PIPE, stderr=log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 0.5)[0] and proc.stdout.readline().startswith(b"READY"):
            return proc
    proc.kill()
    raise RuntimeError("the benchmark's daemon did not start")


def main(argv=None) -> int:
    ap = Parser(prog="modelcache bench restart", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)

    from .. import zoo
    from ..client.connection import connect

    shm = Path(tempfile.mkdtemp(prefix="modelcache-bench-restart-", dir="/dev/shm"))
    with tempfile.TemporaryDirectory(prefix="modelcache-restart-") as tmp:
        tmp = Path(tmp)
        socket = f"ipc://{tmp}/daemon.sock"
        env = {**os.environ, "MODELCACHE_SOCKET": socket, "MODELCACHE_REPOSITORY": str(tmp / "repo"),
               "MODELCACHE_SHM_DIR": str(shm), "MODELCACHE_CONFIG": "", "MODELCACHE_LOG_LEVEL": "info"}
        log_path = tmp / "daemon.log"
        log = open(log_path, "ab")
        src = tmp / f"{args.model}.onnx"
        zoo.save(zoo.build(args.model), str(src))
        daemon = _start(env, log)
        holders = []
        warm_ms, hits, checks = [], [], []
        try:
            with connect(socket, timeout_s=600) as c:
                print(f"adding {args.model} ...", file=sys.stderr, flush=True)
                c.add(str(src), args.model)
                first_pid = c.stats().pid
            for _ in range(args.clients):
                h = subprocess.Popen([sys.executable, "-c", HOLDER, args.model, str(src), str(first_pid)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                assert h.stdout.readline().startswith("OPEN")
                holders.append(h)

            def restart(cold: bool) -> float:
                nonlocal daemon
                tier = shm / f"modelcache.{os.getuid()}.{daemon.pid}"
                daemon.kill()
                daemon.wait()
                if cold:
                    shutil.rmtree(tier)
                daemon = _start(env, log)
                with connect(socket) as c:
                    t0 = time.perf_counter()
                    lease = c.open(args.model)
                    ms = (time.perf_counter() - t0) * 1000
                    c.release(lease.lease_id)
                if not cold:
                    hits.append(lease.hit)
                return ms

            for _ in range(args.runs):
                warm_ms.append(restart(cold=False))
                log.flush()
                checks.append(re.findall(r"re-adopted \d+ models \(([\d.]+) MiB checked in ([\d.]+) s\)",
                                         log_path.read_text())[-1])
            cold_ms = restart(cold=True)
            # Each client: its session opened before the first kill runs, and its client came back alone.
            time.sleep(3)       # at most one heartbeat backoff (2 s) for the last restart
            reports = []
            for h in holders:
                h.stdin.write("go\n")
                h.stdin.flush()
                reports.append(h.stdout.readline().strip())
                h.wait(60)
        finally:
            for h in holders:
                if h.poll() is None:
                    h.kill()
            if daemon.poll() is None:
                daemon.terminate()
                daemon.wait(60)
            log.close()
            shutil.rmtree(shm, ignore_errors=True)
    print(f"{args.model}, {args.clients} clients holding sessions, {args.runs} SIGKILL + restart runs")
    print(f"first open after restart (re-adopted): {summary(warm_ms)} ms, host hit in {sum(hits)}/{len(hits)} runs")
    print(f"first open after restart (tier deleted, cold): {cold_ms:.1f} ms")
    check_ms = summary([float(s) * 1000 for _, s in checks])
    print(f"re-adoption check: {check_ms} ms for {checks[0][0]} MiB (per tensor: xxh3, or sha256 for versions packed before file checksums)")
    for r in reports:
        print(f"client: {r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
