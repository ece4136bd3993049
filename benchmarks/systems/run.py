"""FaaS systems at equal memory (issue 43, part 1): one invocation trace replayed against modelcache and what a
platform would run instead, each system's processes in a memory cgroup of the same size, every call's latency
from its arrival to its result.

    PYTHONPATH=. python -m benchmarks.systems.run --trace benchmarks/faas/azure-2019-slice/invocations.csv \\
        --minutes 546:566 --functions 24 --budgets 1,2,4 --out benchmarks/systems/azure
    PYTHONPATH=. python -m benchmarks.systems.run --trace synthetic --functions 24 --hours 0.5 \\
        --budgets 1,2,4 --out benchmarks/systems/synthetic

Systems (`--systems`, all by default):
  mc-attach         modelcache attach: each cold function instance a fresh process that opens its model by name
                    (modelcache.InferenceSession) and runs it; the daemon's default eviction policy (lru)
  mc-attach-hybrid  the same, the daemon running `hybrid` (keep-alive and pre-warm learned per model)
  mc-serve          modelcache serve: long-lived clients send requests, the daemon pages models in and out
  triton            Triton 2.51, native ORT backend, explicit model control, a ModelMesh-style LRU controller
  ort-mmap          ORT's memory-mapped .ort models, a process per function instance, the page cache the cache
  ort               plain ORT from the .onnx, a process per function instance
The process-per-instance systems (mc-attach*, ort-mmap, ort) run under one platform (faas_platform.py): warm
instances kept for the fixed keep-alive (Azure's 10 minutes, compressed like the trace), at most
--max-instances at once. mc-serve and triton get --max-instances calls in flight at most. Every ORT session:
intra-op threads not spinning; Triton's: its backend's defaults (one instance per model).

Each function gets its own copy of a zoo model (its own weights: nothing shared between functions), drawn with
the seed from --models (repeat a name to weigh it). Calls per function-minute are capped at --per-minute
(the trace's per-minute counts say which minutes each function is called in; the cap keeps two cores able to
run them all, the pattern of idle times kept). Memory-time is the box's usage (anonymous memory, tmpfs and
page cache: what its limit is enforced on) integrated over the replay; CPU-seconds are the box's (cpuacct).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

from modelcache.usage import Parser

from benchmarks.faas.sweep import read_trace, table, trace_source_arguments
from benchmarks.faas.trace import assign_models, invocations
from benchmarks.systems.box import Box, forget

GIB = 1 << 30
SYSTEMS = ("mc-attach", "mc-attach-hybrid", "mc-serve", "triton", "ort-mmap", "ort")
DEFAULT_MODELS = "tiny-cnn,squeezenet1_1,squeezenet1_1,googlenet,googlenet,resnet50,resnet50,vit_b_16"


def name_of(key: str) -> str:
    """A function's copy `arch#i` as every system names it (# is not allowed in either's names)."""
    return key.replace("#", ".f")


def pct(values: list[float], p: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]


# -- the trace and the models --------------------------------------------------------------------

def choose_functions(functions, count: int, window, seed: int):
    """`count` functions called in the window (all of them if fewer), drawn with the seed, in file order."""
    def called(f):
        return any(c > 0 and (window is None or window[0] <= f.first_minute + j < window[1])
                   for j, c in enumerate(f.counts))
    active = [f for f in functions if called(f)]
    if count >= len(active):
        return active
    keep = set(random.Random(seed).sample(range(len(active)), count))
    return [f for i, f in enumerate(active) if i in keep]


def build_models(keys: list[str], folder: Path, want_ort: bool, log) -> dict[str, Path]:
    """Each function's copy saved as NAME.onnx (and NAME.ort for ORT's mmap), once per folder."""
    from modelcache import zoo
    from modelcache.measure import ort_mmap_model
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for n, key in enumerate(sorted(keys)):
        arch, _, copy = key.partition("#")
        path = folder / f"{name_of(key)}.onnx"
        if not path.exists():
            zoo.save(zoo.build(arch, seed=int(copy or 0)), str(path) + ".tmp")
            Path(str(path) + ".tmp").rename(path)
        if want_ort:
            ort_mmap_model(str(path))
        paths[key] = path
        if n % 8 == 7:
            log(f"  {n + 1}/{len(keys)} models ready")
    return paths


def add_to_repository(repo: Path, paths: dict[str, Path], log) -> None:
    """Every copy added to a modelcache repository once (a daemon outside any box does it), nothing resident."""
    from modelcache.client.connection import connect
    from modelcache.measure import managed_daemon
    with tempfile.TemporaryDirectory(prefix="mc-systems-") as tmp, \
            managed_daemon(f"ipc://{tmp}/setup.sock", str(repo)) as sock, connect(sock) as c:
        have = {m["name"] for m in c.list()}
        for key, path in paths.items():
            if name_of(key) not in have:
                c.add(str(path), name_of(key))
        for m in c.list():
            if m["tier"] != "disk":
                c.evict(m["name"], m["version"])
    log(f"  {len(paths)} models in the repository {repo}")


# -- one system in one box -----------------------------------------------------------------------

class System:
    """Start a system in `box`, `call(inv)` from many threads, `stop()`; `extra()` says what it counted."""

    def __init__(self, kind: str, box: Box, work: Path, paths: dict[str, Path], repo: Path, compress: float,
                 keep_alive_s: float, max_instances: int, log_file):
        self.kind, self.box, self.paths = kind, box, paths
        self.daemon = self.platform = self.serve = self.triton = self.controller = None
        self.before: dict = {}
        env = dict(os.environ)
        if kind.startswith("mc-"):
            from contextlib import ExitStack

            from benchmarks.faas.real_replay import daemon_command
            from modelcache.client.connection import connect
            from modelcache.measure import managed_daemon
            self.socket = f"ipc://{work}/{kind}.sock"
            policy = "hybrid" if kind.endswith("hybrid") else "lru"
            self.daemon = ExitStack()
            self.daemon.enter_context(managed_daemon(
                self.socket, str(repo), env={"MODELCACHE_EVICTION_POLICY": policy},
                log_path=str(work / f"{kind}-daemon.log"), command=box.command(daemon_command(compress))))
            with connect(self.socket) as c:
                self.before = dict(c.stats().counters)
            env["MODELCACHE_SOCKET"] = self.socket
        if kind in ("mc-attach", "mc-attach-hybrid", "ort-mmap", "ort"):
            from benchmarks.systems.faas_platform import Platform
            self.platform = Platform("attach" if kind.startswith("mc-") else kind, box.command, env, keep_alive_s,
                                     max_instances, log_file)
        elif kind == "mc-serve":
            from benchmarks.faas.real_replay import _ServeClients
            self.serve = _ServeClients(self.socket)
        elif kind == "triton":
            from benchmarks.systems.triton import LruController, TritonServer, write_repository
            from modelcache import zoo
            write_repository(work / "triton-repo", {name_of(k): str(p) for k, p in paths.items()})
            self.triton = TritonServer(work / "triton-repo", box.command, log_file)
            self.controller = LruController(self.triton, box, {name_of(k): p.stat().st_size for k, p in paths.items()})
            self.feeds = {}
            for k, p in paths.items():
                arch = k.split("#")[0]
                if arch not in self.feeds:
                    self.feeds[arch] = {n: v for n, v in zoo.sample_inputs(str(p)).items()}

    def call(self, function: str, key: str) -> dict:
        try:
            if self.platform is not None:
                return self.platform.call(function, str(self.paths[key]), name_of(key))
            if self.serve is not None:
                return self.serve.call(name_of(key))
            return self.controller.call(name_of(key), self.feeds[key.split("#")[0]])
        except Exception as e:   # the call's failure is its result, not the replay's
            return {"error": f"{type(e).__name__}: {str(e)[:300]}"}

    def extra(self) -> dict:
        out = {}
        if self.platform is not None:
            p = self.platform
            out.update(instances_started=p.started, stopped_idle=p.stopped_idle, stopped_for_room=p.stopped_for_room)
        if self.controller is not None:
            out.update(loads=self.controller.loads, unloads=self.controller.unloads)
        if self.daemon is not None:
            from modelcache.client.connection import connect
            try:
                with connect(self.socket, timeout_s=5) as c:
                    after = c.stats().counters
                out.update({k: after.get(k, 0) - self.before.get(k, 0)
                            for k in ("promotions", "evictions", "pressure_evictions", "refused", "opens_from_disk")})
            except Exception as e:
                out["daemon"] = f"not answering after the replay: {type(e).__name__}: {e}"
        return out

    def stop(self) -> None:
        for close in (self.platform and self.platform.close, self.serve and self.serve.close,
                      self.triton and self.triton.stop):
            if close:
                try:
                    close()
                except Exception:
                    pass
        if self.daemon is not None:
            try:
                self.daemon.close()
            except Exception:
                pass


def replay(system: System, calls, concurrency: int, grace_s: float) -> tuple[list[dict], float]:
    """Every call at its (compressed) time; each record's `ms` from its arrival to its result. A call still
    unanswered `grace_s` after the last arrival fails (a system that thrashes would otherwise hold the replay
    for as long as it crawls); the caller then stops the system."""
    records, lock, over = {}, threading.Lock(), threading.Event()

    def one(i, inv, due: float) -> None:
        r = system.call(inv.function, inv.model)
        r.update(t=inv.t, function=inv.function, model=inv.model, ms=(time.monotonic() - due) * 1e3)
        with lock:
            if not over.is_set():
                records[i] = r

    t0 = time.monotonic() + 0.2
    pool = ThreadPoolExecutor(concurrency)
    futures = []
    for i, inv in enumerate(calls):
        time.sleep(max(0.0, t0 + inv.t - time.monotonic()))
        futures.append(pool.submit(one, i, inv, t0 + inv.t))
    wait(futures, timeout=max(0.0, t0 + calls[-1].t + grace_s - time.monotonic()))
    with lock:
        over.set()
        for i, inv in enumerate(calls):
            if i not in records:
                records[i] = {"t": inv.t, "function": inv.function, "model": inv.model, "ms": math.nan,
                              "error": f"timeout: unanswered {grace_s:.0f} s after the trace's last call"}
    pool.shutdown(wait=False, cancel_futures=True)   # (those in flight end when the system stops)
    return [records[i] for i in range(len(calls))], time.monotonic() - t0


def run_one(kind: str, budget: int, args, work: Path, paths, repo: Path, calls, log) -> tuple[dict, list[dict]]:
    box = Box.make(f"mc-systems-{kind}-{os.getpid()}", budget)
    if box is None:
        sys.exit(f"no memory cgroup for the budget: {Box.why} (run as root where a memory controller is mounted)")
    forget(list(paths.values()) + [p.with_suffix(".ort") for p in paths.values()] + list(repo.rglob("*")))
    system, records, wall, error = None, [], 0.0, ""
    with open(work / f"{kind}.log", "ab") as log_file:
        try:
            system = System(kind, box, work, paths, repo, args.compress, args.keep_alive_s / args.compress,
                            args.max_instances, log_file)
            box.start_sampling(args.sample_s)
            concurrency = 512 if system.platform is not None else args.max_instances
            records, wall = replay(system, calls, concurrency, args.grace_s)
        except Exception as e:          # the system did not start, or died: it fails at this budget
            error = f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            box.stop_sampling()
            extra = system.extra() if system else {}
            cpu, kills = box.cpu_seconds(), box.oom_kills()
            if system:
                system.stop()
            box.remove()
    ok = [r for r in records if "error" not in r]
    timeouts = sum(1 for r in records if r.get("error", "").startswith("timeout"))
    errors = sorted({r["error"].split(":")[0] + ": " + r["error"].split(":", 1)[-1].strip()[:120]
                     for r in records if "error" in r})
    lat = [r["ms"] for r in ok]
    row = {"system": kind, "budget_gib": round(budget / GIB, 3), "calls": len(calls),
           "failed": len(calls) - len(ok), "timeouts": timeouts, "oom_kills": kills, "cold": sum(1 for r in ok if r.get("cold")),
           "p50_ms": pct(lat, 50), "p90_ms": pct(lat, 90), "p99_ms": pct(lat, 99), "p999_ms": pct(lat, 99.9),
           "gib_s": box.byte_s / GIB, "peak_gib": box.peak / GIB, "cpu_s": cpu, "wall_s": wall,
           "error": error, "errors": errors[:5], **extra}
    if kind == "mc-serve":     # serve replies do not say where the weights were: a promotion is a cold start
        row["cold"] = min(len(ok), extra.get("promotions", 0))
    log(f"  {kind} at {budget / GIB:g} GiB: {row['failed']} failed, {row['oom_kills']} OOM kills, cold {row['cold']}, "
        f"p50 {row['p50_ms']:.0f} p99 {row['p99_ms']:.0f} ms, {row['gib_s']:.1f} GiB*s, cpu {cpu or 0:.0f} s"
        + (f"; {error}" if error else "") + (f"; {errors[0]}" if errors else ""))
    return row, [{"system": kind, "budget_gib": row["budget_gib"], **r} for r in records]


# -- the report ----------------------------------------------------------------------------------

COLUMNS = [("system", "system", "{}"), ("budget_gib", "budget GiB", "{:g}"), ("calls", "calls", "{}"),
           ("failed", "failed", "{}"), ("timeouts", "timeouts", "{}"), ("oom_kills", "OOM kills", "{}"), ("cold", "cold", "{}"),
           ("p50_ms", "p50 ms", "{:.0f}"), ("p90_ms", "p90", "{:.0f}"), ("p99_ms", "p99", "{:.0f}"),
           ("p999_ms", "p99.9", "{:.0f}"), ("gib_s", "GiB*s", "{:.0f}"), ("peak_gib", "peak GiB", "{:.2f}"),
           ("cpu_s", "CPU s", "{:.0f}")]


def verdict(rows: list[dict]) -> list[str]:
    """Per budget: modelcache's best mode against the best alternative (the goal: <= 0.5x its p99, 0 failures)."""
    lines = []
    for budget in dict.fromkeys(r["budget_gib"] for r in rows):
        here = [r for r in rows if r["budget_gib"] == budget and r["failed"] == 0]
        ours = [r for r in here if r["system"].startswith("mc-")]
        theirs = [r for r in here if not r["system"].startswith("mc-")]
        failing = [f"{r['system']} ({r['failed']} failed, {r['oom_kills']} OOM kills)" for r in rows
                   if r["budget_gib"] == budget and r["failed"]]
        line = f"{budget:g} GiB: "
        if ours and theirs:
            a, b = min(ours, key=lambda r: r["p99_ms"]), min(theirs, key=lambda r: r["p99_ms"])
            line += (f"modelcache's best {a['system']} p99 {a['p99_ms']:.0f} ms = {a['p99_ms'] / b['p99_ms']:.2f}x the "
                     f"best alternative's ({b['system']}, {b['p99_ms']:.0f} ms); memory-time "
                     f"{a['gib_s'] / b['gib_s']:.2f}x")
        elif ours:
            line += f"every alternative failed; modelcache's best {min(ours, key=lambda r: r['p99_ms'])['system']} did not"
        else:
            line += "no modelcache mode ran without failures"
        lines.append(line + (f"; failing: {', '.join(failing)}" if failing else ""))
    return lines


def report(data: dict, out=sys.stdout) -> None:
    a = data["args"]
    print(f"{data['trace']}, {data.get('functions', '?')} functions replayed: {data['calls']} calls over {data['trace_s']:.0f} s of trace time, compressed "
          f"{a['compress']:g}x (at most {a['per_minute']} a function-minute); {data['models']} models "
          f"({data['mix']}), {data['model_bytes'] / GIB:.2f} GiB of .onnx together; keep-alive "
          f"{a['keep_alive_s']:g} s of trace time, at most {a['max_instances']} instances or calls in flight", file=out)
    print(table(data["rows"], COLUMNS), file=out)
    for r in data["rows"]:
        if r["error"] or r["errors"]:
            print(f"  {r['system']} at {r['budget_gib']:g} GiB: " + "; ".join(filter(None, [r["error"], *r["errors"]])),
                  file=out)
    print("\n" + "\n".join(verdict(data["rows"])), file=out)


def plots(data: dict, records: list[dict], out: Path) -> list[Path]:
    from modelcache.plotting import pyplot
    plt = pyplot()
    if plt is None:
        return []
    systems = list(dict.fromkeys(r["system"] for r in data["rows"]))
    budgets = sorted({r["budget_gib"] for r in data["rows"]})
    fig, axes = plt.subplots(1, len(budgets), figsize=(4.5 * len(budgets), 4), sharey=True, squeeze=False)
    for ax, b in zip(axes[0], budgets):
        for s in systems:
            ms = sorted(r["ms"] for r in records if r["system"] == s and r["budget_gib"] == b and "error" not in r)
            if ms:
                ax.plot(ms, [(i + 1) / len(ms) for i in range(len(ms))], label=s)
        ax.set_xscale("log")
        ax.set_title(f"{b:g} GiB", fontsize=9)
        ax.set_xlabel("arrival to result (ms)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("fraction of answered calls")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"{data['trace']}, {data.get('functions', '?')} functions replayed", fontsize=9)
    fig.tight_layout()
    cdf = out / "latency-cdf.png"
    fig.savefig(cdf, dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in systems:
        pts = [(r["budget_gib"], r["p99_ms"], r["failed"]) for r in data["rows"] if r["system"] == s]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
        for x, y, f in pts:
            if f:
                ax.annotate(f"{f} failed", (x, y), fontsize=6)
    ax.set_yscale("log")
    ax.set_xlabel("memory budget (GiB, enforced)")
    ax.set_ylabel("p99 arrival to result (ms)")
    ax.set_title(f"{data['trace']}, {data.get('functions', '?')} functions replayed", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    p99 = out / "p99-vs-budget.png"
    fig.savefig(p99, dpi=110)
    plt.close(fig)
    return [cdf, p99]


def main(argv=None) -> int:
    ap = Parser(prog="python -m benchmarks.systems.run", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    trace_source_arguments(ap, 24, 0.5, "how many functions (a CSV: drawn from those it calls)")
    ap.add_argument("--models", default=DEFAULT_MODELS, help=f"zoo models drawn from (default {DEFAULT_MODELS})")
    ap.add_argument("--per-minute", type=int, default=2, help="calls a function-minute at most (default 2)")
    ap.add_argument("--compress", type=float, default=15.0, help="divide trace time by this (default 15)")
    ap.add_argument("--budgets", default="1,2,4", help="memory budgets in GiB (default 1,2,4)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    ap.add_argument("--keep-alive-s", type=float, default=600.0, help="the platform's keep-alive, trace seconds")
    ap.add_argument("--max-instances", type=int, default=8, help="instances (or calls in flight) at most (default 8)")
    ap.add_argument("--grace-s", type=float, default=60.0,
                    help="a call unanswered this long after the last arrival fails (default 60 s)")
    ap.add_argument("--sample-s", type=float, default=0.1, help="memory sampling interval (default 0.1 s)")
    ap.add_argument("--work", default="", help="keep the models and repository here between runs (default: temporary)")
    ap.add_argument("--out", help="report.txt, results.json, calls.csv.gz and the plots here")
    ap.add_argument("--update", action="store_true",
                    help="keep OUT's other rows: rerun only --systems at --budgets (same trace and arguments)")
    args = ap.parse_args(argv)
    if args.update and not args.out:
        ap.error("--update needs --out: the run whose rows it keeps")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or set(systems) - set(SYSTEMS):
        ap.error(f"--systems: choose from {', '.join(SYSTEMS)}")
    if args.compress <= 0 or args.max_instances < 1 or args.per_minute < 1:
        ap.error("--compress must be positive, --max-instances and --per-minute at least 1")
    budgets = [int(float(b) * GIB) for b in args.budgets.split(",")]
    if "triton" in systems:
        from benchmarks.systems.triton import PEER, peer_paths
        if peer_paths() is None:
            ap.error(f"--systems triton: no Triton peer built here (run {PEER}/build.sh), or leave it out")
    log = lambda s: print(s, file=sys.stderr, flush=True)   # noqa: E731
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    try:
        label, functions = read_trace(args, out)
    except ValueError as e:
        ap.error(str(e))
    functions = [dataclasses.replace(f, counts=tuple(min(c, args.per_minute) for c in f.counts))
                 for f in choose_functions(functions, args.functions, args.minutes, args.seed)]
    catalogue = [(m.strip(), 0) for m in args.models.split(",") if m.strip()]
    models = assign_models(functions, catalogue, args.seed)
    calls = invocations(functions, models, args.seed, args.compress, args.minutes)
    if not calls:
        ap.error("no calls in the window replayed")
    with tempfile.TemporaryDirectory(prefix="mc-systems-") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        keys = sorted({m for m, _ in models.values()})
        log(f"{label}: {len(calls)} calls, {len(keys)} models; building them ...")
        paths = build_models(keys, work / "models", "ort-mmap" in systems, log)
        repo = work / "repo"
        if any(s.startswith("mc-") for s in systems):
            add_to_repository(repo, paths, log)
        rows, records = [], []
        for i, budget in enumerate(budgets):
            order = systems[i % len(systems):] + systems[:i % len(systems)]   # a different system first each time
            for kind in order:
                log(f"{kind} at {budget / GIB:g} GiB: {len(calls)} calls over {calls[-1].t:.0f} s ...")
                row, recs = run_one(kind, budget, args, Path(tmp), paths, repo, calls, log)
                rows.append(row)
                records += recs
        if args.update:
            rows, records = kept_from(out, label, len(calls), rows, records, ap)
        rows.sort(key=lambda r: (r["budget_gib"], SYSTEMS.index(r["system"])))
        mix = {}
        for k in keys:
            mix[k.split("#")[0]] = mix.get(k.split("#")[0], 0) + 1
        data = {"trace": label, "args": {**vars(args), "minutes": args.minutes}, "calls": len(calls),
                "trace_s": calls[-1].t * args.compress, "models": len(keys), "functions": len(functions),
                "mix": ", ".join(f"{n} {a}" for a, n in mix.items()),
                "model_bytes": sum(p.stat().st_size for p in paths.values()), "rows": rows}
    report(data)
    if out:
        from modelcache.measure import save_results
        save_results(str(out), "systems", argv, data, report, command="python -m benchmarks.systems.run")
        write_calls(out / "calls.csv.gz", records)
        for p in plots(data, records, out):
            print(f"figure: {p}")
    return 0


def kept_from(out: Path, label: str, calls: int, rows: list[dict], records: list[dict], ap) -> tuple[list, list]:
    """`rows` and `records` with the rows of OUT's earlier run that this one did not replace (--update)."""
    import csv
    import gzip
    try:
        old = json.loads((out / "results.json").read_text())
        with gzip.open(out / "calls.csv.gz", "rt", newline="") as f:
            old_records = list(csv.DictReader(f))
    except (OSError, ValueError) as e:
        ap.error(f"--update: cannot read the earlier run in {out}: {e}")
    if old.get("trace") != label or old.get("calls") != calls:
        ap.error(f"--update: {out} holds a run of another trace ({old.get('trace')}, {old.get('calls')} calls)")
    done = {(r["system"], r["budget_gib"]) for r in rows}
    kept = [r for r in old["rows"] if (r["system"], r["budget_gib"]) not in done]
    for r in old_records:
        r["budget_gib"], r["ms"], r["t"] = float(r["budget_gib"]), float(r["ms"]), float(r["t"])
        if not r["error"]:
            del r["error"]
    return kept + rows, [r for r in old_records if (r["system"], r["budget_gib"]) not in done] + records


def write_calls(path: Path, records: list[dict]) -> None:
    import csv
    import gzip
    fields = ["system", "budget_gib", "t", "model", "ms", "cold", "wait_ms", "start_ms", "run_ms", "hit", "error"]
    with gzip.open(path, "wt", newline="") as f:
        w = csv.DictWriter(f, fields, extrasaction="ignore")
        w.writeheader()
        for r in sorted(records, key=lambda r: (r["system"], r["budget_gib"], r["t"])):
            w.writerow({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()})


if __name__ == "__main__":
    sys.exit(main())
