"""Which ORT binding shares the daemon's weights best? Measures the candidates side by side.

    PYTHONPATH=. python benchmarks/binding/run.py [--models resnet50 vgg16] [--runs 3]

Each candidate builds a session in a fresh process and reports: session create time,
private memory (USS) once ready and after a warm run, and the median warm run time.
Candidates (see ../shared/DESIGN.md):
  ort             plain InferenceSession on the original .onnx (the baseline)
  external-mmap   packed skeleton + weights blob in /dev/shm, optimizers and prepacking off
  add-initializer packed skeleton, each weight an OrtValue over an mmap of the blob
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
import time
from pathlib import Path

CANDIDATES = ["ort", "external-mmap", "add-initializer"]


def anon_bytes() -> int:
    """Anonymous memory of this process: what it allocated for itself, weights it copied included.

    USS would also count /dev/shm pages that only this process happens to map.
    """
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Anonymous line in /proc/self/smaps_rollup")


def child(candidate: str, src: str, packed: str, warm_runs: int) -> dict:
    """Runs in a fresh interpreter: build one session the candidate's way and measure it."""
    import numpy as np
    import onnxruntime as ort
    
    from modelcache import zoo
    from modelcache.session_options import attach_session_options

    uss0 = anon_bytes()
    t0 = time.perf_counter()
    if candidate == "ort":
        sess = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    elif candidate == "external-mmap":
        sess = ort.InferenceSession(os.path.join(packed, "model.onnx"), attach_session_options(),
                                    providers=["CPUExecutionProvider"])
    elif candidate == "add-initializer":
        from modelcache.store.format import load_manifest
        manifest = load_manifest(Path(packed))
        blob = np.memmap(os.path.join(packed, "weights.bin"), dtype=np.uint8, mode="r")
        so = attach_session_options()
        keep = []
        for t in manifest.tensors:
            arr = blob[t.offset:t.offset + t.nbytes].view(t.dtype).reshape(t.shape)
            ov = ort.OrtValue.ortvalue_from_numpy(arr)
            keep.append(ov)
            so.add_initializer(t.name, ov)
        sess = ort.InferenceSession(os.path.join(packed, "model.onnx"), so, providers=["CPUExecutionProvider"])
    else:
        raise SystemExit(f"unknown candidate {candidate}")
    create_ms = (time.perf_counter() - t0) * 1e3
    uss_ready = anon_bytes()
    feeds = zoo.sample_inputs(src)
    out = sess.run(None, feeds)[0]
    times = []
    for _ in range(warm_runs):
        t = time.perf_counter()
        sess.run(None, feeds)
        times.append((time.perf_counter() - t) * 1e3)
    return {"candidate": candidate, "create_ms": create_ms, "anon_ready_mib": (uss_ready - uss0) / 2**20,
            "anon_after_run_mib": (anon_bytes() - uss0) / 2**20,
            "warm_ms": statistics.median(times), "checksum": float(np.abs(out).sum())}


def report(samples: list[dict], out=sys.stdout) -> None:
    print(f"{'model':<10} {'candidate':<16} {'create ms':>10} {'anon ready MiB':>14} {'anon run MiB':>12} "
          f"{'warm ms':>9} {'warm vs ort':>11}", file=out)
    for name in dict.fromkeys(s["model"] for s in samples):
        base = statistics.median(s["warm_ms"] for s in samples if s["model"] == name and s["candidate"] == "ort")
        for c in CANDIDATES:
            rows = [s for s in samples if s["model"] == name and s["candidate"] == c]
            med = {k: statistics.median(r[k] for r in rows) for k in
                   ("create_ms", "anon_ready_mib", "anon_after_run_mib", "warm_ms")}
            print(f"{name:<10} {c:<16} {med['create_ms']:>10.1f} {med['anon_ready_mib']:>14.1f} "
                  f"{med['anon_after_run_mib']:>12.1f} {med['warm_ms']:>9.1f} {base / med['warm_ms']:>10.2f}x",
                  file=out)


def run_child(candidate: str, src: str, packed: str, warm_runs: int) -> dict:
    cmd = [sys.executable, __file__, "--child", candidate, src, packed, str(warm_runs)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["resnet50", "vgg16", "vit_b_16"])
    ap.add_argument("--runs", type=int, default=3, help="fresh processes per candidate (interleaved)")
    ap.add_argument("--warm-runs", type=int, default=10)
    ap.add_argument("--out", default=None, help="write OUT/results.json (every sample) and OUT/report.txt")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        c, src, packed, warm = args.child
        print(json.dumps(child(c, src, packed, int(warm))))
        return 0

    from modelcache import zoo
    from modelcache.measure import save_results
    from modelcache.store.packing import pack

    work = Path(tempfile.mkdtemp(prefix="modelcache-binding-"))
    shm = Path(tempfile.mkdtemp(prefix="modelcache-binding-", dir="/dev/shm"))
    samples = []
    try:
        for name in args.models:
            src = str(work / f"{name}.onnx")
            zoo.save(zoo.build(name), src)
            pack(src, work / "repo", name, 1)
            packed = shm / name
            shutil.copytree(work / "repo" / name / "1", packed)  # the host tier: blob + skeleton in /dev/shm
            for _ in range(args.runs):
                for c in CANDIDATES:  # interleaved, so machine drift hits every candidate alike
                    samples.append({"model": name, **run_child(c, src, str(packed), args.warm_runs)})
        report(samples)
        save_results(args.out, "binding", argv, samples, report,
                     command="PYTHONPATH=. python benchmarks/binding/run.py")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
