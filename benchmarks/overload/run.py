"""Overload: a model offered more requests than it can serve, with its queue unbounded and bounded.

    python benchmarks/overload/run.py [--model squeezenet] [--loads 0.7 1.5 3] [--max-queue 4]
                                      [--seconds 6] [--rounds 2] [--out benchmarks/overload]

Two daemons on the same settings but one, `max_queue` (0: unbounded, as Triton's default queue policy;
N: a request that finds N waiting is refused at once, UNAVAILABLE, as Triton's `max_queue_size` refuses
it), serve the zoo model in serve mode, serial batching, one worker group of every core. The model's
capacity is measured first (a closed loop of one client on each daemon, the median). Then at each load
(a fraction of that capacity) one open-loop generator (modelcache/bench/serve_client.py: Poisson arrivals
fixed in advance, latency from the scheduled send, no coordinated omission) sends one-sample requests
without a deadline, as tritonclient does by default, for --seconds; every request is waited for. The two
daemons take turns, their order alternated round by round, and only one is under load at a time.

Per load and daemon, medians over rounds [min-max]: requests served a second (over the time to the last
answer, so a backlog's drain counts), refused a second of the offer, the served requests' p50 and p99, and
how long a refusal took to come back (p99).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from modelcache.measure import compile_bytecode, ensure_models, managed_daemon, save_results, summary


def capacity(socket: str, model: str, seconds: float) -> float:
    """Requests a second one client gets back to back (the serial capacity of the model here)."""
    from modelcache.client.connection import connect
    from modelcache.wire import tensors
    with connect(socket) as c:
        feeds = tensors.random_feeds(c.describe(model).inputs, batch=1, seed=0)
        for _ in range(5):
            c.infer(model, feeds)
        n, start = 0, time.monotonic()
        while time.monotonic() - start < seconds:
            c.infer(model, feeds)
            n += 1
        return n / (time.monotonic() - start)


def offer(socket: str, model: str, rate: float, seconds: float, seed: int) -> dict:
    cfg = {"socket": socket, "model": model, "rate": rate, "seed": seed, "duration_s": seconds,
           "start_at": time.time() + 0.5, "drain_s": max(30.0, 4 * seconds)}
    r = subprocess.run([sys.executable, "-m", "modelcache.bench.serve_client", json.dumps(cfg)],
                       capture_output=True, text=True, timeout=seconds + cfg["drain_s"] + 60)
    if r.returncode != 0:
        raise RuntimeError(f"load generator failed: {r.stderr[-1500:]}")
    requests = json.loads(r.stdout.strip().splitlines()[-1])["requests"]
    served = sorted(lat for _, lat, err, _ in requests if err is None and lat is not None)
    refused = sorted(lat for _, lat, err, _ in requests if err is not None and lat is not None)
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else None  # noqa: E731
    # Served a second: over the time to the last answer (a backlog served after the offer ended counts its drain).
    last = max((at + lat for at, lat, err, _ in requests if err is None and lat is not None), default=seconds)
    return {"offered": len(requests), "served_per_s": len(served) / max(seconds, last),
            "refused_per_s": len(refused) / seconds, "last_answer_s": last,
            "unanswered": sum(1 for _, lat, _, _ in requests if lat is None),
            "codes": sorted({err for _, _, err, _ in requests if err}),
            "p50_ms": pct(served, 0.5), "p99_ms": pct(served, 0.99), "refusal_p99_ms": pct(refused, 0.99)}


def report(results: dict, out=sys.stdout) -> None:
    print(f"{results['model']}, serial, capacity {results['capacity']:.1f} requests/s (closed loop, one client); "
          f"{results['seconds']:.0f} s a point, {results['rounds']} rounds; median [min-max] over rounds", file=out)
    print(f"{'load':>5} {'max_queue':>9} {'served/s':>18} {'refused/s':>18} {'p50 ms':>20} {'p99 ms':>22} "
          f"{'refusal p99 ms':>16}", file=out)
    for load in results["loads"]:
        for label in results["daemons"]:
            rows = [r for r in results["points"] if r["load"] == load and r["daemon"] == label]
            col = lambda key: [r[key] for r in rows if r[key] is not None]  # noqa: E731  (None: nothing refused)
            print(f"{load:>5} {label:>9} {summary(col('served_per_s')):>18} "
                  f"{summary(col('refused_per_s')):>18} {summary(col('p50_ms')):>20} "
                  f"{summary(col('p99_ms')):>22} {summary(col('refusal_p99_ms')):>16}",
                  file=out)
    codes = sorted({c for r in results["points"] for c in r["codes"]})
    print(f"refusals' codes: {', '.join(codes) or 'none'}; unanswered: "
          f"{sum(r['unanswered'] for r in results['points'])}", file=out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="squeezenet")
    ap.add_argument("--loads", nargs="+", type=float, default=[0.7, 1.5, 3.0])
    ap.add_argument("--max-queue", type=int, default=4, help="the bounded daemon's max_queue (default 4)")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", help="write OUT/results.json and OUT/report.txt")
    args = ap.parse_args(argv)
    compile_bytecode()
    daemons = {"0": {}, str(args.max_queue): {"MODELCACHE_MAX_QUEUE": str(args.max_queue)}}
    with tempfile.TemporaryDirectory(prefix="modelcache-overload-") as tmp, ExitStack() as stack:
        sockets = {}
        for label, env in daemons.items():
            sockets[label] = stack.enter_context(managed_daemon(
                f"ipc://{tmp}/{label}.sock", f"{tmp}/repo-{label}",
                env={"MODELCACHE_BATCHING": "serial", "MODELCACHE_STATE_DIR": f"{tmp}/state-{label}", **env}))
            ensure_models(sockets[label], [args.model], Path(tmp) / "zoo")
        cap = statistics.median(capacity(s, args.model, 3.0) for s in sockets.values())
        points = []
        for rnd in range(args.rounds):
            for load in args.loads:
                order = list(daemons) if rnd % 2 == 0 else list(daemons)[::-1]
                for label in order:
                    point = offer(sockets[label], args.model, load * cap, args.seconds, seed=rnd)
                    points.append({"round": rnd, "load": load, "daemon": label, **point})
                    print(f"round {rnd} load {load} max_queue {label}: {point}", file=sys.stderr)
    results = {"model": args.model, "capacity": cap, "seconds": args.seconds, "rounds": args.rounds,
               "loads": args.loads, "daemons": list(daemons), "points": points}
    report(results)
    save_results(args.out, "overload", None, results, report, command="python benchmarks/overload/run.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
