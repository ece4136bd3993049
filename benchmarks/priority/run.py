"""Priority levels: what Triton's `priority_levels` buy a latency-sensitive client beside a load that keeps the
model's queue full, Triton 2.51 (its native C++ fronts and ONNX Runtime backend) and modelcache side by side, each
with levels and without (one FIFO queue), the same model, config and client load.

    python benchmarks/priority/run.py [--model squeezenet1_1] [--low 6] [--high 1] [--max-batch-size 1]
                                      [--rounds 3] [--seconds 8] [--warmup 3] [--seed 0] [--quick] [--out DIR]

Two Triton repositories of one zoo model (benchmarks/responsecache's write_repository: the inputs and outputs
written out, `max_batch_size` --max-batch-size, one CPU instance with one intra-op thread, the tuned Triton of
benchmarks/grpc/peers; no response cache), each with `dynamic_batching`: in `levels`'s, `priority_levels: 2
default_priority_level: 2`; in `fifo`'s, nothing (`dynamic_batching { }`). Four systems, each a server of its own
over one of them:

  triton-levels / triton-fifo          tritonserver (benchmarks/responsecache's start_triton: serve.sh's flags,
                                       --model-control-mode=none, glibc's malloc) over `levels` / `fifo`
  modelcache-levels / modelcache-fifo  `modelcache daemon` importing `levels` / `fifo` (MODELCACHE_TRITON_REPOSITORY),
                                       its gRPC front on MODELCACHE_GRPC_PORT, no response cache, defaults otherwise

Load, every window: --low tritonclient.grpc client processes sending with no priority (level 2, the default: the
queue they keep full) and --high client processes sending `priority=1`, all closed loops of batch 1 with fresh
inputs (benchmarks/responsecache's worker and window: every client connected and warm, then one common start
and end). With FIFO the high client waits behind the low ones' queue; with levels it should wait at most for
the batch running. All four servers start before round 0, get --warmup seconds of the same load (not reported),
and serve every round, one under load at a time, in an order rotated round by round.

Per window and class (high, low, and all requests): requests/s, p50, p99; the server's CPU time a request and its
rows an execution (its statistics' success over execution_count: the batches' size). The report gives medians
over the rounds [min-max], and per-round ratios: the high class's p50 and p99 with levels over FIFO (each
server), modelcache-levels over triton-levels, and what the levels cost the low class and the total (requests/s).
Sampled answers of every window are compared with plain ONNX Runtime's in this process (benchmarks/responsecache's
Checker, within 1e-3); a wrong answer ends the run with status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:      # benchmarks.* (run as a script from anywhere)
    sys.path.insert(0, str(ROOT))

from benchmarks.responsecache.run import (Checker, built_systems, latency_figures, ratios,  # noqa: E402
                                          run_and_report, start_modelcache, start_triton, window, write_repository)

SYSTEMS = ("triton-levels", "triton-fifo", "modelcache-levels", "modelcache-fifo")
LEVELS = "priority_levels: 2 default_priority_level: 2"
CLASSES = ("high", "low", "all")
SHOWN_ENV = ("LD_LIBRARY_PATH", "LD_PRELOAD", "MODELCACHE_")    # the settings report.txt prints of each server


def repositories(work: Path, model: str, max_batch_size: int) -> tuple[dict, dict, Path]:
    """({"levels": repo, "fifo": repo}, the model's input and output, its .onnx): one model, two queues."""
    from modelcache import zoo
    onnx_path = work / f"{model}.onnx"
    zoo.save(zoo.build(model), str(onnx_path))
    repos = {}
    for kind, batching in (("levels", f"dynamic_batching {{ {LEVELS} }}"), ("fifo", "dynamic_batching { }")):
        repo = work / f"repo-{kind}"
        io = write_repository(repo, model, onnx_path, max_batch_size, response_cache=False)
        with open(repo / model / "config.pbtxt", "a") as f:
            f.write(batching + "\n")
        repos[kind] = repo
    return repos, io, onnx_path


def settings_of(server) -> dict:
    """How a server was started: its command line and the environment that sets it (/proc: what it really got)."""
    try:
        env = dict(kv.split("=", 1) for kv in Path(f"/proc/{server.proc.pid}/environ").read_text().split("\0")
                   if "=" in kv)
    except OSError:
        env = {}
    return {"argv": [str(a) for a in server.proc.args],
            "env": {k: v for k, v in sorted(env.items()) if k.startswith(SHOWN_ENV)}}


def classes(args) -> list:
    """Each client's own settings: the high ones first (priority 1), then the low ones (no priority: level 2)."""
    return [{"priority": 1}] * args.high + [{}] * args.low


def one_window(server, model: str, io: dict, args, rnd: int, checker: Checker, seconds: float | None = None) -> dict:
    """A window of both classes on `server`: its figures by class, flat (high_p99_ms ...), answers checked."""
    row = window(server, model, io, 0, args, rnd, seconds, clients=classes(args))
    runs = row["_runs"]
    seconds = args.seconds if seconds is None else seconds
    flat = {"model": model, "distinct": 0, "round": rnd, "system": server.label}
    for name, part in (("high", runs[:args.high]), ("low", runs[args.high:]), ("all", runs)):
        flat.update({f"{name}_{k}": v for k, v in latency_figures(part, seconds).items()})
    flat.update(server_executions=row["server_executions"], server_success=row["server_success"],
                server_cpu_ms_per_request=row["server_cpu_ms_per_request"],
                client_cpu_ms_per_request=row["client_cpu_ms_per_request"])
    checker.check(server.label, 0, rnd, row)
    return flat


def run(args, systems: list, work: Path, results: dict) -> None:
    model = args.model
    repos, io, onnx_path = repositories(work, model, args.max_batch_size)
    results["configs"] = {kind: (repo / model / "config.pbtxt").read_text() for kind, repo in repos.items()}
    checker = Checker(onnx_path, io, args.seed)
    servers: dict = {}
    try:
        for label in systems:      # all started at once (Triton loads in C++, the daemons import their repository)
            repo = repos[label.split("-", 1)[1]]
            servers[label] = start_triton(label, repo, None, "glibc", work) if label.startswith("triton") else \
                start_modelcache(label, repo, 0, work)
        for s in servers.values():
            s.wait_ready(model)
            results["servers"][s.label] = settings_of(s)
        print(f"{model}: {', '.join(systems)} ready", file=sys.stderr, flush=True)
        if args.warmup > 0:        # untimed: the fronts, sessions and (modelcache's) run-time estimates warm
            for label in systems:
                results["warmup"].append(one_window(servers[label], model, io, args, -1, checker, args.warmup))
        for rnd in range(args.rounds):
            order = systems[rnd % len(systems):] + systems[:rnd % len(systems)]
            for label in order:
                row = one_window(servers[label], model, io, args, rnd, checker)
                results["windows"].append(row)
                print(f"round {rnd} {label}: " + "; ".join(
                    f"{c} {row[f'{c}_requests_s']:.1f} req/s p50 {row[f'{c}_p50_ms']:.1f} "
                    f"p99 {row[f'{c}_p99_ms']:.1f} ms" for c in CLASSES if row[f"{c}_requests"]),
                    file=sys.stderr, flush=True)
        says = [line.split(": ", 1)[-1] for s in servers.values() if s.label.startswith("modelcache")
                for line in s.log.read_text(errors="replace").splitlines() if "not honour" in line]
        results["modelcache_says"] = sorted(set(says))
        results["checks"] = {"answers": checker.answers, "fresh_samples_checked": int(checker.checked),
                             "max_abs_diff_vs_ort": checker.worst}
    finally:
        for s in servers.values():
            s.stop()
        results["loadavg"]["after"] = list(os.getloadavg())


def report(results: dict, out=sys.stdout) -> None:
    from modelcache.measure import summary
    a, ws = results["args"], results["windows"]
    print(f"{a['model']}, max_batch_size {a['max_batch_size']} with dynamic batching, one CPU instance: "
          f"{a['high']} high client(s) (priority=1) and {a['low']} low (no priority: level 2), tritonclient.grpc "
          f"processes, closed loop, batch 1, fresh inputs; {a['seconds']:g} s a window, {a['rounds']} rounds, systems "
          f"rotated each round, servers kept across rounds after {a['warmup']:g} s of the same load each. "
          f"Medians over rounds [min-max].", file=out)
    load = results.get("loadavg", {})
    if load:
        print(f"load average (1, 5, 15 min): before {' '.join(f'{v:.2f}' for v in load['before'])}, after "
              f"{' '.join(f'{v:.2f}' for v in load.get('after', ()))}", file=out)
    if results.get("skipped"):
        print(results["skipped"], file=out)
    print(f"{'system':<18} {'class':<5} {'req/s':>20} {'p50 ms':>20} {'p99 ms':>20} {'server CPU ms/req':>20} "
          f"{'rows/execution':>18}", file=out)
    for system in results["systems"]:
        rows = [w for w in ws if w["system"] == system]
        for c in CLASSES:
            col = lambda key: [r[key] for r in rows if r[key] is not None]   # noqa: E731
            cpu = summary(col("server_cpu_ms_per_request"), ".2f") if c == "all" else ""
            rows_per = summary([r["server_success"] / r["server_executions"] for r in rows if r["server_executions"]],
                               ".2f") if c == "all" else ""
            print(f"{system:<18} {c:<5} {summary(col(f'{c}_requests_s')):>20} {summary(col(f'{c}_p50_ms'), '.1f'):>20} "
                  f"{summary(col(f'{c}_p99_ms'), '.1f'):>20} {cpu:>20} {rows_per:>18}", file=out)
    print("per-round ratios, median [min-max]:", file=out)
    pairs = [("triton-levels", "triton-fifo"), ("modelcache-levels", "modelcache-fifo"),
             ("modelcache-levels", "triton-levels"), ("modelcache-fifo", "triton-fifo")]
    for num, den in pairs:
        cells = [f"{c} {what} x{summary(r, '.2f')}" for c, what, key in
                 (("high", "p50", "high_p50_ms"), ("high", "p99", "high_p99_ms"), ("high", "req/s", "high_requests_s"),
                  ("low", "req/s", "low_requests_s"), ("low", "p50", "low_p50_ms"),
                  ("all", "req/s", "all_requests_s"))
                 if (r := ratios(ws, a["model"], 0, num, den, key))]
        if cells:
            print(f"  {num}/{den}: " + "; ".join(cells), file=out)
    print("how each server was set:", file=out)
    for label, s in results["servers"].items():
        print(f"  {label}: {' '.join(s['argv'])}", file=out)
        for k, v in s["env"].items():
            print(f"    {k}={v}", file=out)
    for kind, text in results.get("configs", {}).items():
        print(f"config.pbtxt ({kind}):\n" + "".join(f"    {line}\n" for line in text.splitlines()), end="", file=out)
    for line in results.get("modelcache_says", []):
        print(f"modelcache said: {line}", file=out)
    c = results.get("checks")
    if c:
        print(f"answers: {c['answers']}, {c['fresh_samples_checked']} sampled ones against plain ORT, max abs diff "
              f"{c['max_abs_diff_vs_ort']:.3g}; wrong answers: 0", file=out)
    if results.get("failure"):
        print(f"FAILED: {results['failure']}", file=out)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="squeezenet1_1", help="a zoo model with a free batch dimension")
    ap.add_argument("--low", type=int, default=6, help="client processes with no priority (default 6)")
    ap.add_argument("--high", type=int, default=1, help="client processes with priority=1 (default 1)")
    ap.add_argument("--max-batch-size", type=int, default=1, help="the config's max_batch_size (default 1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--warmup", type=float, default=3.0,
                    help="seconds of the same load each server gets before round 0, not reported (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="the test's run: tiny-cnn, 2 low clients, 1 round of 1.5 s, no warm-up (Triton skipped "
                         "where not built)")
    ap.add_argument("--out", help="write OUT/report.txt (the command first) and OUT/results.json (every window)")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.low, args.rounds, args.seconds, args.warmup = "tiny-cnn", 2, 1, 1.5, 0.0
    if args.high < 1 or args.low < 0 or args.max_batch_size < 1:
        ap.error("--high >= 1, --low >= 0 and --max-batch-size >= 1 (priority levels need the dynamic batcher)")
    args.zipf = 1.0                    # (responsecache's window reads it; unused with fresh inputs)
    from modelcache.measure import compile_bytecode
    compile_bytecode()
    systems, skipped = built_systems(SYSTEMS)
    results = {"args": vars(args), "systems": systems, "skipped": skipped, "windows": [], "warmup": [], "servers": {},
               "modelcache_says": [], "checks": None, "failure": None,
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg": {"before": list(os.getloadavg())}}
    return run_and_report("priority", argv, results, report, lambda work: run(args, systems, work, results))


if __name__ == "__main__":
    sys.exit(main())
