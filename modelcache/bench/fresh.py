"""Fresh processes timed from exec, as the cold-start benchmarks (CPU and CUDA forms) start them."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time


def spawn(mode: str, name: str, src: str, tuned_dir: str, socket: str, hold: bool = False, *,
          child: str) -> subprocess.Popen:
    """A fresh process of the `child` script (coldstart_child.py, or coldstart_cuda_child.py), timed from now."""
    env = {**os.environ, "MODELCACHE_SOCKET": socket}
    if hold:
        env["HOLD"] = "1"
    return subprocess.Popen([sys.executable, child, mode, name, src, tuned_dir, str(time.monotonic_ns())],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@contextlib.contextmanager
def holding(procs: list):
    """Clients started with hold=True: wait until each has its session, and let them all go on exit."""
    try:
        for p in procs:
            if not p.stdout.readline():
                raise RuntimeError(f"memory client failed: {p.stderr.read()[-1500:]}")
        yield procs
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            p.wait(60)


def sample(mode, name, src, tuned_dir, socket, *, child: str) -> dict:
    """One fresh `child` process run to its end: the JSON it prints last."""
    proc = spawn(mode, name, src, tuned_dir, socket, child=child)
    out, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} {name} failed: {err[-1500:]}")
    return json.loads(out.strip().splitlines()[-1])
