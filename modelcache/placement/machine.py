"""This machine as a system description (`modelcache place --describe`): its CPU worker groups, with
peak rates measured here, and its GPUs; plus the cost table of a packed model on a system.

The CPU's peak rates feed the roofline's calibration (a modelled kind is assumed as far from its
peak as this CPU is from its own), so they are measured, not looked up: a large MatMul in ORT on
N threads for the FLOP rate, a large numpy copy for memory bandwidth.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from .costs import CostTable, build_table
from .profile import boundary_bytes, node_facts
from .system import HOST, Kind, Link, System, WorkerSpec

GPU_PLACEHOLDER = dict(conv_gflop_s=10000.0, matmul_gflop_s=10000.0, other_gflop_s=1000.0, mem_gbyte_s=500.0,
                       launch_us=10.0)

# What serve mode adds on this machine outside the stages' ORT runs (System.request_s, handoff_s):
# client wall time less the stages' run_ms, serving AlexNet and ResNet-50 (602 KB input, 4 KB output)
# one request at a time in 1-3 stages on groups "1,1" and "2" (20 requests each, load average 0.3-1.0):
# medians 2.21 ms at 1 stage (1.80-2.52), 2.51 at 2 (2.23-2.92), 2.75 at 3 (2.53-3.10); a line through
# them: 1.95 ms a request (client encode and decode, the lane round trip, the daemon's decode and
# reply) + 0.27 ms a stage (the job to its worker's thread, the wake-up, the result back to the loop).
# A tiny model's request costs less (0.44 ms over the lane: benchmarks/grpc/path): the 602 KB input is most of it here.
# benchmarks/placement/check prints the measured figure beside the system's for each row.
SERVE_REQUEST_US = 1950.0
SERVE_HANDOFF_US = 270.0


def matmul_gflop_s(threads: int, size: int = 768, runs: int = 5) -> float:
    """Best of `runs` of a size³ float MatMul in ORT on `threads` threads."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "mm",
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, [size, size]) for n in "ab"],
                          [helper.make_tensor_value_info("c", TensorProto.FLOAT, [size, size])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = {n: np.random.default_rng(0).standard_normal((size, size), dtype=np.float32) for n in "ab"}
    sess.run(None, feeds)
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        sess.run(None, feeds)
        best = min(best, time.perf_counter() - t)
    return 2 * size ** 3 / best / 1e9


def memory_gbyte_s(mib: int = 64, runs: int = 5) -> float:
    """Best of `runs` copies of `mib` MiB: bytes read plus bytes written per second."""
    src = np.ones(mib << 18, dtype=np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best / 1e9


def cpu_kind(threads: int) -> Kind:
    flops = matmul_gflop_s(threads)
    mem = memory_gbyte_s()
    return Kind(f"cpu{threads}", flops, flops, mem / 8, mem, launch_us=0.0,
                comment=f"this machine's CPU on {threads} threads, measured: MatMul {flops:.1f} GFLOP/s "
                        f"(conv taken alike: MLAS runs it as GEMM), copy {mem:.1f} GB/s; elementwise = copy/8")


def describe_machine(workers_spec: str | None = None, gpus: str = "auto") -> System:
    """This machine: one CPU worker per group of `workers_spec` (the daemon's `workers` setting, default
    one group of every core), one GPU worker per CUDA device."""
    from ..executor.workers import discover_gpus, gpu_kind, parse_groups

    cores = len(os.sched_getaffinity(0))
    groups = parse_groups(str(cores) if workers_spec in (None, "auto") else workers_spec)
    kinds, workers, links = {}, [], {}
    for i, g in enumerate(groups):
        name = f"cpu{len(g)}"
        if name not in kinds:
            kinds[name] = cpu_kind(len(g))
        workers.append(WorkerSpec(f"cpu-{i}", name, HOST, group="cpu"))
    try:
        devices = discover_gpus(gpus)
    except ValueError:
        devices = []
    for d in devices:
        kind = gpu_kind(d)
        kinds.setdefault(kind, Kind(kind, **GPU_PLACEHOLDER,
                                    comment=f"{d.name}: placeholder peak rates, edit them from its data sheet"))
        workers.append(WorkerSpec(f"gpu-{d.index}", kind, d.uuid, d.total_bytes / 1e9, group="gpu"))
        for a, b in ((HOST, d.uuid), (d.uuid, HOST)):
            links[(a, b)] = Link(a, b, 16e9, 10e-6)    # PCIe 4.0 x16, about 16 GB/s each way
    return System(f"{os.uname().nodename} ({cores} cores)", kinds, workers, links,
                  request_s=SERVE_REQUEST_US * 1e-6, handoff_s=SERVE_HANDOFF_US * 1e-6,
                  serving_on_worker_cores=sum(map(len, groups)) >= cores)


def profiled_threads(system: System) -> list[int]:
    """Thread counts of the system's cpuN kinds that this machine can run; else all its cores, so a
    system of modelled kinds only still has a measured kind to calibrate against."""
    cores = len(os.sched_getaffinity(0))
    wanted = sorted({int(k[3:]) for k in system.kinds if k.startswith("cpu") and k[3:].isdigit()
                     and 1 <= int(k[3:]) <= cores})
    return wanted or [cores]


def cost_table(model_dir: Path, model: str, system: System, batch: int, runs: int = 3,
               facts_cache: dict | None = None, min_s: float | None = None,
               profiles: dict | None = None, measured_on: str = "this machine",
               wake_s: dict | None = None) -> CostTable:
    """Profile the packed model in `model_dir` (its skeleton, as serve mode runs it) and table its costs
    (or table `profiles` and `wake_s`: a PooledProfile's summary and wake_s of that skeleton on
    profiled_threads(system)).

    When no kind of the system is measured here, the modelled kinds are calibrated on this machine's
    CPU (its peak rates measured now). `measured_on` says where `profiles` ran (CostTable.source)."""
    from ..store.format import SKELETON_FILE
    from ..zoo import sample_inputs
    from .profile import MIN_PROFILE_S, PooledProfile
    skeleton = Path(model_dir) / SKELETON_FILE
    threads = profiled_threads(system)
    key = (str(skeleton), tuple(threads))
    if wake_s is not None and profiles is None:
        raise ValueError("cost_table: wake_s goes with the profiles it was measured with (give both, or neither)")
    given = profiles is not None
    cached = None if given else (facts_cache or {}).get(key)
    if cached is None:
        feeds = sample_inputs(str(skeleton), batch=1)
        if profiles is None:
            pool = PooledProfile(skeleton, feeds, threads)
            pool.take(runs, MIN_PROFILE_S if min_s is None else min_s)
            profiles, wake_s = pool.summary(), pool.wake_s()
        facts, input_bytes = node_facts(skeleton, threads, feeds, profiles=profiles)
        cached = (facts, boundary_bytes(skeleton, facts, input_bytes), wake_s)
        if facts_cache is not None and not given:
            facts_cache[key] = cached
    facts, cuts, wake_s = cached
    reference = None
    if not any(k in facts[0].measured_s for k in system.kinds):
        reference = cpu_kind(threads[-1])
    return build_table(model, facts, cuts, system, batch, reference=reference, measured_on=measured_on,
                       wake_s=wake_s)
