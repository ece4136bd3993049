"""How far could keeping alone go? An offline policy that knows every model's next call keeps a model
through an idle gap exactly when the gap is cheap — size x gap <= a price in GiB*s per cold start — and
never pre-warms. For a given memory-time, that is the fewest cold starts any policy without pre-warming
can have on the trace (keeping the cheapest gaps first is a fractional knapsack with equal values), so
its curve says whether issue #29's 0.5x can come from deciding *how long to keep* at all, or only from
predicting *when to bring a model back*.

    python benchmarks/faas/keep_oracle.py --trace benchmarks/faas/azure-2019-slice/invocations.csv \
        --minutes 546:690 --folder benchmarks/faas/azure-2019-slice/sweep

The baselines' front and the learned policies' points come from FOLDER/results.json (the sweep of the same
trace and options). The host tier holds every model (nothing is evicted), so the oracle's point moves only
with its price. Prints the oracle's curve, then, at each learned point's memory-time, the cold starts the
oracle has there as a ratio to the baselines' front, beside the learned policy's own ratio.
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict
from pathlib import Path

from modelcache.eviction.timed import TimedPolicy
from benchmarks.faas.simulate import GIB, Costs, replay
from benchmarks.faas.sweep import BASELINES, LEARNED, frontier, interpolate, load_trace, ratio_text, trace_arguments


class KeepIfCheap(TimedPolicy):
    """Knows each model's call times; after a call keeps the model until its next call when
    size (GiB) x gap (s) <= `price`, else lets it go as soon as the call ends. Never pre-warms."""

    name = "keep-oracle"

    def __init__(self, clock, calls, sizes: dict[str, int], price_gib_s: float):
        super().__init__(clock)
        self.times: dict[str, list[float]] = defaultdict(list)
        for c in calls:                          # in time order
            self.times[c.model].append(c.t)
        self.sizes, self.price = sizes, price_gib_s

    def plan(self, key, now):
        key = key.rpartition("@")[0]             # the replay's model "name@1" is the trace's model "name"
        times = self.times[key]
        i = bisect.bisect_right(times, now)      # a call waits for its promotion: `now` may be past its arrival
        if i == len(times):
            return None, 0.0
        gap = times[i] - now
        return None, (gap + 1e-6) if self.sizes[key] / GIB * gap <= self.price else 0.0

    def idle_keep_s(self):
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    trace_arguments(ap)   # (--capacities is not used: the tier holds every model)
    ap.add_argument("--folder", required=True, help="the sweep of the same trace (its results.json)")
    ap.add_argument("--prices", default="", help="GiB*s per cold start, comma-separated; default: a log "
                    "grid from 1 to 10^6")
    args = ap.parse_args()
    label, _, _, sizes, calls = load_trace(ap, args, None)
    rows = json.loads((Path(args.folder) / "results.json").read_text())["rows"]
    front = frontier([(r["gib_s"], r["cold_fraction"]) for r in rows if r["policy"] in BASELINES])
    prices = ([float(x) for x in args.prices.split(",")] if args.prices
              else [10 ** (k / 4) for k in range(0, 25)])
    print(f"keep-only oracle at full capacity, {label}; front from {args.folder}")
    curve = []
    for price in prices:
        r = replay(lambda clock: KeepIfCheap(clock, calls, sizes, price), sum(sizes.values()), calls, sizes, Costs())
        curve.append((r.gib_s, r.cold_fraction))
        at_front = interpolate(front, r.gib_s, 0)
        print(f"  price {price:9.1f} GiB*s: cold {r.cold_fraction:.3%} ({r.disk_misses}), {r.gib_s:.0f} GiB*s; "
              f"cold {ratio_text(at_front and r.cold_fraction / at_front)} the front's at equal memory-time",
              flush=True)
    oracle = frontier(curve)
    print("at each learned point's memory-time: cold starts as a ratio to the baselines' front")
    for r in rows:
        if r["policy"] not in LEARNED:
            continue
        at_front = interpolate(front, r["gib_s"], 0)
        best = interpolate(oracle, r["gib_s"], 0)
        print(f"  {r['policy']:>12} at {r['capacity_gib']:6.2f} GiB ({r['gib_s']:.0f} GiB*s): itself "
              f"{ratio_text(at_front and r['cold_fraction'] / at_front)}, the keep-only oracle "
              f"{ratio_text(at_front and best and best / at_front)}", flush=True)
    first_calls = len({c.model for c in calls})
    print(f"first calls (cold for every policy): {first_calls} of {len(calls)} ({first_calls / len(calls):.3%})")


if __name__ == "__main__":
    main()
