"""Before/after a restructure, paired: the hot paths of two checkouts, measured round by round in one run.

    git worktree add /tmp/mc-before <commit>
    PYTHONPATH=. python benchmarks/restructure/paired.py --before /tmp/mc-before --after . --rounds 3

Each round runs, in each checkout (which goes first alternates by round, so the machine's drift hits
both alike), three of `modelcache bench`'s own measurements, each reduced to a ratio taken inside that
run so that the machine's speed at the moment cancels:
  attach-hit cold start   median exec -> first result of attach-hit over ideal's (bench coldstart)
  serve-mode overhead     p50 a tiny model's served call adds over in-process ORT, lane, back to back
                          (bench executor --overhead-only), in ms
  promotion speed         median disk -> /dev/shm promotion MB/s over `cp`'s of the same file (bench tiers)
It prints every round and, per figure, the medians before and after and after/before.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def bench(tree: Path, args: list[str]) -> dict:
    """Run `modelcache bench ...` from `tree`'s own package; its results.json."""
    with tempfile.TemporaryDirectory(prefix="mc-paired-") as out:
        env = dict(os.environ, PYTHONPATH=str(tree))
        subprocess.run([sys.executable, "-m", "modelcache.cli", "bench", *args, "--out", out], cwd=tree, env=env,
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=1800)
        return json.loads((Path(out) / "results.json").read_text())


def attach_over_ideal(tree: Path, model: str, runs: int) -> float:
    # (ort and ort-tuned too: the report of the commit before the restructure needs them)
    r = bench(tree, ["coldstart", "--models", model, "--modes", "ort", "ort-tuned", "attach-hit", "ideal",
                     "--runs", str(runs), "--clients", "1", "--memory-model", model])
    by_mode = {m: statistics.median(s["total_ms"] for s in r["samples"] if s["mode"] == m and s["model"] == model)
               for m in ("attach-hit", "ideal")}
    return by_mode["attach-hit"] / by_mode["ideal"]


def serve_overhead_ms(tree: Path, calls: int) -> float:
    r = bench(tree, ["executor", "--overhead-only", "--calls", str(calls)])
    row = next(x for x in r["overhead"]["rows"] if x["transport"] == "lane" and x["pattern"] == "back-to-back")
    return row["overhead_p50_ms"]


def promotion_over_cp(tree: Path, model: str, runs: int) -> float:
    r = bench(tree, ["tiers", "--model", model, "--big", model, "--runs", str(runs)])
    return statistics.median(r["promote_mb_s"]) / statistics.median(r["cp_mb_s"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="the checkout before the change")
    ap.add_argument("--after", type=Path, required=True, help="the checkout after it")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default="alexnet", help="zoo model for the cold start and the promotion")
    ap.add_argument("--runs", type=int, default=3, help="fresh processes / promotions per mode and round")
    ap.add_argument("--calls", type=int, default=500, help="served calls per overhead block")
    args = ap.parse_args()
    if args.rounds < 1 or args.runs < 1 or args.calls < 10:
        ap.error("--rounds and --runs at least 1, --calls at least 10")
    figures = {"attach-hit / ideal": lambda t: attach_over_ideal(t, args.model, args.runs),
               "serve overhead ms": lambda t: serve_overhead_ms(t, args.calls),
               "promotion / cp": lambda t: promotion_over_cp(t, args.model, args.runs)}
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    seen = {f: {"before": [], "after": []} for f in figures}
    for r in range(args.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for figure, measure in figures.items():
            for side in order:
                value = measure(trees[side])
                seen[figure][side].append(value)
                print(f"round {r + 1} {figure:<20} {side:<6} {value:.3f}", flush=True)
    print(f"\n{'figure':<20} {'before (median [min-max])':<28} {'after':<28} after/before")
    for figure, sides in seen.items():
        b, a = sides["before"], sides["after"]
        fmt = lambda v: f"{statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]"   # noqa: E731
        print(f"{figure:<20} {fmt(b):<28} {fmt(a):<28} {statistics.median(a) / statistics.median(b):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
