"""Where a new model's load goes: `pack` (what `modelcache add`, an import and a repository load run, in a child
process of the daemon) run here in-process under cProfile, and its time split into the parts that dominate it.

    python benchmarks/repoload/pack_profile.py [--model resnet50] [--runs 3]

Per run: the pack's wall time, then the cumulative seconds of ORT's session starts (its optimizations: the CPU
graph and the GPU skeleton's), fsync (and the wait for the weights' fsync on a thread of its own), the ONNX checker
(asked only of a file ORT refuses), the weights written out, the GPU skeleton, the checksums; then, timed apart, the
interpreter's start with the modules a packing child imports (in a fresh process), and what the front reads of the
file before it asks for the pack (its inputs and outputs, the files it names).
Medians [min-max] over the runs.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# part -> (file suffix, function name) whose cumulative time it is
PARTS = {
    "ORT session starts": ("onnxruntime_inference_collection.py", "_create_inference_session"),
    "fsync": ("~", "<built-in method posix.fsync>"),
    "fsync waited for": ("packing.py", "wait"),    # (_Flusher's, on its own thread meanwhile)
    "ONNX checker": ("checker.py", "check_model"),
    "weights written out": ("packing.py", "_externalize"),
    "GPU skeleton": ("packing.py", "_write_gpu_skeleton"),
    "checksums (sha256, xxh3)": ("integrity.py", "file_digest"),
}


def one_run(src: str) -> dict:
    from modelcache.store.packing import pack
    with tempfile.TemporaryDirectory(prefix="mc-packprof-") as tmp:
        profile = cProfile.Profile()
        t0 = time.perf_counter()
        profile.runcall(pack, src, Path(tmp), "m", None)
        wall = time.perf_counter() - t0
    stats = pstats.Stats(profile).stats   # (file, line, function) -> (calls, ..., tottime, cumtime, callers)
    out = {"pack": wall}
    for part, (suffix, function) in PARTS.items():
        out[part] = sum(v[3] for (file, _, fn), v in stats.items() if file.endswith(suffix) and fn == function)
    return out


def front_reads_s(src: str) -> float:
    """What the front reads of the file before it asks the daemon to pack it: its inputs and outputs (for the
    config), the files it names (their descriptors travel to the daemon)."""
    from modelcache.store.packing import model_io
    from modelcache.store.sources import close_all, open_model_files
    t0 = time.perf_counter()
    model_io(src)
    close_all(open_model_files(src)[1])
    return time.perf_counter() - t0


def child_start_s() -> float:
    """A packing child's start: the interpreter and the modules it imports, in a fresh process."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import modelcache.store.packing, onnx, onnxruntime"], check=True)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    from modelcache import zoo
    from modelcache.measure import summary
    with tempfile.TemporaryDirectory(prefix="mc-packprof-src-") as tmp:
        src = str(Path(tmp) / f"{args.model}.onnx")
        zoo.save(zoo.build(args.model), src)
        rows = [one_run(src) for _ in range(args.runs)]
        reads = [front_reads_s(src) for _ in range(args.runs)]
    starts = [child_start_s() for _ in range(args.runs)]
    print(f"{args.model}: pack in-process, {args.runs} runs")
    for part in ["pack", *PARTS]:
        print(f"  {part:<28} {summary([r[part] for r in rows], '.2f'):>20} s")
    print(f"  {'a packing child starts':<28} {summary(starts, '.2f'):>20} s")
    print(f"  {'the front reads the file':<28} {summary(reads, '.2f'):>20} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
