"""The README's tables from sweep folders: per trace, cold starts and memory-time of every policy at every
capacity, each learned policy against the baselines' front, time to first result p99, and the targets.

    python -m benchmarks.faas.summary benchmarks/faas/synthetic-6h benchmarks/faas/synthetic-24h ...

It reads each folder's results.json (written by `python -m benchmarks.faas.sweep --out DIR`) and prints
Markdown: what benchmarks/faas/README.md shows is what this prints, not figures copied by hand.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from modelcache.usage import Parser
from benchmarks.faas.sweep import ratio_text, verdict_line


def _k(gib_s: float) -> str:
    return f"{gib_s / 1000:.0f}k" if gib_s >= 1000 else f"{gib_s:.0f}"


def summarize(results: dict) -> str:
    """One trace's section (results: a sweep's results.json)."""
    rows = results["rows"]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    capacities = sorted({r["capacity_gib"] for r in rows})
    learned = list(results.get("vs_baselines", {}))
    total_gib = max(capacities)
    calls = rows[0]["calls"]
    out = [f"### {results['trace']} ({calls:,} calls, {total_gib:.1f} GiB of models)", "",
           "Cold starts % / memory-time GiB*s; then each learned policy on the baselines' front (its cold starts "
           "against theirs at equal memory-time, its memory-time against theirs at equal cold starts).", ""]
    head = ["capacity"] + policies + [f"{p}: on the front" for p in learned]
    out += ["| " + " | ".join(head) + " |", "|" + "---:|" * (1 + len(policies)) + "---|" * len(learned)]
    by = {(r["policy"], r["capacity_gib"]): r for r in rows}
    fronts = {p: {c["capacity_gib"]: c for c in results["vs_baselines"][p]} for p in learned}
    for cap in capacities:
        cells = [f"{cap:.2f} GiB ({cap / total_gib:.0%})"]
        for p in policies:
            r = by.get((p, cap))
            cells.append("" if r is None else f"{100 * r['cold_fraction']:.2f} / {_k(r['gib_s'])}")
        for p in learned:
            c = fronts[p].get(cap)
            cells.append("" if c is None else f"{ratio_text(c['cold_ratio'])}, {ratio_text(c['mem_ratio'])}"
                         + ("; WORSE than LRU on both" if c["worse_than_lru_on_both"] else ""))
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "Time to first result p99, ms, by capacity: " + "; ".join(
        f"{p} " + " / ".join(f"{by[(p, c)]['ttfr_p99_ms']:g}" for c in capacities if (p, c) in by) for p in policies)
        + "."]
    for p in learned:
        if results["targets"].get(p):
            out.append(f"`{p}`: {verdict_line(results['targets'][p])}.")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = Parser(prog="python -m benchmarks.faas.summary", description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", help="sweep output folders (each with results.json)")
    args = ap.parse_args(argv)
    sections = []
    for folder in args.folders:
        path = Path(folder) / "results.json"
        try:
            results = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            ap.error(f"{path}: cannot read a sweep's results ({e}); make one with "
                     f"`python -m benchmarks.faas.sweep --out {folder}`")
        if "vs_baselines" not in results:
            ap.error(f"{path}: written by an older sweep (no vs_baselines); run the sweep again")
        sections.append(summarize(results))
    print("\n\n".join(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
