"""Issue #30's figures, each against its target, from verify.sh's report.json.

    python3 benchmarks/gpu/targets.py REPORT_JSON

Standard library only. A figure the report does not hold is "not measured", with what would have measured it
(and that step's outcome where it ran): nothing is inferred from a neighbouring figure.
"""

from __future__ import annotations

import json
import statistics
import sys

MODELS = ["vgg16", "resnet50", "vit_b_16"]
BENCH = "bench coldstart --device cuda"
MET, NOT_MET, ABSENT = "met", "NOT met", "not measured"


def row(figure: str, target: str, verdict: str, value: str = "", source: str = "") -> dict:
    return {"figure": figure, "target": target, "verdict": verdict, "value": value, "source": source}


def absent(figure: str, target: str, by: str, report: dict, steps: list[str]) -> dict:
    """Not measured by `by`; says how the steps that would have measured it ended, where they ran."""
    ran = [f"{s} {report['steps'][s]['status']}" for s in steps if s in report.get("steps", {})]
    why = f"not measured by {by}" + (f" ({', '.join(ran)})" if ran else " (not run)")
    return row(figure, target, ABSENT, "", why)


def verdict(ok: bool) -> str:
    return MET if ok else NOT_MET


# -- the tests --------------------------------------------------------------------------------------

def gpu_tests(report: dict) -> dict:
    figure, target = "gpu-marked tests", "all pass, none skipped"
    t = report.get("tests")
    if not t:
        return absent(figure, target, "pytest -m gpu", report, ["tests"])
    value = f"{t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped"
    ok = t["passed"] > 0 and t["failed"] == t["errors"] == t["skipped"] == 0
    return row(figure, target, verdict(ok), value, "pytest -m gpu (junit-gpu.xml)")


# -- bench coldstart --device cuda ------------------------------------------------------------------

def runs(report: dict) -> list[dict]:
    return list((report.get("bench") or {}).values())


def median(report: dict, model: str, mode: str, key: str) -> float | None:
    values = [s[key] for run in runs(report) for s in run.get("samples", [])
              if s.get("model") == model and s.get("mode") == mode]
    return statistics.median(values) if values else None


def bench_steps(model: str) -> list[str]:
    return ["bench-vgg16"] if model == "vgg16" else ["bench-rest"]


def hit_ready_vs_ideal(report: dict, model: str) -> dict:
    figure, target = f"{model}: gpu-attach-hit spawn->ready / ideal's", "<= 1.10"
    hit, ideal = median(report, model, "gpu-attach-hit", "ready_ms"), median(report, model, "ideal", "ready_ms")
    if hit is None or ideal is None:
        return absent(figure, target, BENCH, report, bench_steps(model))
    ratio = hit / ideal
    return row(figure, target, verdict(ratio <= 1.10), f"{ratio:.2f}x ({hit:.0f} / {ideal:.0f} ms, medians)", BENCH)


def first_speedup(report: dict, model: str, mode: str, bound: float) -> dict:
    figure, target = f"{model}: {mode} spawn->first result, speedup over ort-cuda", f">= {bound:g}x"
    mine, ort = median(report, model, mode, "first_ms"), median(report, model, "ort-cuda", "first_ms")
    if mine is None or ort is None:
        return absent(figure, target, BENCH, report, bench_steps(model))
    speedup = ort / mine
    return row(figure, target, verdict(speedup >= bound), f"{speedup:.2f}x ({ort:.0f} / {mine:.0f} ms, medians)", BENCH)


def memory(report: dict, model: str, clients: int) -> dict:
    """Beyond the device memory in use with the daemon idle (its context, counted on both sides): the arena
    plus k attached clients, against k clients with no weights + 1.05 x one copy of the weights."""
    figure = f"{model}: device memory, daemon + {clients} gpu-attach clients started together"
    target = f"<= daemon + {clients} x (client with no weights) + 1.05 x weights"
    for run in runs(report):
        rows = [r for r in run.get("memory", []) if r.get("model") == model]
        arena = next((r for r in rows if r["mode"] == "arena"), None)
        floor = next((r for r in rows if r["mode"] == "floor"), None)
        hit = next((r for r in rows if r["mode"] == "gpu-attach-hit" and r["clients"] == clients), None)
        if arena and floor and hit:
            total = arena["device_mib"] + hit["device_mib"]
            bound = clients * floor["device_mib"] + 1.05 * arena["weights_mib"]
            return row(figure, target, verdict(total <= bound),
                       f"{total:.0f} MiB vs bound {bound:.0f} MiB (arena {arena['device_mib']:.0f}, floor "
                       f"{floor['device_mib']:.0f}/client, weights {arena['weights_mib']:.0f}; daemon's idle context "
                       "on both sides)", BENCH)
    return absent(figure, target, f"{BENCH} --clients ... {clients}", report, bench_steps(model))


def promotion(report: dict, model: str) -> dict:
    figure, target = f"{model}: host->GPU promotion / pinned host->device bandwidth, same run", ">= 0.8"
    for run in runs(report):
        rows = [r for r in run.get("promotion", []) if r.get("model") == model]
        pinned = (run.get("bandwidth") or {}).get("pinned_gb_s")
        if rows and pinned:
            copy, load = (statistics.median(r[k] for r in rows) for k in ("copy_gb_s", "load_gb_s"))
            if not copy:   # the GPU tier's stats gave no rate of its last copy
                return row(figure, target, ABSENT, f"whole load call {load:.1f} GB/s",
                           f"not measured by {BENCH}: the GPU tier reported no promotion_bytes_per_s")
            return row(figure, target, verdict(copy / pinned >= 0.8), f"{copy / pinned:.2f} ({copy:.1f} / "
                       f"{pinned:.1f} GB/s; whole load call {load:.1f} GB/s)", BENCH)
    return absent(figure, target, BENCH, report, bench_steps(model))


# -- the drop-in open -------------------------------------------------------------------------------

def outputs(report: dict, model: str) -> list[dict]:
    by = "verify.sh dropin (benchmarks/gpu/dropin.py)"
    rel_fig, rel_target = f"{model}: outputs vs plain ort-cuda", "max abs diff / max abs of ort-cuda's <= 1e-3"
    bit_fig, bit_target = f"{model}: outputs vs plain ort-cuda over the BASIC-optimized graph", "bit-identical"
    r = ((report.get("dropin") or {}).get("models") or {}).get(model)
    if not r:
        return [absent(rel_fig, rel_target, by, report, ["dropin"]), absent(bit_fig, bit_target, by, report, ["dropin"])]
    rel, basic = r["vs_ort_cuda"], r["vs_ort_cuda_basic"]
    on_cuda = r.get("providers") == ["CUDAExecutionProvider"]
    note = "" if on_cuda else f"; ran on {r.get('providers')}, not CUDA alone"
    rel_ok = on_cuda and rel.get("max_rel_diff", float("inf")) <= 1e-3
    return [row(rel_fig, rel_target, verdict(rel_ok), f"{rel.get('max_rel_diff', float('nan')):.2e}{note}", by),
            row(bit_fig, bit_target, verdict(on_cuda and basic.get("bit_identical", False)),
                ("identical" if basic.get("bit_identical") else f"max abs diff {basic.get('max_abs_diff')}") + note, by)]


# -- all of them ------------------------------------------------------------------------------------

NOT_MEASURED_BY_ANY_STEP = [
    ("a client SIGKILLed while attached releases its device lease", "the daemon's GPU lease list empties"),
    ("eviction never frees device memory a live lease maps", "the arena stays while a client maps it"),
]


def evaluate(report: dict) -> list[dict]:
    rows = [gpu_tests(report)]
    rows += [hit_ready_vs_ideal(report, m) for m in MODELS]
    rows += [first_speedup(report, "vgg16", "gpu-attach-hit", 2.4), first_speedup(report, "vgg16", "serve", 10),
             memory(report, "vgg16", 4)]
    rows += [promotion(report, m) for m in MODELS]
    rows += [r for m in MODELS for r in outputs(report, m)]
    rows += [row(f, t, ABSENT, "", "not measured by bench coldstart --device cuda nor verify.sh dropin: no step of "
                                   "this kit measures it yet (a gpu test would)") for f, t in NOT_MEASURED_BY_ANY_STEP]
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| figure | target | measured | verdict | by |", "|---|---|---|---|---|"]
    lines += [f"| {r['figure']} | {r['target']} | {r['value'] or '-'} | {r['verdict']} | {r['source']} |" for r in rows]
    counts = {v: sum(r["verdict"] == v for r in rows) for v in (MET, NOT_MET, ABSENT)}
    lines.append(f"\n{counts[MET]} met, {counts[NOT_MET]} not met, {counts[ABSENT]} not measured")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: targets.py REPORT_JSON", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        print(table(evaluate(json.load(f))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
