"""Where do placement_check's stage times come from, and do they agree? One model on one CPU layout,
cut into each stage count in turn, several rounds, every phase metered for other processes' CPU.

    PYTHONPATH=. python benchmarks/placement/check/phases.py [--model resnet50] [--workers 2]
        [--stages 2 3] [--rounds 3] [--requests 10] [--seconds 8] [--profile-s 2] [--out FILE.json]

Per round and stage count, as placement_check does a row, but keeping every sample:
  profile   the whole model's kernel time per run (ORT's profiler, pinned to the group's cores,
            runs spread over --profile-s): median of all runs and of the faster half (what the
            planner uses);
  solo      one request at a time: the sum of the stages' run_ms per request (median), and wall;
  loaded    open loop at 1.5x for --seconds: stage sum per request (median) and served throughput,
            with the per-request service time it implies (1 / throughput) less the stage sum;
and the cores other processes and steal took in each phase (cpuload.py here).

The question it answers: is the gap between a row's profile, solo and loaded stage times systematic
(the cut, the phase, the order of rows), or noise that comes and goes with other processes' load?
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main(argv=None) -> int:
    from modelcache import zoo
    from benchmarks.placement.check import cpuload
    from modelcache.measure import managed_daemon
    from benchmarks.placement.check.run import OVERLOAD, balanced_plan, open_loop
    from modelcache.client.connection import connect
    from modelcache.placement.machine import cost_table, describe_machine
    from modelcache.placement.plan import PlanCost
    from modelcache.placement.profile import fastest_runs, node_times
    from modelcache.placement.simulate import poisson_arrivals
    from modelcache.store.format import SKELETON_FILE
    from modelcache.zoo import sample_inputs

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--workers", default="2")
    ap.add_argument("--stages", nargs="+", type=int, default=[2, 3])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--profile-s", type=float, default=2.0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="modelcache-phases-") as tmp:
        tmp = Path(tmp)
        zoo.save(zoo.build(args.model), str(tmp / f"{args.model}.onnx"))
        env = {"MODELCACHE_WORKERS": args.workers, "MODELCACHE_BATCHING": "serial", "MODELCACHE_GPUS": "none",
               "MODELCACHE_STATE_DIR": str(tmp / "state")}
        repo = tmp / "repo"
        with managed_daemon(f"ipc://{tmp}/d.sock", str(repo), env, str(tmp / "daemon.log")) as socket, \
                connect(socket, timeout_s=600) as client:
            system = describe_machine(args.workers, gpus="none")
            threads = int(system.workers[0].kind[3:])          # cpuN: the first group's cores
            client.add(str(tmp / f"{args.model}.onnx"), args.model)
            model_dir = repo / args.model / "1"
            feeds = sample_inputs(str(model_dir / "model.onnx"), batch=1)
            skeleton = model_dir / SKELETON_FILE
            table = cost_table(model_dir, f"{args.model}@1", system, 1, runs=5, min_s=args.profile_s)
            for rnd in range(args.rounds):
                for k in args.stages:
                    row = {"round": rnd, "stages": k, "cpu": {}}
                    with cpuload.Meter() as m:
                        times, _, _ = node_times(skeleton, feeds, threads, 5, args.profile_s)
                    row["cpu"]["profile"] = m.result
                    runs = max(len(t) for t in times.values())
                    totals = [sum(t[i] for t in times.values() if i < len(t)) for i in range(1, runs)]
                    keep = [i - 1 for i in fastest_runs(times)]
                    row["profile_ms"] = {"runs": len(totals), "median": statistics.median(totals) * 1e3,
                                         "faster_half": statistics.median([totals[i] for i in keep]) * 1e3,
                                         "min": min(totals) * 1e3, "all": [t * 1e3 for t in totals]}
                    plan = balanced_plan(table, system, k)
                    plan.model = f"{args.model}@1"
                    client.partition(args.model, plan=plan.to_json(system, table))
                    for _ in range(3):
                        client.infer(args.model, feeds)
                    sums, walls = [], []
                    with cpuload.Meter() as m:
                        for _ in range(args.requests):
                            t0 = time.perf_counter()
                            _, timings = client.infer(args.model, feeds)
                            walls.append((time.perf_counter() - t0) * 1e3)
                            sums.append(sum(st["run_ms"] for st in timings["stages"]))
                    row["cpu"]["solo"] = m.result
                    row["solo_ms"] = {"stage_sum": statistics.median(sums), "wall": statistics.median(walls)}
                    bottleneck = PlanCost(table, system, 1).bottleneck_s(plan)
                    rate = OVERLOAD / bottleneck
                    arrivals = poisson_arrivals(rate, max(4, int(rate * args.seconds)), seed=rnd + 1)
                    with cpuload.Meter() as m:
                        load = open_loop(client, args.model, arrivals, feeds)
                    row["cpu"]["load"] = m.result
                    answered = [(a, lat, r) for a, lat, r in load if lat is not None]
                    thru = len(answered) / (max(a + lat for a, lat, _ in answered) - min(arrivals))
                    loaded_sum = statistics.median(sum(r) for _, _, r in answered) * 1e3
                    row["loaded"] = {"stage_sum_ms": loaded_sum, "throughput_per_s": thru,
                                     "service_ms": 1e3 / thru, "beyond_stages_ms": 1e3 / thru - loaded_sum}
                    rows.append(row)
                    c = row["cpu"]
                    print(f"round {rnd} {k} stages | profile ms: faster half {row['profile_ms']['faster_half']:.1f}, "
                          f"median {row['profile_ms']['median']:.1f}, min {row['profile_ms']['min']:.1f} "
                          f"({row['profile_ms']['runs']} runs) | solo stage sum {row['solo_ms']['stage_sum']:.1f}, "
                          f"wall {row['solo_ms']['wall']:.1f} | loaded stage sum {loaded_sum:.1f}, "
                          f"{thru:.2f}/s = {1e3 / thru:.1f} ms a request | other cores: "
                          + ", ".join(f"{p} {c[p]['other'] + c[p]['steal']:.2f}" for p in ("profile", "solo", "load"))
                          + f" (daemon in profile {c['profile']['daemon']:.2f})", flush=True)
                    for _ in range(120):
                        try:
                            client.partition(args.model, stages=1)
                            break
                        except Exception:
                            time.sleep(1)
    if args.out:
        Path(args.out).write_text(json.dumps({"argv": sys.argv[1:], "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
