"""Serving benchmark: batching policies under open-loop Poisson load (LBCI / StarONNX style).

    modelcache bench serve [--models alexnet resnet50] [--policies serial batch dynamic layer]
                           [--loads 0.25 0.5 0.75 1 1.5 2] [--duration 8] [--out DIR]

Per model, once: add it, split it into --stages, and calibrate (stage times per batch size,
g(b), N_opt at t_opt; stored with the model). t_opt defaults to 5x a batch-1 request's
round trip. Rates are fractions (--loads) of the serial capacity 1 / (that round trip),
so the sweep scales to the machine; "medium" load is --medium (default 0.5) of it.

One daemon per model (one worker group of every core) serves every point; between points its
batching policy is switched by rewriting its config file and SIGHUP, so each rate runs all
policies back to back and the machine's noise touches them alike. At each point
--clients generator processes send one-sample requests at Poisson times (latency counts
from the scheduled send time), --warmup seconds are excluded, requests carry a deadline of
--deadline-factor x t_opt so an overload drains instead of queueing without end.
Then the maximum sustainable rate (p99 <= t_opt) of each policy is found by bisection
between its highest passing and lowest failing rate of the sweep, policies interleaved.

Policies: serial (one request at a time), batch (LBCI's Batchsize(m): m = --batch-m, or
whatever arrived within --window-ms), dynamic (Triton: up to N_opt as soon as the worker is
free), layer (LBCI's layer-to-layer: starts at once, absorbs newcomers at stage boundaries
while every member's predicted finish stays within t_opt).

--threads-vs-processes N instead: N threads of one process, each with its own serve session, against
N processes of one session each, closed loop under dynamic batching, paired and alternated over
--rounds; prints batches formed, mean batch size and req/s of each.

Writes OUT/serve.csv, OUT/results.json, OUT/report.txt, and per model
OUT/<model>-latency.png (latency vs throughput) and OUT/<model>-bars.png (mean latency per rate).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..plotting import pyplot
from ..measure import ensure_models, managed_daemon, save_results
from ..usage import Parser

POLICIES = ("serial", "batch", "dynamic", "layer")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; inf entries (requests that never made it) count as the slowest."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s))) - 1))]


def summarize(requests: list, warmup_s: float, duration_s: float, t_opt_s: float) -> dict:
    """Figures over the requests scheduled after the warm-up."""
    window = [r for r in requests if r[0] >= warmup_s]
    measured_s = duration_s - warmup_s
    ok = [r[1] for r in window if r[2] is None and r[1] is not None]
    lat = ok + [float("inf")] * (len(window) - len(ok))
    good = sum(1 for x in ok if x <= t_opt_s)
    batches = [r[3] for r in window if r[2] is None and r[3]]
    return {"sent": len(window), "completed": len(ok),
            "throughput_rps": len(ok) / measured_s, "goodput_rps": good / measured_s,
            "timeout_ratio": 1 - good / len(window) if window else float("nan"),
            "errors": len(window) - len(ok),
            "mean_ms": statistics.fmean(ok) * 1e3 if ok else float("nan"),
            "mean_batch": statistics.fmean(batches) if batches else float("nan"),
            "p50_ms": percentile(lat, 50) * 1e3, "p90_ms": percentile(lat, 90) * 1e3,
            "p99_ms": percentile(lat, 99) * 1e3}


def load_point(socket: str, model: str, rate: float, clients: int, duration_s: float, warmup_s: float,
               t_opt_s: float, deadline_factor: float, seed: int) -> dict:
    """Run the generators at `rate` requests/s in total; the figures of the measured window."""
    start_at = time.time() + 1.0   # every generator has connected and encoded its input by then
    procs = []
    for k in range(clients):
        cfg = {"socket": socket, "model": model, "rate": rate / clients, "duration_s": duration_s,
               "drain_s": deadline_factor * t_opt_s + 1.0, "deadline_ms": deadline_factor * t_opt_s * 1e3,
               "seed": seed * 1000 + k, "start_at": start_at}
        procs.append(subprocess.Popen([sys.executable, "-m", "modelcache.bench.serve_client", json.dumps(cfg)],
                                      stdout=subprocess.PIPE, text=True))
    requests, late = [], 0
    for p in procs:
        out, _ = p.communicate(timeout=duration_s + deadline_factor * t_opt_s + 120)
        if p.returncode != 0:
            raise RuntimeError(f"a load generator failed (exit {p.returncode})")
        result = json.loads(out)
        requests += result["requests"]
        late += result["late_sends"]
    point = summarize(requests, warmup_s, duration_s, t_opt_s)
    point.update(rate_rps=rate, late_sends=late)
    return point


def sustainable(point: dict, t_opt_ms: float) -> bool:
    return point["sent"] > 0 and point["p99_ms"] <= t_opt_ms


def bisect_max_rates(run_all, sweeps: dict, t_opt_ms: float, steps: int) -> tuple[dict, dict]:
    """Per policy, the highest rate with p99 <= t_opt: bisection between the sweep's best pass and the
    first fail above it. Each step runs every policy's midpoint back to back (`run_all({policy: rate})`),
    so a noisy spell on the machine touches all policies alike."""
    bounds = {}
    for policy, sweep in sweeps.items():
        passing = [p["rate_rps"] for p in sweep if sustainable(p, t_opt_ms)]
        lo = max(passing) if passing else 0.0
        failing = [p["rate_rps"] for p in sweep if p["rate_rps"] > lo and not sustainable(p, t_opt_ms)]
        bounds[policy] = [lo, min(failing) if failing else 2 * max(p["rate_rps"] for p in sweep)]
    tried = {policy: [] for policy in sweeps}
    for _ in range(steps):
        points = run_all({policy: sum(b) / 2 for policy, b in bounds.items()})
        for policy, point in points.items():
            point["phase"] = "bisect"
            tried[policy].append(point)
            bounds[policy][0 if sustainable(point, t_opt_ms) else 1] = point["rate_rps"]
    return {policy: b[0] for policy, b in bounds.items()}, tried


def prepare(socket: str, name: str, src_dir: Path, stages: int, t_opt_ms: float | None, batches: list[int]) -> dict:
    from ..client.calibrate import calibrate
    from ..client.connection import connect
    ensure_models(socket, [name], src_dir)
    with connect(socket, timeout_s=600) as c:
        if stages > 1:
            c.partition(name, stages=stages)
        profile = calibrate(c, name, batches, runs=7, t_opt_ms=t_opt_ms,
                            progress=lambda line: print(f"  {name} {line}", file=sys.stderr, flush=True))
    return profile


class PolicySwitch:
    """Switch the running daemon's batching policy: rewrite its config file, SIGHUP, wait until applied.

    One daemon for every policy lets each rate run all policies back to back (the machine's noise
    then touches them alike), and sessions, caches and performance models stay warm across them."""

    def __init__(self, socket: str, config: Path, args):
        self.socket, self.config, self.args = socket, config, args

    def __call__(self, policy: str) -> None:
        import signal
        from ..client.connection import connect
        max_batch = self.args.batch_m if policy == "batch" else 0   # 0: the calibrated N_opt
        self.config.write_text(f'batching = "{policy}"\nmax_batch = {max_batch}\n'
                               f"batch_window_ms = {self.args.window_ms}\n")
        with connect(self.socket) as c:
            os.kill(c.stats().pid, signal.SIGHUP)
            deadline = time.monotonic() + 30
            while True:  # applied, and nothing left from the previous point
                ex = c.stats().executor
                if ex["batching"]["policies"] == {"*": policy} and not ex["in_flight"] and not ex.get("queued"):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the daemon did not switch to {policy} and drain within 30 s")
                time.sleep(0.1)


def run_bench(args) -> dict:
    """The whole benchmark, in --work (kept) or in a temporary directory (removed at the end)."""
    if args.work:
        Path(args.work).mkdir(parents=True, exist_ok=True)
        return _run_in(Path(args.work), args)
    with tempfile.TemporaryDirectory(prefix="modelcache-bench-serve-") as tmp:
        return _run_in(Path(tmp), args)


def _run_in(tmp: Path, args) -> dict:
    socket = f"ipc://{tmp}/serve.sock"
    repo = str(tmp / "repo")
    config = tmp / "batching.toml"
    config.write_text('batching = "serial"\n')
    for key in ("BATCHING", "MAX_BATCH", "BATCH_WINDOW_MS", "MAX_QUEUE_DELAY_MS", "T_OPT_MS"):
        os.environ.pop(f"MODELCACHE_{key}", None)   # the config file decides them, and reloads
    os.environ.update({"MODELCACHE_WORKERS": args.workers, "MODELCACHE_STATE_DIR": str(tmp / "state"),
                       "MODELCACHE_CONFIG": str(config)})
    results = {"models": {}, "settings": vars(args)}
    switch = PolicySwitch(socket, config, args)
    for name in args.models:
        print(f"{name}: add, partition into {args.stages}, calibrate ...", file=sys.stderr, flush=True)
        with managed_daemon(socket, repo):
            profile = prepare(socket, name, tmp / "src", args.stages, args.t_opt_ms, args.batches)
            t_opt_ms = profile["t_opt_ms"]
            capacity = 1.0 / profile["request_s"][0]      # serial: one batch-1 request after another
            rates = [round(f * capacity, 2) for f in args.loads]
            model = results["models"][name] = {"profile": profile, "t_opt_ms": t_opt_ms,
                                               "serial_capacity_rps": capacity, "rates": rates,
                                               "medium_rps": round(args.medium * capacity, 2), "policies": {}}
            print(f"{name}: t_opt {t_opt_ms:.0f} ms, N_opt {profile['n_opt']}, serial capacity {capacity:.1f} "
                  f"req/s; rates {rates}", file=sys.stderr, flush=True)
            seeds = iter(range(1, 10**6))

            def run(policy, rate):
                switch(policy)
                p = load_point(socket, name, rate, args.clients, args.duration, args.warmup,
                               t_opt_ms / 1e3, args.deadline_factor, next(seeds))
                print(f"  {name} {policy:8s} {rate:7.2f} req/s: p50 {p['p50_ms']:8.1f}  p99 {p['p99_ms']:8.1f} ms  "
                      f"thr {p['throughput_rps']:6.2f}  good {p['goodput_rps']:6.2f}  "
                      f"timeouts {100 * p['timeout_ratio']:5.1f}%", file=sys.stderr, flush=True)
                return p

            run(args.policies[0], rates[0])  # warm-up: promotes the model and builds the stage sessions
            sweeps = {policy: [] for policy in args.policies}
            for rate in rates:
                for policy in args.policies:
                    point = run(policy, rate)
                    point["phase"] = "sweep"
                    sweeps[policy].append(point)
            best, tried = bisect_max_rates(lambda mids: {pol: run(pol, r) for pol, r in mids.items()},
                                           sweeps, t_opt_ms, args.bisect_steps)
            from ..client.connection import connect
            with connect(socket) as c:
                batching = c.stats().executor["batching"]
            for policy in args.policies:
                model["policies"][policy] = {"sweep": sweeps[policy], "bisect": tried[policy],
                                             "max_rate_rps": best[policy]}
            model["batching_counters"] = batching
    return results


def threads_vs_processes(args) -> dict:
    """N threads of one process against N processes, each a closed loop of serve-mode runs, alternated."""
    from ..client.connection import connect
    n, rounds = args.threads_vs_processes, args.rounds
    with tempfile.TemporaryDirectory(prefix="modelcache-bench-serve-") as tmp:
        socket = f"ipc://{tmp}/serve.sock"
        env = {"MODELCACHE_WORKERS": args.workers, "MODELCACHE_STATE_DIR": f"{tmp}/state",
               "MODELCACHE_BATCHING": "dynamic"}
        with managed_daemon(socket, f"{tmp}/repo", env=env):
            ensure_models(socket, args.models[:1], Path(tmp) / "src")
            rows = {"threads": [], "processes": []}
            for r in range(rounds):
                for shape in (("threads", "processes") if r % 2 == 0 else ("processes", "threads")):
                    cfg = {"socket": socket, "model": args.models[0], "duration_s": args.duration,
                           "start_at": time.time() + 1.5}
                    processes = 1 if shape == "threads" else n
                    with connect(socket) as c:
                        before = c.stats().executor["batching"]
                    procs = [subprocess.Popen([sys.executable, "-m", "modelcache.bench.serve_client",
                                               json.dumps({**cfg, "threads": n if shape == "threads" else 1,
                                                           "seed": k})], stdout=subprocess.PIPE, text=True)
                             for k in range(processes)]
                    requests = sum(json.loads(p.communicate(timeout=args.duration + 120)[0])["requests"]
                                   for p in procs)
                    with connect(socket) as c:
                        after = c.stats().executor["batching"]
                    batches = after["batches"] - before["batches"]
                    samples = after["batches"] * (after["mean_batch"] or 0) - before["batches"] * (before["mean_batch"] or 0)
                    row = {"round": r, "batches": batches, "mean_batch": samples / batches if batches else float("nan"),
                           "rps": requests / args.duration, "requests": requests}
                    rows[shape].append(row)
                    print(f"  round {r} {n} {shape:9s}: {batches:5d} batches, mean batch {row['mean_batch']:5.2f}, "
                          f"{row['rps']:7.1f} req/s", file=sys.stderr, flush=True)
    summary = {shape: {"batches": statistics.median(x["batches"] for x in rs),
                       "mean_batch": statistics.median(x["mean_batch"] for x in rs),
                       "rps": statistics.median(x["rps"] for x in rs)} for shape, rs in rows.items()}
    print(f"\n{args.models[0]}, dynamic batching, {n} threads of one process vs {n} processes, "
          f"{rounds} rounds of {args.duration:g} s (median per round):")
    for shape, m in summary.items():
        print(f"  {n} {shape:9s}: {m['batches']:7.1f} batches  mean batch {m['mean_batch']:5.2f}  {m['rps']:7.1f} req/s")
    return {"rows": rows, "summary": summary}


def comparisons(model: dict) -> dict:
    """The issue's two targets, from one run: layer vs batch(m) mean latency at medium load,
    layer vs serial max sustainable rate."""
    pol = model["policies"]
    out = {}
    if "layer" in pol and "batch" in pol:
        medium = min(model["rates"], key=lambda r: abs(r - model["medium_rps"]))
        at = {p: next(x for x in pol[p]["sweep"] if x["rate_rps"] == medium) for p in ("layer", "batch")}
        out["medium_rps"] = medium
        out["mean_latency_cut_vs_batch"] = 1 - at["layer"]["mean_ms"] / at["batch"]["mean_ms"]
    if "layer" in pol and "serial" in pol and pol["serial"]["max_rate_rps"] > 0:
        out["max_rate_gain_vs_serial"] = pol["layer"]["max_rate_rps"] / pol["serial"]["max_rate_rps"] - 1
    return out


def report(res: dict, out=sys.stdout) -> None:
    for name, model in res["models"].items():
        print(f"\n{name}: t_opt {model['t_opt_ms']:.0f} ms, N_opt {model['profile']['n_opt']}, "
              f"rates scaled to {model['serial_capacity_rps']:.1f} req/s = 1 / batch-1 round trip at calibration",
              file=out)
        prof = model["profile"]
        print("calibration (whole model, per batch size): " + ", ".join(
            f"{b}: {sum(st) * 1e3:.1f} ms ({sum(st) * 1e3 / b:.1f}/sample)" for b, st in zip(prof["batches"], prof["stage_s"])),
            file=out)
        print(f"{'policy':8s} {'rate':>7s} {'thr':>7s} {'good':>7s} {'mean':>8s} {'p50':>8s} {'p90':>8s} "
              f"{'p99':>8s} {'timeout':>8s} {'batch':>6s}", file=out)
        for policy, r in model["policies"].items():
            for p in r["sweep"]:
                print(f"{policy:8s} {p['rate_rps']:7.2f} {p['throughput_rps']:7.2f} {p['goodput_rps']:7.2f} "
                      f"{p['mean_ms']:8.1f} {p['p50_ms']:8.1f} {p['p90_ms']:8.1f} {p['p99_ms']:8.1f} "
                      f"{100 * p['timeout_ratio']:7.1f}% {p['mean_batch']:6.2f}", file=out)
        print("max sustainable rate (p99 <= t_opt): " + ", ".join(
            f"{p} {r['max_rate_rps']:.1f}" for p, r in model["policies"].items()) + " req/s", file=out)
        c = comparisons(model)
        if "mean_latency_cut_vs_batch" in c:
            print(f"layer vs batch(m) mean latency at {c['medium_rps']} req/s: "
                  f"{100 * c['mean_latency_cut_vs_batch']:+.0f}% lower (target >= 20%)", file=out)
        if "max_rate_gain_vs_serial" in c:
            print(f"layer vs serial max sustainable rate: {100 * c['max_rate_gain_vs_serial']:+.0f}% (target >= 20%)",
                  file=out)


def write_csv(res: dict, path: Path) -> None:
    import csv
    cols = ["rate_rps", "sent", "completed", "throughput_rps", "goodput_rps", "timeout_ratio", "errors",
            "mean_ms", "p50_ms", "p90_ms", "p99_ms", "mean_batch", "late_sends"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "policy", "phase", *cols])
        for name, model in res["models"].items():
            for policy, r in model["policies"].items():
                for p in r["sweep"] + r["bisect"]:
                    w.writerow([name, policy, p["phase"], *(p[c] for c in cols)])


def plot(res: dict, out_dir: Path) -> list[str]:
    plt = pyplot()
    if plt is None:
        return []
    written = []
    for name, model in res["models"].items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for policy, r in model["policies"].items():
            pts = sorted(r["sweep"], key=lambda p: p["rate_rps"])
            line, = ax.plot([p["throughput_rps"] for p in pts], [p["p50_ms"] for p in pts], "o-", label=f"{policy} p50")
            ax.plot([p["throughput_rps"] for p in pts], [p["p99_ms"] for p in pts], "s--", color=line.get_color(),
                    label=f"{policy} p99")
        ax.axhline(model["t_opt_ms"], color="grey", lw=0.8, ls=":", label="t_opt")
        ax.set(xlabel="throughput (req/s)", ylabel="latency (ms)", yscale="log",
               title=f"{name}: latency vs throughput, Poisson arrivals")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(out_dir / f"{name}-latency.png", dpi=120)
        written.append(f"{name}-latency.png")
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(7, 4.5))
        policies = list(model["policies"])
        width = 0.8 / len(policies)
        for i, policy in enumerate(policies):
            pts = model["policies"][policy]["sweep"]
            ax.bar([j + i * width for j in range(len(pts))], [p["mean_ms"] for p in pts], width, label=policy)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(model["rates"]))],
                      [f"{r:g}" for r in model["rates"]])
        ax.set(xlabel="offered load (req/s)", ylabel="mean latency (ms)", yscale="log",
               title=f"{name}: mean latency per policy (LBCI-style)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / f"{name}-bars.png", dpi=120)
        written.append(f"{name}-bars.png")
        plt.close(fig)
    return written


def main(argv=None) -> int:
    ap = Parser(prog="modelcache bench serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["alexnet", "resnet50"])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--loads", type=float, nargs="+", default=[0.25, 0.5, 0.75, 1.0, 1.5, 2.0],
                    help="offered rates as fractions of the serial capacity")
    ap.add_argument("--medium", type=float, default=0.5, help="the load called medium, as a fraction")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds of arrivals per rate")
    ap.add_argument("--warmup", type=float, default=2.0, help="first seconds excluded from the figures")
    ap.add_argument("--clients", type=int, default=2, help="generator processes")
    ap.add_argument("--stages", type=int, default=3, help="sub-models per model (layer-to-layer joins between)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="calibrated batch sizes")
    ap.add_argument("--t-opt-ms", type=float, help="latency bound; default 5x the batch-1 time")
    ap.add_argument("--batch-m", type=int, default=10, help="m of batch(m), LBCI's Batchsize(10)")
    ap.add_argument("--window-ms", type=float, default=50.0, help="how long batch(m) waits for m requests")
    ap.add_argument("--deadline-factor", type=float, default=3.0, help="request deadline, in t_opt")
    ap.add_argument("--bisect-steps", type=int, default=4)
    ap.add_argument("--workers", default="auto", help="the daemon's worker groups")
    ap.add_argument("--work", help="directory for the daemon's repository and state (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="a tiny model, short runs: checks the pipeline")
    ap.add_argument("--threads-vs-processes", type=int, metavar="N",
                    help="only compare N threads of one process with N processes (closed loop, dynamic batching)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of --threads-vs-processes, each shape once")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.threads_vs_processes:
        if args.quick:
            args.models, args.duration = ["tiny-cnn"], 2.0
        threads_vs_processes(args)
        return 0
    if args.quick:
        args.models, args.duration, args.warmup, args.bisect_steps = ["tiny-cnn"], 1.5, 0.3, 1
        args.loads, args.batches, args.stages = [0.3, 1.5], [1, 4], 2
        args.t_opt_ms = args.t_opt_ms or 50.0
    t0 = time.monotonic()
    res = run_bench(args)
    res["seconds"] = time.monotonic() - t0
    report(res)
    if args.out:
        out = Path(args.out)
        save_results(args.out, "serve", argv, res, report)
        write_csv(res, out / "serve.csv")
        written = plot(res, out)
        print(f"wrote {out}/serve.csv, results.json, report.txt" + "".join(f", {w}" for w in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
