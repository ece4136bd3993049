"""Issue #36's figures (steps 1 and 2), each against its target, from verify.sh's report.json.

    python3 benchmarks/gpu/targets.py REPORT_JSON

Standard library only. A figure the report does not hold is "not measured by X", with how X ended where it
ran: nothing is inferred from a neighbouring figure. Sources: the junit files of the two pytest runs, the
tier stage's checks (report["checks"][NAME]["figures"], keys as each check_NAME.py documents them; check_vmm's
keys are in benchmarks/gpu/README.md), dropin.py's comparison and `bench coldstart --device cuda`'s results.
"""

from __future__ import annotations

import json
import statistics
import sys

BENCH = "bench coldstart --device cuda"
DROPIN = "verify.sh dropin (benchmarks/gpu/dropin.py)"
MET, NOT_MET, ABSENT = "met", "NOT met", "not measured"
# Step 2's "within noise": VMM's attach time and device memory against legacy IPC's, in the same run.
ATTACH_NOISE = (1.10, 1.0)       # ratio, or else this many ms more
MEMORY_NOISE = (1.05, 4.0)       # ratio, or else this many MiB more


def row(figure: str, target: str, verdict: str, value: str = "", source: str = "") -> dict:
    return {"figure": figure, "target": target, "verdict": verdict, "value": value, "source": source}


def verdict(ok: bool) -> str:
    return MET if ok else NOT_MET


def ran(report: dict, steps: list[str]) -> str:
    """How the named steps (or checks, as 'check NAME') ended, for a figure they did not give."""
    out = []
    for s in steps:
        if s.startswith("check "):
            c = (report.get("checks") or {}).get(s[6:])
            if c:
                out.append(f"{s}: {c.get('status')}" + (f", {c['error']}" if c.get("error") else ""))
        elif s in (report.get("steps") or {}):
            st = report["steps"][s]
            out.append(f"{s} {st['status']}" + (f": {st['why']}" if st.get("why") else ""))
    return f" ({'; '.join(out)})" if out else " (not run)"


def absent(figure: str, target: str, by: str, report: dict, steps: list[str]) -> dict:
    return row(figure, target, ABSENT, "", f"not measured by {by}{ran(report, steps)}")


def med(value):
    """A figure given as one number or as samples: its median."""
    if isinstance(value, list):
        value = [v for v in value if v is not None]
        return statistics.median(value) if value else None
    return value


# -- the tests --------------------------------------------------------------------------------------

def gpu_tests(report: dict, which: str, selection: str, step: str) -> dict:
    figure, target = f"gpu-marked tests, {selection}", "all pass, none skipped"
    t = (report.get("tests") or {}).get(which)
    if not t:
        return absent(figure, target, f"pytest -m '{selection}'", report, [step])
    value = f"{t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped"
    ok = t["passed"] > 0 and t["failed"] == t["errors"] == t["skipped"] == 0
    return row(figure, target, verdict(ok), value, f"pytest -m '{selection}' (junit-{which}.xml)")


# -- bench coldstart --device cuda ------------------------------------------------------------------

def runs(report: dict) -> list[dict]:
    return [r for r in (report.get("bench") or {}).values() if r]


def median(report: dict, model: str, mode: str, key: str) -> float | None:
    values = [s[key] for run in runs(report) for s in run.get("samples", [])
              if s.get("model") == model and s.get("mode") == mode]
    return statistics.median(values) if values else None


def hit_ready_vs_ideal(report: dict, model: str) -> dict:
    figure, target = f"{model}: gpu-attach-hit spawn->ready / ideal's", "<= 1.10"
    hit, ideal = median(report, model, "gpu-attach-hit", "ready_ms"), median(report, model, "ideal", "ready_ms")
    if hit is None or ideal is None:
        return absent(figure, target, BENCH, report, ["bench"])
    ratio = hit / ideal
    return row(figure, target, verdict(ratio <= 1.10), f"{ratio:.2f}x ({hit:.0f} / {ideal:.0f} ms, medians)", BENCH)


def first_speedup(report: dict, model: str, mode: str, bound: float) -> dict:
    figure, target = f"{model}: {mode} spawn->first result, speedup over ort-cuda", f">= {bound:g}x"
    mine, ort = median(report, model, mode, "first_ms"), median(report, model, "ort-cuda", "first_ms")
    if mine is None or ort is None:
        return absent(figure, target, BENCH, report, ["bench"])
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
    return absent(figure, target, f"{BENCH} --clients {clients}", report, ["bench"])


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
    return absent(figure, target, BENCH, report, ["bench"])


# -- the drop-in open -------------------------------------------------------------------------------

def outputs(report: dict, model: str) -> list[dict]:
    rel_fig, rel_target = f"{model}: outputs vs plain ort-cuda", "max abs diff / max abs of ort-cuda's <= 1e-3"
    bit_fig, bit_target = f"{model}: outputs vs plain ort-cuda over the BASIC-optimized graph", "bit-identical"
    r = ((report.get("dropin") or {}).get("models") or {}).get(model)
    if not r:
        return [absent(rel_fig, rel_target, DROPIN, report, ["dropin"]),
                absent(bit_fig, bit_target, DROPIN, report, ["dropin"])]
    rel, basic = r["vs_ort_cuda"], r["vs_ort_cuda_basic"]
    on_cuda = r.get("providers") == ["CUDAExecutionProvider"]
    note = "" if on_cuda else f"; ran on {r.get('providers')}, not CUDA alone"
    rel_ok = on_cuda and rel.get("max_rel_diff", float("inf")) <= 1e-3
    return [row(rel_fig, rel_target, verdict(rel_ok), f"{rel.get('max_rel_diff', float('nan')):.2e}{note}", DROPIN),
            row(bit_fig, bit_target, verdict(on_cuda and basic.get("bit_identical", False)),
                ("identical" if basic.get("bit_identical") else f"max abs diff {basic.get('max_abs_diff')}") + note,
                DROPIN)]


# -- the tier stage's checks ------------------------------------------------------------------------

def figures(report: dict, check: str) -> dict:
    return ((report.get("checks") or {}).get(check) or {}).get("figures") or {}


def from_check(report: dict, check: str, figure: str, target: str, keys: list[str], judge) -> dict:
    """A row from check_<check>.py's figures: judge(values) -> (ok, value text); absent when a key is missing."""
    f = figures(report, check)
    missing = [k for k in keys if f.get(k) is None]
    by = f"check_{check}.py"
    if missing:
        result = (report.get("checks") or {}).get(check)
        tier = (report.get("steps") or {}).get("tier")
        if result and result.get("status") in ("ok", "failed"):
            why = f" ({result['status']}, but its result has no {missing[0]!r})"
        elif result:     # it could not run, or was stopped: say why, once
            why = f" ({result.get('status')}: {result.get('error')})"
        else:
            why = f" (no check_{check}.json; tier {tier['status']})" if tier else " (not run)"
        return row(figure, target, ABSENT, "", f"not measured by {by}{why}")
    ok, value = judge(*(f[k] for k in keys))
    return row(figure, target, verdict(ok), value, by)


def tier_rows(report: dict) -> list[dict]:
    c = lambda *a: from_check(report, *a)   # noqa: E731
    return [
        c("ipc", "another process reads the GPU tier's weights through its IPC handles", "sha256 of every tensor = "
          "the manifest's", ["bytes_identical", "tensors_checked"], lambda same, n: (same, f"{n} tensors, "
                                                                                       f"{'identical' if same else 'DIFFER'}")),
        c("ipc", "leases counted for 2 importing clients", "2", ["lease_count_two_clients"],
          lambda n: (n == 2, str(n))),
        c("ipc", "eviction never frees memory a live lease maps", "evict refused, nothing freed",
          ["evict_refused_under_lease", "evict_refused_freed_mib", "arena_mib"],
          lambda refused, freed, arena: (refused and freed < arena / 2,
                                         f"{'refused' if refused else 'NOT refused'}, {freed:.0f} MiB freed")),
        c("ipc", "a SIGKILLed attached client releases its device lease", "released (within 10 s)",
          ["killed_client_lease_released", "killed_client_lease_released_s"],
          lambda ok, s: (ok, f"after {s} s" if ok else f"NOT released ({s})")),
        c("ipc", "the arena's memory returns once the last importer is gone and the model is evicted",
          "> half the arena freed", ["memory_returned_after_last_importer_mib", "arena_mib"],
          lambda freed, arena: (freed > arena / 2, f"{freed:.0f} of {arena:.0f} MiB")),
        c("ipc", "imported memory outlives its exporter's cudaFree and exit, and goes with the last importer",
          "bytes intact; >= 0.9 x the allocation freed with the importer",
          ["raw_bytes_intact_after_exporter_freed_and_exited", "raw_held_by_importer_alone_mib", "raw_allocation_mib"],
          lambda intact, held, size: (intact and held >= 0.9 * size, f"{'intact' if intact else 'CHANGED'}, "
                                                                     f"{held:.0f} of {size:.0f} MiB")),
        c("ipc", "device memory of an importing client beyond a bare CUDA context", "< 5 % of the arena",
          ["import_extra_mib", "arena_mib", "importer_client_mib"],
          lambda extra, arena, each: (extra < 0.05 * arena, f"{extra:.0f} MiB ({each:.0f} MiB a client, arena "
                                                            f"{arena:.0f} MiB)")),
        c("pinned", "cudaHostRegister(ReadOnly) of a read-only /dev/shm mapping", "accepted",
          ["read_only_register_accepted"], lambda ok: (ok, "accepted" if ok else "refused (staging ring used)")),
        c("pinned", "host->GPU copy from a read-only /dev/shm mapping (the tier's copy_in) / pinned bandwidth",
          ">= 0.8", ["copy_in_vs_pinned", "copy_in_gb_s", "pinned_gb_s", "pageable_gb_s"],
          lambda ratio, copy, pinned, pageable: (ratio >= 0.8, f"{ratio:.2f} ({copy:.1f} / {pinned:.1f} GB/s; "
                                                                f"pageable {pageable:.1f} GB/s)")),
    ]


def within(a: float, b: float, noise: tuple) -> bool:
    return a <= b * noise[0] or a - b <= noise[1]


def vmm_rows(report: dict) -> list[dict]:
    c = lambda *a: from_check(report, "vmm", *a)   # noqa: E731
    return [
        c("step 2: a client's write to a read-only (VMM) weight fails", "the write fails",
          ["write_refused"], lambda ok: (ok, "refused" if ok else "the write WENT THROUGH")),
        c("step 2: attach time, read-only VMM vs legacy IPC", f"<= {ATTACH_NOISE[0]:g}x or + {ATTACH_NOISE[1]:g} ms",
          ["attach_ms_vmm", "attach_ms_ipc"],
          lambda v, i: (within(med(v), med(i), ATTACH_NOISE), f"{med(v):.2f} vs {med(i):.2f} ms (medians)")),
        c("step 2: device memory, read-only VMM vs legacy IPC", f"<= {MEMORY_NOISE[0]:g}x or + {MEMORY_NOISE[1]:g} MiB",
          ["device_mib_vmm", "device_mib_ipc"],
          lambda v, i: (within(med(v), med(i), MEMORY_NOISE), f"{med(v):.0f} vs {med(i):.0f} MiB")),
        c("step 2: a killed client's mapping goes with its fd", "released", ["killed_client_mapping_released"],
          lambda ok: (ok, "released" if ok else "NOT released")),
    ]


# -- all of them ------------------------------------------------------------------------------------

def evaluate(report: dict) -> list[dict]:
    rows = [gpu_tests(report, "tier", "gpu and not cuda_ep", "tier"),
            gpu_tests(report, "ort", "gpu and cuda_ep", "tests")]
    models = ["vgg16"] + sorted({s["model"] for run in runs(report) for s in run.get("samples", [])} - {"vgg16"})
    rows += [hit_ready_vs_ideal(report, m) for m in models]
    rows += [first_speedup(report, "vgg16", "gpu-attach-hit", 2.4), first_speedup(report, "vgg16", "serve", 10),
             memory(report, "vgg16", 4)]
    rows += [promotion(report, m) for m in models]
    dropped = ["vgg16"] + sorted(set((report.get("dropin") or {}).get("models") or {}) - {"vgg16"})
    rows += [r for m in dropped for r in outputs(report, m)]
    return rows + tier_rows(report) + vmm_rows(report)


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
