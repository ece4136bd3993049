"""Response cache: Triton 2.51's (its native C++ fronts and ONNX Runtime backend, its `local` cache) against
modelcache's, each with its cache on and off, the same model, the same Triton repository and the same client load.

    python benchmarks/responsecache/run.py [--models resnet50 tiny-cnn] [--clients 4] [--distinct 64 0]
                                           [--zipf 1.0] [--seed 0] [--cache-size 256M] [--rounds 3]
                                           [--seconds 6] [--warmup 2] [--triton-malloc glibc|jemalloc]
                                           [--quick] [--out DIR]

One model at a time (each of --models in turn) in a Triton repository of its own: MODEL/1/model.onnx (the zoo's
model) and a config.pbtxt of `backend: "onnxruntime"`, `max_batch_size: 0` with the model's inputs and outputs
spelled out (left out, both Triton's and modelcache's autocomplete would turn max_batch_size 0 into 4 with dynamic
batching: here no scheduler batches, every miss runs alone), one CPU instance with one intra-op thread (the tuned
Triton of benchmarks/grpc/peers) and `response_cache { enable: true }`. All four systems serve that repository;
on and off is the server's setting:

  triton-on        tritonserver --cache-config local,size=SIZE --cache-directory <pytriton's caches folder>
  triton-off       tritonserver without --cache-config (it then serves a model asking for the cache uncached)
  modelcache-on    `modelcache daemon` importing the repository (MODELCACHE_TRITON_REPOSITORY), its gRPC front on
                   MODELCACHE_GRPC_PORT, MODELCACHE_RESPONSE_CACHE_SIZE=SIZE
  modelcache-off   the same with MODELCACHE_RESPONSE_CACHE_SIZE=0

Triton is started with ../shared/peers/triton-native/serve.sh's flags (loopback, --model-control-mode=none,
--strict-readiness, no metrics, no pinned or CUDA pools), glibc's malloc as serve.sh leaves it (--triton-malloc
jemalloc: LD_PRELOAD benchmarks/systems/triton.py's jemalloc()). modelcache runs its defaults otherwise. Each
server runs in a memory cgroup of its own where one can be made (root), all four started before the first round
and kept across rounds and workloads. Before round 0 each server gets --warmup seconds of the same clients with
fresh inputs (not reported): its fronts and session warm, no pool input cached. A cache filled in round 0
stays filled after it (the steady state a cache is for); round 0's windows, with the pool's misses, are in
results.json.

Load: --clients processes, each a closed loop of tritonclient.grpc infer calls, batch 1. With --distinct K, each
request's input is one of K fixed random inputs (the same K for every client, system and round: --seed), picked
by a Zipf(--zipf) law over them (the i-th input's weight 1/i^s), each client its own seeded sequence; with
--distinct 0 every request's input is fresh (all misses: what the cache costs when it never helps). Each
workload, system and round is one window of --seconds; in each round the workloads in turn, and within one the
four systems in an order rotated round by round, only one under load at a time.

Per window: requests/s, p50 and p99 latency, the server's own cache hits and misses (ModelStatistics:
inference_stats.cache_hit / cache_miss, the window's difference), the server's CPU time a request (every process
of its tree, /proc: user + system, over the window) and, after the model's rounds, each server's memory (its
cgroup's working set: resident memory less page cache, shared memory included; without a cgroup, the tree's
PSS). Every answer to a pool input is compared with the first answer that system gave for that input (bitwise)
and that first answer with plain ONNX Runtime's in this process (within 1e-3); sampled fresh inputs are checked
against ORT too. A difference is a wrong answer: the run says so and exits 1.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SYSTEMS = ("triton-on", "triton-off", "modelcache-on", "modelcache-off")
MiB = 1 << 20
FRESH_SAMPLES = 8          # fresh inputs a client keeps (with their answers) to check against ORT, per window
WARM_CALLS = 3             # each client's calls with fresh inputs before a window's clock starts


# ---- the client process --------------------------------------------------------------------------------------

def pool_inputs(shape: list, distinct: int, seed: int):
    """The K pool inputs every client, system and round shares (and the parent's ORT check recomputes)."""
    import numpy as np
    rng = np.random.default_rng([seed, 7])
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(distinct)]


def fresh_input(base, head):
    """A fresh input: the base with its first 4 values replaced (a new input for any cache keyed on its bytes)."""
    x = base.copy()
    x.reshape(-1)[:4] = head
    return x


def zipf_picks(distinct: int, s: float, rng, n: int):
    import numpy as np
    w = 1.0 / np.arange(1, distinct + 1) ** s
    return rng.choice(distinct, size=n, p=w / w.sum())


def worker(spec: dict) -> None:
    """One client: warm, say READY, read the common end time from stdin, call until then; print what it saw."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    c = grpcclient.InferenceServerClient(spec["address"])
    shape, name, out_name, k = spec["shape"], spec["input"], spec["output"], spec["distinct"]

    def request(x):
        i = grpcclient.InferInput(name, list(x.shape), "FP32")
        i.set_data_from_numpy(x)
        return i

    own = np.random.default_rng()          # unseeded: warm-up and fresh inputs no other window has sent
    if k:
        pool = [request(x) for x in pool_inputs(shape, k, spec["seed"])]
        picks = zipf_picks(k, spec["zipf"], np.random.default_rng([spec["seed"], spec["round"], spec["client"]]),
                           1 << 18)
    else:
        base = pool_inputs(shape, 1, spec["seed"])[0]
    for _ in range(WARM_CALLS):            # connected and warm before the clock (misses outside the pool)
        c.infer(spec["model"], [request(own.standard_normal(shape).astype(np.float32))])
    print("READY", flush=True)
    end = float(sys.stdin.readline())
    lat, first, wrong, samples, n = [], {}, [], [], 0
    cpu = time.process_time()
    while time.time() < end:
        if k:
            idx = int(picks[n % len(picks)])
            inp = pool[idx]
        else:
            head = own.standard_normal(4).astype(np.float32)
            inp = request(fresh_input(base, head))
        t0 = time.perf_counter()
        out = c.infer(spec["model"], [inp], priority=spec.get("priority", 0)).as_numpy(out_name)
        lat.append((time.perf_counter() - t0) * 1e6)
        if k:
            seen = first.get(idx)
            if seen is None:
                first[idx] = out.copy()
            elif not np.array_equal(out, seen):
                wrong.append({"input": idx, "request": n, "max_abs_diff": float(np.max(np.abs(out - seen)))})
        elif len(samples) < FRESH_SAMPLES and n % 37 == 0:
            samples.append({"head": head.tolist(), "output": base64.b64encode(out.tobytes()).decode(),
                            "shape": list(out.shape)})
        n += 1
    cpu = time.process_time() - cpu
    c.close()
    print(json.dumps({"latency_us": lat, "cpu_s": cpu, "wrong": wrong[:20], "wrong_count": len(wrong),
                      "first": {i: base64.b64encode(v.tobytes()).decode() for i, v in first.items()},
                      "out_shape": list(next(iter(first.values())).shape) if first else None,
                      "fresh_samples": samples}), flush=True)


# ---- the servers ---------------------------------------------------------------------------------------------

class Server:
    """A server process (its own session) in a memory cgroup of its own where one can be made: `label`, its gRPC
    port; its CPU time and memory read over its process tree. As benchmarks/instances/run.py's, with a fallback
    where there is no cgroup."""

    def __init__(self, label: str, cmd: list, env: dict, grpc_port: int, log: Path, cwd: Path | None = None):
        from modelcache import memlimit
        self.label, self.grpc_port, self.log = label, grpc_port, log
        self.successes = None              # its statistics' success count after the last window (settled_stats)
        self.cg = memlimit.ChildCgroup.make(f"mc-responsecache-{label}-{os.getpid()}", 64 << 30)
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=f, cwd=cwd,
                                         preexec_fn=self.cg.enter if self.cg else None, start_new_session=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def wait_ready(self, model: str, timeout_s: float = 300) -> None:
        import tritonclient.grpc as grpcclient
        client = grpcclient.InferenceServerClient(self.address)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.label} exited: status {self.proc.returncode}; its log {self.log}:\n"
                                       f"{self.log.read_text()[-3000:]}")
                try:
                    if client.is_model_ready(model):
                        return
                except Exception:
                    pass
                time.sleep(0.3)
            raise RuntimeError(f"{self.label}: {model} not ready after {timeout_s:.0f} s; its log {self.log}")
        finally:
            client.close()

    def tree(self) -> list:
        import psutil
        try:
            p = psutil.Process(self.proc.pid)
            return [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def cpu_s(self) -> float:
        """CPU time (user + system, every thread) so far of the server and its live descendants."""
        import psutil
        total = 0.0
        for p in self.tree():
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    def memory_mib(self) -> tuple[float, str]:
        from modelcache import memlimit
        if self.cg is not None:
            return memlimit.working_set_bytes(self.cg.limit) / MiB, "cgroup working set"
        import psutil
        pss = 0
        for p in self.tree():
            try:
                pss += p.memory_full_info().pss
            except psutil.Error:
                pass
        return pss / MiB, "PSS of the process tree"

    def stop(self) -> None:
        from benchmarks.instances.run import stop_group
        stop_group(self.proc)
        if self.label.startswith("modelcache"):   # what a daemon killed hard could not clean
            import shutil
            shutil.rmtree(f"/dev/shm/modelcache.{os.getuid()}.{self.proc.pid}", ignore_errors=True)
        if self.cg is not None:
            for _ in range(50):                    # (a cgroup empties a moment after its last process exits)
                try:
                    self.cg.remove()
                    break
                except OSError:
                    time.sleep(0.1)


def start_triton(label: str, repo: Path, cache_bytes: int | None, malloc: str, work: Path,
                 control: str = "none", metrics_port: int | None = None) -> Server:
    """Triton on `repo`; `control`: its --model-control-mode (explicit: nothing loaded until a load asks);
    `metrics_port`: its metrics there, CPU metrics on, GPU's off (as serve.sh's METRICS_PORT); else none."""
    from benchmarks.systems.triton import jemalloc, peer_paths
    paths = peer_paths()
    grpc, http = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["LD_LIBRARY_PATH"] = f"{paths['backends'] / 'onnxruntime'}:{paths['pylib']}"
    if malloc == "jemalloc":
        found = jemalloc()
        if found is None:
            raise RuntimeError("--triton-malloc jemalloc: no jemalloc here (benchmarks/systems/triton.py jemalloc())")
        env["LD_PRELOAD"] = found
    argv = [str(paths["server"]), f"--model-repository={repo}", f"--model-control-mode={control}",
            "--strict-readiness=true", f"--backend-directory={paths['backends']}",
            "--http-address=127.0.0.1", f"--http-port={http}", "--grpc-address=127.0.0.1", f"--grpc-port={grpc}",
            *(["--allow-metrics=false"] if metrics_port is None else
              ["--allow-metrics=true", "--allow-gpu-metrics=false", "--allow-cpu-metrics=true",
               "--metrics-address=127.0.0.1", f"--metrics-port={metrics_port}"]),
            "--allow-sagemaker=false", "--allow-vertex-ai=false",
            "--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0", "--exit-timeout-secs=5",
            "--log-verbose=0"]
    if cache_bytes is not None:
        # Triton looks for libtritoncache_local.so under /opt/tritonserver/caches by default: pytriton's wheel
        # has it in its own tree, beside bin/.
        argv += [f"--cache-config=local,size={cache_bytes}",
                 f"--cache-directory={Path(paths['server']).parents[1] / 'caches'}"]
    return Server(label, argv, env, grpc, work / f"{label}.log")


def start_modelcache(label: str, repo: Path, cache_bytes: int, work: Path, extra_env: dict | None = None,
                     checkout: Path | None = None) -> Server:
    """`modelcache daemon` importing the Triton repository `repo`; `checkout`: another checkout's package (run from
    there, with it first on the path), for a side-by-side run against a baseline."""
    home = work / label
    home.mkdir()
    grpc = free_port()
    env = {**os.environ, "MODELCACHE_SOCKET": f"ipc://{home}/d.sock", "MODELCACHE_REPOSITORY": str(home / "repo"),
           "MODELCACHE_CONFIG": "", "MODELCACHE_TRITON_REPOSITORY": str(repo), "MODELCACHE_GRPC_PORT": str(grpc),
           "MODELCACHE_RESPONSE_CACHE_SIZE": str(cache_bytes), **(extra_env or {})}
    if checkout is not None:
        env["PYTHONPATH"] = str(checkout)
    return Server(label, [sys.executable, "-m", "modelcache.cli", "daemon"], env, grpc, work / f"{label}.log",
                  cwd=checkout)


def free_port() -> int:
    from benchmarks.systems.triton import free_port as port
    return port()


def write_repository(repo: Path, model: str, onnx_path: Path, max_batch_size: int = 0,
                     response_cache: bool = True) -> dict:
    """repo/MODEL/{config.pbtxt, 1/model.onnx}; the model's first input and output (name, shape at batch 1). With
    `max_batch_size` > 0 the model's first dimension is the batch's, left out of the dims."""
    import onnx
    types = {onnx.TensorProto.FLOAT: "TYPE_FP32"}
    g = onnx.load(str(onnx_path), load_external_data=False).graph
    init = {i.name for i in g.initializer}
    ins = [v for v in g.input if v.name not in init]

    def dims(v, batch=False):
        return [d.dim_value if d.dim_value > 0 else -1 for d in v.type.tensor_type.shape.dim][batch:]

    def io(vs):
        for v in vs:
            if v.type.tensor_type.elem_type not in types:
                raise SystemExit(f"{model}: {v.name} is not float32; this benchmark sends FP32 inputs")
        return ",\n".join(f'  {{ name: "{v.name}" data_type: {types[v.type.tensor_type.elem_type]} '
                          f'dims: {dims(v, max_batch_size > 0)} }}' for v in vs)
    if len(ins) != 1:
        raise SystemExit(f"{model}: {len(ins)} inputs; this benchmark sends one")
    (repo / model / "1").mkdir(parents=True)
    (repo / model / "1" / "model.onnx").symlink_to(onnx_path)
    (repo / model / "config.pbtxt").write_text(
        f'name: "{model}"\nbackend: "onnxruntime"\nmax_batch_size: {max_batch_size}\n'
        f"input [\n{io(ins)}\n]\noutput [\n{io(g.output)}\n]\n"
        'instance_group [ { kind: KIND_CPU count: 1 } ]\n'
        'parameters { key: "intra_op_thread_count" value: { string_value: "1" } }\n' +
        ('response_cache { enable: true }\n' if response_cache else ''))
    return {"input": ins[0].name, "output": g.output[0].name, "shape": [d if d > 0 else 1 for d in dims(ins[0])]}


# ---- one window ----------------------------------------------------------------------------------------------

def cache_stats(server: Server, model: str) -> dict:
    import tritonclient.grpc as grpcclient
    c = grpcclient.InferenceServerClient(server.address)
    try:
        s = c.get_inference_statistics(model, as_json=True)["model_stats"][0]
    finally:
        c.close()
    st = s.get("inference_stats", {})
    count = lambda key: int(st.get(key, {}).get("count", 0))   # noqa: E731  (an empty stat: {} in JSON)
    return {"hits": count("cache_hit"), "misses": count("cache_miss"), "success": count("success"),
            "executions": int(s.get("execution_count", 0))}


def settled_stats(server: Server, model: str, success: int, timeout_s: float = 5.0) -> dict:
    """The statistics once they count `success` successes: modelcache's fronts report what they answered
    themselves (their own cache, a model they run) once a second."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = cache_stats(server, model)
        if stats["success"] >= success or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def window(server: Server, model: str, io: dict, workload: int, args, rnd: int, seconds: float | None = None,
           clients: list | None = None) -> dict:
    """One window of closed-loop clients started together: `args.clients` alike, or one per item of `clients`, each
    its settings over the common ones (e.g. its `priority`); `_runs` holds each client's run, in that order."""
    seconds = args.seconds if seconds is None else seconds
    clients = [{} for _ in range(args.clients)] if clients is None else clients
    spec = {"address": server.address, "model": model, **io, "distinct": workload, "zipf": args.zipf,
            "seed": args.seed, "round": rnd}
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker",
                               json.dumps({**spec, "client": i, **own})],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for i, own in enumerate(clients)]
    try:
        for p in procs:            # every client imported, connected and warm before the clock starts
            if p.stdout.readline().strip() != "READY":
                raise RuntimeError(f"{server.label}: a client did not start (status {p.wait()})")
        # (the clients' warm calls counted first: a modelcache front reports what it answered a second later)
        before = cache_stats(server, model) if server.successes is None else \
            settled_stats(server, model, server.successes + WARM_CALLS * len(procs))
        cpu = server.cpu_s()
        end = time.time() + seconds
        for p in procs:
            p.stdin.write(f"{end!r}\n")
            p.stdin.flush()
        time.sleep(max(0.0, end - time.time()))
        cpu = server.cpu_s() - cpu
        runs = []
        for p in procs:
            out, _ = p.communicate(timeout=120)
            if p.returncode != 0:
                raise RuntimeError(f"{server.label}: a client failed (status {p.returncode})")
            runs.append(json.loads(out.strip().splitlines()[-1]))
        after = settled_stats(server, model, before["success"] + sum(len(r["latency_us"]) for r in runs))
        server.successes = after["success"]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    figures = latency_figures(runs, seconds)
    n = figures["requests"]
    d = {k: after[k] - before[k] for k in after}
    return {**figures, "cache_hits": d["hits"], "cache_misses": d["misses"], "server_success": d["success"],
            "server_executions": d["executions"],
            "hit_ratio": d["hits"] / (d["hits"] + d["misses"]) if d["hits"] + d["misses"] else None,
            "server_cpu_ms_per_request": cpu / n * 1e3 if n else None,
            "client_cpu_ms_per_request": sum(r["cpu_s"] for r in runs) / n * 1e3 if n else None,
            "_runs": runs}


def latency_figures(runs: list, seconds: float) -> dict:
    """Requests, requests/s, p50 and p99 (ms) of the clients' `runs` over a window of `seconds`."""
    lat = sorted(v for r in runs for v in r["latency_us"])
    n = len(lat)
    pct = lambda q: lat[min(n - 1, int(q * n))] / 1e3 if lat else None   # noqa: E731
    return {"requests": n, "requests_s": n / seconds, "p50_ms": pct(0.5), "p99_ms": pct(0.99)}


class WrongAnswer(Exception):
    pass


class Checker:
    """Every system's answers: each pool input's answers bitwise equal to the first that system gave for it, that
    first answer (and sampled fresh ones) equal to plain ORT's within 1e-3."""

    def __init__(self, onnx_path: Path, io: dict, seed: int):
        import onnxruntime as ort
        self.sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        self.io, self.seed = io, seed
        self.truth: dict = {}                 # pool index -> ORT's output
        self.first: dict = {}                 # system -> {pool index: first answer}
        self.pools: dict = {}
        self.checked = self.worst = 0.0
        self.answers = 0

    def ort(self, x):
        return self.sess.run([self.io["output"]], {self.io["input"]: x})[0]

    def close_enough(self, got, want) -> bool:
        import numpy as np
        diff = float(np.max(np.abs(got - want))) if got.shape == want.shape else float("inf")
        self.worst = max(self.worst, diff)
        return diff <= 1e-3 * max(1.0, float(np.max(np.abs(want))))

    def check(self, system: str, workload: int, rnd: int, row: dict) -> None:
        import numpy as np
        runs = row.pop("_runs")
        where = f"{system}, round {rnd}, {'fresh inputs' if not workload else f'{workload} distinct inputs'}"
        self.answers += row["requests"]
        for r in runs:
            if r["wrong_count"]:
                raise WrongAnswer(f"{where}: {r['wrong_count']} answers differ from that input's first answer, "
                                  f"e.g. {r['wrong'][:3]}")
            if workload:
                pool = self.pools.setdefault(workload, pool_inputs(self.io["shape"], workload, self.seed))
                mine = self.first.setdefault((system, workload), {})
                for i, b64 in r["first"].items():
                    got = np.frombuffer(base64.b64decode(b64), np.float32).reshape(r["out_shape"])
                    i = int(i)
                    if i in mine and not np.array_equal(got, mine[i]):
                        raise WrongAnswer(f"{where}: pool input {i} answered differently from this system's first "
                                          f"answer to it (max abs diff {np.max(np.abs(got - mine[i])):.3g})")
                    mine.setdefault(i, got)
                    if (workload, i) not in self.truth:
                        self.truth[(workload, i)] = self.ort(pool[i])
                    if not self.close_enough(got, self.truth[(workload, i)]):
                        raise WrongAnswer(f"{where}: pool input {i}: the answer is not ORT's (max abs diff "
                                          f"{np.max(np.abs(got - self.truth[(workload, i)])):.3g})")
            else:
                base = pool_inputs(self.io["shape"], 1, self.seed)[0]
                for s in r["fresh_samples"]:
                    got = np.frombuffer(base64.b64decode(s["output"]), np.float32).reshape(s["shape"])
                    want = self.ort(fresh_input(base, np.asarray(s["head"], np.float32)))
                    if not self.close_enough(got, want):
                        raise WrongAnswer(f"{where}: a fresh input's answer is not ORT's (max abs diff "
                                          f"{np.max(np.abs(got - want)):.3g})")
                    self.checked += 1


# ---- the run ---------------------------------------------------------------------------------------------------

def size_bytes(text: str) -> int:
    from modelcache.config import parse_size
    return parse_size(text)


def run_model(model: str, systems: list, args, work: Path, results: dict) -> None:
    from modelcache import zoo
    mwork = work / model
    mwork.mkdir()
    onnx_path = mwork / f"{model}.onnx"
    zoo.save(zoo.build(model), str(onnx_path))
    repo = mwork / "triton-repo"
    io = write_repository(repo, model, onnx_path)
    checker = Checker(onnx_path, io, args.seed)
    cache = size_bytes(args.cache_size)
    servers: dict = {}
    try:
        for label in systems:      # all started at once (Triton loads in C++, the daemons import the repository)
            on = label.endswith("-on")
            if label.startswith("triton"):
                servers[label] = start_triton(label, repo, cache if on else None, args.triton_malloc, mwork)
            else:
                servers[label] = start_modelcache(label, repo, cache if on else 0, mwork)
        for s in servers.values():
            s.wait_ready(model)
        print(f"{model}: {', '.join(systems)} ready", file=sys.stderr, flush=True)
        if args.warmup > 0:        # untimed, fresh inputs: the fronts and sessions warm, no pool input cached
            for label in systems:
                row = window(servers[label], model, io, 0, args, -1, args.warmup)
                checker.check(label, 0, -1, row)
                results["warmup"].append({"model": model, "system": label, **row})
        for rnd in range(args.rounds):
            for workload in args.distinct:
                order = systems[rnd % len(systems):] + systems[:rnd % len(systems)]
                for label in order:
                    row = window(servers[label], model, io, workload, args, rnd)
                    checker.check(label, workload, rnd, row)
                    row = {"model": model, "distinct": workload, "round": rnd, "system": label, **row}
                    results["windows"].append(row)
                    print(f"{model} {workload or 'fresh'} round {rnd} {label}: {row['requests_s']:.1f} req/s, "
                          f"p50 {row['p50_ms']:.2f} ms, p99 {row['p99_ms']:.2f} ms, hits {row['cache_hits']}, "
                          f"misses {row['cache_misses']}, server CPU {row['server_cpu_ms_per_request']:.3f} ms/req",
                          file=sys.stderr, flush=True)
        for label, s in servers.items():
            mib, how = s.memory_mib()
            results["memory_mib"].setdefault(model, {})[label] = mib
            results["memory_how"] = how
        says = [line.split(": ", 1)[-1] for s in servers.values() if s.label.startswith("modelcache")
                for line in s.log.read_text(errors="replace").splitlines() if "not honour" in line]
        results["modelcache_says"][model] = sorted(set(says))
        results["checks"][model] = {"answers": checker.answers, "fresh_samples_checked": int(checker.checked),
                                    "pool_inputs_checked": len(checker.truth),
                                    "max_abs_diff_vs_ort": checker.worst}
    finally:
        for s in servers.values():
            s.stop()


def ratios(windows: list, model: str, workload: int, num: str, den: str, key: str) -> list:
    by = {(w["round"], w["system"]): w for w in windows if w["model"] == model and w["distinct"] == workload}
    rounds = sorted({r for r, _ in by})
    return [by[(r, num)][key] / by[(r, den)][key] for r in rounds
            if (r, num) in by and (r, den) in by and by[(r, num)][key] and by[(r, den)][key]]


def report(results: dict, out=sys.stdout) -> None:
    from modelcache.measure import summary
    a = results["args"]
    print(f"{a['clients']} tritonclient.grpc client processes, closed loop, batch 1; inputs: Zipf({a['zipf']}) over "
          f"K fixed random ones (seed {a['seed']}), or fresh every request (K = 0); {a['seconds']:g} s a window, "
          f"{a['rounds']} rounds, systems rotated each round; servers started once per model and kept across "
          f"rounds after {a['warmup']:g} s of fresh inputs each (round 0's windows fill the caches with the pool); "
          f"cache size {a['cache_size']} both sides; Triton's malloc "
          f"{a['triton_malloc']}. Medians over rounds [min-max].", file=out)
    if results.get("skipped"):
        print(results["skipped"], file=out)
    print(f"{'model':<9} {'K':>5} {'system':<15} {'req/s':>22} {'p50 ms':>20} {'p99 ms':>20} {'hit ratio':>18} "
          f"{'hits/misses':>16} {'server CPU ms/req':>22} {'memory MiB':>10}", file=out)
    ws = results["windows"]
    for model in results["models"]:
        for workload in a["distinct"]:
            for system in results["systems"]:
                rows = [w for w in ws if w["model"] == model and w["distinct"] == workload and w["system"] == system]
                if not rows:
                    continue
                col = lambda key: [r[key] for r in rows if r[key] is not None]   # noqa: E731
                hits, misses = sum(r["cache_hits"] for r in rows), sum(r["cache_misses"] for r in rows)
                mem = results["memory_mib"].get(model, {}).get(system)
                print(f"{model:<9} {workload or 'fresh':>5} {system:<15} {summary(col('requests_s')):>22} "
                      f"{summary(col('p50_ms'), '.2f'):>20} {summary(col('p99_ms'), '.2f'):>20} "
                      f"{summary(col('hit_ratio'), '.3f'):>18} {f'{hits}/{misses}':>16} "
                      f"{summary(col('server_cpu_ms_per_request'), '.3f'):>22} "
                      f"{'-' if mem is None else f'{mem:.0f}':>10}", file=out)
    print("per-round ratios, median [min-max] (requests/s; p99):", file=out)
    pairs = [("modelcache-on", "triton-on"), ("modelcache-off", "triton-off"), ("triton-on", "triton-off"),
             ("modelcache-on", "modelcache-off")]
    for model in results["models"]:
        for workload in a["distinct"]:
            cells = []
            for num, den in pairs:
                rps = ratios(ws, model, workload, num, den, "requests_s")
                p99 = ratios(ws, model, workload, num, den, "p99_ms")
                if rps:
                    cells.append(f"{num}/{den} x{summary(rps, '.2f')}; x{summary(p99, '.2f')}")
            if cells:
                print(f"  {model} K={workload or 'fresh'}: " + " | ".join(cells), file=out)
    if a["rounds"] > 1 and any(a["distinct"]):
        print("K > 0 from round 1 on (round 0's misses left out; a slow model's pool may still be filling), "
              "median [min-max] (requests/s; p99 ms):", file=out)
        for model in results["models"]:
            for workload in [k for k in a["distinct"] if k]:
                later = [w for w in ws if w["model"] == model and w["distinct"] == workload and w["round"] >= 1]
                cells = []
                for system in results["systems"]:
                    rows = [w for w in later if w["system"] == system]
                    if rows:
                        missed = f" ({sum(r['cache_misses'] for r in rows)} misses)" if system.endswith("-on") else ""
                        cells.append(f"{system} {summary([r['requests_s'] for r in rows])}; "
                                     f"{summary([r['p99_ms'] for r in rows], '.2f')}{missed}")
                rps = ratios(later, model, workload, "modelcache-on", "triton-on", "requests_s")
                p99 = ratios(later, model, workload, "modelcache-on", "triton-on", "p99_ms")
                if rps:
                    cells.append(f"modelcache-on/triton-on x{summary(rps, '.2f')}; x{summary(p99, '.2f')}")
                print(f"  {model} K={workload}: " + " | ".join(cells), file=out)
    neither = {}
    for w in ws:
        if w["system"].endswith("-on"):
            key = (w["model"], w["system"])
            neither[key] = neither.get(key, 0) + w["requests"] - w["cache_hits"] - w["cache_misses"]
    if neither:
        print("requests the server counted neither a hit nor a miss (Triton counts a miss when it inserts the answer, "
              "so a second miss of an input already being computed is neither): " +
              ", ".join(f"{m} {s} {n}" for (m, s), n in neither.items()), file=out)
    print(f"memory: {results.get('memory_how', '-')}, after each model's rounds", file=out)
    for model, c in results["checks"].items():
        print(f"answers checked, {model}: {c['answers']} answers, every pool answer bitwise equal to its system's "
              f"first; {c['pool_inputs_checked']} pool inputs and {c['fresh_samples_checked']} fresh samples against "
              f"plain ORT, max abs diff {c['max_abs_diff_vs_ort']:.3g}; wrong answers: 0", file=out)
    for model, says in results["modelcache_says"].items():
        for line in says:
            print(f"modelcache said ({model}): {line}", file=out)
    if results.get("failure"):
        print(f"FAILED: {results['failure']}", file=out)


def built_systems(systems) -> tuple[list, str | None]:
    """(the systems to run, why some are not): the Triton ones left out, with a line, where its peer is not built."""
    from benchmarks.systems.triton import PEER, peer_paths
    if peer_paths() is not None:
        return list(systems), None
    skipped = f"Triton systems skipped: no Triton peer built here (run {PEER}/build.sh)"
    print(skipped, flush=True)
    return [s for s in systems if not s.startswith("triton")], skipped


def run_and_report(bench: str, argv: list, results: dict, report, run) -> int:
    """run(a temporary work folder), timed (results["wall_s"]), then report(results) printed and saved with
    results.json in --out (results["args"]["out"]); the status: 1 where an answer was wrong (results["failure"])."""
    from modelcache.measure import save_results
    started = time.monotonic()
    rc = 0
    with tempfile.TemporaryDirectory(prefix=f"mc-{bench}-") as tmp:
        try:
            run(Path(tmp))
        except WrongAnswer as e:
            results["failure"] = f"wrong answer: {e}"
            print(f"WRONG ANSWER: {e}", file=sys.stderr)
            rc = 1
    results["wall_s"] = time.monotonic() - started
    report(results)
    save_results(results["args"]["out"], bench, argv, results, report, command=f"python benchmarks/{bench}/run.py")
    return rc


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(json.loads(argv[1]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["resnet50", "tiny-cnn"], help="zoo models, one at a time")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--distinct", nargs="+", type=int, default=[64, 0],
                    help="workloads: K distinct inputs picked by Zipf, 0 = every input fresh (default 64 0)")
    ap.add_argument("--zipf", type=float, default=1.0, help="the Zipf exponent s (default 1.0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-size", default="256M", help="both systems' cache (default 256M)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--warmup", type=float, default=2.0,
                    help="seconds of fresh inputs each server gets before round 0, not reported (default 2)")
    ap.add_argument("--triton-malloc", choices=("glibc", "jemalloc"), default="glibc")
    ap.add_argument("--quick", action="store_true",
                    help="the test's run: tiny-cnn, 1 round, 1.5 s, 2 clients (Triton skipped where not built)")
    ap.add_argument("--out", help="write OUT/report.txt (the command first) and OUT/results.json (every window)")
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.rounds, args.seconds, args.clients, args.warmup = ["tiny-cnn"], 1, 1.5, 2, 0.5
    if str(ROOT) not in sys.path:      # benchmarks.systems (run as a script from anywhere)
        sys.path.insert(0, str(ROOT))
    from modelcache.measure import compile_bytecode
    compile_bytecode()
    systems, skipped = built_systems(SYSTEMS)
    results = {"args": vars(args), "systems": systems, "models": args.models, "skipped": skipped, "windows": [],
               "warmup": [],
               "memory_mib": {}, "modelcache_says": {}, "checks": {}, "failure": None}
    return run_and_report("responsecache", argv, results, report,
                          lambda work: [run_model(model, systems, args, work, results) for model in args.models])


if __name__ == "__main__":
    sys.exit(main())
