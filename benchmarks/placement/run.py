"""Placement benchmark: the searched plan against the baselines, per model and system description.

    python benchmarks/placement/run.py [--models alexnet vgg16 resnet50 vit_b_16] [--systems FILE ...]
                               [--batch 8] [--time-budget 60] [--out benchmarks/placement]

Each zoo model is packed into a scratch repository and profiled once on this machine's CPU (ORT's
profiler); each system's kinds are then measured (cpuN) or modelled (roofline), and `place` searches
a plan. Printed per system: every plan's analytical latency and throughput and the simulator's
figures; then the figures the issue asks for: the mean latency reduction against MARS's half-split,
whether the plan beats every baseline, and the search time per model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from modelcache.measure import save_results
from modelcache.usage import Parser

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "systems"
DEFAULT_SYSTEMS = [str(EXAMPLES / "mars-8acc.toml"), str(EXAMPLES / "cpu-two-gpus.toml")]
DEFAULT_MODELS = ["alexnet", "vgg16", "resnet50", "vit_b_16"]


def _slug(system) -> str:
    return "".join(c if c.isalnum() else "-" for c in system.name.split(":")[0].lower()).strip("-")


def summarize(reports: list) -> dict:
    """Per system: mean/min/max latency reduction vs half-split, plans that beat every baseline, search times."""
    out = {}
    for system in dict.fromkeys(r["system"] for r in reports):
        mine = [r for r in reports if r["system"] == system]
        reductions, beats = {}, {}
        for r in mine:
            plan, *base = r["rows"]
            half = next(b for b in base if b["method"] == "half-split")
            reductions[r["model"]] = 1 - plan["latency_s"] / half["latency_s"]
            beats[r["model"]] = all(plan["latency_s"] < b["latency_s"] * (1 - 1e-9) for b in base)
        out[system] = {"reduction_vs_half_split": reductions,
                       "mean_reduction_vs_half_split": statistics.fmean(reductions.values()),
                       "beats_every_baseline": beats,
                       "search_s": {r["model"]: r["search_s"] for r in mine}}
    return out


def print_summary(data: dict, f=sys.stdout) -> None:
    for system, s in data["summary"].items():
        red = s["reduction_vs_half_split"]
        print(f"\n{system} (batch {data['batch']}):", file=f)
        print("  latency reduction vs half-split: " + ", ".join(f"{m} {v * 100:.1f} %" for m, v in red.items())
              + f"; mean {s['mean_reduction_vs_half_split'] * 100:.1f} %", file=f)
        print("  plan beats every baseline: " + ", ".join(f"{m} {'yes' if v else 'NO'}"
                                                       for m, v in s["beats_every_baseline"].items()), file=f)
        print("  search time: " + ", ".join(f"{m} {v:.1f} s" for m, v in s["search_s"].items()), file=f)


def report(data: dict, f) -> None:
    for text in data["reports_text"]:
        f.write(text + "\n")
    print_summary(data, f)


def main(argv=None) -> int:
    import io

    from modelcache import zoo
    from modelcache.placement.command import report as place_report
    from modelcache.placement.machine import cost_table
    from modelcache.placement.search import place
    from modelcache.placement.system import load_system
    from modelcache.store.packing import pack

    ap = Parser(prog="python benchmarks/placement/run.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    ap.add_argument("--systems", nargs="+", default=DEFAULT_SYSTEMS)
    ap.add_argument("--batch", type=int, default=8, help="samples per request (MARS evaluates batches)")
    ap.add_argument("--time-budget", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    systems = [load_system(p) for p in args.systems]
    reports, texts, facts_cache = [], [], {}
    with tempfile.TemporaryDirectory(prefix="modelcache-placement-") as tmp:
        tmp = Path(tmp)
        for name in args.models:
            print(f"packing and profiling {name} ...", file=sys.stderr, flush=True)
            src = tmp / f"{name}.onnx"
            zoo.save(zoo.build(name), str(src))
            manifest = pack(str(src), tmp / "repo", name, 1)
            src.unlink()
            directory = tmp / "repo" / name / str(manifest.version)
            for system in systems:
                t0 = time.perf_counter()
                table = cost_table(directory, f"{name}", system, args.batch, facts_cache=facts_cache)
                placement = place(table, system, args.batch, "latency", args.seed, args.time_budget)
                buf = io.StringIO()
                rep = place_report(placement, buf)
                rep["with_profiling_s"] = time.perf_counter() - t0
                print(buf.getvalue(), flush=True)
                texts.append(buf.getvalue())
                reports.append(rep)
                if args.out:
                    from modelcache.placement.plots import plot_gantt
                    Path(args.out).mkdir(parents=True, exist_ok=True)
                    plot_gantt(placement, Path(args.out) / f"gantt-{name}-{_slug(system)}.png")
    data = {"batch": args.batch, "models": args.models, "systems": [s.name for s in systems],
            "reports": reports, "reports_text": texts, "summary": summarize(reports)}
    print_summary(data)
    save_results(args.out, "placement", argv, data, report, command="python benchmarks/placement/run.py")
    if args.out:
        from modelcache.placement.plots import plot_bars
        for system in systems:
            plot_bars([r for r in reports if r["system"] == system.name], Path(args.out) / f"bars-{_slug(system)}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
