"""What ORT's profiler tells about each node of a packed model: its time on this machine's CPU
groups, and from the shapes it reports, the node's FLOPs and bytes for the roofline model.

The profiler's per-node events carry input/output shapes and byte counts, so the optimized graph
(fused, NCHWc) is measured and counted as it runs, with no shape inference over contrib ops.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..executor.profile import MIN_PROFILE_S, profiling_options, run_profiled
from ..wire.protocol import MAX_PROFILE_RUNS

DTYPE_BYTES = {"float": 4, "float16": 2, "bfloat16": 2, "double": 8, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1, "uint16": 2, "uint32": 4, "uint64": 8}
# A worker thread that idled a while runs its next stage slower than back to back: measured paired here
# (AlexNet on 1 thread: 1.01x after 3 or 10 ms idle, 1.07x after 20 and 60 ms; on 2 threads 1.04-1.05x;
# ResNet-50 on 1 thread 1.02x after 30 and 100 ms: about 2 ms a run either way, not a share of it).
# Serving one request at a time, every stage on "1,1" meets a worker idle that long. So every other
# profiled run follows WAKE_GAP_S of sleep (executor/profile.py): those "cold" runs give the extra seconds
# (PooledProfile.wake_s), the rest the node times; the simulator adds it to a run on a worker idle WAKE_AFTER_S
# or more.
WAKE_AFTER_S = 0.015
MIN_WAKE_SAMPLES = 3
MAX_WAKE_SHARE = 0.1
MATMUL_OPS = {"MatMul", "Gemm", "FusedMatMul", "MatMulInteger", "QGemm", "MatMulNBits", "FusedGemm"}


def op_class(op: str) -> str:
    """Which peak rate of a kind bounds this op: 'conv', 'matmul' or 'other' (pooling, elementwise...)."""
    if "Conv" in op:
        return "conv"
    if op in MATMUL_OPS or "Attention" in op:
        return "matmul"
    return "other"


@dataclass
class NodeFacts:
    """One node, per sample (profiled at batch 1)."""
    name: str
    op: str
    flops: float                 # floating-point operations
    weight_bytes: float          # parameters read once per run, whatever the batch
    activation_bytes: float      # inputs read and outputs written per sample
    output_bytes: list = field(default_factory=list)      # per output, in node.output order
    measured_s: dict = field(default_factory=dict)        # kind (cpuN) -> seconds at batch 1


def _elems(shape) -> int:
    return int(np.prod([max(1, int(d)) for d in shape])) if shape else 1


def _tensor(entry: dict) -> tuple[int, list]:
    (dtype, shape), = entry.items()
    return DTYPE_BYTES.get(dtype, 4), shape


def flops_of(op: str, inputs: list, outputs: list) -> float:
    """FLOPs from the shapes ORT reports: 2 per multiply-add for conv and matmul, one per output element
    otherwise (the roofline's memory term bounds those anyway)."""
    out_elems = sum(_elems(_tensor(o)[1]) for o in outputs)
    kind = op_class(op)
    if kind == "conv" and len(inputs) >= 2:
        w = _tensor(inputs[1])[1]
        return 2.0 * out_elems * (_elems(w) / max(1, w[0]))     # each output: C/g * kh * kw multiply-adds
    if kind == "matmul" and inputs:
        a = _tensor(inputs[0])[1]
        return 2.0 * out_elems * (a[-1] if a else 1)
    return float(out_elems)


def profile_nodes(skeleton: Path, feeds: dict, threads: int, runs: int = 3, min_s: float = MIN_PROFILE_S,
                  max_runs: int = MAX_PROFILE_RUNS) -> dict[str, dict]:
    """name -> {op, seconds (median over the runs), args (the profiler's shapes and sizes)}, on `threads` cores.

    One warm-up run first: the first run allocates the arena and would inflate every node. Then at least
    `runs` runs, and more (up to `max_runs`) until they have taken `min_s` seconds: another process's
    burst, or this VM's own speed, moves a multi-thread run for a second or more, so runs spread over a
    few seconds sample the machine as serving will meet it, where a handful taken in a fraction of a
    second sample one moment of it."""
    pooled = PooledProfile(skeleton, feeds, [threads])
    pooled.take(runs, min_s, max_runs)
    return pooled.summary()[threads]


class PooledProfile:
    """A model's per-node kernel times on each thread count, pooled over profiles taken at several moments.

    On a VM whose speed moves on its own by 20 % over tens of seconds (benchmarks/placement/check/run.py, its
    speed_probe.py), one profile taken before a measurement predicts the moment it was taken. A check
    that interleaves short profiles with what it measures pools them here, so both sample the same
    stretch of the machine's time."""

    def __init__(self, skeleton: Path, feeds: dict, threads: list[int], source=None):
        """source(threads, runs, min_s, max_runs) -> node_times' (times, args, wake): where a profile is taken. By
        default in this process, pinned as a worker group of that size is (node_times); `daemon_source`
        takes it on the daemon's own workers."""
        self.skeleton, self.feeds, self.threads = skeleton, feeds, list(threads)
        self.source = source or (lambda n, runs, min_s, max_runs: node_times(skeleton, feeds, n, runs, min_s, max_runs))
        self.times: dict[int, dict[str, list]] = {n: {} for n in self.threads}   # warm-ups left out
        self.args: dict[int, dict[str, dict]] = {n: {} for n in self.threads}
        self.wake: dict[int, list] = {n: [] for n in self.threads}     # cold runs' extra seconds

    def take(self, runs: int = 3, min_s: float = MIN_PROFILE_S, max_runs: int = MAX_PROFILE_RUNS) -> None:
        """One more profile on every thread count (profile_nodes' runs), added to the pool."""
        for n in self.threads:
            times, args, wake = self.source(n, runs, min_s, max_runs)
            self.wake[n].extend(wake)
            for name, t in times.items():
                # Less the warm-up, appended in order: run i of every node stays the same run, so
                # fastest_runs can still pick whole runs (when every node ran in every run).
                self.times[n].setdefault(name, []).extend(t[1:])
            self.args[n].update(args)

    def wake_s(self) -> dict[int, float]:
        """threads -> a cold run's extra seconds: the median over the pool's cold runs, 0 with fewer than
        MIN_WAKE_SAMPLES, and at most MAX_WAKE_SHARE of a run (the probe found ~2 ms a run, not a share of
        it: a long run's cold-minus-warm is mostly its own noise)."""
        out = {}
        for n, w in self.wake.items():
            run_s = sum(statistics.median(t) for t in self.times[n].values() if t)
            out[n] = (min(max(0.0, statistics.median(w)), MAX_WAKE_SHARE * run_s)
                      if len(w) >= MIN_WAKE_SAMPLES else 0.0)
        return out

    def summary(self, keep: str = "median") -> dict[int, dict[str, dict]]:
        """threads -> name -> {op, seconds, args}. keep: "median" (every run: the cost a stretch of
        serving sees; what the planner uses) or "faster-half" (the group's cost when it has its cores).

        The planner kept the faster half until the simulator check interleaved its profile with the
        serving it predicts (benchmarks/placement/check): there the median
        put 12 and 9 of 16 figures within 10 % of the daemon's in two runs, the faster half 6 and 7,
        predicting every latency low (11 and 11 in a run before the wall-time scaling)."""
        if keep not in ("median", "faster-half"):
            raise ValueError(f"keep={keep!r}: 'median' or 'faster-half'")
        out = {}
        for n, times in self.times.items():
            chosen = None
            if keep == "faster-half":
                # fastest_runs counts index 0 as the warm-up, which the pool has left out already.
                chosen = [i - 1 for i in fastest_runs({k: [0.0, *t] for k, t in times.items()})]
            out[n] = {}
            for name, t in times.items():
                runs = t if chosen is None else ([t[i] for i in chosen if i < len(t)] or t)
                if runs:
                    out[n][name] = {"op": self.args[n][name].get("op_name", "?"),
                                    "seconds": statistics.median(runs), "args": self.args[n][name]}
        return out


def daemon_workers(client) -> dict[int, str]:
    """Thread count -> the name of the daemon's first CPU worker of that many threads (not disabled)."""
    workers: dict[int, str] = {}
    for w in client.stats().executor.get("workers", []):
        kind = str(w.get("kind", ""))
        if w.get("device", "cpu") == "cpu" and not w.get("disabled") and kind[3:].isdigit():
            workers.setdefault(int(kind[3:]), w.get("name") or f"cpu-{w['id']}")
    return workers


def daemon_source(client, name: str, feeds: dict, version: int | None = None, threads: list | None = None):
    """A PooledProfile source that takes each profile on the daemon's own worker of that thread count
    (Client.profile): where serve mode will run the model's stages, over the same weights in /dev/shm.
    ValueError, naming the daemon's workers, for a thread count it has none of: at once for each of
    `threads`, else when a profile asks."""
    workers = daemon_workers(client)

    def worker_of(n: int) -> str:
        if n not in workers:
            have = ", ".join(f"{w} ({k} threads)" for k, w in sorted(workers.items())) or "none"
            raise ValueError(f"the daemon has no CPU worker of {n} threads to profile on (it has {have})")
        return workers[n]

    for n in threads or ():
        worker_of(n)

    def take(n: int, runs: int, min_s: float, max_runs: int):
        reply = client.profile(name, feeds, worker=worker_of(n), runs=runs, min_s=min_s, version=version)
        return reply.times, reply.args, reply.wake_s
    take.workers = workers
    return take


def node_times(skeleton: Path, feeds: dict, threads: int, runs: int = 3, min_s: float = MIN_PROFILE_S,
               max_runs: int = MAX_PROFILE_RUNS) -> tuple[dict[str, list], dict[str, dict], list]:
    """(name -> its seconds in each back-to-back run (kernel times scaled to the run's wall time), the
    warm-up first; name -> the profiler's args; each cold run's extra seconds): run_profiled's runs, in this
    process (the daemon's workers profile the same way: Client.profile, Worker.profile)."""
    import onnxruntime as ort

    # Pinned to the cores a worker group of this size gets (executor/workers.py): on a shared machine a
    # pinned thread cannot flee to an idle core, and the costs should be the worker's, not a free thread's.
    from ..executor.workers import parse_groups
    before = os.sched_getaffinity(0)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            os.sched_setaffinity(0, parse_groups(str(threads))[0])   # this thread; ORT's pool inherits it
        except OSError:
            pass
        try:
            so = profiling_options(threads, tmp)
            sess = ort.InferenceSession(str(skeleton), so, providers=["CPUExecutionProvider"])
            return run_profiled(sess, feeds, runs, min_s, max_runs)
        finally:
            os.sched_setaffinity(0, before)


def fastest_runs(times: dict[str, list]) -> list[int]:
    """Which runs PooledProfile.summary("faster-half") keeps: the faster half of the runs after the
    warm-up (index 0), by their total. On 2 cores a 2-thread run is stretched whole whenever another
    process takes a core for a moment (each parallel op waits for its preempted thread), and the faster
    half is the group's cost when it has its cores. The planner used it until the simulator check
    showed it predicting serving low (see summary)."""
    runs = max((len(t) for t in times.values()), default=0)
    totals = {i: sum(t[i] for t in times.values() if i < len(t)) for i in range(1, runs)}
    ordered = sorted(totals, key=lambda i: (totals[i], i))
    return sorted(ordered[: max(1, (len(ordered) + 1) // 2)])


def node_facts(skeleton: Path, threads: list[int], feeds: dict, profiles: dict) -> tuple[list, dict]:
    """(NodeFacts in graph order, graph-input bytes per sample) from `profiles`: a PooledProfile's summary
    of the skeleton over `feeds` on CPU groups of each thread count."""
    import onnx

    model = onnx.load(str(skeleton), load_external_data=False)
    first = profiles[threads[0]]
    facts = []
    for node in model.graph.node:
        p = first.get(node.name)
        if p is None:   # a node ORT ran no kernel for (it folded it away): it costs nothing
            facts.append(NodeFacts(node.name, node.op_type, 0.0, 0.0, 0.0, [0.0] * len(node.output)))
            continue
        a = p["args"]
        ins, outs = a.get("input_type_shape", []), a.get("output_type_shape", [])
        out_bytes = [b * _elems(s) for b, s in map(_tensor, outs)]
        facts.append(NodeFacts(node.name, p["op"], flops_of(p["op"], ins, outs),
                               float(a.get("parameter_size", 0)),
                               float(a.get("activation_size", 0)) + float(a.get("output_size", 0)),
                               out_bytes + [0.0] * (len(node.output) - len(out_bytes)),
                               {f"cpu{n}": profiles[n].get(node.name, {}).get("seconds", 0.0) for n in threads}))
    input_bytes = {k: float(v.nbytes) for k, v in feeds.items()}
    return facts, input_bytes


def boundary_bytes(skeleton: Path, facts: list, input_bytes: dict) -> list[float]:
    """Bytes per sample crossing each boundary: [0] the model's inputs, [i] every tensor alive between
    node i-1 and node i (any number of them), [n] the model's outputs."""
    import onnx
    from ..executor.partition import crossing_tensors

    model = onnx.load(str(skeleton), load_external_data=False)
    size = dict(input_bytes)
    for node, f in zip(model.graph.node, facts):
        size.update(zip(node.output, f.output_bytes))
    crossing = crossing_tensors(model)
    outputs = [o.name for o in model.graph.output]
    return ([sum(input_bytes.values())] + [sum(size.get(t, 0.0) for t in c) for c in crossing]
            + [sum(size.get(t, 0.0) for t in outputs)])
