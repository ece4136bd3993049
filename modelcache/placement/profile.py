"""What ORT's profiler tells about each node of a packed model: its time on this machine's CPU
groups, and from the shapes it reports, the node's FLOPs and bytes for the roofline model.

The profiler's per-node events carry input/output shapes and byte counts, so the optimized graph
(fused, NCHWc) is measured and counted as it runs, with no shape inference over contrib ops.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

DTYPE_BYTES = {"float": 4, "float16": 2, "bfloat16": 2, "double": 8, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1, "uint16": 2, "uint32": 4, "uint64": 8}
MIN_PROFILE_S = 1.0       # a node's runs span at least this long (profile_nodes)
MAX_PROFILE_RUNS = 100
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

    On a VM whose speed moves on its own by 20 % over tens of seconds (bench/placement_check.py, its
    speed_probe.py), one profile taken before a measurement predicts the moment it was taken. A check
    that interleaves short profiles with what it measures pools them here, so both sample the same
    stretch of the machine's time."""

    def __init__(self, skeleton: Path, feeds: dict, threads: list[int]):
        self.skeleton, self.feeds, self.threads = skeleton, feeds, list(threads)
        self.times: dict[int, dict[str, list]] = {n: {} for n in self.threads}   # warm-ups left out
        self.args: dict[int, dict[str, dict]] = {n: {} for n in self.threads}

    def take(self, runs: int = 3, min_s: float = MIN_PROFILE_S, max_runs: int = MAX_PROFILE_RUNS) -> None:
        """One more profile on every thread count (profile_nodes' runs), added to the pool."""
        for n in self.threads:
            times, args = node_times(self.skeleton, self.feeds, n, runs, min_s, max_runs)
            for name, t in times.items():
                # Less the warm-up, appended in order: run i of every node stays the same run, so
                # fastest_runs can still pick whole runs (when every node ran in every run).
                self.times[n].setdefault(name, []).extend(t[1:])
            self.args[n].update(args)

    def summary(self, keep: str = "median") -> dict[int, dict[str, dict]]:
        """threads -> name -> {op, seconds, args}. keep: "median" (every run: the cost a stretch of
        serving sees; what the planner uses) or "faster-half" (the group's cost when it has its cores).

        The planner kept the faster half until the simulator check interleaved its profile with the
        serving it predicts (bench/placement_check.py, benchmarks/placement/check): there the median
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


def node_times(skeleton: Path, feeds: dict, threads: int, runs: int = 3, min_s: float = MIN_PROFILE_S,
               max_runs: int = MAX_PROFILE_RUNS) -> tuple[dict[str, list], dict[str, dict]]:
    """(name -> its kernel seconds in each run, the warm-up first; name -> the profiler's args): profile_nodes' runs."""
    import onnxruntime as ort
    from ..session_options import attach_session_options

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
            so = attach_session_options(spinning=False)
            so.intra_op_num_threads = threads
            so.enable_profiling = True
            so.profile_file_prefix = os.path.join(tmp, "profile")
            sess = ort.InferenceSession(str(skeleton), so, providers=["CPUExecutionProvider"])
            walls, start = [], time.perf_counter()
            while len(walls) <= runs or (time.perf_counter() - start < min_s and len(walls) <= max_runs):
                t0 = time.perf_counter()
                sess.run(None, feeds)                 # the first is the warm-up
                walls.append(time.perf_counter() - t0)
            events = json.loads(Path(sess.end_profiling()).read_text())
        finally:
            os.sched_setaffinity(0, before)
    times: dict[str, list] = {}
    args: dict[str, dict] = {}
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            name = e["name"][: -len("_kernel_time")]
            times.setdefault(name, []).append(float(e.get("dur", 0)) * 1e-6)
            args[name] = e.get("args", {})
    return to_wall(times, walls), args


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


def node_facts(skeleton: Path, threads: list[int], feeds: dict | None = None, runs: int = 3,
               min_s: float = MIN_PROFILE_S, profiles: dict | None = None) -> tuple[list, dict]:
    """(NodeFacts in graph order, graph-input bytes per sample), measured on CPU groups of each thread count
    (or taken from `profiles`, a PooledProfile's summary over the same feeds)."""
    import onnx
    from ..zoo import sample_inputs

    model = onnx.load(str(skeleton), load_external_data=False)
    feeds = feeds or sample_inputs(str(skeleton), batch=1)
    if profiles is None:
        profiles = {n: profile_nodes(skeleton, feeds, n, runs, min_s) for n in threads}
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
