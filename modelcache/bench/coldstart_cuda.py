"""GPU cold start, as TrIMS measured it on GPUs: a fresh process per sample, exec to session ready and to first result.

    modelcache bench coldstart --device cuda [--models vgg16 resnet50 vit_b_16] [--runs 5] [--quick] [--out DIR]

Modes, interleaved round by round so machine drift hits them alike:
  ort-cuda         plain onnxruntime.InferenceSession(model.onnx) on the CUDA provider + one run
  host-attach      weights from the host tier (the GPU variant, mapped read-only); ORT copies them to the device
  gpu-attach-hit   modelcache.InferenceSession(name, providers=["CUDAExecutionProvider"]), model on the GPU:
                   its weights mapped by CUDA IPC, no copy
  gpu-attach-miss  the same after the model was demoted from the GPU: host -> GPU promotion included
  serve            the client hands the input to the daemon, whose GPU worker runs over the GPU tier's
                   arena (the client imports neither onnxruntime nor CUDA)
  ideal            import onnxruntime + CUDA context + a 1-node CUDA session ("ready"), then the model's
                   warm run ("first"): loading the model costs nothing
Also: device memory (NVML) with k clients started together, ort-cuda vs gpu-attach-hit, beside a client with
no weights ("floor") and the daemon; and promotion throughput beside the host -> device bandwidth (pageable and
pinned) measured in the same run. Needs a CUDA device, onnxruntime-gpu and cupy (the [gpu] extra); without them
it says what is missing and exits.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..errors import ModelCacheError
from ..plotting import pyplot
from ..measure import ensure_models, managed_daemon, save_results, summary
from .fresh import holding, sample as sample_child, spawn as spawn_child
from ..usage import Parser

MODES = ["ort-cuda", "host-attach", "gpu-attach-hit", "gpu-attach-miss", "serve", "ideal"]
CHILD = str(Path(__file__).with_name("coldstart_cuda_child.py"))
DEFAULT_MODELS = ["vgg16", "resnet50", "vit_b_16"]
# The benchmark's own daemon drops idle serve sessions fast: a GPU worker's lease on a model's device
# copy (held while it may have sessions over it) would otherwise keep gpu-attach-miss from demoting it.
DAEMON_ENV = {"MODELCACHE_SERVE_IDLE_S": "1", "MODELCACHE_HEARTBEAT_INTERVAL_S": "0.25"}


class NoCudaDevice(ModelCacheError):
    code = "device"


# -- NVML through ctypes (no context is created: the parent must not hold device memory) -----------

class _MemoryInfo(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class Nvml:
    def __init__(self):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self.lib.nvmlInit_v2(), "nvmlInit")

    def _check(self, rc: int, call: str) -> None:
        if rc != 0:
            self.lib.nvmlErrorString.restype = ctypes.c_char_p
            raise NoCudaDevice(f"{call} failed: {self.lib.nvmlErrorString(rc).decode()}")

    def count(self) -> int:
        n = ctypes.c_uint()
        self._check(self.lib.nvmlDeviceGetCount_v2(ctypes.byref(n)), "nvmlDeviceGetCount")
        return n.value

    def used_bytes(self, uuid: str) -> int:
        """Device memory in use on the GPU named `uuid` (our 32-hex form), all processes together."""
        h = uuid.lower().replace("-", "").removeprefix("gpu")
        name = f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}".encode()
        handle = ctypes.c_void_p()
        self._check(self.lib.nvmlDeviceGetHandleByUUID(name, ctypes.byref(handle)), f"nvmlDeviceGetHandleByUUID({name})")
        info = _MemoryInfo()
        self._check(self.lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(info)), "nvmlDeviceGetMemoryInfo")
        return info.used


def preflight() -> Nvml:
    """NVML with a device, onnxruntime with the CUDA provider, cupy with a device; else NoCudaDevice saying what is missing."""
    problems, nvml = [], None
    try:
        nvml = Nvml()
        if nvml.count() == 0:
            problems.append("NVML sees no NVIDIA GPU")
    except OSError:
        problems.append("no NVIDIA driver here (libnvidia-ml.so.1 cannot be loaded)")
    except NoCudaDevice as e:
        problems.append(str(e))
    try:
        import onnxruntime as ort
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            problems.append(f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (install onnxruntime-gpu "
                            "1.31+, or put its pip --target directory first on PYTHONPATH)")
    except ImportError:
        problems.append("onnxruntime is not installed")
    try:
        from cupy.cuda import runtime
        if runtime.getDeviceCount() == 0:
            problems.append("cupy sees no CUDA device")
    except ImportError:
        problems.append("cupy is not installed (the daemon's GPU tier needs cupy-cuda13x)")
    except Exception as e:   # CUDARuntimeError: no driver or no device
        problems.append(f"cupy cannot use CUDA: {e}")
    if problems:
        raise NoCudaDevice("bench coldstart --device cuda needs a CUDA device with onnxruntime-gpu and cupy "
                           "(pip install 'modelcache[gpu]'): " + "; ".join(problems))
    return nvml


# -- samples ----------------------------------------------------------------------------------------

def spawn(mode: str, name: str, src: str, layout: str, socket: str, hold: bool = False) -> subprocess.Popen:
    return spawn_child(mode, name, src, layout, socket, hold, child=CHILD)


def sample(mode, name, src, layout, socket) -> dict:
    return sample_child(mode, name, src, layout, socket, child=CHILD)


def model_row(client, name: str) -> dict:
    return next(m for m in client.list() if m["name"] == name)


def demote(client, name: str, timeout_s: float = 600) -> None:
    """Evict the model from the GPU once nothing holds its copy there (a GPU worker's idle sessions go after serve_idle_s)."""
    deadline = time.monotonic() + timeout_s
    while any(g["leases"] for g in model_row(client, name)["gpu"]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name}: its GPU copy stayed leased for {timeout_s:.0f} s; cannot measure a GPU miss")
        time.sleep(0.1)
    if model_row(client, name)["gpu"]:
        client.evict(name, tier="gpu")


def write_layouts(client, names: list[str], repository: Path, work: Path) -> dict[str, str]:
    """Per model, a JSON file with where the host tier holds its GPU variant (what host-attach maps)."""
    from ..store.format import load_manifest
    out = {}
    for name in names:
        lease = client.open(name)     # resident in the host tier while we read where it lies
        try:
            root = Path(lease.skeleton_path).parent
            key = f"{name}@{lease.version}"
            where = json.loads((root / f"{key}.where.json").read_text())["locations"]["gpu"]
            manifest = load_manifest(repository / name / str(lease.version))
            segments = sorted({seg for seg, _ in where.values()})
            tensors = [[t.name, t.dtype, t.shape, segments.index(where[t.name][0]), where[t.name][1], t.nbytes]
                       for t in manifest.gpu_tensors]
            layout = {"skeleton": str(root / f"{key}.gpu.onnx"), "segments": [str(root / s) for s in segments],
                      "tensors": tensors, "bytes": sum(t.nbytes for t in manifest.gpu_tensors)}
        finally:
            client.release(lease.lease_id)
        out[name] = str(work / f"{name}.layout.json")
        Path(out[name]).write_text(json.dumps(layout))
    return out


def write_floor(work: Path) -> str:
    """The ideal mode's 1-node model, and the layout file that names it."""
    from onnx import TensorProto, helper, save
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "floor",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8     # onnx 1.23 writes IR 14 by default, which onnxruntime-gpu 1.31 refuses (its max is 13)
    save(model, str(work / "floor.onnx"))
    (work / "floor.json").write_text(json.dumps({"floor": str(work / "floor.onnx")}))
    return str(work / "floor.json")


def warm_serve(client, name: str, src: str, log) -> list:
    """Serve requests until the scheduler has timed the model on every worker kind; the kinds the last ran on."""
    from .. import zoo
    feeds = zoo.sample_inputs(src)
    kinds = []
    for _ in range(6):
        _, timings = client.infer(name, feeds)
        kinds = [s["kind"] for s in timings["stages"]]
    log(f"serve {name}: calibrated, runs on {', '.join(kinds)}")
    return kinds


def measure_promotion(client, names: list[str], layouts: dict, runs: int, log) -> list[dict]:
    rows = []
    for name in names:
        nbytes = json.loads(Path(layouts[name]).read_text())["bytes"]
        for _ in range(runs):
            demote(client, name)
            t0 = time.perf_counter()
            client.load(name, tier="gpu")
            load_s = time.perf_counter() - t0
            tier = next(t for t in client.stats().tiers if t["tier"] == "gpu")
            rows.append({"model": name, "bytes": nbytes, "load_gb_s": nbytes / load_s / 1e9,
                         "copy_gb_s": tier.get("promotion_bytes_per_s", 0.0) / 1e9})
        log(f"promotion {name}: {statistics.median(r['copy_gb_s'] for r in rows if r['model'] == name):.1f} GB/s "
            f"(copy), {statistics.median(r['load_gb_s'] for r in rows if r['model'] == name):.1f} GB/s (load call)")
    return rows


def measure_latency(client, socket, paths, layouts, floor, modes, runs, log) -> list[dict]:
    samples = []
    order = sorted(modes, key=lambda m: m != "gpu-attach-miss")   # its demotion waits on idle serve sessions
    for r in range(runs):
        for name, src in paths.items():
            for mode in order:
                if mode == "gpu-attach-miss":
                    demote(client, name)
                elif mode in ("gpu-attach-hit", "serve"):
                    client.load(name, tier="gpu")
                s = sample(mode, name, src, floor if mode == "ideal" else layouts[name], socket)
                s["run"] = r
                samples.append(s)
            log(f"round {r + 1}/{runs} {name}: " + ", ".join(f"{s['mode']} {s['ready_ms']:.0f}/{s['first_ms']:.0f}"
                                                             for s in samples if s["run"] == r and s["model"] == name))
    return samples


def measure_memory(client, nvml, uuid, idle_used, socket, name, src, layout, floor, counts, log) -> list[dict]:
    """Device memory with k clients holding a session, started together; the daemon holds only `name` on the GPU."""
    client.load(name, tier="gpu")
    time.sleep(1.0)
    daemon = nvml.used_bytes(uuid) - idle_used   # the daemon's arena: one copy of the weights
    weights = json.loads(Path(layout).read_text())["bytes"]
    rows = [{"model": name, "mode": "arena", "clients": 0, "device_mib": daemon / 2**20,
             "weights_mib": weights / 2**20}]
    plan = [("floor", 1)] + [(mode, k) for k in counts for mode in ("ort-cuda", "gpu-attach-hit")]
    for mode, k in plan:
        with holding([spawn(mode, name, src, floor if mode == "floor" else layout, socket, hold=True)
                      for _ in range(k)]):
            time.sleep(0.5)
            clients = nvml.used_bytes(uuid) - idle_used - daemon
            rows.append({"model": name, "mode": mode, "clients": k, "device_mib": clients / 2**20,
                         "per_client_mib": clients / k / 2**20, "weights_mib": weights / 2**20})
            log(f"memory {mode} k={k}: clients {clients / 2**20:.0f} MiB ({clients / k / 2**20:.0f} each), "
                f"the daemon's arena {daemon / 2**20:.0f} MiB")
    return rows


# -- report -----------------------------------------------------------------------------------------

def report(data: dict, out=sys.stdout) -> None:
    samples, memory, promotion, bandwidth = data["samples"], data["memory"], data["promotion"], data["bandwidth"]
    print(f"device: {data.get('device', '?')}", file=out)
    modes = [m for m in MODES if any(s["mode"] == m for s in samples)]
    print(f"{'model':<12} {'mode':<16} {'spawn->ready ms':>22} {'spawn->first ms':>22} {'ready x ort':>11} "
          f"{'first x ort':>11} {'ready x ideal':>13} {'first x ideal':>13}", file=out)
    for name in dict.fromkeys(s["model"] for s in samples):
        med = {(m, k): statistics.median(s[k] for s in samples if s["model"] == name and s["mode"] == m)
               for m in modes for k in ("ready_ms", "first_ms")}
        for m in modes:
            rows = [s for s in samples if s["model"] == name and s["mode"] == m]
            ratio = lambda base, k: f"{med[(m, k)] / med[(base, k)]:.2f}" if (base, k) in med else "-"  # noqa: E731
            print(f"{name:<12} {m:<16} {summary([r['ready_ms'] for r in rows]):>22} "
                  f"{summary([r['first_ms'] for r in rows]):>22} {ratio('ort-cuda', 'ready_ms'):>11} "
                  f"{ratio('ort-cuda', 'first_ms'):>11} {ratio('ideal', 'ready_ms'):>13} "
                  f"{ratio('ideal', 'first_ms'):>13}", file=out)
        if ("gpu-attach-hit", "ready_ms") in med and ("ideal", "ready_ms") in med:
            print(f"{name:<12} -> gpu-attach-hit ready at {med[('gpu-attach-hit', 'ready_ms')] / med[('ideal', 'ready_ms')]:.2f}x "
                  f"ideal's ready (target <= 1.10)", file=out)
        for m in ("gpu-attach-hit", "serve"):
            if (m, "first_ms") in med and ("ort-cuda", "first_ms") in med:
                print(f"{name:<12} -> {m} first result {med[('ort-cuda', 'first_ms')] / med[(m, 'first_ms')]:.2f}x "
                      f"faster than ort-cuda", file=out)
    if bandwidth:
        print(f"\nhost -> device, {bandwidth['bytes'] / 2**20:.0f} MiB: pageable {bandwidth['pageable_gb_s']:.1f} GB/s, "
              f"pinned {bandwidth['pinned_gb_s']:.1f} GB/s", file=out)
    for name in dict.fromkeys(r["model"] for r in promotion):
        copy = statistics.median(r["copy_gb_s"] for r in promotion if r["model"] == name)
        load = statistics.median(r["load_gb_s"] for r in promotion if r["model"] == name)
        vs = f", {copy / bandwidth['pinned_gb_s']:.2f}x pinned (target >= 0.8)" if bandwidth else ""
        print(f"promotion {name:<12} copy {copy:.1f} GB/s{vs}; whole load call {load:.1f} GB/s", file=out)
    if memory:
        print(f"\n{'model':<12} {'mode':<16} {'clients':>7} {'device MiB':>11} {'per client':>11}", file=out)
        for r in memory:
            print(f"{r['model']:<12} {r['mode']:<16} {r['clients']:>7} {r['device_mib']:>11.0f} "
                  f"{r.get('per_client_mib', r['device_mib']):>11.0f}", file=out)
        print("(device MiB beyond what was in use with the daemon idle: 'arena' is its copy of the weights, "
              "'floor' a client with no weights: CUDA context and a 1-node session, run once)", file=out)
        arena = next(r for r in memory if r["mode"] == "arena")
        floor = next((r for r in memory if r["mode"] == "floor"), None)
        for r in memory:
            if r["mode"] == "gpu-attach-hit" and floor is not None:
                # beyond the daemon's idle context: k weightless clients + 1.05 x one copy of the weights
                bound = r["clients"] * floor["device_mib"] + 1.05 * arena["weights_mib"]
                total = arena["device_mib"] + r["device_mib"]
                print(f"{r['clients']} gpu-attach clients + the daemon's arena: {total:.0f} MiB; bound (k x floor + "
                      f"1.05 x weights) {bound:.0f} MiB: {'met' if total <= bound else 'NOT met'}", file=out)


def plot(data: dict, out_dir: Path) -> list[str]:
    plt = pyplot()
    if plt is None:
        return []
    samples, memory = data["samples"], data["memory"]
    names = list(dict.fromkeys(s["model"] for s in samples))
    med = {(n, m, k): statistics.median(s[k] for s in samples if s["model"] == n and s["mode"] == m)
           for n in names for m in MODES for k in ("ready_ms", "first_ms")
           if any(s["mode"] == m and s["model"] == n for s in samples)}
    modes = [m for m in MODES if m not in ("ort-cuda", "ideal") and any((n, m, "first_ms") in med for n in names)]
    written = []
    if modes and all((n, "ort-cuda", "first_ms") in med for n in names):
        fig, axes = plt.subplots(1, 2, figsize=(max(8, 3.2 * len(names)), 4), sharey=True)
        width = 0.8 / len(modes)
        for ax, k, title in zip(axes, ("ready_ms", "first_ms"), ("spawn -> session ready", "spawn -> first result")):
            for i, m in enumerate(modes):
                ax.bar([j + i * width for j in range(len(names))],
                       [med[(n, "ort-cuda", k)] / med[(n, m, k)] if (n, m, k) in med else 0 for n in names],
                       width, label=m)
            for j, n in enumerate(names):   # the ideal speedup, as TrIMS marks it
                if (n, "ideal", k) in med:
                    ax.hlines(med[(n, "ort-cuda", k)] / med[(n, "ideal", k)], j - width / 2, j + 0.8 - width / 2,
                              colors="k", linestyles="dashed", label="ideal" if j == 0 else None)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names)
            ax.set_title(title)
        axes[0].set_ylabel("speedup over plain ORT on CUDA")
        axes[1].legend()
        fig.suptitle(f"GPU cold start of a fresh process ({data.get('device', 'CUDA')})")
        fig.tight_layout()
        fig.savefig(out_dir / "speedup-cuda.png", dpi=120)
        written.append("speedup-cuda.png")
    if memory:
        daemon = next(r for r in memory if r["mode"] == "arena")["device_mib"]
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode in ("ort-cuda", "gpu-attach-hit"):
            rows = [r for r in memory if r["mode"] == mode]
            extra = daemon if mode == "gpu-attach-hit" else 0.0
            ax.plot([r["clients"] for r in rows], [r["device_mib"] + extra for r in rows], marker="o",
                    label=mode + (" (+ the daemon's arena)" if extra else ""))
        ax.set_xlabel("concurrent clients of one model, started together")
        ax.set_ylabel("device memory beyond the idle daemon, MiB (NVML)")
        ax.set_title(f"GPU memory: {memory[0]['model']}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "memory-cuda.png", dpi=120)
        written.append("memory-cuda.png")
    plt.close("all")
    return written


def main(argv=None) -> int:
    ap = Parser(prog="modelcache bench coldstart --device cuda", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", help=f"zoo models (default: {' '.join(DEFAULT_MODELS)})")
    ap.add_argument("--runs", type=int, help="fresh processes per mode and model (default 5; 3 with --quick)")
    ap.add_argument("--quick", action="store_true", help="resnet50 only, 3 runs, 1-2 clients")
    ap.add_argument("--clients", type=int, nargs="+", help="memory: clients started together (default 1 2 4 8; 0: skip)")
    ap.add_argument("--memory-model", help="model for the memory measurement (default vgg16, or the first model)")
    ap.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    ap.add_argument("--socket", help="use this running daemon (default: start a private one); with a long serve_idle_s "
                                     "its GPU workers keep the model on the GPU that long, and gpu-attach-miss waits")
    ap.add_argument("--out", help="directory for samples.csv, results.json, report.txt and plots")
    args = ap.parse_args(argv)
    nvml = preflight()
    models = args.models or (["resnet50"] if args.quick else DEFAULT_MODELS)
    runs = args.runs or (3 if args.quick else 5)
    counts = args.clients or ([1, 2] if args.quick else [1, 2, 4, 8])
    memory_model = args.memory_model or ("vgg16" if "vgg16" in models else models[0])
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731

    try:
        return run(args, argv, nvml, models, runs, counts, memory_model, log)
    except RuntimeError as e:   # a child failed: its stderr is in the message
        raise ModelCacheError(f"bench coldstart --device cuda: {e}") from None


def run(args, argv, nvml, models, runs, counts, memory_model, log) -> int:
    from ..client.connection import connect
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="modelcache-coldstart-cuda-") as tmp:
        work = Path(tmp)
        socket = args.socket or f"ipc://{tmp}/daemon.sock"
        floor = write_floor(work)
        try:   # ORT lists its CUDA provider even where the CUDA or cuDNN libraries it needs are missing
            sample("floor", "-", "-", floor, socket)
        except RuntimeError as e:
            raise NoCudaDevice(f"onnxruntime cannot run a session on the CUDA provider here: {e}") from None
        with managed_daemon(socket, None if args.socket else f"{tmp}/repo", env=DAEMON_ENV,
                            log_path=str(work / "daemon.log")):
            paths = ensure_models(socket, models, work / "zoo")
            with connect(socket) as client:
                stats = client.stats()
                tiers = [t for t in stats.tiers if t["tier"] == "gpu"]
                if not tiers:
                    raise NoCudaDevice("the daemon has no GPU tier (is cupy installed for it, and gpus not 'none'?)")
                gpu_tier = tiers[0]
                device = f"{gpu_tier['name']} ({gpu_tier['device']})"
                repository = Path(next(t["path"] for t in stats.tiers if t["tier"] == "disk"))
                for name in models:
                    client.load(name, tier="gpu")
                layouts = write_layouts(client, models, repository, work)
                for name in models:
                    warm_serve(client, name, paths[name], log)
                bw = sample("bandwidth", "-", "-", layouts[memory_model], socket)
                log(f"host -> device: pageable {bw['pageable_gb_s']:.1f} GB/s, pinned {bw['pinned_gb_s']:.1f} GB/s")
                promotion = measure_promotion(client, models, layouts, 3, log)
                samples = measure_latency(client, socket, paths, layouts, floor, args.modes, runs, log)
                memory = []
                if counts != [0]:
                    # In use with every model demoted: the daemon's own context and whatever else runs here.
                    # What follows is counted from there: the daemon's copy of the weights, then the clients.
                    for m in client.list():
                        if m["gpu"]:
                            demote(client, m["name"])
                    time.sleep(1.0)
                    idle = nvml.used_bytes(gpu_tier["device"])
                    memory = measure_memory(client, nvml, gpu_tier["device"], idle, socket, memory_model,
                                            paths[memory_model], layouts[memory_model], floor, counts, log)
    data = {"device": device, "samples": samples, "memory": memory, "promotion": promotion, "bandwidth": bw}
    report(data)
    log(f"benchmark took {time.monotonic() - t0:.0f} s")
    save_results(args.out, "coldstart", ["--device", "cuda", *(argv or [])], data, report)
    if args.out:
        out = Path(args.out)
        with open(out / "samples-cuda.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(samples[0]))
            w.writeheader()
            w.writerows(samples)
        plot(data, out)
    return 0
