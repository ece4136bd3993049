"""A client in another container: session ready and first run, against one beside the daemon and ORT's own mmap.

    PYTHONPATH=. python benchmarks/containers/run.py [--models squeezenet resnet50] [--runs 7] [--out DIR]

Needs root and unshare(1). Every sample is a fresh process (`modelcache.demo`'s child: imports, open, first
run on sample inputs), the modes alternated round by round while a first client holds the model resident:
  here            modelcache.InferenceSession in the daemon's mount namespace
  container       the same, in a new mount namespace whose /dev/shm and repository are empty tmpfs mounts:
                  only the socket's directory (and the .onnx the child reads its sample inputs from) is in
                  view, so the lease's files can only come as descriptors (docs/operations.md)
  container-mmap  ORT's own mmap of the model's .ort, in the same kind of namespace, the .ort in view: what a
                  container with its model baked in runs instead
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from modelcache.measure import (compile_bytecode, ensure_models, managed_daemon, ort_mmap_model, save_results,
                                summary)

MODES = ("here", "container", "container-mmap")


def child(socket: str, repository: str, mode: str, name: str, src: str) -> dict:
    command = [sys.executable, "-m", "modelcache.demo", "--child", "open",
               "ort-mmap" if mode == "container-mmap" else "modelcache", name, src]
    if mode != "here":
        hide = f"mount -t tmpfs none /dev/shm && mount -t tmpfs none {repository}"
        command = ["unshare", "-m", "sh", "-c", f'{hide} && exec "$@"', "sh", *command]
    out = subprocess.run(command, env={**os.environ, "MODELCACHE_SOCKET": socket}, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} child failed: {out.stderr[-2000:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "mode": mode}


def measure(socket: str, repository: str, paths: dict, runs: int) -> dict:
    import modelcache
    from modelcache import zoo

    samples = []
    for name, src in paths.items():
        ort_mmap_model(src)
        holder = modelcache.InferenceSession(name, socket=socket)   # resident, its pages touched
        holder.run(None, zoo.sample_inputs(src))
        for _ in range(runs):
            for mode in MODES:
                samples.append(child(socket, repository, mode, name, src))
        holder.close()
    return {"samples": samples}


def report(results: dict, out=sys.stdout) -> None:
    samples = results["samples"]
    print(f"{'model':<12} {'mode':<15} {'ready ms':>22} {'first run ms':>22} {'USS MiB':>20}", file=out)
    for name in dict.fromkeys(s["model"] for s in samples):
        ready = {}
        for mode in MODES:
            rows = [s for s in samples if s["model"] == name and s["mode"] == mode]
            ready[mode] = statistics.median(r["ready_ms"] for r in rows)
            print(f"{name:<12} {mode:<15} {summary([r['ready_ms'] for r in rows]):>22} "
                  f"{summary([r['first_run_ms'] for r in rows]):>22} {summary([r['uss_mib'] for r in rows]):>20}",
                  file=out)
        print(f"{name:<12} -> ready in a container {ready['container'] / ready['here']:.2f}x beside the daemon, "
              f"{ready['container'] / ready['container-mmap']:.2f}x ORT's mmap there", file=out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["squeezenet", "resnet50"])
    ap.add_argument("--runs", type=int, default=7, help="fresh processes per mode and model (default 7)")
    ap.add_argument("--out", help="write every sample to OUT/results.json and the table to OUT/report.txt")
    args = ap.parse_args(argv)
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        print("needs root and unshare(1): a container's mount namespace", file=sys.stderr)
        return 2
    compile_bytecode()
    with tempfile.TemporaryDirectory(prefix="modelcache-containers-") as tmp:
        socket, repository = f"ipc://{tmp}/daemon.sock", f"{tmp}/repo"
        with managed_daemon(socket, repository):
            paths = ensure_models(socket, args.models, Path(tmp) / "zoo")
            results = measure(socket, repository, paths, args.runs)
    report(results)
    save_results(args.out, "containers", argv, results, report, command="PYTHONPATH=. python benchmarks/containers/run.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
