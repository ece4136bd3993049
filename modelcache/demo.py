"""`modelcache demo`, and the side-by-side measure it shares with `modelcache bench open`.

Session-ready time, private memory and warm speed: plain ORT, ORT's own memory-mapped .ort model (no daemon,
the page cache shared: measure.ort_mmap_session) and modelcache. Session-ready
time and memory are measured in fresh processes (`python -m modelcache.demo --child ...`),
interleaved so machine drift hits both modes alike. For modelcache, the measuring process
itself holds the model open and has run it once: the measured process is a *second*
client, the case the cache exists for. Warm speed is measured in one process that holds
both sessions and alternates their runs, so the ratio is side by side.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from .measure import (alternate_runs, answer_child, compile_bytecode, ensure_models, managed_daemon,
                      memory_mib, ort_mmap_model, ort_mmap_session, run_child, summary)

MODES = ("ort", "ort-mmap", "modelcache")
# Fresh processes per mode and model the demo times. With one, its verdicts flipped from run to run: ResNet-50's
# ORT-mmap session was ready in 261 ms in one run (its .ort file read from disk) and 15-21 ms in the next two.
DEMO_RUNS = 3


def child_open(mode: str, name: str, src: str) -> dict:
    t0 = time.perf_counter()
    import numpy as np  # noqa: F401  (counted in imports, as any client would)
    import onnxruntime as ort
    import modelcache
    from modelcache import zoo
    t_imports = time.perf_counter()
    if mode == "ort":
        sess = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    elif mode == "ort-mmap":
        sess = ort_mmap_session(src)
    else:
        sess = modelcache.InferenceSession(name)
    t_ready = time.perf_counter()
    feeds = zoo.sample_inputs(src)
    sess.run(None, feeds)
    t_first = time.perf_counter()
    return {"mode": mode, "model": name, "imports_ms": (t_imports - t0) * 1e3,
            "ready_ms": (t_ready - t_imports) * 1e3, "first_run_ms": (t_first - t_ready) * 1e3,
            **memory_mib()}


def child_warm(name: str, src: str, runs: int) -> dict:
    import onnxruntime as ort
    import modelcache
    from modelcache import zoo
    feeds = zoo.sample_inputs(src)
    sessions = {"ort": ort.InferenceSession(src, providers=["CPUExecutionProvider"]), "ort-mmap": ort_mmap_session(src),
                "modelcache": modelcache.InferenceSession(name)}
    for s in sessions.values():
        s.run(None, feeds)
    times = alternate_runs(sessions, feeds, runs)
    return {"model": name, "warm_ms": times}


def measure(socket: str, paths: dict[str, str], runs: int, warm_runs: int, modes=MODES,
            module: str = "modelcache.demo", unmeasured_rounds: int = 0) -> dict:
    """Per model, with a first client holding it: `runs` fresh processes per mode opening it (`module`'s
    child_open), after `unmeasured_rounds` of them per mode that are not counted (the files each mode reads, and
    the libraries, brought into the page cache for every mode alike: one fresh process each is otherwise a draw of
    the cache's state); then one process timing warm runs of every mode's session side by side (its child_warm)."""
    import modelcache
    from modelcache import zoo
    samples, warm = [], []
    for name, src in paths.items():
        ort_mmap_model(src)
        holder = modelcache.InferenceSession(name, socket=socket)  # the first client: weights resident and touched
        holder.run(None, zoo.sample_inputs(src))
        for _ in range(unmeasured_rounds):
            for mode in modes:
                run_child(module, socket, "open", mode, name, src)
        for _ in range(runs):
            for mode in modes:
                samples.append(run_child(module, socket, "open", mode, name, src))
        warm.append(run_child(module, socket, "warm", name, src, str(warm_runs)))
        holder.close()
    return {"samples": samples, "warm": warm}


def report(results: dict, out=sys.stdout) -> None:
    samples, warm = results["samples"], {w["model"]: w["warm_ms"] for w in results["warm"]}
    print(f"{'model':<14} {'mode':<11} {'ready ms':>22} {'USS MiB':>22} {'anon MiB':>9} {'warm ms':>20}", file=out)
    for name in dict.fromkeys(s["model"] for s in samples):
        ready = {}
        for mode in [m for m in MODES if any(s["model"] == name and s["mode"] == m for s in samples)]:
            rows = [s for s in samples if s["model"] == name and s["mode"] == mode]
            ready[mode] = statistics.median(r["ready_ms"] for r in rows)
            print(f"{name:<14} {mode:<11} {summary([r['ready_ms'] for r in rows]):>22} "
                  f"{summary([r['uss_mib'] for r in rows]):>22} {statistics.median(r['anon_mib'] for r in rows):>9.1f} "
                  f"{summary(warm[name][mode]):>20}", file=out)
        for ref, said in (("ort", "plain ORT"), ("ort-mmap", "ORT's mmap of .ort")):
            if ref not in ready or ref not in warm[name]:
                continue
            # Each pair of runs was adjacent in time: the median of their ratios resists machine drift.
            pairs = sorted(o / m for o, m in zip(warm[name][ref], warm[name]["modelcache"]))
            q = lambda f: pairs[min(len(pairs) - 1, int(f * len(pairs)))]  # noqa: E731
            print(f"{name:<14} -> vs {said}: session ready {_how_much_faster(ready[ref], ready['modelcache'])}, "
                  f"warm speed {statistics.median(pairs):.2f}x (pairs' quartiles {q(0.25):.2f}-{q(0.75):.2f})",
                  file=out)


def _how_much_faster(baseline_ms: float, ours_ms: float) -> str:
    """'6.1x faster', or '1.4x slower' when it is: never '1x faster' for a loss."""
    if ours_ms <= baseline_ms:
        return f"{baseline_ms / ours_ms:.1f}x faster"
    return f"{ours_ms / baseline_ms:.1f}x slower"


def demo(args) -> int:
    """`modelcache demo`: a daemon on the default settings, two zoo models, fresh clients vs plain ORT and ORT's
    own mmap of an .ort model."""
    from .config import load
    settings = load()
    compile_bytecode()   # the clients below are fresh processes: as installed, not compiling modelcache each time
    print(f"daemon socket {settings.socket}, repository {settings.repository}")
    with managed_daemon(settings.socket, settings.repository):
        work = Path(settings.repository).parent / "zoo"
        paths = ensure_models(settings.socket, args.models, work)
        results = measure(settings.socket, paths, runs=DEMO_RUNS, warm_runs=10, unmeasured_rounds=1)
    report(results)
    print(f"\nready = from InferenceSession(...) to a usable session, in a fresh process (median [min-max] of "
          f"{DEMO_RUNS}, each mode's first process not counted); USS = memory only that process holds")
    return 0


if __name__ == "__main__":   # a measured fresh process: `--child open|warm ...` (see measure)
    if sys.argv[1:2] != ["--child"]:
        sys.exit("run the demo as `modelcache demo`")
    sys.exit(answer_child(sys.argv[2:], child_open, child_warm))
