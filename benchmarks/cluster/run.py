"""Cluster benchmark: locality-aware multiplexed routing against Ray Serve's default routing (issue #19).

    python benchmarks/cluster/run.py [--models 12] [--requests 600] [--zipf 1.0] [--rate 8] [--repeats 3]
                             [--seed 0] [--modes locality default serve-multiplexed] [--out benchmarks/cluster]

A FaaS-style trace: model popularity Zipf over ranks (popularity of rank r ∝ 1/r^s, ranks shuffled against the
model sizes), Poisson arrivals (exponential gaps at --rate per second). It is replayed open-loop (each request
sent at its arrival time, whatever is still in flight) across a three-node Ray cluster on this machine
(`ray.cluster_utils.Cluster`, one CPU per node), each node running its own modelcache daemon with a private
repository, a host tier of about a third of the models' bytes, and the same file:// remote store.

The models are embedding lookups (Gather of 16 ids from a float32 table, then a sum), tables of 8 to 48 MB,
each with its own seed so no two share weights. Opening one costs its weight bytes (fetch, read and check,
map), running one costs microseconds: the benchmark measures where requests land, not compute.

Rows (each with fresh daemons, fresh repositories and host tiers, a fresh Serve app; the same trace):
  locality           deploy(router="locality"), the model as Serve's multiplexed model id: LocalityRouter
                     sends each request to the node that opens the model soonest (routing.py)
  default            deploy(router="default"), the model in the request body: Serve's power-of-two-choices
                     router, which knows nothing of the model
  serve-multiplexed  deploy(router="default") with the multiplexed model id: Serve's own multiplexing
                     (prefers replicas whose model-id cache lists the model; knows nothing of the host tier)

Per row: warm-hit fraction (the request's node had the model in its host tier when the request arrived), p50
and p99 latency measured at the caller, and remote fetches (the daemons' counters, over the whole trace).
The first --warmup fraction of the trace (20 %) is sent like the rest but left out of the hit and latency
figures. Printed: median [min-max] over --repeats, and the ratios the issue targets (warm-hit fraction
locality/default >= 2, p99 default/locality >= 3).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from modelcache.measure import save_results, summary
from modelcache.usage import Parser

MODES = {  # mode -> (router, multiplexed)
    "locality": ("locality", True),
    "default": ("default", False),
    "serve-multiplexed": ("default", True),
}
EMBED_DIM = 64
IDS = 16
NODES = 3


# -- the trace (pure) ---------------------------------------------------------------------------------------

def zipf_weights(n: int, s: float) -> np.ndarray:
    """Popularity of ranks 1..n, ∝ 1/rank^s, summing to 1."""
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return w / w.sum()


def trace(models: list, n_requests: int, zipf_s: float, rate_per_s: float, seed: int) -> list:
    """[(arrival offset in s, model name)]: models[0] is rank 1 (the most popular), Poisson arrivals."""
    rng = np.random.default_rng(seed)
    ranks = rng.choice(len(models), size=n_requests, p=zipf_weights(len(models), zipf_s))
    arrivals = np.cumsum(rng.exponential(1.0 / rate_per_s, size=n_requests))
    return [(float(t), models[int(r)]) for t, r in zip(arrivals, ranks)]


def percentile(values: list, q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


# -- the models ---------------------------------------------------------------------------------------------

def embed_model(name: str, table_bytes: int, seed: int):
    """Gather IDS rows of a float32 (rows, EMBED_DIM) table, then sum them: open cost ~ bytes, run cost ~ 0."""
    from onnx import TensorProto, helper

    from modelcache.zoo import GraphBuilder
    g = GraphBuilder(name, seed)
    rows = max(IDS, table_bytes // (4 * EMBED_DIM))
    table = g.const("table", g.rng.standard_normal((rows, EMBED_DIM), dtype=np.float32))
    emb = g.node("Gather", [table, "ids"], axis=0)                              # B, IDS, D
    g.nodes.append(helper.make_node("ReduceSum", [emb, g.const("axes", np.array([1], np.int64))], ["y"],
                                    keepdims=0))
    return g.build([helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", IDS])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", EMBED_DIM])])


def model_sizes(n: int, lo_mb: float = 8, hi_mb: float = 48) -> list:
    return [int(mb * 2**20) for mb in np.linspace(lo_mb, hi_mb, n)]


def build_store(store: Path, n: int, seed: int) -> dict:
    """Pack n embedding models into `store` and publish it; returns name -> weight bytes (as the store lists)."""
    from modelcache import zoo
    from modelcache.store.packing import pack
    from modelcache.tiers.remote import publish
    store.mkdir(parents=True, exist_ok=True)
    src_dir = store.parent / "src"
    src_dir.mkdir(exist_ok=True)
    for i, size in enumerate(model_sizes(n)):
        name = f"embed-{i:02d}-{size >> 20}mb"
        src = src_dir / f"{name}.onnx"
        zoo.save(embed_model(name, size, seed * 1000 + i), str(src))
        pack(str(src), store, name, 1)
        src.unlink()
        print(f"packed {name}", file=sys.stderr, flush=True)
    index = publish(store)
    return {m["name"]: sum(f["bytes"] for f in m["files"].values()) for m in index["models"]}


# -- one run: fresh daemons and app, the trace replayed open-loop -------------------------------------------

def run_mode(mode: str, schedule: list, warmup: int, store: Path, work: Path, host_capacity: int) -> dict:
    from ray import serve

    from modelcache.cluster import local, rayserve
    router, multiplexed = MODES[mode]
    work.mkdir(parents=True)

    inputs = {"ids": np.arange(IDS, dtype=np.int64).reshape(1, IDS)}
    local.start_node_daemons(work, remote=f"file://{store}", host_capacity=str(host_capacity), log_level="warning")
    try:
        handle = rayserve.deploy(router=router)
        try:
            results: list = [None] * len(schedule)
            pool = ThreadPoolExecutor(max_workers=64)
            lock = threading.Lock()

            def wait(i, response, sent):
                try:
                    r = response.result(timeout_s=120)
                    done = time.perf_counter()
                    row = {"ms": 1000 * (done - sent), "tier": r["tier"], "warm": bool(r["warm"]),
                           "node": r["node"][:8], "server_ms": r["ms"], "failed_over": bool(r["failed_over_from"])}
                except Exception as e:                     # a failed request is a row too, not a crash
                    row = {"ms": 1000 * (time.perf_counter() - sent), "error": repr(e)[:200]}
                with lock:
                    results[i] = row

            started = time.perf_counter()
            lag = []
            for i, (offset, model) in enumerate(schedule):
                delay = started + offset - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                else:
                    lag.append(-delay)
                sent = time.perf_counter()
                response = rayserve.infer(handle, model, inputs, multiplexed=multiplexed)
                pool.submit(wait, i, response, sent)
            pool.shutdown(wait=True)
            wall_s = time.perf_counter() - started
            status = rayserve.cluster_status()
        finally:
            serve.delete(rayserve.APP_NAME)
    finally:
        rayserve.stop_daemons()
    for i, row in enumerate(results):
        row["model"] = schedule[i][1]
    measured = [r for r in results[warmup:] if "error" not in r]
    ms = [r["ms"] for r in measured]
    return {
        "mode": mode, "router": router, "multiplexed": multiplexed,
        "requests": len(schedule) - warmup, "errors": sum("error" in r for r in results),
        "warm_fraction": sum(r["warm"] for r in measured) / len(measured) if measured else float("nan"),
        "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99), "mean_ms": statistics.fmean(ms) if ms else 0,
        "tiers": {t: sum(r["tier"] == t for r in measured) for t in ("gpu", "host", "disk", "remote")},
        "remote_fetches": sum(row.get("fetched", 0) for row in status),
        "error_kinds": sorted({r["error"][:120] for r in results if "error" in r})[:5],
        "per_node": [{"node": row["node_id"][:8], "up": row.get("up"), "restarts": row.get("restarts", 0),
                      "fetched": row.get("fetched", 0), "models": row.get("models", {}),
                      "host_used": row.get("host_used", 0), "requests": sum(r.get("node") == row["node_id"][:8]
                                                                          for r in results)} for row in status],
        "send_lag_ms_max": 1000 * max(lag, default=0.0), "wall_s": wall_s,
        "samples": results,
    }


# -- the report ---------------------------------------------------------------------------------------------

def _med(values):
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def summarize(runs: list, modes: list) -> dict:
    out = {}
    for mode in modes:
        rows = [r for r in runs if r["mode"] == mode]
        out[mode] = {k: [r[k] for r in rows] for k in ("warm_fraction", "p50_ms", "p99_ms", "remote_fetches",
                                                       "errors", "requests")}
    ratios = {}
    if "locality" in out and "default" in out:
        # per repeat (same trace, same machine minutes), then the median over repeats
        loc = [r for r in runs if r["mode"] == "locality"]
        dft = [r for r in runs if r["mode"] == "default"]
        warm = [a["warm_fraction"] / b["warm_fraction"] if b["warm_fraction"] else float("inf")
                for a, b in zip(loc, dft)]
        p99 = [b["p99_ms"] / a["p99_ms"] for a, b in zip(loc, dft)]
        ratios = {"warm_locality_over_default": warm, "p99_default_over_locality": p99,
                  "warm_target_met": _med(warm) >= 2.0, "p99_target_met": _med(p99) >= 3.0}
    return {"modes": out, "ratios": ratios}


def report(data: dict, f=sys.stdout) -> None:
    a = data["args"]
    print(f"{a['models']} embedding models ({data['total_mb']:.0f} MB in all), host tier {data['host_capacity_mb']:.0f} "
          f"MB per node ({data['host_capacity_mb'] / data['total_mb']:.2f} of all), {NODES} nodes; {a['requests']} requests, Zipf s={a['zipf']}, Poisson "
          f"{a['rate']}/s; the first {data['warmup']} requests are warm-up, left out of hits and latency; "
          f"{a['repeats']} repeat(s): median [min-max]", file=f)
    print(f"{'mode':<18} {'requests':>8} {'warm-hit':>18} {'p50 ms':>20} {'p99 ms':>22} {'remote fetches':>18}"
          f" {'errors':>6}", file=f)
    for mode, s in data["summary"]["modes"].items():
        warm = summary([100 * v for v in s["warm_fraction"]]) + " %"
        print(f"{mode:<18} {s['requests'][0]:>8} {warm:>18} {summary(s['p50_ms']):>20} {summary(s['p99_ms']):>22} "
              f"{summary(s['remote_fetches']):>18} {sum(s['errors']):>6}", file=f)
    r = data["summary"]["ratios"]
    if r:
        def ratio(values):
            med = statistics.median(values)
            return f"{med:.2f} [{min(values):.2f}-{max(values):.2f}]" if len(values) > 1 else f"{med:.2f}"
        print(f"warm-hit fraction locality/default: {ratio(r['warm_locality_over_default'])}x (target >= 2x: "
              f"{'met' if r['warm_target_met'] else 'NOT met'}); p99 default/locality: "
              f"{ratio(r['p99_default_over_locality'])}x (target >= 3x: {'met' if r['p99_target_met'] else 'NOT met'})"
              " (ratios per repeat, then the median)", file=f)
    for run in data["runs"]:
        nodes = "; ".join(f"{n['node']} {n['requests']} req, {n['fetched']} fetched, host "
                          f"{len(n['models'].get('host', []))} models"
                          + (f", daemon restarted {n['restarts']}x" if n.get("restarts") else "")
                          for n in run["per_node"])
        print(f"  {run['mode']:<18} repeat {run['repeat']}: tiers {run['tiers']}; {nodes}; "
              f"send lag max {run['send_lag_ms_max']:.0f} ms", file=f)
        for e in run.get("error_kinds", []):
            print(f"    error: {e}", file=f)
    print(f"machine: {data['machine']}", file=f)


def main(argv=None) -> int:
    ap = Parser(prog="python benchmarks/cluster/run.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=int, default=12, help="embedding models, 8 to 48 MB (at least 12)")
    ap.add_argument("--requests", type=int, default=600, help="requests in the trace, warm-up included")
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent s of model popularity")
    ap.add_argument("--rate", type=float, default=8.0, help="mean arrivals per second (Poisson)")
    ap.add_argument("--warmup", type=float, default=0.2, help="fraction of the trace left out of the figures")
    ap.add_argument("--host-fraction", type=float, default=1 / NODES,
                    help="each node's host tier, as a fraction of all the models' bytes (default: a third, so the "
                         "three tiers together hold every model only if they pack perfectly)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of every mode, interleaved (same trace)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--samples", action="store_true", help="keep every request's row in results.json")
    ap.add_argument("--out", help="write OUT/results.json and OUT/report.txt")
    args = ap.parse_args(argv)
    if args.models < 12:
        ap.error("--models: at least 12 (the issue's trace)")

    import os

    from modelcache.cluster import local

    tmp = Path(tempfile.mkdtemp(prefix="modelcache-cluster-"))
    runs = []
    try:
        sizes = build_store(tmp / "store", args.models, args.seed)
        rng = np.random.default_rng(args.seed + 1)
        by_rank = [list(sizes)[i] for i in rng.permutation(len(sizes))]      # popularity independent of size
        total = sum(sizes.values())
        host_capacity = int(total * args.host_fraction)
        print(f"{len(sizes)} models, {total / 2**20:.0f} MB in all; host tier per node: {host_capacity / 2**20:.0f} "
              f"MB ({args.host_fraction:.2f} of the models' bytes); popularity ranks: {', '.join(by_rank)}", flush=True)
        schedule = trace(by_rank, args.requests, args.zipf, args.rate, args.seed)
        warmup = int(args.warmup * len(schedule))

        def collect(partial=False):
            return {"args": vars(args), "models": sizes, "popularity_order": by_rank, "total_mb": total / 2**20,
                    "host_capacity_mb": host_capacity / 2**20, "warmup": warmup,
                    "machine": f"{os.cpu_count()} cores, {NODES} Ray nodes of 1 CPU each on it",
                    "partial": partial, "runs": runs,
                    "summary": summarize(runs, [m for m in args.modes if any(r["mode"] == m for r in runs)])}

        t0 = time.perf_counter()
        with local.ray_cluster(NODES):
            print(f"ray cluster of {NODES} nodes up in {time.perf_counter() - t0:.1f} s", flush=True)
            for repeat in range(args.repeats):
                for mode in args.modes:
                    t0 = time.perf_counter()
                    run = run_mode(mode, schedule, warmup, tmp / "store", tmp / f"r{repeat}-{mode}", host_capacity)
                    run["repeat"] = repeat
                    if not args.samples:
                        run.pop("samples")
                    runs.append(run)
                    print(f"{mode:<18} repeat {repeat}: warm-hit {100 * run['warm_fraction']:.1f} %, p50 "
                          f"{run['p50_ms']:.1f} ms, p99 {run['p99_ms']:.1f} ms, remote fetches "
                          f"{run['remote_fetches']}, errors {run['errors']} ({time.perf_counter() - t0:.0f} s)",
                          flush=True)
                    shutil.rmtree(tmp / f"r{repeat}-{mode}", ignore_errors=True)
                    if args.out:               # what is done so far survives a cluster killed under us
                        Path(args.out).mkdir(parents=True, exist_ok=True)
                        (Path(args.out) / "results.json").write_text(json.dumps(collect(partial=True), indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    data = collect()
    print()
    report(data)
    save_results(args.out, "cluster", argv, data, report, command="python benchmarks/cluster/run.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
