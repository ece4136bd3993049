"""ORT's profiler over a model as the daemon's workers run it: session options, the profiled runs (warm,
and cold after an idle spell), and per-node kernel times read back from the profile.

It runs inside the daemon's CPU workers (Worker.profile) and in the planner's own process
(placement/profile.py's node_times); the planner turns the times into costs.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..wire.protocol import MAX_PROFILE_RUNS

MIN_PROFILE_S = 1.0       # a node's runs span at least this long (placement/profile.py's profile_nodes)
# Every other profiled run follows this much sleep: a worker's wake-up, measured (placement/profile.py says why).
WAKE_GAP_S = 0.03


def profiling_options(threads: int, folder: str):
    """Session options as serve mode's stage sessions have them, with ORT's profiler writing into `folder`."""
    from ..session_options import attach_session_options

    so = attach_session_options(spinning=False)
    so.intra_op_num_threads = threads
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(folder, "profile")
    return so


# What the profiler's per-node args carry that the planner reads (node_facts); the rest (thread
# scheduling statistics on a multi-thread run) is dropped, so a daemon's answer stays small.
KEPT_ARGS = ("op_name", "input_type_shape", "output_type_shape", "parameter_size", "activation_size", "output_size")


def run_profiled(sess, feeds: dict, runs: int = 3, min_s: float = MIN_PROFILE_S,
                 max_runs: int = MAX_PROFILE_RUNS, max_s: float | None = None,
                 should_stop=None) -> tuple[dict[str, list], dict[str, dict], list]:
    """Run a profiling session (profiling_options): one warm-up, then back-to-back runs, each but the first
    followed by a cold run (after WAKE_GAP_S of idle): at least `runs` back-to-back runs, and more (up to
    `max_runs`) until they span `min_s`; none started once `max_s` passed (or should_stop() says so) and one
    is done. Returns node_times' (times, args) of the back-to-back runs, and per cold run its extra seconds
    over the run before it."""
    # Run 0 is the warm-up, odd runs follow the run before at once, even ones (from 2) idle first: after
    # i runs, i // 2 back-to-back ones are done.
    walls, cold, start = [], [], time.perf_counter()
    while len(walls) // 2 < runs or (time.perf_counter() - start < min_s and len(walls) // 2 < max_runs):
        if len(walls) >= 2 and ((max_s is not None and time.perf_counter() - start >= max_s)
                                or (should_stop is not None and should_stop())):
            break
        if len(walls) >= 2 and len(walls) % 2 == 0:
            time.sleep(WAKE_GAP_S)
            cold.append(len(walls))
        t0 = time.perf_counter()
        sess.run(None, feeds)                 # the first is the warm-up
        walls.append(time.perf_counter() - t0)
    events = json.loads(Path(sess.end_profiling()).read_text())
    times, args = node_events(events, len(walls))
    times = to_wall(times, walls)
    wake = [walls[i] - walls[i - 1] for i in cold]
    if cold and all(len(t) == len(walls) for t in times.values()):   # runs line up: leave the cold ones out
        warm = sorted(set(range(len(walls))) - set(cold))
        times = {name: [t[i] for i in warm] for name, t in times.items()}
    return times, args, wake


def node_events(events: list, runs: int) -> tuple[dict[str, list], dict[str, dict]]:
    """(node name -> its kernel seconds per run, node name -> the profiler's args kept) from ORT's profile.

    Each kernel event goes to the run (ORT's "model_run" event) it started in, summed there (a node of a
    subgraph may run several kernels a run; one a run skips counts 0), so run i of every node is the same
    run and cold runs can be told apart. Should the run events not number `runs`, the kernel events are
    listed in order as they come, which run_profiled and to_wall then take as they are."""
    import bisect

    starts = sorted(float(e.get("ts", 0)) for e in events
                    if e.get("cat") == "Session" and e.get("name") == "model_run")
    kernels = [e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]
    times: dict[str, list] = {}
    args: dict[str, dict] = {}
    for e in kernels:
        name = e["name"][: -len("_kernel_time")]
        seconds = float(e.get("dur", 0)) * 1e-6
        if len(starts) == runs:
            run = max(0, bisect.bisect_right(starts, float(e.get("ts", 0))) - 1)
            times.setdefault(name, [0.0] * runs)[run] += seconds
        else:
            times.setdefault(name, []).append(seconds)
        a = e.get("args", {})
        args[name] = {k: a[k] for k in KEPT_ARGS if k in a}
    return times, args


def to_wall(times: dict[str, list], walls: list) -> dict[str, list]:
    """Each run's node times scaled so they add up to that run's wall time. The profiler times kernels
    only; a stage's run in the daemon also pays the executor between them (allocating outputs, the
    thread pool's hand-offs, the run call itself): AlexNet's kernels added up to 18.7 ms of a 19.4 ms
    run on 2 threads, 29.1 of 30.2 on 1 (ResNet-50: within 1 %). A node absent from some runs leaves
    the times as the profiler gave them (the runs could not be lined up)."""
    if not times or any(len(t) != len(walls) for t in times.values()):
        return times
    scale = []
    for i, wall in enumerate(walls):
        kernels = sum(t[i] for t in times.values())
        scale.append(wall / kernels if kernels > 0 else 1.0)
    return {name: [x * f for x, f in zip(t, scale)] for name, t in times.items()}
