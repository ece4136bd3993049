"""FaaS trace replay against the real daemon: cold starts, time to first result and memory-time per
eviction policy and host-tier capacity, and how close the discrete-event simulator comes to it.

    python -m benchmarks.faas.real_replay [--functions 50 --hours 1 --compress 12] [--policies lru,gdsf]
                          [--capacities 0.1,0.3] [--mode attach|serve] [--out DIR]
    python -m benchmarks.faas.real_replay --trace invocations.csv --minutes 540:600 ...   an Azure Functions trace

Each function gets its own copy of a zoo model (`--models`, drawn with the seed as faas/trace.py
does), added to the daemon's repository once. Per policy and capacity a fresh daemon replays the
trace, time divided by --compress: each call is a fresh process that opens its model and runs it once
(attach, as a FaaS function starts), or a serve request from a pool of long-lived clients (--mode
serve: no process starts). At most --max-procs calls are in flight; a call the cap held back is
counted late, by how much. Where the weights were found comes from the open reply (attach); serve
replies do not say, so there a cold start is counted per promotion (waiters on one load count once).
Memory-time integrates the host tier's use, sampled from `stats` every --sample-s.

Costs: before the replays, the same daemon measures what the simulator (faas/simulate.py) takes as
parameters — an open that hits the host tier and the first run, as a fresh process sees them; a disk
miss's extra time against the model's size (the promotion) — and writes them to OUT/costs.json
(`python -m benchmarks.faas.sweep --costs OUT/costs.json` sweeps with them). Then the simulator
replays the same calls with those costs, and the report sets real and simulated side by side.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from modelcache import bench
from modelcache.bench.fresh import spawn
from modelcache.measure import compile_bytecode, managed_daemon, save_results
from modelcache.usage import Parser

from benchmarks.faas.simulate import GIB, Costs, replay, trace_policy
from benchmarks.faas.sweep import load_costs, plot, read_trace, table, trace_source_arguments
from benchmarks.faas.trace import Invocation, assign_models, invocations

CHILD = str(Path(bench.__file__).with_name("coldstart_child.py"))   # a fresh process per call, as coldstart's
DEFAULT_MODELS = "squeezenet1_1,googlenet,resnet50"


def daemon_name(model: str) -> str:
    """The daemon's name for a function's copy of a model: trace.py's `arch#i` (# is not allowed in names)."""
    return model.replace("#", ".f")


def daemon_env(policy: str, capacity_bytes: int) -> dict:
    """The daemon's settings for one replay (its policy's windows are compressed by `daemon_command`)."""
    return {"MODELCACHE_EVICTION_POLICY": policy, "MODELCACHE_HOST_CAPACITY": str(capacity_bytes)}


def daemon_command(compress: float) -> list:
    """A daemon whose policies' windows, in trace time, shrink with the trace (compressed_daemon.py)."""
    return [sys.executable, "-m", "benchmarks.faas.compressed_daemon", "--compress", repr(compress),
            "--log-level", "warning"]


def pct(values: list[float], p: float) -> float:
    """The nearest-rank percentile, as the simulator's Result computes it (so that the two compare)."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]


# -- setup: the models and the measured costs ---------------------------------------------------

def add_copies(client, models: dict[str, tuple[str, int]], work: Path, log) -> dict[str, int]:
    """Add each function's copy of its zoo model, with weights of its own (the copy's number seeds them:
    the host tier stores equal tensors once, so identical copies would share memory no function shares);
    returns trace name -> the host tier's charge for it in bytes, read with it resident (the charge an
    eviction frees), one at a time."""
    from modelcache import zoo
    work.mkdir(parents=True, exist_ok=True)
    have = {m["name"] for m in client.list()}
    keys = sorted({name for name, _ in models.values()})
    for n, key in enumerate(keys):
        arch, _, copy = key.partition("#")
        if daemon_name(key) not in have:
            path = work / f"{daemon_name(key)}.onnx"
            zoo.save(zoo.build(arch, seed=int(copy or 0)), str(path))
            client.add(str(path), daemon_name(key))
            path.unlink()
        if n % 10 == 9:
            log(f"  {n + 1}/{len(keys)} added")
    charge = {}
    for key in keys:
        client.load(daemon_name(key))
        charge[key] = next(m["host_bytes"] for m in client.list() if m["name"] == daemon_name(key))
        client.evict(daemon_name(key))
    return charge


def measure_costs(client, socket: str, sizes: dict[str, int], runs: int, mode: str, log) -> Costs:
    """The simulator's costs on this daemon, per architecture (its first copy): a call on a hit as the
    replay makes it (attach: a fresh process's open and first run; serve: the request, all of it run time),
    medians of `runs`; the open request's extra time on a disk miss, fitted against the size as
    fixed + bytes x seconds-per-byte (the promotion)."""
    first = {}
    for key in sorted(sizes):
        first.setdefault(key.split("#")[0], key)
    serve = _ServeClients(socket) if mode == "serve" else None
    opens, run_s, misses = [], {}, []
    try:
        for arch, key in first.items():
            name, hits, hit_ms, miss_ms = daemon_name(key), [], [], []
            for _ in range(runs):
                client.evict(name)
                t = time.perf_counter()
                client.release(client.open(name).lease_id)
                miss_ms.append((time.perf_counter() - t) * 1e3)
                t = time.perf_counter()
                client.release(client.open(name).lease_id)
                hit_ms.append((time.perf_counter() - t) * 1e3)
                r = serve.call(name) if serve else _attach_call(socket, name)
                if "error" in r:
                    raise RuntimeError(f"measuring the costs of {name}: {r['error']}")
                hits.append((r["open_ms"], r["open_run_ms"] - r["open_ms"]))
            opens += [o / 1e3 for o, _ in hits]
            run_s[arch] = statistics.median(r for _, r in hits) / 1e3
            misses.append((sizes[key], (statistics.median(miss_ms) - statistics.median(hit_ms)) / 1e3))
            log(f"costs of {arch}: open on a hit {statistics.median(o for o, _ in hits):.1f} ms, run "
                f"{run_s[arch] * 1e3:.1f} ms, a disk miss adds {misses[-1][1] * 1e3:.1f} ms for {sizes[key] / 2**20:.1f} MiB")
    finally:
        if serve:
            serve.close()
    fixed, per_byte = fit_line(misses)
    return Costs(open_host_s=statistics.median(opens), open_disk_s=fixed, promote_s_per_byte=per_byte,
                 run_s=run_s, default_run_s=statistics.median(run_s.values()))


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares y = a + b x, both >= 0; one size (or sizes that disagree with a line): all per byte."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx > 0:
        b = sum((x - mx) * (y - my) for x, y in points) / sxx
        a = my - b * mx
        if a >= 0 and b > 0:
            return a, b
    return 0.0, max(my, 0.0) / mx if mx else 0.0


# -- the replay ---------------------------------------------------------------------------------

class TierSampler(threading.Thread):
    """Integrates each tier's bytes in use over time (left rectangles between `stats` samples)."""

    def __init__(self, socket: str, interval_s: float):
        super().__init__(daemon=True)
        self.socket, self.interval_s = socket, interval_s
        self.byte_s: dict[str, float] = {}
        self.peak: dict[str, int] = {}
        self.samples = 0
        self.error: Exception | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            self._sample()
        except Exception as e:   # reported by the replay: memory-time from a sampler that stopped is wrong
            self.error = e

    def _sample(self) -> None:
        from modelcache.client.connection import connect
        with connect(self.socket) as c:
            last, used = time.monotonic(), {}
            while True:
                tiers = c.stats().tiers
                now = time.monotonic()
                for tier, b in used.items():
                    self.byte_s[tier] = self.byte_s.get(tier, 0.0) + b * (now - last)
                used = {}
                for t in tiers:
                    if t["tier"] != "disk":
                        used[t["tier"]] = used.get(t["tier"], 0) + t.get("used_bytes", 0)
                for tier, b in used.items():
                    self.peak[tier] = max(self.peak.get(tier, 0), b)
                last = now
                self.samples += 1
                if self.stop.wait(self.interval_s):
                    return


def _attach_call(socket: str, name: str) -> dict:
    """One FaaS invocation: a fresh process opens `name` and runs it once."""
    proc = spawn("attach", name, "", "", socket, child=CHILD)
    out, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        return {"error": (err.strip().splitlines() or ["exit status %d" % proc.returncode])[-1]}
    s = json.loads(out.strip().splitlines()[-1])
    return {"hit": s["hit"], "total_ms": s["total_ms"], "open_ms": s["session_ms"],
            "open_run_ms": s["session_ms"] + s["first_run_ms"]}


class _ServeClients:
    """Serve mode's long-lived clients: one connection per pool thread, a session per model on it."""

    def __init__(self, socket: str):
        self.socket, self.local, self.clients = socket, threading.local(), []
        self.lock = threading.Lock()

    def call(self, name: str) -> dict:
        import numpy as np

        from modelcache.client.connection import connect
        from modelcache.client.serve import ServeSession
        from modelcache.bench.coldstart_child import ones_feeds
        if not hasattr(self.local, "client"):
            self.local.client, self.local.sessions = connect(self.socket), {}
            with self.lock:
                self.clients.append(self.local.client)
        t = time.perf_counter()
        try:
            sess = self.local.sessions.get(name) or ServeSession(name, client=self.local.client)
            self.local.sessions[name] = sess
            sess.run(None, ones_feeds(sess, np))
        except Exception as e:   # the call's failure is its result (a refusal, say), not the replay's
            return {"error": f"{type(e).__name__}: {e}"}
        ms = (time.perf_counter() - t) * 1e3
        return {"hit": None, "total_ms": ms, "open_ms": 0.0, "open_run_ms": ms}   # (a request opens nothing)

    def close(self) -> None:
        for c in self.clients:
            c.close()


def replay_real(socket: str, calls, mode: str, max_procs: int, sample_s: float) -> dict:
    """Replay `calls` (compressed times) against the daemon at `socket`; per call: hit, times, lateness."""
    from modelcache.client.connection import connect
    with connect(socket) as c:
        for m in c.list():   # every replay starts with nothing resident
            if m["tier"] != "disk":
                c.evict(m["name"], m["version"])
        before = dict(c.stats().counters)
    serve = _ServeClients(socket) if mode == "serve" else None
    sampler = TierSampler(socket, sample_s)
    records = []

    def one(inv, due: float) -> None:
        late_s = max(0.0, time.monotonic() - due)
        try:
            r = serve.call(daemon_name(inv.model)) if serve else _attach_call(socket, daemon_name(inv.model))
        except Exception as e:   # (a pool thread's exception would vanish with its future: the call counts as failed)
            r = {"error": f"{type(e).__name__}: {e}"}
        r.update(function=inv.function, model=inv.model, t=inv.t, late_ms=late_s * 1e3)
        if "total_ms" in r:   # from the call's due time: what the caller waited, the cap's delay included
            r["ttfr_ms"] = r["late_ms"] + r["total_ms"]
        records.append(r)

    sampler.start()
    t0 = time.monotonic() + 0.2
    try:
        with ThreadPoolExecutor(max_procs) as pool:   # FIFO: a call the cap holds back starts in arrival order
            for inv in calls:
                time.sleep(max(0.0, t0 + inv.t - time.monotonic()))
                pool.submit(one, inv, t0 + inv.t)
    finally:
        sampler.stop.set()
        sampler.join()
        if serve:
            serve.close()
    wall_s = time.monotonic() - t0
    if sampler.error is not None:
        raise RuntimeError(f"sampling the tiers' use from `stats` failed, so memory-time is unknown: {sampler.error}")
    with connect(socket) as c:
        after = c.stats().counters
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return {"records": records, "counters": delta, "wall_s": wall_s, "byte_s": sampler.byte_s,
            "peak_bytes": sampler.peak, "samples": sampler.samples}


def summarize(policy: str, capacity: int, run: dict, mode: str, late_ms: float) -> dict:
    """One report row: where each call found its weights, times, memory-time, counters."""
    recs, n = run["records"], len(run["records"])
    ok = [r for r in recs if "error" not in r]
    counters = run["counters"]
    if mode == "serve":   # no per-request answer: a promotion is a cold start (module docstring)
        cold = min(len(ok), counters.get("promotions", 0))
    else:
        cold = sum(1 for r in ok if not r["hit"])
    remote = min(cold, counters.get("fetched", 0))
    late = [r["late_ms"] for r in recs if r["late_ms"] > late_ms]
    return {"policy": policy, "capacity_gib": round(capacity / GIB, 4), "capacity_bytes": capacity, "calls": n,
            "failed": n - len(ok), "host_hits": len(ok) - cold, "disk_misses": cold - remote, "remote_misses": remote,
            "cold_fraction": round(cold / max(1, len(ok)), 5),
            "gib_s": round(run["byte_s"].get("host", 0.0) / GIB, 4),
            "gpu_gib_s": round(run["byte_s"].get("gpu", 0.0) / GIB, 4),
            "peak_gib": round(run["peak_bytes"].get("host", 0) / GIB, 4),
            "open_run_p50_ms": round(pct([r["open_run_ms"] for r in ok], 50), 2),
            "open_run_p99_ms": round(pct([r["open_run_ms"] for r in ok], 99), 2),
            "ttfr_p50_ms": round(pct([r["ttfr_ms"] for r in ok], 50), 2),
            "ttfr_p99_ms": round(pct([r["ttfr_ms"] for r in ok], 99), 2),
            "late": len(late), "late_p99_ms": round(pct(late, 99), 1) if late else 0.0,
            "promotions": counters.get("promotions", 0), "evictions": counters.get("evictions", 0),
            "gpu_promotions": counters.get("gpu_promotions", 0), "wall_s": round(run["wall_s"], 1),
            "errors": sorted({r["error"] for r in recs if "error" in r})[:5]}


REAL_COLUMNS = [("policy", "policy", "{}"), ("capacity_gib", "cap GiB", "{:.3f}"), ("calls", "calls", "{}"),
                ("cold_fraction", "cold %", "{:.1%}"), ("host_hits", "host hit", "{}"),
                ("disk_misses", "disk", "{}"), ("remote_misses", "remote", "{}"), ("failed", "failed", "{}"),
                ("gib_s", "GiB*s", "{:.3g}"), ("open_run_p50_ms", "open+run p50", "{:.1f}"),
                ("open_run_p99_ms", "p99", "{:.1f}"), ("ttfr_p50_ms", "ttfr p50 ms", "{:.0f}"),
                ("ttfr_p99_ms", "p99", "{:.0f}"), ("late", "late", "{}"), ("late_p99_ms", "late p99 ms", "{:.0f}"),
                ("promotions", "promotions", "{}"), ("evictions", "evictions", "{}")]
AGREE_COLUMNS = [("policy", "policy", "{}"), ("capacity_gib", "cap GiB", "{:.3f}")] + [
    (f"{k}_{side}", f"{title} {side}", fmt) for k, title, fmt in
    (("cold", "cold %", "{:.1%}"), ("gib_s", "GiB*s", "{:.3g}"), ("p50", "p50 ms", "{:.1f}"), ("p99", "p99 ms", "{:.1f}"))
    for side in ("real", "sim")] + [(f"{k}_ratio", f"{k} sim/real", "{:.2f}") for k in ("cold", "gib_s", "p50", "p99")]


def agreement(real: dict, sim: dict) -> dict:
    """Real against simulated for one policy and capacity (open+run: the part of a call the simulator models)."""
    pairs = {"cold": (real["cold_fraction"], sim["cold_fraction"]), "gib_s": (real["gib_s"], sim["gib_s"]),
             "p50": (real["open_run_p50_ms"], sim["ttfr_p50_ms"]), "p99": (real["open_run_p99_ms"], sim["ttfr_p99_ms"])}
    row = {"policy": real["policy"], "capacity_gib": real["capacity_gib"]}
    for k, (r, s) in pairs.items():
        row[f"{k}_real"], row[f"{k}_sim"] = r, s
        row[f"{k}_ratio"] = s / r if r else (1.0 if s == r else math.inf)
    return row


def report(data: dict, out=sys.stdout) -> None:
    print(f"{data['trace']}: {data['calls']} calls over {data['trace_s']:.0f} s of trace time, compressed "
          f"{data['args']['compress']:g}x; {data['models']} models, {data['total_bytes'] / 2**20:.1f} MiB together; "
          f"mode {data['args']['mode']}, at most {data['args']['max_procs']} in flight", file=out)
    c = data["costs"]
    print(f"costs ({data['args']['costs'] or 'measured'}): open on a host hit {c['open_host_s'] * 1e3:.1f} ms, a miss adds "
          f"{c['open_disk_s'] * 1e3:.2f} ms + {c['promote_s_per_byte'] * 1e9:.3f} s/GB, run "
          + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in c["run_s"].items()), file=out)
    print("\nreal replay (open+run: the function's open and first run; ttfr: from the call's due time to its first "
          "result, process start and lateness included; late: calls the in-flight cap started late):", file=out)
    print(table(data["rows"], REAL_COLUMNS), file=out)
    for r in data["rows"]:
        if r["errors"]:
            print(f"  {r['policy']} at {r['capacity_gib']:.3f} GiB: {r['failed']} calls failed: "
                  + "; ".join(r["errors"]), file=out)
    if data["agreement"]:
        print("\nreal vs simulated with the measured costs (same calls; p50/p99: open+run real, time to first "
              "result simulated):", file=out)
        print(table(data["agreement"], AGREE_COLUMNS), file=out)
        print("\nthe same, simulated at the times the calls really started (the replay's lateness taken out):",
              file=out)
        print(table(data["agreement_as_started"], AGREE_COLUMNS), file=out)


def write_calls(path: Path, records: list[dict]) -> None:
    """Every call of every replay, one CSV row each (the function is its model's copy: not repeated), gzipped:
    the folder travels to the GPU machine with every device call, where each MiB counts."""
    import csv
    import gzip
    fields = ["policy", "capacity_gib", "t", "model", "late_ms", "hit", "open_run_ms", "ttfr_ms", "error"]
    with gzip.open(path, "wt", newline="") as f:
        w = csv.DictWriter(f, fields, extrasaction="ignore")
        w.writeheader()
        for r in sorted(records, key=lambda r: (r["policy"], r["capacity_gib"], r["t"])):
            w.writerow({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})


def main(argv=None) -> int:
    ap = Parser(prog="python -m benchmarks.faas.real_replay", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    trace_source_arguments(ap, 20, 0.5)
    ap.add_argument("--models", default=DEFAULT_MODELS, help=f"zoo models the functions draw from (default {DEFAULT_MODELS})")
    ap.add_argument("--policies", default="lru,gdsf",
                    help="comma-separated eviction policies the daemon runs (keepalive, hybrid: where it accepts them)")
    ap.add_argument("--capacities", default="0.1,0.3",
                    help="host-tier capacities as fractions of all the functions' models together (at least the largest)")
    ap.add_argument("--compress", type=float, default=10.0, help="divide trace time by this (default 10)")
    ap.add_argument("--mode", choices=("attach", "serve"), default="attach",
                    help="attach: a fresh process per call (default); serve: requests from long-lived clients")
    ap.add_argument("--max-procs", type=int, default=4, help="calls in flight at most (default 4)")
    ap.add_argument("--late-ms", type=float, default=20.0, help="a call started this much after its time is late")
    ap.add_argument("--sample-s", type=float, default=0.1, help="how often memory use is sampled (default 0.1 s)")
    ap.add_argument("--cost-runs", type=int, default=3, help="samples per model for the measured costs (default 3)")
    ap.add_argument("--costs", default="", help="use these simulator costs (JSON) instead of measuring them")
    ap.add_argument("--no-simulate", action="store_true", help="skip the simulator's replay and the agreement")
    ap.add_argument("--out", help="results.json, report.txt, costs.json, trace.csv and pareto.png here")
    args = ap.parse_args(argv)
    # Wrong arguments: one line (the parser's usage error), before any daemon starts.
    if args.compress <= 0 or args.max_procs < 1 or args.sample_s <= 0:
        ap.error("--compress and --sample-s must be positive and --max-procs at least 1")
    log = lambda s: print(s, file=sys.stderr, flush=True)   # noqa: E731
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    try:
        label, functions = read_trace(args, out)
        costs = load_costs(args.costs) if args.costs else None
    except ValueError as e:
        ap.error(str(e))
    models = assign_models(functions, [(m.strip(), 0) for m in args.models.split(",") if m.strip()], args.seed)
    calls = invocations(functions, models, args.seed, args.compress, args.minutes)
    if not calls:
        ap.error("the trace has no calls in the window replayed: choose more functions, hours or another window")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    from modelcache.config import EVICTION_POLICIES   # what the daemon's eviction_policy setting accepts
    if not policies or set(policies) - set(EVICTION_POLICIES):
        ap.error(f"--policies {args.policies}: the daemon runs {', '.join(EVICTION_POLICIES)}; "
                 f"not {', '.join(sorted(set(policies) - set(EVICTION_POLICIES))) or 'an empty list'}")
    fractions = [float(x) for x in args.capacities.split(",")]
    compile_bytecode()

    from modelcache.client.connection import connect
    from modelcache.config import MIN_CAPACITY
    with tempfile.TemporaryDirectory(prefix="modelcache-faas-") as tmp:
        repo = f"{tmp}/repo"
        with managed_daemon(f"ipc://{tmp}/setup.sock", repo) as socket, connect(socket) as c:
            log(f"adding {len({m for m, _ in models.values()})} models ...")
            sizes = add_copies(c, models, Path(tmp) / "zoo", log)
            if costs is None:
                costs = measure_costs(c, socket, sizes, args.cost_runs, args.mode, log)
        if out:
            (out / "costs.json").write_text(json.dumps(vars(costs), indent=1))
        sizes = {k: sizes[k] for k in {inv.model for inv in calls}}   # the models of the window replayed
        total = sum(sizes.values())
        rows, sims, sims_started, records = [], [], [], []
        for i, frac in enumerate(fractions):
            # Below the largest model its calls are refused; below MIN_CAPACITY the daemon refuses to start.
            capacity = max(int(total * frac), max(sizes.values()), MIN_CAPACITY)
            for policy in policies:
                log(f"replaying {len(calls)} calls ({calls[-1].t:.0f} s) with {policy} at {capacity / 2**20:.1f} MiB ...")
                with managed_daemon(f"ipc://{tmp}/{policy}-{i}.sock", repo,
                                    env=daemon_env(policy, capacity), command=daemon_command(args.compress)) as socket:
                    run = replay_real(socket, calls, args.mode, args.max_procs, args.sample_s)
                rows.append(summarize(policy, capacity, run, args.mode, args.late_ms))
                log(f"  cold {rows[-1]['cold_fraction']:.1%}, {rows[-1]['gib_s']:.2f} GiB*s, "
                    f"{rows[-1]['late']} late, {rows[-1]['failed']} failed, {rows[-1]['wall_s']:.0f} s")
                records += [{"policy": policy, "capacity_gib": rows[-1]["capacity_gib"], **r} for r in run["records"]]
                if not args.no_simulate:   # on the trace's times, and on the times the calls really started
                    started = sorted(Invocation(r["t"] + r["late_ms"] / 1e3, r["function"], r["model"])
                                     for r in run["records"])
                    for out_list, these in ((sims, calls), (sims_started, started)):
                        sim = replay(trace_policy(policy, args.compress), capacity, these, sizes, costs)
                        out_list.append({**sim.row(), "gib_s": sim.gib_s})   # (row() rounds to 0.1 GiB*s)
    data = {"trace": label, "args": vars(args), "calls": len(calls), "trace_s": calls[-1].t * args.compress,
            "models": len(sizes), "total_bytes": total, "costs": vars(costs), "rows": rows, "simulated": sims,
            "agreement": [agreement(r, s) for r, s in zip(rows, sims)],
            "agreement_as_started": [agreement(r, s) for r, s in zip(rows, sims_started)]}
    report(data)
    save_results(args.out, "faas", argv, data, report, command="python -m benchmarks.faas.real_replay")
    if out:
        write_calls(out / "calls.csv.gz", records)
    if out and plot(rows, out / "pareto.png", f"real replay: {label}, compressed {args.compress:g}x"):
        print(f"figure: {out / 'pareto.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
