"""Soak: many client processes against one daemon for minutes, with the host tier too small for them.

    modelcache bench soak [--minutes 5] [--clients 8] [--models tiny-cnn tiny-vit ...] [--out DIR]

Starts a private daemon, adds each zoo model --copies times (weights seeded apart), computes
plain ORT's answer for each, cuts the host tier to --capacity-fraction of what the models take
in it (below the working set, so promotions evict), and runs --clients client processes:
  - one "churn" client evicts and loads random models (the very models the others use);
  - one "openclose" client opens an attach session, runs it once and closes it, over and over;
  - the others ("mixed") alternate serve-mode infer and attach sessions (kept --attach-runs runs).
Clients other than the churn stay with a model for --stick requests, then pick another at random:
at any moment some models are in use and others are free to evict.
Every output is compared with plain ORT. Each minute (--report-s) it prints: requests, throughput,
p50/p99 latency, errors by kind, wrong outputs, clients dropped by the daemon, and the daemon's
RSS, open fds and /dev/shm bytes (its host tier and the clients' I/O files). At the end: the
slopes per minute of RSS, fds and /dev/shm bytes (least squares over one sample a second).

Errors: CapacityError is "explained" (the tier is full of models in use, or the churn client
asked to evict a model in use); every other kind counts as unexplained. A client told
"unknown client" was dropped by the daemon: it is counted and reconnects.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from ..usage import Parser

MiB = 1 << 20
EXPLAINED = {"CapacityError"}


# -- a client process -----------------------------------------------------------------------

class Tally:
    """What a client did since its last report line: latencies, errors by kind, wrong outputs."""

    def __init__(self, role: str):
        self.role = role
        self.reset()

    def reset(self):
        self.lat_ms, self.errors, self.wrong, self.dropped, self.busy = [], Counter(), 0, 0, 0
        self.evictions = self.loads = 0

    def line(self) -> str:
        out = json.dumps({"t": time.time(), "role": self.role, "lat_ms": [round(x, 3) for x in self.lat_ms],
                          "errors": dict(self.errors), "wrong": self.wrong, "dropped": self.dropped, "busy": self.busy,
                          "evictions": self.evictions, "loads": self.loads})
        self.reset()
        return out


def worker(role: str, socket: str, refs_path: str, seconds: float, seed: int, churn_interval_s: float,
           attach_runs: int, stick: int) -> int:
    """A client process: `role` work until `seconds` pass; one JSON line per second on stdout."""
    import numpy as np

    import modelcache
    from modelcache.errors import LeaseError

    data = np.load(refs_path)
    names = sorted({k.split("/", 1)[0] for k in data.files})
    refs = {n: data[f"{n}/ref"] for n in names}
    feeds = {n: {k.split("/", 2)[2]: data[k] for k in data.files if k.startswith(f"{n}/feed/")} for n in names}
    rng = random.Random(seed)
    tally = Tally(role)
    client = modelcache.connect(socket)
    sessions: dict = {}                   # a mixed client's attach sessions: name -> [session, runs left]
    end = time.monotonic() + seconds
    next_report = time.monotonic() + 1.0

    def check(name, out):
        tally.wrong += int(not np.allclose(out, refs[name], rtol=1e-3, atol=1e-4))

    name, left = names[0], 0
    while time.monotonic() < end:
        if role == "churn" or left <= 0:  # clients stay with a model a while: the tier holds what is in use,
            name, left = rng.choice(names), stick   # not all of it, so promotions must evict
            for s, _ in sessions.values():  # and let go of the one they leave
                s.close()
            sessions.clear()
        left -= 1
        t0 = time.perf_counter()
        try:
            if role == "churn":
                for step in ("evict", "load"):
                    try:
                        getattr(client, step)(name)
                        tally.evictions += step == "evict"
                        tally.loads += step == "load"
                    except modelcache.errors.CapacityError:
                        tally.busy += 1     # in use, or the tier is full of models in use: refused, as it should be
                time.sleep(churn_interval_s)
            elif role == "openclose":
                with modelcache.InferenceSession(name, client=client) as s:
                    check(name, s.run(None, feeds[name])[0])
            elif rng.random() < 0.5:        # mixed: serve mode
                out, _ = client.infer(name, feeds[name])
                check(name, next(iter(out.values())))
            else:                           # mixed: attach, a session kept for a few runs
                if name not in sessions:
                    sessions[name] = [modelcache.InferenceSession(name, client=client), attach_runs]
                entry = sessions[name]
                check(name, entry[0].run(None, feeds[name])[0])
                entry[1] -= 1
                if entry[1] <= 0:
                    sessions.pop(name)[0].close()
            if role != "churn":
                tally.lat_ms.append((time.perf_counter() - t0) * 1000)
        except Exception as e:
            tally.errors[type(e).__name__] += 1
            if isinstance(e, LeaseError) and "unknown client" in str(e):
                tally.dropped += 1          # the daemon forgot us: say hello again
                for s, _ in sessions.values():
                    s.close()
                sessions.clear()
                client.close()
                client = modelcache.connect(socket)
            elif isinstance(e, modelcache.errors.DaemonUnavailable):
                break
        if time.monotonic() >= next_report:
            print(tally.line(), flush=True)
            next_report += 1.0
    for s, _ in sessions.values():
        s.close()
    client.close()
    print(tally.line(), flush=True)
    return 0


# -- the daemon's footprint -------------------------------------------------------------------

def shm_bytes(daemon_pid: int) -> int:
    """Bytes in /dev/shm of the daemon's host tier and of every modelcache I/O file (what clients leave)."""
    from ..wire.tensors import IO_DIR, IO_PREFIX
    total = 0
    tier = Path(IO_DIR) / f"modelcache.{os.getuid()}.{daemon_pid}"
    for f in tier.iterdir() if tier.is_dir() else ():
        try:
            total += f.lstat().st_blocks * 512
        except OSError:
            pass
    with os.scandir(IO_DIR) as entries:
        for e in entries:
            if e.name.startswith(IO_PREFIX):
                try:
                    total += e.stat(follow_symlinks=False).st_blocks * 512
                except OSError:
                    pass
    return total


def slope_per_minute(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) samples, per minute."""
    n = len(samples)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    return 60 * sum((t - mt) * (v - mv) for t, v in samples) / var if var else 0.0


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


# -- the run ---------------------------------------------------------------------------------

def host_bytes(client) -> int:
    return next(t["used_bytes"] for t in client.stats().tiers if t["tier"] == "host")


def prepare(models: list[str], work: Path, client, copies: int = 1) -> tuple[str, dict]:
    """Add the zoo models, write their feeds and plain ORT's answers to refs.npz; returns (path, name -> the
    bytes the model takes in the host tier: its segments, less than the manifest's padded weights_bytes).
    Each zoo model is added `copies` times (NAME.K, weights seeded K: no segment is shared)."""
    import numpy as np

    from .. import zoo
    from ..measure import plain_session
    arrays, sizes = {}, {}
    for zname, k in ((z, k) for z in models for k in range(copies)):
        name = f"{zname}.{k}" if copies > 1 else zname
        src = work / f"{name}.onnx"
        zoo.save(zoo.build(zname, seed=k), str(src))
        client.add(str(src), name)
        before = host_bytes(client)
        client.load(name)
        sizes[name] = host_bytes(client) - before
        feeds = zoo.sample_inputs(str(src), batch=2)
        arrays[f"{name}/ref"] = plain_session(str(src)).run(None, feeds)[0]
        arrays.update({f"{name}/feed/{k}": v for k, v in feeds.items()})
    path = work / "refs.npz"
    np.savez(path, **arrays)
    return str(path), sizes


def roles(clients: int) -> list[str]:
    return ["churn", "openclose", *["mixed"] * max(0, clients - 2)][:clients]


def run_soak(args, work: Path, log=print) -> dict:
    import psutil

    from ..client.connection import connect
    from ..measure import managed_daemon

    address = f"ipc://{work}/daemon.sock"
    env = {"MODELCACHE_WORKERS": args.workers, "MODELCACHE_STATE_DIR": str(work / "state"),
           "MODELCACHE_HOST_CAPACITY": "1G"}
    # First a daemon to add the models (to learn their sizes), then the soak's, with the tier cut below them.
    with managed_daemon(address, str(work / "repo"), env, str(work / "daemon.log")), connect(address) as c:
        refs_path, sizes = prepare(args.models, work, c, args.copies)
    weights = sum(sizes.values())
    # below the working set, yet room for the largest model (else it could never be served)
    capacity = max(int(weights * args.capacity_fraction), max(sizes.values()) + 4096)
    env["MODELCACHE_HOST_CAPACITY"] = str(capacity)
    result = {"args": {k: v for k, v in vars(args).items() if k != "out"}, "weights_bytes": weights,
              "model_bytes": sizes,
              "host_capacity_bytes": capacity, "minutes": [], "samples": []}
    log(f"models {' '.join(args.models)}: {weights >> 10} KiB in the host tier, which holds {capacity >> 10} KiB; "
        f"clients {' '.join(roles(args.clients))}")
    log(HEADER_ROW)
    with managed_daemon(address, str(work / "repo"), env, str(work / "daemon.log")), connect(address) as monitor:
        pid = monitor.stats().pid
        daemon = psutil.Process(pid)
        seconds = args.minutes * 60
        lines: list[dict] = []
        lock = threading.Lock()
        procs = []
        for i, role in enumerate(roles(args.clients)):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "modelcache.bench.soak", "--worker", role, address, refs_path, str(seconds),
                 str(args.seed + i), str(args.churn_interval_s), str(args.attach_runs), str(args.stick)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))

        def read(p):
            for line in p.stdout:
                if line.startswith("{"):
                    with lock:
                        lines.append(json.loads(line))
        readers = [threading.Thread(target=read, args=(p,), daemon=True) for p in procs]
        for t in readers:
            t.start()
        t_start = time.time()
        crashed = False
        next_report = t_start + args.report_s
        minute_start = t_start
        while any(p.poll() is None for p in procs):
            time.sleep(1.0)
            if not daemon.is_running():
                crashed = True
                log("the daemon died")
                break
            try:
                result["samples"].append([round(time.time() - t_start, 1), daemon.memory_info().rss, daemon.num_fds(),
                                          shm_bytes(pid)])
            except psutil.Error:
                crashed = True
                break
            if time.time() >= next_report:
                result["minutes"].append(summarize(lines, lock, minute_start, time.time(), result["samples"], monitor))
                log(minute_row(len(result["minutes"]), result["minutes"][-1]))
                minute_start, next_report = time.time(), next_report + args.report_s
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        for t in readers:
            t.join(5)
        if time.time() - minute_start > 1 or not result["minutes"]:
            result["minutes"].append(summarize(lines, lock, minute_start, time.time() + 1, result["samples"],
                                               None if crashed else monitor))
            log(minute_row(len(result["minutes"]), result["minutes"][-1]))
        result["client_exit_codes"] = [p.returncode for p in procs]
        result["client_stderr"] = [p.stderr.read()[-1500:] for p in procs if p.returncode]
        result["crashed"] = crashed or not daemon.is_running()
        if not result["crashed"]:
            counters = monitor.stats().counters
            result["clients_lost"] = counters.get("clients_lost", 0)
            result["daemon_counters"] = {k: counters.get(k, 0) for k in ("promotions", "evictions", "opens", "hits",
                                                                         "misses", "bad_messages")}
    s = [x for x in result["samples"] if x[0] <= seconds]   # while every client runs, not their wind-down
    result["slopes_per_minute"] = {"rss_mib": slope_per_minute([(t, r / MiB) for t, r, _, _ in s]),
                                   "fds": slope_per_minute([(t, f) for t, _, f, _ in s]),
                                   "shm_mib": slope_per_minute([(t, b / MiB) for t, _, _, b in s])}
    totals = Counter()
    for m in result["minutes"]:
        totals.update({"requests": m["requests"], "wrong": m["wrong"], "dropped": m["dropped"],
                       "unexplained_errors": sum(v for k, v in m["errors"].items() if k not in EXPLAINED),
                       "explained_errors": sum(v for k, v in m["errors"].items() if k in EXPLAINED)})
    result["totals"] = dict(totals)
    return result


def summarize(lines: list, lock, t0: float, t1: float, samples: list, monitor) -> dict:
    """The client lines stamped in [t0, t1) and the daemon's latest footprint, as one report row."""
    with lock:
        mine = [x for x in lines if t0 <= x["t"] < t1]
    lat = sorted(v for x in mine for v in x["lat_ms"])
    errors = Counter()
    for x in mine:
        errors.update(x["errors"])
    _, rss, fds, shm = samples[-1] if samples else (0, 0, 0, 0)
    return {"seconds": round(t1 - t0, 1), "requests": len(lat), "rps": round(len(lat) / max(t1 - t0, 1e-9), 1),
            "p50_ms": round(percentile(lat, 0.5), 2), "p99_ms": round(percentile(lat, 0.99), 2),
            "errors": dict(errors), "wrong": sum(x["wrong"] for x in mine), "dropped": sum(x["dropped"] for x in mine),
            "churn_busy": sum(x["busy"] for x in mine), "evictions": sum(x["evictions"] for x in mine),
            "loads": sum(x["loads"] for x in mine),
            "rss_mib": round(rss / MiB, 1), "fds": fds,
            "shm_mib": round(shm / MiB, 1)}


HEADER_ROW = (f"{'min':>4} {'requests':>9} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'wrong':>5} {'dropped':>7} "
              f"{'RSS MiB':>8} {'fds':>4} {'shm MiB':>8}  errors")


def minute_row(i: int, m: dict) -> str:
    errors = ", ".join(f"{k} {v}" for k, v in sorted(m["errors"].items())) or "-"
    return (f"{i:>4} {m['requests']:>9} {m['rps']:>7} {m['p50_ms']:>7} {m['p99_ms']:>7} {m['wrong']:>5} "
            f"{m['dropped']:>7} {m['rss_mib']:>8} {m['fds']:>4} {m['shm_mib']:>8}  {errors}")


def report(r: dict, f=None) -> None:
    p = lambda s="": print(s, file=f)   # noqa: E731
    a = r["args"]
    p(f"soak: {a['minutes']} min, {a['clients']} clients ({' '.join(roles(a['clients']))}), models "
      f"{' '.join(a['models'])}; {r['weights_bytes'] >> 10} KiB of them, "
      f"host tier {r['host_capacity_bytes'] >> 10} KiB")
    p(HEADER_ROW)
    for i, m in enumerate(r["minutes"], 1):
        p(minute_row(i, m))
    t, s = r["totals"], r["slopes_per_minute"]
    p(f"totals: {t.get('requests', 0)} requests, {t.get('wrong', 0)} wrong, "
      f"{t.get('unexplained_errors', 0)} unexplained errors, {t.get('explained_errors', 0)} explained (CapacityError), "
      f"{t.get('dropped', 0)} clients dropped (daemon's clients_lost {r.get('clients_lost', '?')}), "
      f"churn: {sum(m['evictions'] for m in r['minutes'])} evictions, {sum(m['loads'] for m in r['minutes'])} loads, "
      f"{sum(m['churn_busy'] for m in r['minutes'])} refused (in use)")
    p(f"daemon crashed: {'YES' if r['crashed'] else 'no'}; client exit codes {r['client_exit_codes']}; "
      f"daemon counters {r.get('daemon_counters', '?')}")
    p(f"slopes per minute: RSS {s['rss_mib']:+.2f} MiB, fds {s['fds']:+.2f}, /dev/shm {s['shm_mib']:+.2f} MiB")
    for e in r.get("client_stderr", []):
        p(f"client stderr: {e}")


def passed(r: dict) -> bool:
    t = r["totals"]
    return (not r["crashed"] and t.get("wrong", 0) == 0 and t.get("unexplained_errors", 0) == 0
            and t.get("dropped", 0) == 0 and all(c == 0 for c in r["client_exit_codes"]))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        role, socket, refs, seconds, seed, interval, attach_runs, stick = argv[1:9]
        return worker(role, socket, refs, float(seconds), int(seed), float(interval), int(attach_runs), int(stick))
    from ..measure import save_results
    ap = Parser(prog="modelcache bench soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0, help="how long the clients run (default 5)")
    ap.add_argument("--clients", type=int, default=8,
                    help="client processes: 1 load/evict churn, 1 open/close churn, the rest mixed (default 8)")
    ap.add_argument("--models", nargs="+", default=["tiny-cnn", "tiny-vit", "tiny-embed", "tiny-fp16"],
                    help="zoo models the clients use (default: the four tiny ones of the eviction soak in tests)")
    ap.add_argument("--capacity-fraction", type=float, default=0.75,
                    help="host tier size as a share of the models' bytes in it; below 1 evicts (default 0.75; "
                         "never below the largest model)")
    ap.add_argument("--workers", default="1,1", help="the daemon's serve-mode worker groups (default 1,1)")
    ap.add_argument("--copies", type=int, default=2,
                    help="add each zoo model this many times, weights seeded apart (default 2: 8 models)")
    ap.add_argument("--stick", type=int, default=50,
                    help="requests a client makes of one model before it picks another (default 50)")
    ap.add_argument("--attach-runs", type=int, default=5,
                    help="runs of a mixed client's attach session before it closes it (default 5); "
                         "longer holds leave the churn client fewer models it may evict")
    ap.add_argument("--churn-interval-s", type=float, default=0.02, help="pause of the load/evict client per model")
    ap.add_argument("--report-s", type=float, default=60.0, help="seconds per report row (default 60: per minute)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write results.json and report.txt here (e.g. benchmarks/soak)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mc-soak-") as tmp:
        r = run_soak(args, Path(tmp), log=lambda s: print(s, flush=True))
    report(r)
    save_results(args.out, "soak", argv, r, report)
    return 0 if passed(r) else 1


if __name__ == "__main__":
    raise SystemExit(main())
