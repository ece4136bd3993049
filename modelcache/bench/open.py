"""Open benchmark: session ready time, private memory and warm speed: plain ORT, ORT's mmap of .ort, modelcache.

    modelcache bench open [--models vgg16 resnet50] [--runs 5] [--out benchmarks/open]

The measure `modelcache demo` prints, with more runs and models of your choice (modelcache/demo.py
has how it measures): the figures to check a machine by before deploying on it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from ..demo import measure, report
from ..measure import compile_bytecode, ensure_models, managed_daemon, save_results
from ..usage import Parser


def main(argv=None) -> int:
    ap = Parser(prog="modelcache bench open", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["vgg16", "resnet50"])
    ap.add_argument("--runs", type=int, default=5, help="fresh processes per mode and model (default 5)")
    ap.add_argument("--warm-runs", type=int, default=40, help="alternating warm runs per session (default 40)")
    ap.add_argument("--socket", help="measure against this running daemon (default: start a private one)")
    ap.add_argument("--prepack", action="store_true",
                    help="add the models with shared prepacked MatMul weights (`modelcache add --prepack`)")
    ap.add_argument("--out", help="write all samples to OUT/results.json and the table to OUT/report.txt")
    args = ap.parse_args(argv)
    compile_bytecode()
    with tempfile.TemporaryDirectory(prefix="modelcache-bench-") as tmp:
        socket = args.socket or f"ipc://{tmp}/daemon.sock"
        repository = None if args.socket else f"{tmp}/repo"
        with managed_daemon(socket, repository, env={"MODELCACHE_PREPACK": "1"} if args.prepack else None):
            paths = ensure_models(socket, args.models, Path(tmp) / "zoo")
            results = measure(socket, paths, args.runs, args.warm_runs)
    report(results)
    save_results(args.out, "open", argv, results, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
