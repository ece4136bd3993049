"""Simulator vs the real daemon: does a plan's simulated latency and throughput match serving it here?

    PYTHONPATH=. python benchmarks/placement/check/run.py [--models resnet50 alexnet] [--workers 1,1 2] [--stages 2 3]
                                     [--requests 15] [--seconds 21] [--profile-s 3] [--rounds 3]
                                     [--max-other 0.1] [--retries 1] [--out benchmarks/placement/check]

For each CPU worker layout, a daemon is started with serial batching (a request is its own batch,
as the simulator replays it). Each model is cut into k stages of equal measured cost, stage i on
worker cpu-(i mod groups), served with `partition --plan`; the model is profiled with ORT's
profiler on the daemon's own worker of each thread count (`place --profile-on daemon`), and in this
process pinned alike, and the simulator predicts from each. A row runs in --rounds rounds, each a
slice of the profiles, of the solo requests and of the load, and each figure pools its slices: this
VM's speed moves by ~20 % over tens of seconds with nothing else running
(benchmarks/placement/check/speed_probe.py), so a profile taken once, seconds before, predicts the
moment it was taken (2 and 5 of 16 figures within 10 % in two runs that way).

  latency     one request at a time: the median of --requests round trips (client wall time)
              against the simulator's, each request sent as the previous is answered (one_at_a_time:
              the workers that ran the previous request's stages are warm, others may have idled);
  throughput  open-loop Poisson arrivals at 1.5x the plan's analytical capacity for --seconds
              (latency from the scheduled send time), answered requests per second, against the
              simulator replaying the same arrival times.

The simulator is fed four ways: the daemon's profile (each node's median run: the planner's own
costs, a true prediction); the profile taken in this process (what the planner used before, and
still does without a daemon; it ran 0-14 % faster than the daemon ran the stages); the stage times
the daemon measured serving one request at a time (solo: then throughput under load is still a
prediction, of queueing and pipelining); and the stage times it measured under the load (which
checks the simulator's queueing model alone). Each is simulated with the system's
serving costs (request_us, handoff_us: machine.py); "serving ms" is what this run measured of them
(client wall less the stages' runs). On a shared machine the gap between them is other processes'
load: the load average is printed beside each row.

Other processes are measured, not guessed from the load average (which counts this benchmark's own
daemon and lags a minute): each phase of a row (the profile, the solo requests, the load) records
the cores other processes and the hypervisor (steal) took meanwhile (cpuload.py here). On 2 cores a
2-thread worker's every parallel op waits for a preempted thread, so a burst of someone else's work
in one phase and not the other shows as a simulator error that is no error of the simulator. A row
where any phase saw more than --max-other cores of that is measured again (up to --retries times),
keeping the quietest attempt; the row says what its phases saw and how many attempts it took.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.placement.check import cpuload
from modelcache.measure import managed_daemon, save_results

OVERLOAD = 1.5


def balanced_plan(table, system, stages: int) -> "Plan":
    from modelcache.placement.plan import Plan, Stage
    kind = system.workers[0].kind
    total = table.seconds(kind, 0, table.n, 1)
    bounds, at = [0], 0
    for k in range(1, stages):
        at = min(range(at + 1, table.n - (stages - k) + 1),
                 key=lambda i: abs(table.seconds(kind, 0, i, 1) - total * k / stages))
        bounds.append(at)
    bounds.append(table.n)
    W = len(system.workers)
    return Plan([Stage(a, b, (k % W,), (1,)) for k, (a, b) in enumerate(zip(bounds, bounds[1:]))], 1,
                model="", method=f"{stages} stages of equal cost")


def open_loop(client, name: str, arrivals: list, feeds: dict, drain_s: float = 60.0) -> list:
    """Send one request at each arrival time (s from now) whatever the answers do; returns per request
    (arrival, latency from its scheduled time or None, [run seconds per stage as the daemon timed them])."""
    from modelcache.client.stream import InferStream
    from modelcache.wire import tensors

    group_of = client.address[len("ipc://"):] if client.address.startswith("ipc://") else None
    wire, files = tensors.encode(feeds, group_of=group_of)
    results: dict = {}
    try:
        with InferStream(client) as stream:
            start, i, sent = time.monotonic(), 0, {}
            end = start + (arrivals[-1] if arrivals else 0) + drain_s
            while i < len(arrivals) or (sent and time.monotonic() < end):
                now = time.monotonic()
                while i < len(arrivals) and start + arrivals[i] <= now:
                    stream.send(i, name, wire)
                    sent[i] = start + arrivals[i]
                    i += 1
                wait_s = (start + arrivals[i] - now) if i < len(arrivals) else end - now
                for req_id, _, timings, error in stream.receive(max(0, int(wait_s * 1000))):
                    scheduled = sent.pop(req_id, None)
                    if scheduled is not None and error is None:
                        results[req_id] = (arrivals[req_id], time.monotonic() - scheduled,
                                           [st["run_ms"] / 1e3 for st in timings["stages"]])
    finally:
        for f in files:
            os.unlink(f)
    return [results.get(k, (a, None, [])) for k, a in enumerate(arrivals)]


def as_served(table, plan, run_s: list):
    """The cost table with each stage's nodes scaled so the stage takes the median time the daemon
    measured for it: the simulator's queueing model checked apart from the profile's stage times. Its
    wake_s is empty: the measured times hold whatever wake-ups the runs met."""
    import numpy as np
    from modelcache.placement.costs import CostTable

    node_s = {k: np.diff(p, axis=1) for k, p in table.prefix_s.items()}
    for k, stage in enumerate(plan.stages):
        for kind, arr in node_s.items():
            planned = arr[1, stage.start:stage.end].sum()
            if planned > 0 and run_s[k]:
                arr[:, stage.start:stage.end] *= statistics.median(run_s[k]) / planned
    return CostTable.from_node_seconds(table.model, node_s, table.cut_bytes, np.diff(table.weight_prefix),
                                       table.source, table.nodes)


def merged(meters: list[dict]) -> dict:
    """cpuload results of a phase's slices as one: each figure weighted by its slice's seconds."""
    seconds = sum(m["seconds"] for m in meters)
    return {k: (seconds if k == "seconds" else sum(m[k] * m["seconds"] for m in meters) / seconds if seconds else 0.0)
            for k in meters[0]}


def check_one(client, repo: Path, name: str, system, stages: int, args) -> dict:
    """One row: the model cut into `stages`, served, and simulated, in args.rounds interleaved rounds
    (a profile slice, solo requests, a load slice), so the profile and what it predicts sample the same
    stretch of this VM's time (its speed moves by ~20 % over tens of seconds with nothing else running)."""
    from modelcache.placement.machine import cost_table, profiled_threads
    from modelcache.placement.plan import PlanCost
    from modelcache.placement.profile import PooledProfile, daemon_source
    from modelcache.placement.simulate import one_at_a_time, poisson_arrivals, simulate
    from modelcache.store.format import SKELETON_FILE
    from modelcache.zoo import sample_inputs

    model_dir = repo / name / "1"
    feeds = sample_inputs(str(model_dir / "model.onnx"), batch=1)
    threads = profiled_threads(system)
    # The planner's costs: profiled on the daemon's own workers (`place --profile-on daemon`); beside them,
    # the same profile taken in this process, pinned alike (`--profile-on here`).
    pools = {"profile": PooledProfile(model_dir / SKELETON_FILE, feeds, threads,
                                      source=daemon_source(client, name, feeds)),
             "profile_here": PooledProfile(model_dir / SKELETON_FILE, feeds, threads)}
    pool = pools["profile"]
    meters: dict[str, list] = {"profile": [], "solo": [], "load": []}
    slice_s = args.profile_s / args.rounds

    def profile_slice(r: int) -> None:
        with cpuload.Meter() as m:
            for key in sorted(pools, reverse=bool(r % 2)):    # each first in every other round
                pools[key].take(runs=5, min_s=slice_s)
        meters["profile"].append(m.result)

    profile_slice(0)
    first = cost_table(model_dir, f"{name}@1", system, 1, profiles=pool.summary(), wake_s=pool.wake_s())
    plan = balanced_plan(first, system, stages)     # the cut, from the first slice; the rounds keep it
    plan.model = f"{name}@1"
    PlanCost(first, system, 1).annotate(plan)
    client.partition(name, plan=plan.to_json(system, first))
    for _ in range(3):                       # sessions built, performance models calibrated
        client.infer(name, feeds)
    walls, solo_run_s, serving_ms = [], [[] for _ in plan.stages], []
    chunks, rate = [], None                  # per round: (arrivals, open_loop's answers)
    per_round = max(1, -(-args.requests // args.rounds))
    for r in range(args.rounds):
        if r:
            profile_slice(r)
        with cpuload.Meter() as m:
            for _ in range(per_round):
                t0 = time.perf_counter()
                _, timings = client.infer(name, feeds)
                walls.append(time.perf_counter() - t0)
                for k, st in enumerate(timings["stages"]):
                    solo_run_s[k].append(st["run_ms"] / 1e3)
                # serving's own cost (wall less the stages' runs), against the system's request_us + stages x handoff_us
                serving_ms.append(walls[-1] * 1e3 - sum(st["run_ms"] for st in timings["stages"]))
        meters["solo"].append(m.result)
        if rate is None:
            # Offered load: 1.5x the capacity the first solo stage times give, so the pipeline saturates but drains soon.
            rate = OVERLOAD / PlanCost(as_served(first, plan, solo_run_s), system, 1).bottleneck_s(plan)
        arrivals = poisson_arrivals(rate, max(4, int(rate * args.seconds / args.rounds)), seed=r + 1)
        with cpuload.Meter() as m:
            chunks.append((arrivals, open_loop(client, name, arrivals, feeds)))
        meters["load"].append(m.result)
    phases = {k: merged(v) for k, v in meters.items()}

    costs = {key: PlanCost(cost_table(model_dir, f"{name}@1", system, 1, profiles=p.summary(), wake_s=p.wake_s()),
                           system, 1) for key, p in pools.items()}
    costs["solo"] = PlanCost(as_served(first, plan, solo_run_s), system, 1)
    answers = [x for _, load in chunks for x in load]
    loaded_run_s = [[run[k] for _, _, run in answers if len(run) > k] for k in range(len(plan.stages))]
    costs["loaded"] = PlanCost(as_served(first, plan, loaded_run_s), system, 1)

    def one(c):
        """As the solo requests were sent: each when the previous was answered (the first, on idle workers, left out)."""
        return statistics.median(one_at_a_time(c, plan, 3, samples=1)[1:])

    def throughput(served: list) -> float:
        """Requests per second over the load slices: answered / the slices' spans (first arrival to last answer)."""
        done = sum(n for n, _ in served)
        return done / sum(span for _, span in served)

    measured = []
    for arrivals, load in chunks:
        answered = [(a, lat) for a, lat, _ in load if lat is not None]
        measured.append((len(answered), max(a + lat for a, lat in answered) - min(arrivals)))
    measured_thru = throughput(measured)
    thru = {}
    for key, c in costs.items():
        runs = [simulate(c, plan, arrivals, within_set="dmda", samples=1, record=False) for arrivals, _ in chunks]
        thru[key] = throughput([(s.completed, s.span_s(arrivals)) for s, (arrivals, _) in zip(runs, chunks)])
    measured_latency = statistics.median(walls)
    cost = costs["profile"]
    row = {"model": name, "workers": [w.name for w in system.workers], "kind": system.workers[0].kind,
           "stages": stages, "bounds": [(s.start, s.end) for s in plan.stages], "rounds": args.rounds,
           "latency_ms": {"measured": measured_latency * 1e3,
                          **{f"simulated_{k}": one(c) * 1e3 for k, c in costs.items() if k != "loaded"},
                          "samples_ms": [w * 1e3 for w in walls]},
           "throughput_per_s": {"measured": measured_thru, "offered": rate,
                                "requests": sum(len(a) for a, _ in chunks), "answered": sum(n for n, _ in measured),
                                **{f"simulated_{k}": v for k, v in thru.items()}},
           "stage_s": {"profiled": [cost.stage_s(st) for st in plan.stages],
                       "profiled_here": [costs["profile_here"].stage_s(st) for st in plan.stages],
                       "served_solo": [statistics.median(r) for r in solo_run_s],
                       "served_loaded": [statistics.median(r) if r else None for r in loaded_run_s]},
           "serving_ms": {"measured": statistics.median(serving_ms),
                          "system": (system.request_s + stages * system.handoff_s) * 1e3},
           "wake_ms": {key: {n: s * 1e3 for n, s in p.wake_s().items()} for key, p in pools.items()},
           "load_average": os.getloadavg(), "cpu": phases,
           "other_cores": max(p["other"] + p["steal"] for p in phases.values())}
    for key in ("profile", "profile_here", "solo"):
        row[f"latency_error_{key}"] = row["latency_ms"][f"simulated_{key}"] / (measured_latency * 1e3) - 1
    for key in costs:
        row[f"throughput_error_{key}"] = thru[key] / measured_thru - 1
    for _ in range(120):                      # requests still in flight hold the model
        try:
            client.partition(name, stages=1)
            break
        except Exception:
            time.sleep(1)
    return row


def quietest(measure, args) -> dict:
    """A row measured until no phase saw more than args.max_other cores of other processes' work (at most
    1 + args.retries attempts): the quietest attempt, with every attempt's figures kept beside it."""
    tries = []
    while True:
        row = measure()
        tries.append(row)
        print(("  " if len(tries) == 1 else "    again: ") + line(row), flush=True)
        if row["other_cores"] <= args.max_other or len(tries) > args.retries:
            break
    best = min(range(len(tries)), key=lambda i: tries[i]["other_cores"])
    row = dict(tries[best], attempts=len(tries), chosen=best + 1)
    if len(tries) > 1:
        row["other_attempts"] = [t for i, t in enumerate(tries) if i != best]
    return row


def speed_drift(r: dict) -> tuple | None:
    """The daemon's stage runs, solo and under load, against the profile's for the same stages (sums; None
    when not recorded). The profile's slices are interleaved with the requests, so the machine's own
    drift (benchmarks/placement/check/speed_probe.py) is mostly out of this; what is left is how much
    slower the daemon runs the stages than the profile ran them, which an error "from the profile"
    carries whatever the simulator does."""
    st = r.get("stage_s") or {}
    if not st.get("profiled") or not st.get("served_solo") or None in (st.get("served_loaded") or [None]):
        return None
    base = sum(st["profiled"])
    return sum(st["served_solo"]) / base - 1, sum(st["served_loaded"]) / base - 1


def line(r: dict) -> str:
    lat, thr = r["latency_ms"], r["throughput_per_s"]
    return (f"{r['model']:<9} {','.join(r['workers'])} ({r['kind']}) {r['stages']} stages | latency ms: measured "
            f"{lat['measured']:.1f}, simulated {lat['simulated_profile']:.1f} from the profile "
            f"({r['latency_error_profile'] * 100:+.1f} %)"
            + (f", {lat['simulated_profile_here']:.1f} profiled here ({r['latency_error_profile_here'] * 100:+.1f} %)"
               if "simulated_profile_here" in lat else "")
            + f", {lat['simulated_solo']:.1f} from solo stage times "
            f"({r['latency_error_solo'] * 100:+.1f} %) | throughput /s: measured {thr['measured']:.2f}, simulated "
            f"{thr['simulated_profile']:.2f} profile ({r['throughput_error_profile'] * 100:+.1f} %), "
            + (f"{thr['simulated_profile_here']:.2f} here ({r['throughput_error_profile_here'] * 100:+.1f} %), "
               if "simulated_profile_here" in thr else "")
            + f"{thr['simulated_solo']:.2f} solo ({r['throughput_error_solo'] * 100:+.1f} %), "
            f"{thr['simulated_loaded']:.2f} loaded ({r['throughput_error_loaded'] * 100:+.1f} %) | "
            + (f"serving ms: measured {o['measured']:.2f}, system {o['system']:.2f} | " if (o := r.get("serving_ms")) else "")
            + (f"stage runs vs the profile: solo {drift[0] * 100:+.1f} %, load {drift[1] * 100:+.1f} % | "
               if (drift := speed_drift(r)) else "")
            + (f"profile here vs the daemon's: {(sum(st['profiled_here']) / sum(st['profiled']) - 1) * 100:+.1f} % | "
               if (st := r.get("stage_s") or {}).get("profiled_here") else "")
            + (f"wake ms: {', '.join(f'{v:.2f}' for v in wk['profile'].values())} | " if (wk := r.get("wake_ms")) else "")
            + f"load average {r['load_average'][0]:.1f}"
            + (f" | other cores: profile {c['profile']['other'] + c['profile']['steal']:.2f}, solo "
               f"{c['solo']['other'] + c['solo']['steal']:.2f}, load {c['load']['other'] + c['load']['steal']:.2f}"
               f"{'' if r.get('attempts', 1) == 1 else ', attempt %d of %d' % (r['chosen'], r['attempts'])}"
               if (c := r.get("cpu")) else ""))


def report(data: dict, f) -> None:
    if "load_average_at_start" in data:
        f.write(f"(load average {data['load_average_at_start']:.2f} at start; other processes' cores "
                f"(busy less this benchmark's, plus steal) at most {data['max_other']} in every phase of a row, "
                f"else measured again, up to {data['retries']} more times)\n")
    for r in data["rows"]:
        f.write(line(r) + "\n")
    names = {"profile": "the profile on the daemon's workers", "profile_here": "the profile in this process",
             "profile_fast": "the profile's faster half", "solo": "solo stage times", "loaded": "loaded stage times"}
    for key in names:
        errs = [abs(r[f"{m}_error_{key}"]) for r in data["rows"] for m in ("latency", "throughput")
                if f"{m}_error_{key}" in r]
        if errs:
            f.write(f"simulated from {names[key]}: largest error {max(errs) * 100:.1f} %, within 10 %: "
                    f"{sum(e <= 0.10 for e in errs)} of {len(errs)}\n")


def main(argv=None) -> int:
    from modelcache import zoo
    from modelcache.client.connection import connect
    from modelcache.placement.machine import describe_machine

    ap = argparse.ArgumentParser(prog="benchmarks/placement/check/run.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["resnet50", "alexnet"])
    ap.add_argument("--workers", nargs="+", default=["1,1", "2"])
    ap.add_argument("--stages", nargs="+", type=int, default=[2, 3])
    ap.add_argument("--requests", type=int, default=15, help="solo requests, over all rounds")
    ap.add_argument("--seconds", type=float, default=21.0, help="seconds of offered load, over all rounds")
    ap.add_argument("--profile-s", type=float, default=3.0,
                    help="the profile's runs span at least this many seconds, over all rounds")
    ap.add_argument("--rounds", type=int, default=3,
                    help="profile, solo requests and load interleaved this many times in each row")
    ap.add_argument("--max-other", type=float, default=0.1,
                    help="a row where other processes (and steal) took more cores than this in any phase is measured again")
    ap.add_argument("--retries", type=int, default=1, help="times a disturbed row is measured again")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.requests < 1 or args.seconds <= 0 or args.profile_s < 0:
        ap.error("--rounds and --requests must be at least 1, --seconds above 0, --profile-s not below 0")
    rows, load_at_start = [], os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="modelcache-simcheck-") as tmp:
        tmp = Path(tmp)
        for name in args.models:
            zoo.save(zoo.build(name), str(tmp / f"{name}.onnx"))
        for spec in args.workers:
            env = {"MODELCACHE_WORKERS": spec, "MODELCACHE_BATCHING": "serial", "MODELCACHE_GPUS": "none",
                   "MODELCACHE_STATE_DIR": str(tmp / f"state-{spec}")}
            repo = tmp / f"repo-{spec.replace(',', '-')}"
            with managed_daemon(f"ipc://{tmp}/d-{spec.replace(',', '-')}.sock", str(repo), env,
                                str(tmp / "daemon.log")) as socket, connect(socket, timeout_s=600) as client:
                system = describe_machine(spec, gpus="none")
                print(f"workers {spec}:", flush=True)
                for name in args.models:
                    client.add(str(tmp / f"{name}.onnx"), name)
                    for k in args.stages:
                        rows.append(quietest(lambda: check_one(client, repo, name, system, k, args), args))
    data = {"rows": rows, "cores": len(os.sched_getaffinity(0)), "load_average_at_start": load_at_start,
            "max_other": args.max_other, "retries": args.retries}
    report(data, sys.stdout)
    save_results(args.out, "placement_check", argv, data, report,
                 command="PYTHONPATH=. python benchmarks/placement/check/run.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
