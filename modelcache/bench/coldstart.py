"""FaaS cold-start benchmark, measured as TrIMS did: a fresh process from exec to first result.

    modelcache bench coldstart [--models resnet50 vgg16 ...] [--runs 7] [--quick] [--out DIR]
    modelcache bench coldstart --device cuda ...   the GPU form (bench/coldstart_cuda.py)

Modes, interleaved round by round so machine drift hits them alike:
  ort          plain onnxruntime.InferenceSession(model.onnx) + one run
  ort-mmap     ORT's own answer, no daemon: the model converted to .ort once (onnxruntime.tools.
               convert_onnx_models_to_ort), each process memory-maps it and takes its initializers from the
               mapping (session.use_memory_mapped_ort_model, use_ort_model_bytes_directly and
               use_ort_model_bytes_for_initializers); the page cache shares it; prepacking on, as its users run it
  ort-tuned    skeleton + weights in /dev/shm by hand, optimizers and prepacking off (no daemon)
  attach-hit   modelcache.InferenceSession(name), model resident in host memory
  attach-miss  the same, model evicted to disk first
  serve        client hands the input to the daemon and gets the output (no onnxruntime import)
  ideal        same interpreter and imports + compute of a warm session: loading costs nothing
Memory: k concurrent clients of one model holding a session, PSS and USS per client, ort vs attach.
"""

from __future__ import annotations

import argparse
import csv
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ..plotting import pyplot
from ..measure import compile_bytecode, ensure_models, managed_daemon, ort_mmap_model, save_results, summary
from .fresh import holding, sample, spawn
from ..usage import Parser

MODES = ["ort", "ort-mmap", "ort-tuned", "attach-hit", "attach-miss", "serve", "ideal"]
CHILD = str(Path(__file__).with_name("coldstart_child.py"))
DEFAULT_MODELS = ["squeezenet1_1", "resnet50", "googlenet", "vgg16", "vit_b_16", "alexnet"]


def prepare_tuned(client, name: str, root: Path) -> str:
    """ort-tuned's files: the packed skeleton and weights blob, copied into our own /dev/shm directory."""
    repository = Path(next(t["path"] for t in client.stats().tiers if t["tier"] == "disk"))
    version = max(m["version"] for m in client.list() if m["name"] == name)
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    for f in ("model.onnx", "weights.bin"):
        shutil.copyfile(repository / name / str(version) / f, d / f)
    return str(d)


def measure_latency(client, socket, paths, tuned, modes, runs, log) -> list[dict]:
    samples = []
    for r in range(runs):
        for name, src in paths.items():
            for mode in modes:
                if mode == "attach-miss":
                    client.evict(name)
                elif mode in ("attach-hit", "serve"):
                    client.release(client.open(name).lease_id)  # make sure it is resident
                s = sample(mode, name, src, tuned[name], socket, child=CHILD)
                s["run"] = r
                samples.append(s)
            log(f"round {r + 1}/{runs} {name}: " + ", ".join(f"{s['mode']} {s['total_ms']:.0f}"
                                                             for s in samples if s["run"] == r and s["model"] == name))
    return samples


def measure_memory(client, socket, name, src, tuned_dir, counts, log, modes=("ort", "attach-hit")) -> list[dict]:
    import psutil
    # Measure attach clients alone: free serve mode's sessions and every other model the daemon holds.
    for m in client.list():
        if m["tier"] == "host":
            client.evict(m["name"], m["version"])
    daemon_pid = client.stats().pid
    rows = []
    for k in counts:
        for mode in [m for m in ("ort", "ort-mmap", "attach-hit") if m in modes]:
            with holding([spawn(mode, name, src, tuned_dir, socket, hold=True, child=CHILD) for _ in range(k)]) as procs:
                infos = [psutil.Process(p.pid).memory_full_info() for p in procs]
                daemon_pss = psutil.Process(daemon_pid).memory_full_info().pss if mode == "attach-hit" else 0
                row = {"model": name, "mode": mode, "clients": k,
                       "clients_pss_mib": sum(i.pss for i in infos) / 2**20,
                       "daemon_pss_mib": daemon_pss / 2**20,
                       "uss_per_client_mib": statistics.median(i.uss for i in infos) / 2**20}
                row["total_pss_mib"] = row["clients_pss_mib"] + row["daemon_pss_mib"]
                rows.append(row)
                log(f"memory {mode} k={k}: total PSS {row['total_pss_mib']:.0f} MiB, "
                    f"USS/client {row['uss_per_client_mib']:.0f} MiB")
    return rows


def report(samples: list[dict], memory: list[dict], out=sys.stdout) -> None:
    modes = [m for m in MODES if any(s["mode"] == m for s in samples)]
    print(f"{'model':<14} {'mode':<12} {'total ms (median [min-max])':>28} {'x ort':>7} {'x ideal':>8} "
          f"{'interp':>7} {'imports':>8} {'session':>8} {'1st run':>8}", file=out)
    for name in dict.fromkeys(s["model"] for s in samples):
        med = {m: statistics.median(s["total_ms"] for s in samples if s["model"] == name and s["mode"] == m)
               for m in modes}
        def over(m, ref, width):   # a ratio to a reference mode, or "-" when that mode was not run
            return f"{med[m] / med[ref]:>{width}.2f}" if ref in med else f"{'-':>{width}}"

        for m in modes:
            rows = [s for s in samples if s["model"] == name and s["mode"] == m]
            phase = {k: statistics.median(r[k] for r in rows)
                     for k in ("interpreter_ms", "imports_ms", "session_ms", "first_run_ms")}
            print(f"{name:<14} {m:<12} {summary([r['total_ms'] for r in rows]):>28} "
                  f"{over(m, 'ort', 7)} {over(m, 'ideal', 8)} {phase['interpreter_ms']:>7.0f} "
                  f"{phase['imports_ms']:>8.0f} {phase['session_ms']:>8.1f} {phase['first_run_ms']:>8.1f}", file=out)
        if "attach-hit" in med:   # against each reference that ran
            said = ([f"{med['ort'] / med['attach-hit']:.2f}x faster than ort"] if "ort" in med else []) + \
                [f"{med['attach-hit'] / med[ref]:.2f}x {ref}" for ref in ("ideal", "ort-mmap", "ort-tuned") if ref in med]
            if said:
                print(f"{name:<14} -> attach-hit is " + ", ".join(said), file=out)
            paired = [f"{ref} {summary(r, '.2f')}" for ref in ("ideal", "ort-mmap", "ort-tuned", "ort")
                      if (r := paired_ratios(samples, name, "attach-hit", ref))]
            if paired:
                print(f"{name:<14} -> paired by round, attach-hit over: " + ", ".join(paired), file=out)
    if memory:
        print(f"\n{'model':<14} {'mode':<11} {'clients':>7} {'total PSS MiB':>14} {'(daemon)':>9} {'USS/client MiB':>15}",
              file=out)
        for r in memory:
            print(f"{r['model']:<14} {r['mode']:<11} {r['clients']:>7} {r['total_pss_mib']:>14.0f} "
                  f"{r['daemon_pss_mib']:>9.0f} {r['uss_per_client_mib']:>15.0f}", file=out)
        kmax = max(r["clients"] for r in memory)
        top = {r["mode"]: r["total_pss_mib"] for r in memory if r["clients"] == kmax}
        if "attach-hit" in top:
            print(f"{kmax} attach clients + daemon use " + ", ".join(
                f"{100 * top['attach-hit'] / top[ref]:.0f}% of the memory of {kmax} {ref} processes"
                for ref in ("ort", "ort-mmap") if ref in top), file=out)


def paired_ratios(samples: list[dict], model: str, mode: str, reference: str) -> list[float]:
    """mode's total over reference's, round by round. The modes of a round run back to back, so the
    machine's drift (this VM's speed moves by ~20 % over tens of seconds, and a fresh process's imports
    by 30 ms) hits both sides of each ratio alike; the median of the ratios is steadier than the ratio
    of the medians, which pairs a fast moment of one mode with a slow one of another."""
    total = {(s["mode"], s["run"]): s["total_ms"] for s in samples if s["model"] == model}
    return [total[(mode, r)] / total[(reference, r)] for (m, r) in sorted(total, key=lambda k: k[1])
            if m == mode and (reference, r) in total]


def plot(samples: list[dict], memory: list[dict], out_dir: Path) -> list[str]:
    plt = pyplot()
    if plt is None:
        return []
    written = []
    names = list(dict.fromkeys(s["model"] for s in samples))
    modes = [m for m in MODES if m not in ("ort", "ideal") and any(s["mode"] == m for s in samples)]
    med = {(n, m): statistics.median(s["total_ms"] for s in samples if s["model"] == n and s["mode"] == m)
           for n in names for m in MODES if any(s["mode"] == m and s["model"] == n for s in samples)}
    if "ort" not in {m for _, m in med} or not modes:   # the chart is speedup over plain ORT: it needs ort
        modes = []
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(names)), 4))
    width = 0.8 / max(1, len(modes))
    for i, m in enumerate(modes):
        ax.bar([j + i * width for j in range(len(names))], [med[(n, "ort")] / med[(n, m)] for n in names],
               width, label=m)
    for j, n in enumerate(names if modes and (names[0], "ideal") in med else []):  # the ideal speedup, as TrIMS marks it
        ax.hlines(med[(n, "ort")] / med[(n, "ideal")], j - width / 2, j + 0.8 - width / 2, colors="k",
                  linestyles="dashed", label="ideal" if j == 0 else None)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names)
    ax.set_ylabel("speedup over plain ORT (end to end)")
    ax.set_title("Cold start of a fresh process: exec to first result")
    if modes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "speedup.png", dpi=120)
    written.append("speedup.png")
    if memory:
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode in ("ort", "attach-hit"):
            rows = [r for r in memory if r["mode"] == mode]
            ax.plot([r["clients"] for r in rows], [r["total_pss_mib"] for r in rows], marker="o", label=mode)
        ax.set_xlabel("concurrent clients of one model")
        ax.set_ylabel("total PSS, MiB (attach includes the daemon)")
        ax.set_title(f"Memory: {memory[0]['model']}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "memory.png", dpi=120)
        written.append("memory.png")
    plt.close("all")
    return written


def main(argv=None) -> int:
    pre = Parser(add_help=False)
    pre.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    known, rest = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    if known.device == "cuda":
        from ..errors import ModelCacheError
        from .coldstart_cuda import main as main_cuda
        try:
            return main_cuda(rest)
        except ModelCacheError as e:   # no CUDA device here: say what is missing, not a traceback
            print(f"modelcache: {e}", file=sys.stderr)
            return 1
    ap = Parser(prog="modelcache bench coldstart", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: the GPU modes (ort-cuda, host-attach, gpu-attach-hit/miss, serve, ideal); "
                         "`--device cuda --help` lists its options")
    ap.add_argument("--models", nargs="+", help=f"zoo models (default: {' '.join(DEFAULT_MODELS)})")
    ap.add_argument("--runs", type=int, help="fresh processes per mode and model (default 7; 5 with --quick)")
    ap.add_argument("--quick", action="store_true", help="squeezenet1_1 and resnet50, 5 runs, 1-2 clients: < 2 min")
    ap.add_argument("--clients", type=int, nargs="+", help="memory: concurrent clients (default 1 2 4 8)")
    ap.add_argument("--memory-model", help="model for the memory measurement (default vgg16, or the first model)")
    ap.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    ap.add_argument("--socket", help="use this running daemon (default: start a private one)")
    ap.add_argument("--out", help="directory for samples.csv, results.json, report.txt and plots")
    ap.add_argument("--shm-dir", default="/dev/shm",
                    help="where the daemon's host tier and ort-tuned's copy live (e.g. a tmpfs mounted with "
                         "huge=within_size: see benchmarks/pagefaults)")
    args = ap.parse_args(argv)
    models = args.models or (["squeezenet1_1", "resnet50"] if args.quick else DEFAULT_MODELS)
    runs = args.runs or (5 if args.quick else 7)
    counts = args.clients or ([1, 2] if args.quick else [1, 2, 4, 8])
    memory_model = args.memory_model or ("vgg16" if "vgg16" in models else models[0])
    modes = list(dict.fromkeys(args.modes))
    from .. import zoo
    unknown = [m for m in models if zoo.ALIASES.get(m, m) not in zoo.ZOO]
    if unknown:   # up front: found after the daemon started and the first models were built, it cost minutes
        ap.error(f"--models: no zoo model {', '.join(map(repr, unknown))}; `modelcache zoo --list` lists them")
    if memory_model not in models and counts != [0]:
        ap.error(f"--memory-model {memory_model}: not among --models ({' '.join(models)})")
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731

    from ..client.connection import connect
    compile_bytecode()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="modelcache-coldstart-") as tmp, \
            tempfile.TemporaryDirectory(prefix="modelcache-coldstart-", dir=args.shm_dir) as shm:
        socket = args.socket or f"ipc://{tmp}/daemon.sock"
        with managed_daemon(socket, None if args.socket else f"{tmp}/repo", env={"MODELCACHE_SHM_DIR": args.shm_dir}):
            paths = ensure_models(socket, models, Path(tmp) / "zoo")
            with connect(socket) as client:
                tuned = {n: prepare_tuned(client, n, Path(shm)) for n in models}
                if "ort-mmap" in modes:
                    for src in paths.values():
                        ort_mmap_model(src)
                samples = measure_latency(client, socket, paths, tuned, modes, runs, log)
                memory = measure_memory(client, socket, memory_model, paths[memory_model], tuned[memory_model],
                                        counts, log, modes=modes) if counts != [0] else []
    report(samples, memory)
    log(f"benchmark took {time.monotonic() - t0:.0f} s")
    save_results(args.out, "coldstart", argv, {"samples": samples, "memory": memory},
                 lambda data, f: report(data["samples"], data["memory"], f))
    if args.out:
        out = Path(args.out)
        with open(out / "samples.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(samples[0]))
            w.writeheader()
            w.writerows(samples)
        plot(samples, memory, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
