"""Sweep policies x host-tier capacities over a FaaS trace with the discrete-event replay; print the
table, compare `hybrid` (and `hybrid-sized`) with the best baseline, plot cold starts against memory-time (one line per
policy, one point per capacity).

    python -m benchmarks.faas.sweep --trace synthetic --functions 200 --hours 6 --out DIR
    python -m benchmarks.faas.sweep --trace invocations.csv --minutes 540:900 --out DIR
    python -m benchmarks.faas.sweep ... --costs costs.json     costs measured by `benchmarks.faas.real_replay`
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from modelcache.usage import Parser

from benchmarks.faas.simulate import GIB, Costs, replay, trace_policy
from benchmarks.faas.synthetic import generate
from benchmarks.faas.trace import assign_models, invocations, read_counts, write_counts, zoo_catalogue

BASELINES = ("lru", "keepalive", "gdsf")
LEARNED = ("hybrid", "hybrid-sized")   # compared with the baselines' front, against issue #29's targets
COLUMNS = [("policy", "policy", "{}"), ("capacity_gib", "cap GiB", "{:.2f}"), ("cold_fraction", "cold %", "{:.3%}"),
           ("disk_misses", "cold", "{}"), ("host_hits", "warm", "{}"), ("gib_s", "GiB*s", "{:.0f}"),
           ("ttfr_p50_ms", "ttfr p50 ms", "{:.1f}"), ("ttfr_p99_ms", "ttfr p99 ms", "{:.1f}"),
           ("promotions", "promotions", "{}"), ("prewarms", "prewarms", "{}"), ("wasted_prewarms", "wasted", "{}"),
           ("evictions", "evictions", "{}"), ("unloads", "unloads", "{}"), ("unserved", "unserved", "{}")]


def table(rows: list[dict], columns=COLUMNS) -> str:
    """A Markdown table of `rows`: `columns` are (key, title, format) each."""
    cells = [[title for _, title, _ in columns]] + [[fmt.format(r[k]) for k, _, fmt in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["| " + " | ".join(c.rjust(w) for c, w in zip(line, widths)) + " |" for line in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    return "\n".join(lines)


def load_costs(path: str | Path) -> Costs:
    """Costs from a JSON object of Costs' fields (what `benchmarks.faas.real_replay` writes as costs.json)."""
    try:
        data = json.loads(Path(path).read_text())
        return Costs(**data)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: cannot read simulator costs ({e}); expected a JSON object with "
                         f"{', '.join(vars(Costs()))}, as `python -m benchmarks.faas.real_replay --out DIR` writes in DIR/costs.json") from None


def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The Pareto front of (memory-time, cold fraction) points: each point uses more memory-time than the
    one before and has fewer cold starts."""
    front = []
    for x, y in sorted(points):
        if not front or y < front[-1][1]:
            front.append((x, y))
    return front


def interpolate(front: list[tuple[float, float]], x: float, axis: int) -> float | None:
    """On the front, straight between its points on log-log axes (as the figure draws it): the cold
    fraction at memory-time x (axis 0), or the memory-time at cold fraction x (axis 1); None outside the
    front's span (or where a cold fraction is 0, which has no logarithm)."""
    if x <= 0 or any(v <= 0 for p in front for v in p):
        return None
    for a, b in zip(front, front[1:]):
        lo, hi = sorted((a[axis], b[axis]))
        if lo <= x <= hi:
            f = 0.0 if hi == lo else math.log(x / a[axis]) / math.log(b[axis] / a[axis])
            return a[1 - axis] * (b[1 - axis] / a[1 - axis]) ** f
    if len(front) == 1 and front[0][axis] == x:
        return front[0][1 - axis]
    return None


def compare(rows: list[dict], policy: str = "hybrid") -> list[dict]:
    """For each of `policy`'s points: the best baseline's cold fraction at the same memory-time and the
    best baseline's memory-time at the same cold fraction (on the baselines' Pareto front, between its
    points as `interpolate` says); the best baseline at the same capacity (under pressure every policy
    fills the tier, so that is equal memory-time measured, not interpolated); and whether LRU at the same
    capacity beats it on both."""
    base = frontier([(r["gib_s"], r["cold_fraction"]) for r in rows if r["policy"] in BASELINES])
    out = []
    for r in (r for r in rows if r["policy"] == policy):
        cold_at_mem = interpolate(base, r["gib_s"], 0)
        mem_at_cold = interpolate(base, r["cold_fraction"], 1)
        same = [b for b in rows if b["policy"] in BASELINES and b["capacity_gib"] == r["capacity_gib"]]
        best = min(same, key=lambda b: (b["cold_fraction"], b["gib_s"]), default=None)
        lru = next((b for b in same if b["policy"] == "lru"), None)
        out.append({"capacity_gib": r["capacity_gib"], "gib_s": r["gib_s"], "cold_fraction": r["cold_fraction"],
                    "baseline_cold_at_equal_mem": cold_at_mem,
                    "cold_ratio": None if not cold_at_mem else r["cold_fraction"] / cold_at_mem,
                    "baseline_mem_at_equal_cold": mem_at_cold,
                    "mem_ratio": None if not mem_at_cold else r["gib_s"] / mem_at_cold,
                    "same_capacity_best": best and best["policy"],
                    "same_capacity_cold_ratio": best and best["cold_fraction"] and r["cold_fraction"] / best["cold_fraction"],
                    "same_capacity_mem_ratio": best and r["gib_s"] / best["gib_s"],
                    "worse_than_lru_on_both": bool(lru and lru["cold_fraction"] < r["cold_fraction"]
                                                   and lru["gib_s"] < r["gib_s"])})
    return out


def ratio_text(v: float | None) -> str:
    """A ratio as the reports print it; n/a: none (outside the baselines' span)."""
    return "n/a" if v is None else f"{v:.2f}x"


# Issue #29's targets for hybrid against the baselines' front.
COLD_TARGET, MEM_TARGET = 0.5, 0.7


def verdict(comparison: list[dict]) -> dict:
    """The targets, over hybrid's points: the lowest cold-start ratio at equal memory-time and the lowest
    memory-time ratio at equal cold starts (each with its capacity), whether a point meets each target
    (<= 0.5x, <= 0.7x), and whether any point is worse than LRU on both axes."""
    out = {}
    for key, target in (("cold_ratio", COLD_TARGET), ("mem_ratio", MEM_TARGET)):
        measured = [c for c in comparison if c[key] is not None]
        best = min(measured, key=lambda c: c[key], default=None)
        out[key] = {"best": best and best[key], "at_capacity_gib": best and best["capacity_gib"], "target": target,
                    "met_at_gib": [c["capacity_gib"] for c in measured if c[key] <= target]}
    out["worse_than_lru_on_both_at_gib"] = [c["capacity_gib"] for c in comparison if c["worse_than_lru_on_both"]]
    return out


def verdict_line(v: dict) -> str:
    def one(key, what):
        r = v[key]
        if r["best"] is None:
            return f"{what}: no point on the baselines' span"
        met = ", ".join(f"{g:.2f}" for g in r["met_at_gib"])
        return (f"{what} <= {r['target']}x: best {r['best']:.2f}x (at {r['at_capacity_gib']:.2f} GiB), "
                + (f"met at {met} GiB" if met else "met nowhere"))
    lru = ", ".join(f"{g:.2f} GiB" for g in v["worse_than_lru_on_both_at_gib"]) or "nowhere"
    return (f"targets (issue #29): {one('cold_ratio', 'cold starts at equal memory-time')}; "
            f"{one('mem_ratio', 'memory-time at equal cold starts')}; worse than LRU on both: {lru}")


def plot(rows: list[dict], path: Path, title: str) -> bool:
    from modelcache.plotting import pyplot
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted((r["gib_s"], 100 * r["cold_fraction"]) for r in rows if r["policy"] == policy)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
    ax.set_xscale("log")
    ax.set_yscale("log")
    xs = [r["gib_s"] for r in rows if r["gib_s"] > 0]
    if xs and max(xs) / min(xs) > 10:
        ax.xaxis.set_minor_formatter(plt.NullFormatter())   # (over a decade the minor labels overlap;
                                                            # within one they are the only ones)
    ax.set_xlabel("memory-time in the host tier (GiB x s)")
    ax.set_ylabel("cold starts (% of calls)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def trace_source_arguments(ap: argparse.ArgumentParser, functions: int, hours: float,
                           functions_help: str = "synthetic: how many functions") -> None:
    """The options that say which trace: --trace, --functions, --hours, --minutes, --seed (the sweep's, the real
    replay's and the systems benchmark's, each with its own defaults)."""
    ap.add_argument("--trace", default="synthetic", help="'synthetic' or an Azure Functions invocation-count CSV")
    ap.add_argument("--functions", type=int, default=functions, help=f"{functions_help} (default {functions})")
    ap.add_argument("--hours", type=float, default=hours, help=f"synthetic: trace length (default {hours:g})")
    ap.add_argument("--minutes", type=minutes_window, default=None,
                    help="a CSV's window, FIRST:STOP in its minute numbers")
    ap.add_argument("--seed", type=int, default=0, help="the trace, the models' draw, the spread in a minute")


def trace_arguments(ap: argparse.ArgumentParser) -> None:
    """The options that say which trace to replay and how (shared with `attribute`)."""
    trace_source_arguments(ap, 200, 6.0)
    ap.add_argument("--capacities", default="0.02,0.05,0.1,0.2,0.3,0.5,1.0",
                    help="host-tier capacities as fractions of all the trace's models together")
    ap.add_argument("--compress", type=float, default=1.0,
                    help="divide trace time by this (the policies' windows scale with it)")


def minutes_window(text: str) -> tuple[int, int]:
    """`--minutes FIRST:STOP` as (first, stop), checked as the option is parsed."""
    try:
        first, stop = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: expected FIRST:STOP, two minute numbers of the trace") from None
    if stop <= first:
        raise argparse.ArgumentTypeError(f"{text}: STOP must be after FIRST (the window is FIRST <= minute < STOP)")
    return first, stop


def read_trace(args, out: Path | None):
    """(label, functions) of the trace `args` name; a synthetic trace is written to `out`/trace.csv and
    read back (the reader the real trace goes through)."""
    if args.trace == "synthetic":
        functions = generate(args.functions, args.hours, args.seed)
        if out:
            write_counts(out / "trace.csv", functions)
            functions = read_counts(out / "trace.csv")
        label = f"synthetic, {args.functions} functions, {args.hours:g} h, seed {args.seed}"
    else:
        functions = read_counts(args.trace, args.minutes)
        label = f"{Path(args.trace).name}, {len(functions)} functions" + (
            f", minutes {args.minutes[0]}-{args.minutes[1] - 1}" if args.minutes else "")
    return label, functions


def load_trace(ap: argparse.ArgumentParser, args, out: Path | None):
    """(label, functions, models, sizes, calls) for the trace `args` name, models from the zoo's catalogue;
    a file that is not a trace (or has no run for the window) is a usage error of `ap`."""
    try:
        label, functions = read_trace(args, out)
    except ValueError as e:
        ap.error(str(e))
    models = assign_models(functions, zoo_catalogue(), args.seed)
    sizes = dict(models.values())
    calls = invocations(functions, models, args.seed, args.compress, args.minutes)
    print(f"{label}: {len(calls)} calls, {len(sizes)} models, {sum(sizes.values()) / GIB:.1f} GiB together", flush=True)
    return label, functions, models, sizes, calls


def main(argv=None) -> int:
    ap = Parser(prog="python -m benchmarks.faas.sweep", description=__doc__.split("\n\n")[0])
    trace_arguments(ap)
    ap.add_argument("--policies", default="lru,keepalive,gdsf,hybrid,hybrid-sized", help="comma-separated eviction policies")
    ap.add_argument("--costs", default="", help="a JSON file of the simulator's costs (Costs' fields), e.g. "
                    "the costs.json `benchmarks.faas.real_replay` measures on the real daemon; default: the README's figures")
    ap.add_argument("--out", default="", help="folder for trace.csv, results.json, pareto.png")
    args = ap.parse_args(argv)
    try:
        costs = load_costs(args.costs) if args.costs else Costs()
    except ValueError as e:
        ap.error(str(e))
    print("python -m benchmarks.faas.sweep " + " ".join(sys.argv[1:] if argv is None else argv))
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    label, _, _, sizes, calls = load_trace(ap, args, out)
    total = sum(sizes.values())

    rows = []
    for frac in (float(x) for x in args.capacities.split(",")):
        for name in args.policies.split(","):
            t0 = time.perf_counter()
            r = replay(trace_policy(name, args.compress), int(total * frac), calls, sizes, costs)
            rows.append(r.row())
            print(f"  {name} at {frac:g} of the models ({r.capacity_bytes / GIB:.2f} GiB): "
                  f"cold {r.cold_fraction:.3%}, {r.gib_s:.0f} GiB*s ({time.perf_counter() - t0:.1f} s)",
                  file=sys.stderr, flush=True)
    print(table(rows))
    learned = [name for name in args.policies.split(",") if name in LEARNED]
    comparisons = {name: compare(rows, name) for name in learned}
    targets = {name: verdict(c) for name, c in comparisons.items() if c}
    for name, comparison in comparisons.items():
        for c in comparison:
            print(f"{name} at {c['capacity_gib']:.2f} GiB: on the baselines' front, cold starts {ratio_text(c['cold_ratio'])} "
                  f"at equal memory-time, memory-time {ratio_text(c['mem_ratio'])} at equal cold starts; at the same "
                  f"capacity vs {c['same_capacity_best']}: cold {ratio_text(c['same_capacity_cold_ratio'])}, memory-time "
                  f"{ratio_text(c['same_capacity_mem_ratio'])}{'; WORSE than LRU on both' if c['worse_than_lru_on_both'] else ''}")
    for name, v in targets.items():
        print(f"{name}: {verdict_line(v)}")
    if out:
        (out / "results.json").write_text(json.dumps({"trace": label, "args": vars(args), "costs": vars(costs),
                                                      "rows": rows, "vs_baselines": comparisons,
                                                      "targets": targets}, indent=1))
        if plot(rows, out / "pareto.png", label):
            print(f"figure: {out / 'pareto.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
