"""`modelcache place`: describe this machine, or search a plan for a packed model and report it beside the baselines."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from ..errors import InputError, ModelNotFound
from .plan import Plan
from .search import Placement, place
from .simulate import poisson_arrivals, simulate

LOAD_SHARE = 0.7          # Poisson load for the p99 figure: this share of each plan's own sustainable rate
OVERLOAD = 2.0            # ... and for the throughput figure, this many times it (the simulator saturates)
TRACE_REQUESTS = 400


def model_dir(repository: Path, name: str, version: int | None) -> tuple[Path, int]:
    from ..tiers.disk import Repository
    versions = [(v, d) for n, v, d in Repository(repository).version_dirs(name) if (d / "manifest.json").exists()]
    if version is not None:
        versions = [(v, d) for v, d in versions if v == version]
    if not versions:
        raise ModelNotFound(f"no {name}{'@' + str(version) if version else ''} in the repository {repository}; "
                            "add it with `modelcache add`")
    v, d = max(versions)
    return d, v


def sim_figures(placement: Placement, plan: Plan, seed: int = 0) -> dict:
    """The simulator's figures for a plan: one request's latency; the samples/s it sustains under Poisson
    overload; p50 and p99 at LOAD_SHARE of its analytical capacity."""
    cost = placement.cost
    one = simulate(cost, plan, [0.0], record=False).latencies_s[0]
    capacity = (plan.throughput_per_s or 0) / plan.batch     # requests (batches) per s
    if not capacity or not math.isfinite(capacity):
        return {"latency_s": one}
    over = poisson_arrivals(OVERLOAD * capacity, TRACE_REQUESTS, seed)
    saturated = simulate(cost, plan, over, record=False)
    arrivals = poisson_arrivals(LOAD_SHARE * capacity, TRACE_REQUESTS, seed)
    res = simulate(cost, plan, arrivals, record=False)
    return {"latency_s": one, "throughput_per_s": saturated.throughput_per_s(over) * plan.batch,
            "rate_per_s": LOAD_SHARE * capacity, "p50_s": res.percentile_s(0.5), "p99_s": res.percentile_s(0.99)}


def report(placement: Placement, out=None) -> dict:
    """Print the plan, the baselines and the simulator's figures; returns them as data."""
    out = out or sys.stdout
    cost, plan = placement.cost, placement.plan
    system, table = cost.system, cost.table
    print(f"{table.model} on {system.name!r}: {table.n} nodes, batch {plan.batch}, objective {plan.objective}",
          file=out)
    for kind, src in table.source.items():
        print(f"  costs of {kind}: {src}", file=out)
    for line in plan.describe(system, table):
        print("  " + line, file=out)
    rows = []
    print(f"  {'plan':<22} {'latency ms':>11} {'thru/s':>9} {'vs plan':>8} {'sim lat ms':>11} {'sim thru/s':>11} "
          f"{'sim p99 ms':>11}", file=out)
    for p in [plan, *placement.baselines]:
        sim = sim_figures(placement, p)
        name = "search (" + (p.method or "ga") + ")" if p is plan else p.method
        rows.append({"method": name, "latency_s": p.latency_s, "throughput_per_s": p.throughput_per_s,
                     "stages": len(p.stages), "sim": sim})
        ratio = p.latency_s / plan.latency_s if plan.latency_s else float("nan")
        print(f"  {name:<22} {p.latency_s * 1e3:>11.3f} {p.throughput_per_s:>9.1f} {ratio:>7.2f}x "
              f"{sim['latency_s'] * 1e3:>11.3f} {sim.get('throughput_per_s', float('nan')):>11.1f} "
              f"{sim.get('p99_s', float('nan')) * 1e3:>11.3f}", file=out)
    print(f"  (sim thru/s: samples/s under Poisson overload; sim p99: at {LOAD_SHARE:.0%} of each plan's capacity)",
          file=out)
    half = next((b for b in placement.baselines if b.method == "half-split"), None)
    if half is not None and half.latency_s:
        print(f"  latency reduction vs half-split: {(1 - plan.latency_s / half.latency_s) * 100:.1f} %", file=out)
    print(f"  search: {placement.search_s:.1f} s; " + "; ".join(placement.notes), file=out)
    return {"model": table.model, "system": system.name, "batch": plan.batch, "objective": plan.objective,
            "nodes": table.n, "search_s": placement.search_s, "notes": placement.notes, "cost_source": table.source,
            "rows": rows}


def daemon_profiles(args, settings, directory: Path, version: int, system) -> tuple[dict | None, dict | None, str]:
    """(a PooledProfile's summary and wake_s taken on the daemon's own CPU workers, where), per --profile-on:
    "daemon" there or an error, "here" (None: cost_table profiles in this process), "auto" the daemon when
    one answers and has a worker of each measured thread count, else here, saying why."""
    here = (None, None, "this process, pinned as a worker group is")
    if args.profile_on == "here":
        return here
    import onnx
    from ..client.connection import connect
    from ..errors import ModelCacheError
    from ..store.format import SKELETON_FILE, load_manifest
    from ..zoo import sample_inputs
    from .machine import profiled_threads
    from .profile import MIN_PROFILE_S, PooledProfile, daemon_source

    skeleton = directory / SKELETON_FILE
    feeds = sample_inputs(str(skeleton), batch=1)
    try:
        with connect(settings.socket, timeout_s=30) as client:
            # The daemon's NAME@version must be the model in this repository (--repository may name another).
            theirs = client.describe(args.name, version)
            if theirs.version != version or theirs.weights_bytes != load_manifest(directory).weights_bytes:
                raise ValueError(f"the daemon's {args.name}@{theirs.version} is not the one in {directory}")
            threads = profiled_threads(system)
            source = daemon_source(client, args.name, feeds, version, threads)
            where = ", ".join(source.workers[n] for n in threads)
            print(f"profiling {args.name}@{version} on the daemon's worker {where} (it runs no stage meanwhile, "
                  f"~{len(threads) * MIN_PROFILE_S:g} s and the session's build)", file=sys.stderr)
            pool = PooledProfile(skeleton, feeds, threads, source=source)
            pool.take(runs=3, min_s=MIN_PROFILE_S)
            nodes = {n.name for n in onnx.load(str(skeleton), load_external_data=False).graph.node}
            if any(not set(pool.times[n]) <= nodes for n in threads):
                raise ValueError(f"the daemon's {args.name}@{version} has nodes that {skeleton} lacks")
            return pool.summary(), pool.wake_s(), "the daemon's worker " + where
    except (ModelCacheError, ValueError) as e:
        if args.profile_on == "daemon":
            raise SystemExit(f"modelcache place: cannot profile on the daemon's workers: {e}") from None
        print(f"profiling in this process, not on the daemon's workers: {e}", file=sys.stderr)
        return here


def run(args, settings) -> int:
    from .machine import cost_table, describe_machine
    from .system import format_system, load_system

    if args.describe:
        system = describe_machine(args.workers or settings.workers, settings.gpus)
        text = format_system(system, "This machine, written by `modelcache place --describe`. CPU peak rates are "
                                     "measured now;\nthe kinds named cpuN are measured per node when a model "
                                     "is placed.")
        if args.output:
            Path(args.output).write_text(text)
            print(f"wrote {args.output}")
        else:
            print(text, end="")
        return 0
    if not args.name or not args.system:
        raise InputError("place: give NAME and --system FILE (or --describe to write this machine's system file)")
    system = load_system(args.system)
    directory, version = model_dir(settings.repository_path, args.name, args.version)
    profiles, wake_s, measured_on = daemon_profiles(args, settings, directory, version, system)
    table = cost_table(directory, f"{args.name}@{version}", system, args.batch, profiles=profiles,
                       measured_on=measured_on, wake_s=wake_s)
    placement = place(table, system, args.batch, args.objective, args.seed, args.time_budget)
    data = report(placement)
    out = Path(args.output or f"{args.name}.plan.json")
    out.write_text(json.dumps({**placement.plan.to_json(system, table), "report": data}, indent=1))
    print(f"wrote {out}")
    if args.plots:
        from .plots import plot_bars, plot_gantt
        plots = Path(args.plots)
        plots.mkdir(parents=True, exist_ok=True)
        for path in (plot_gantt(placement, plots / f"{args.name}-gantt.png"),
                     plot_bars([data], plots / f"{args.name}-vs-baselines.png")):
            if path:
                print(f"wrote {path}")
    return 0
