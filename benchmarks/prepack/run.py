"""Prepack benchmark: a second client with the shared pre-packed MatMul weights vs without, side by side.

    PYTHONPATH=. python benchmarks/prepack/run.py [--models vit_b_16] [--runs 5] [--out benchmarks/prepack]

One daemon, one host tier; this process holds the model open (the first client). Fresh child
processes then open it alternately with prepacked=True and prepacked=False (what every client did
before), each measuring session-ready time, its memory after the first run (USS, anonymous), and
the first run. A last child holds plain ORT and both modelcache sessions and alternates their warm
runs, so the warm ratios are side by side.

Read "anon +MiB" (anonymous memory the open and first run added) for private copies. USS
counts pages only that process maps, shared memory included: the holder is prepacked, so
it no longer maps the raw MatMul weights, and an unpacked child is alone on those pages
(its USS shows them, though they are the host tier's, not a copy).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from modelcache.measure import (alternate_runs, answer_child, ensure_models, managed_daemon, memory_mib,
                                     save_results, summary)

MODES = ("prepacked", "unpacked")


def child_open(mode: str, name: str, src: str) -> dict:
    import numpy as np  # noqa: F401  (as a client would have)
    import modelcache
    from modelcache import zoo
    feeds = zoo.sample_inputs(src)
    before = memory_mib()
    t0 = time.perf_counter()
    sess = modelcache.InferenceSession(name, prepacked=(mode == "prepacked"))
    t_ready = time.perf_counter()
    sess.run(None, feeds)
    t_first = time.perf_counter()
    after = memory_mib()
    return {"mode": mode, "model": name, "used_prepacked": sess.prepacked, "ready_ms": (t_ready - t0) * 1e3,
            "first_run_ms": (t_first - t_ready) * 1e3, "anon_growth_mib": after["anon_mib"] - before["anon_mib"],
            **after}


def child_warm(name: str, src: str, runs: int) -> dict:
    import numpy as np
    import onnxruntime as ort
    import modelcache
    from modelcache import zoo
    feeds = zoo.sample_inputs(src)
    sessions = {"ort": ort.InferenceSession(src, providers=["CPUExecutionProvider"]),
                "prepacked": modelcache.InferenceSession(name, prepacked=True),
                "unpacked": modelcache.InferenceSession(name, prepacked=False)}
    outs = {k: s.run(None, feeds)[0] for k, s in sessions.items()}
    max_abs_diff = {k: float(np.max(np.abs(outs[k] - outs["ort"]))) for k in MODES}
    times = alternate_runs(sessions, feeds, runs)
    return {"model": name, "warm_ms": times, "max_abs_diff_vs_ort": max_abs_diff}


def measure(socket: str, paths: dict[str, str], runs: int, warm_runs: int) -> dict:
    from modelcache.demo import measure as measure_open
    return measure_open(socket, paths, runs, warm_runs, MODES, __file__)


def _ratio(a: list[float], b: list[float]) -> str:
    pairs = sorted(x / y for x, y in zip(a, b))
    q = lambda f: pairs[min(len(pairs) - 1, int(f * len(pairs)))]  # noqa: E731
    return f"{statistics.median(pairs):.2f}x (pairs' quartiles {q(0.25):.2f}-{q(0.75):.2f})"


def report(results: dict, out=sys.stdout) -> None:
    samples, warm = results["samples"], {w["model"]: w for w in results["warm"]}
    print(f"{'model':<10} {'mode':<10} {'ready ms':>22} {'first run ms':>22} {'USS MiB':>20} {'anon +MiB':>18} "
          f"{'warm ms':>20}", file=out)
    for name in dict.fromkeys(s["model"] for s in samples):
        w = warm[name]
        print(f"{name:<10} {'ort':<10} {'':>22} {'':>22} {'':>20} {'':>18} {summary(w['warm_ms']['ort']):>20}",
              file=out)
        for mode in MODES:
            rows = [s for s in samples if s["model"] == name and s["mode"] == mode]
            used = sum(r["used_prepacked"] for r in rows)
            print(f"{name:<10} {mode:<10} {summary([r['ready_ms'] for r in rows]):>22} "
                  f"{summary([r['first_run_ms'] for r in rows]):>22} {summary([r['uss_mib'] for r in rows]):>20} "
                  f"{summary([r['anon_growth_mib'] for r in rows]):>18} {summary(w['warm_ms'][mode]):>20}"
                  f"{'' if mode != 'prepacked' else f'  ({used}/{len(rows)} used the blobs)'}", file=out)
        print(f"{name:<10} -> warm speed vs plain ORT: prepacked {_ratio(w['warm_ms']['ort'], w['warm_ms']['prepacked'])}, "
              f"unpacked {_ratio(w['warm_ms']['ort'], w['warm_ms']['unpacked'])}; outputs' max |diff| vs ORT "
              f"{w['max_abs_diff_vs_ort']}", file=out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/prepack/run.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["vit_b_16"])
    ap.add_argument("--runs", type=int, default=5, help="fresh processes per mode and model (default 5)")
    ap.add_argument("--warm-runs", type=int, default=30, help="alternating warm runs per session (default 30)")
    ap.add_argument("--out", help="write all samples to OUT/results.json and the table to OUT/report.txt")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return answer_child(args.child, child_open, child_warm)
    with tempfile.TemporaryDirectory(prefix="modelcache-bench-") as tmp:
        socket = f"ipc://{tmp}/daemon.sock"
        with managed_daemon(socket, f"{tmp}/repo", env={"MODELCACHE_PREPACK": "1"}):   # models added with blobs
            paths = ensure_models(socket, args.models, Path(tmp) / "zoo")
            results = measure(socket, paths, args.runs, args.warm_runs)
    report(results)
    save_results(args.out, "prepack", argv, results, report,
                 command="PYTHONPATH=. python benchmarks/prepack/run.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
