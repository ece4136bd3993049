"""Why ORT's mmap of an .ort model runs warm slower than a session over the .onnx (bench open: 1.23-1.31x
modelcache's time): the mmap flags, or the converted model? Warm runs of one model under each way of loading
it, alternated in one process.

    PYTHONPATH=. python benchmarks/coldstart/ort_warm.py [--model resnet50] [--runs 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import onnxruntime as ort

from modelcache import zoo
from modelcache.measure import ORT_MMAP_KEYS

MMAP = list(ORT_MMAP_KEYS)


def session(path: Path, keys: list) -> ort.InferenceSession:
    so = ort.SessionOptions()
    for key in keys:
        so.add_session_config_entry(key, "1")
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / f"{args.model}.onnx"
        zoo.save(zoo.build(args.model), str(src))
        subprocess.run([sys.executable, "-m", "onnxruntime.tools.convert_onnx_models_to_ort", str(src),
                        "--output_dir", tmp], check=True, capture_output=True)
        ort_file = src.with_suffix(".ort")
        ways = {".onnx": session(src, []), ".ort, the three mmap flags (bench's ort-mmap)": session(ort_file, MMAP),
                ".ort, mmap only": session(ort_file, MMAP[:1]), ".ort, no flag": session(ort_file, []),
                ".ort, the three flags, prepacking off": session(ort_file, MMAP + ["session.disable_prepacking"])}
        feeds = zoo.sample_inputs(str(src))
        times = {k: [] for k in ways}
        for s in ways.values():
            s.run(None, feeds)
        for _ in range(args.runs):
            for k, s in ways.items():
                t = time.perf_counter()
                s.run(None, feeds)
                times[k].append((time.perf_counter() - t) * 1e3)
    print(f"{args.model}, {args.runs} warm runs each, alternated: median [min-max] ms")
    for k, v in times.items():
        print(f"  {k:<46} {statistics.median(v):7.1f} [{min(v):.1f}-{max(v):.1f}]")


if __name__ == "__main__":
    main()
