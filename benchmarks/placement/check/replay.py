"""Re-simulate a placement_check results.json with the simulator as it is now, without a daemon.

    PYTHONPATH=. python benchmarks/placement/check/replay.py [benchmarks/placement/check/results.json]

Each row's stage times (profiled, served solo, served under load: the medians the run recorded)
become a one-node-per-stage cost table on a system like `describe_machine` writes for the row's
groups (request_us, handoff_us from machine.py, serving_on_worker_cores); the row's arrivals are
regenerated as the check made them (Poisson at the offered rate, seed 1). Prints, per row, the
throughput and latency errors the run recorded beside the ones the current simulator gives: a
change to the simulator's model is checked against every measured row at once, at no machine time.
(Only the simulator changes here: the stage times are what that run measured.)
"""

from __future__ import annotations

import json
import sys

import numpy as np

from modelcache.placement.costs import CostTable
from modelcache.placement.machine import SERVE_HANDOFF_US, SERVE_REQUEST_US
from modelcache.placement.plan import Plan, PlanCost, Stage
from modelcache.placement.simulate import poisson_arrivals, simulate
from modelcache.placement.system import parse_system

KIND = {"conv_gflop_s": 1, "matmul_gflop_s": 1, "other_gflop_s": 1, "mem_gbyte_s": 1}


def system_for(row: dict):
    return parse_system({"name": "replay", "kinds": {row["kind"]: KIND},
                         "workers": [{"name": w, "kind": row["kind"]} for w in row["workers"]],
                         "request_us": SERVE_REQUEST_US, "handoff_us": SERVE_HANDOFF_US,
                         "serving_on_worker_cores": True}, "replay")


def replay(row: dict) -> dict:
    system = system_for(row)
    W, k = len(row["workers"]), row["stages"]
    plan = Plan([Stage(i, i + 1, (i % W,), (1,)) for i in range(k)], 1)
    thr = row["throughput_per_s"]
    arrivals = poisson_arrivals(thr["offered"], thr["requests"], seed=1)
    out = {}
    for key, times in (("profile", "profiled"), ("solo", "served_solo"), ("loaded", "served_loaded")):
        stage_s = row["stage_s"][times]
        if any(t is None for t in stage_s):
            continue
        node_s = {row["kind"]: np.array([[0.0] * k, stage_s])}
        cost = PlanCost(CostTable.from_node_seconds("m", node_s, [0.0] * (k + 1)), system, 1)
        rate = simulate(cost, plan, arrivals, within_set="dmda", samples=1, record=False).throughput_per_s(arrivals)
        out[f"throughput_error_{key}"] = rate / thr["measured"] - 1
        if key != "loaded":
            [lat] = simulate(cost, plan, [0.0], within_set="dmda", samples=1, record=False).latencies_s
            out[f"latency_error_{key}"] = lat * 1e3 / row["latency_ms"]["measured"] - 1
    return out


def main(path: str) -> None:
    rows = json.loads(open(path).read())["rows"]
    for key in ("profile", "solo", "loaded"):
        was, now = [], []
        for r in rows:
            new = replay(r)
            for m in ("latency", "throughput"):
                name = f"{m}_error_{key}"
                if name in r and name in new:
                    was.append(abs(r[name]))
                    now.append(abs(new[name]))
        print(f"from {key:<7}: recorded largest {max(was) * 100:.1f} %, {sum(e <= 0.1 for e in was)} of {len(was)} "
              f"within 10 %; now largest {max(now) * 100:.1f} %, {sum(e <= 0.1 for e in now)} of {len(now)}")
    for r in rows:
        new = replay(r)
        cells = [f"{m[:3]} {key}: {r[f'{m}_error_{key}'] * 100:+.1f} -> {new[f'{m}_error_{key}'] * 100:+.1f}"
                 for key in ("profile", "solo", "loaded") for m in ("latency", "throughput")
                 if f"{m}_error_{key}" in new and f"{m}_error_{key}" in r]
        print(f"{r['model']:<9} {','.join(r['workers']):<12} {r['stages']} stages | " + " | ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/placement/check/results.json")
