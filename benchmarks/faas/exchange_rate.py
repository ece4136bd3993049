"""`hybrid-sized` along its own knob: the exchange rate (`keep_alive_s`) at full capacity, each point against
the baselines' front of a committed sweep folder. Does any rate reach issue #29's 0.5x / 0.7x?

    python benchmarks/faas/exchange_rate.py --hours 6 --seed 0 --folder benchmarks/faas/synthetic-6h \
        --keep-alive 2.5,5,10,20,40,80

The baselines' front is read from FOLDER/results.json (the sweep of the same trace: same --hours and
--seed); the trace is generated again (seeded). At full capacity nothing is evicted, so `hybrid-sized`'s
point moves only with its exchange rate, as the baselines' points move with capacity: this traces its
curve. Prints one line a rate: cold %, GiB*s, and the two ratios on the front (n/a: outside its span).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.faas.simulate import Costs, replay, trace_policy
from benchmarks.faas.sweep import BASELINES, frontier, interpolate, load_trace, ratio_text, trace_arguments


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    trace_arguments(ap)   # (--capacities is not used: the tier holds every model)
    ap.add_argument("--folder", required=True, help="the sweep of the same trace (its results.json)")
    ap.add_argument("--policy", default="hybrid-sized")
    ap.add_argument("--keep-alive", default="2.5,5,10,20,40,80", help="keep_alive_s values, in minutes")
    args = ap.parse_args()
    label, _, _, sizes, calls = load_trace(ap, args, None)
    rows = json.loads((Path(args.folder) / "results.json").read_text())["rows"]
    front = frontier([(r["gib_s"], r["cold_fraction"]) for r in rows if r["policy"] in BASELINES])
    print(f"{args.policy} at full capacity, {label}; front from {args.folder}")
    for minutes in (float(x) for x in args.keep_alive.split(",")):
        r = replay(trace_policy(args.policy, args.compress, keep_alive_s=minutes * 60), sum(sizes.values()), calls,
                   sizes, Costs())
        cold_at_mem, mem_at_cold = interpolate(front, r.gib_s, 0), interpolate(front, r.cold_fraction, 1)
        print(f"  keep_alive {minutes:g} min: cold {r.cold_fraction:.3%}, {r.gib_s:.0f} GiB*s; on the front: "
              f"cold {ratio_text(cold_at_mem and r.cold_fraction / cold_at_mem)} at equal memory-time, "
              f"memory-time {ratio_text(mem_at_cold and r.gib_s / mem_at_cold)} at equal cold starts", flush=True)


if __name__ == "__main__":
    main()
