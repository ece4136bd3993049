"""Triton's protocols served by modelcache, side by side with their peers: Triton itself (its C++ fronts and ONNX
Runtime backend), KServe's Python server, and another modelcache checkout; the same stock client (tritonclient),
the same closed-loop load, then optionally Triton's own load generator (perf_analyzer).

    python benchmarks/grpc/run.py [--models tiny-cnn resnet50] [--clients 1 4] [--seconds 5] [--rounds 3]
                                  [--triton] [--baseline CHECKOUT [--baseline-label base] [--baseline-env N=V ...]]
                                  [--kserve-python /path/to/venv/bin/python [--kserve-no-spin]]
                                  [--servers SERVER ...] [--perf-analyzer [only]] [--out DIR]

A daemon of its own (in a temporary directory, default settings) serves the zoo models; `modelcache grpc` and
`modelcache http` run in front of it on free loopback ports. Each server, model and client count is one closed
loop: N client processes, each calling tritonclient's infer (batch 1, inputs and outputs raw/binary) as fast as
answers come, for --seconds. Rounds alternate the servers' order, so every server sees the same machine; the
report gives each figure's median over the rounds and its spread [min-max], and modelcache's figure over each
peer's on the same protocol, round by round. Beside requests/s and latency, the CPU time (/proc, user + system)
a request cost each server process (and its busiest threads) and the clients, over the clients' window: where
clients and servers share the cores, their ratio bounds the requests/s ratio. Last, issue 46's goals, each
against this run's figures.

  modelcache-grpc     tritonclient.grpc -> `modelcache grpc` -> the daemon's serve lane
  modelcache-http     tritonclient.http (binary tensors) -> `modelcache http` -> the daemon's serve lane
  base-grpc, -http    (--baseline CHECKOUT) the same from another checkout's code (PYTHONPATH, as ab.py runs
                      two): a daemon and fronts of its own, the same models; to A/B a change in the same rounds
  triton-grpc, -http  (--triton) Triton 2.51, its C++ fronts -> its C++ ONNX Runtime backend, one process
                      (../shared/peers/triton-native/serve.sh, one server a model): Triton's defaults on CPU
                      (2 instances, dynamic batching up to 4, ORT's own thread counts)
  triton-tuned-grpc, -http  (--triton) the same as a tuned CPU deployment: INSTANCES=1 INTRA_OP=1
  kserve-grpc, -http  (--kserve-python VENV_PYTHON: a venv with `kserve` and `onnxruntime`) tritonclient ->
                      KServe's ModelServer (grpc.aio; FastAPI over uvicorn, binary tensors) -> plain ORT in its
                      process (kserve_peer.py); --kserve-no-spin: its ORT threads block between runs

  SERVER.shm          (--shared-memory: modelcache-* and triton-*, e.g. modelcache.shm-http) the same server and
                      client with the input and output in system shared memory (Triton's extension): each client
                      writes its input into a region of its own and reads the output from another, every call;
                      the request names the regions. perf_analyzer: --shared-memory system

--servers picks some of them (a Triton server named there needs no --triton). With --perf-analyzer, after the
closed loops (or instead of them: `--perf-analyzer only`), perf_analyzer runs against each server over its
protocol at each --clients concurrency, the servers alternating round by round, its windows bounded by
--pa-interval-ms and --pa-trials; the report gives its infer/s, p50 and p99 and the same ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import shutil
import tempfile
import time
from pathlib import Path

from modelcache.usage import Parser

PROTOCOLS = ("grpc", "http")
SHM = ".shm"                   # a server's variant with its tensors in system shared memory: FAMILY.shm-PROTOCOL
OUTPUT_REGION_BYTES = 1 << 20  # the output's region, at least any zoo model's output
# Triton's two configurations, as serve.sh's environment: its defaults on CPU, and a tuned CPU deployment.
TRITON_CONFIGS = {"triton": {"INSTANCES": "", "INTRA_OP": ""}, "triton-tuned": {"INSTANCES": "1", "INTRA_OP": "1"}}
# (the project's shared folder sits beside the repository)
TRITON_SERVE = str(Path(__file__).resolve().parents[3] / "shared" / "peers" / "triton-native" / "serve.sh")
PERF_ANALYZER = f"{os.environ.get('TMPDIR') or '/tmp'}/triton-native/pa"   # (build.sh's: perf_analyzer, its libs)
GOALS = "goals (issue 46): tiny-cnn requests/s >= 0.7x Triton native (its defaults) at 1 and 4 clients, HTTP and " \
        "gRPC; server CPU a tiny-cnn request <= 0.35 ms; tritonclient.grpc p50 at 1 client <= 1.0 ms; ResNet-50 " \
        "at 4 clients >= 1.0x tuned Triton's requests/s with p99 <= its p99; >= 2x KServe's requests/s, its ORT " \
        "not spinning"


def shm_variant(server: str) -> str:
    """modelcache-http -> modelcache.shm-http: the same server, the client's tensors in shared memory."""
    family, protocol = server.rsplit("-", 1)
    return f"{family}{SHM}-{protocol}"


def base_server(server: str) -> str:
    """The server a variant runs on: modelcache.shm-http -> modelcache-http."""
    return server.replace(SHM + "-", "-")


def _caller(server: str, address: str, model: str, x, io: tuple):
    """(call, close): one infer of `x` through tritonclient, returning the first output. A .shm variant writes
    `x` into its input region and reads the output from its output region every call, as such a client does."""
    name, output = io[0], io[1]
    if server.endswith("-http"):
        import tritonclient.http as client
    else:
        import tritonclient.grpc as client
    c = client.InferenceServerClient(address)
    inp = client.InferInput(name, list(x.shape), "FP32")
    outs = [client.InferRequestedOutput(output)]
    if SHM + "-" not in server:
        inp.set_data_from_numpy(x)
        return (lambda: c.infer(model, [inp], outputs=outs).as_numpy(output)), c.close
    import tritonclient.utils.shared_memory as shm
    from tritonclient.utils import triton_to_np_dtype
    handles = []
    for role, size in (("in", x.nbytes), ("out", OUTPUT_REGION_BYTES)):
        key = f"/mc-bench-{os.getpid()}-{role}"
        handles.append(shm.create_shared_memory_region(key[1:], key, size))
        c.unregister_system_shared_memory(key[1:])
        c.register_system_shared_memory(key[1:], key, size)
    inp.set_shared_memory(f"mc-bench-{os.getpid()}-in", x.nbytes)
    outs[0].set_shared_memory(f"mc-bench-{os.getpid()}-out", OUTPUT_REGION_BYTES)

    def call():
        shm.set_shared_memory_region(handles[0], [x])
        out = c.infer(model, [inp], outputs=outs).get_output(output)
        if server.endswith("-http"):
            datatype, shape = out["datatype"], out["shape"]
        else:
            datatype, shape = out.datatype, list(out.shape)
        return shm.get_contents_as_numpy(handles[1], triton_to_np_dtype(datatype), shape).copy()

    def close():   # (its own regions only: a server's registry is every client's)
        from tritonclient.utils import InferenceServerException
        for role in ("in", "out"):
            for attempt in range(50):   # (Triton 2.51 holds a region "in use" a moment after answering)
                try:
                    c.unregister_system_shared_memory(f"mc-bench-{os.getpid()}-{role}")
                    break
                except InferenceServerException:
                    time.sleep(0.01)
        for h in handles:
            shm.destroy_shared_memory_region(h)
        c.close()
    return call, close


def _worker(server: str, address: str, model: str, io: str) -> None:
    """One client of a closed loop: warm, say READY, read the common end time from stdin, call until then; print
    the latencies (us) and this process's CPU time over the loop."""
    import numpy as np
    io = json.loads(io)
    x = np.random.default_rng(os.getpid()).standard_normal(io[2]).astype(np.float32)
    call, close = _caller(server, address, model, x, io)
    for _ in range(3):
        call()
    print("READY", flush=True)
    end, lat, cpu = float(sys.stdin.readline()), [], time.process_time()
    while time.time() < end:
        t0 = time.perf_counter()
        call()
        lat.append((time.perf_counter() - t0) * 1e6)
    cpu = time.process_time() - cpu   # (every thread of this process: grpc's own threads too)
    close()
    print(json.dumps({"latency_us": lat, "cpu_s": cpu}), flush=True)


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))] if v else float("nan")


def _cpu_s(pid: int) -> float:
    """CPU time (user + system) so far of a process and of its descendants: those alive (or not yet reaped) by their
    own counts, those reaped by their parent's (cutime, cstime). Counting only the living, a child that ended in the
    window (the daemon's packing server, idle 30 s) took its time out of the total, which then fell."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")   # utime, stime, cutime, cstime
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += (task / "children").read_text().split()
    return own + sum(_cpu_s(int(c)) for c in children)


def _threads_cpu_s(pid: int) -> dict:
    """CPU time (user + system) so far of each thread of a process, seconds, by "name/tid" ("main" for the first)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:
            continue   # (a thread that ended)
        name = "main" if int(task.name) == pid else f"{stat[stat.index('(') + 1:stat.rindex(')')]}/{task.name}"
        fields = stat.rsplit(")", 1)[1].split()
        out[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def closed_loop(server: str, address: str, model: str, io: tuple, clients: int, seconds: float,
                pids: dict | None = None) -> dict:
    """`clients` processes in a closed loop for `seconds`, started together: requests/s, p50 and p99 (us), and
    the CPU time a request cost the clients and each of the server's processes (`pids`: name -> pid), us."""
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", server, address, model,
                               json.dumps(io)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(clients)]
    try:
        return _measure(server, procs, seconds, pids or {})
    finally:
        for p in procs:   # (on an error or ^C: a client left behind would block on its full stdout)
            if p.poll() is None:
                p.kill()
                p.wait()


def _measure(server: str, procs: list, seconds: float, pids: dict) -> dict:
    for p in procs:   # every client has imported, connected and warmed before the clock starts
        if p.stdout.readline().strip() != "READY":
            raise RuntimeError(f"{server} client did not start (status {p.wait()})")
    cpu = {name: _cpu_s(pid) for name, pid in pids.items()}
    threads = {name: _threads_cpu_s(pid) for name, pid in pids.items()}
    end = time.time() + seconds
    for p in procs:
        p.stdin.write(f"{end!r}\n")
        p.stdin.flush()
    time.sleep(max(0.0, end - time.time()))   # the server's CPU over the clients' window, not their start-up
    cpu = {name: _cpu_s(pid) - cpu[name] for name, pid in pids.items()}
    threads = {name: {t: v - threads[name].get(t, 0.0) for t, v in _threads_cpu_s(pid).items()}
               for name, pid in pids.items()}
    lat, client_cpu = [], 0.0
    for p in procs:
        out, _ = p.communicate(timeout=180)
        if p.returncode != 0:
            raise RuntimeError(f"{server} client failed (status {p.returncode})")
        run = json.loads(out.strip().splitlines()[-1])
        lat += run["latency_us"]
        client_cpu += run["cpu_s"]
    n = max(1, len(lat))
    return {"rps": len(lat) / seconds, "p50_us": _pct(lat, 50), "p99_us": _pct(lat, 99), "requests": len(lat),
            "client_cpu_us": client_cpu / n * 1e6, "server_cpu_us": {k: v / n * 1e6 for k, v in cpu.items()},
            "thread_cpu_us": {k: {t: v / n * 1e6 for t, v in by.items() if v > 0} for k, by in threads.items()}}


def perf_analyzer(pa_dir: str, server: str, address: str, model: str, io: tuple, concurrency: int,
                  interval_ms: int, trials: int, csv_path: Path) -> dict:
    """One run of perf_analyzer (Triton's C++ load generator; sync: `concurrency` threads, a request each at a time,
    batch 1, random inputs) against `server`, over its protocol, until 3 windows of `interval_ms` agree (within
    100%: its default 10% rarely settles on a shared machine) or `trials` windows: its figures (CSV) for the
    last window, infer/s and p50 and p99 in us; {"error": its last line} where it fails."""
    name, _, shape = io
    command = [f"{pa_dir}/perf_analyzer", "-m", model, "-u", address, "-i", server.rsplit("-", 1)[1],
               "--concurrency-range", f"{concurrency}:{concurrency}", "--measurement-interval", str(interval_ms),
               "--max-trials", str(trials), "--stability-percentage", "100", "-f", str(csv_path)]
    if not server.startswith("triton"):   # (serve.sh's max_batch_size 4: -b 1 adds the batch; ours say 0, [-1, ...])
        command += ["--shape", f"{name}:{','.join(map(str, shape))}"]
    if SHM + "-" in server:
        command += ["--shared-memory", "system", "--output-shared-memory-size", str(OUTPUT_REGION_BYTES)]
    csv_path.unlink(missing_ok=True)
    try:
        r = subprocess.run(command, env={**os.environ, "LD_LIBRARY_PATH": pa_dir}, capture_output=True, text=True,
                           timeout=60 + 3 * trials * interval_ms / 1e3)
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    if r.returncode != 0 or not csv_path.exists():
        return {"error": ((r.stdout + r.stderr).strip().splitlines() or [f"status {r.returncode}"])[-1][:200]}
    with open(csv_path) as f:
        row = next(csv.DictReader(f))
    return {"rps": float(row["Inferences/Second"]), "p50_us": float(row["p50 latency"]),
            "p99_us": float(row["p99 latency"]), "csv": row}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_kserve(python: str, paths: dict, log, spin: bool = True) -> tuple[subprocess.Popen, str, str]:
    """The KServe peer serving `paths`: (process, its gRPC host:port, its HTTP host:port)."""
    import tritonclient.grpc as client
    grpc_port, http_port = _free_port(), _free_port()
    peer = Path(__file__).with_name("kserve_peer.py")
    # -I: the peer's own venv only, nothing of ours on its sys.path
    proc = subprocess.Popen([python, "-I", str(peer), "--grpc-port", str(grpc_port), "--http-port", str(http_port),
                             *([] if spin else ["--no-spin"]),
                             *(f"{m}={p}" for m, p in paths.items())], stdout=log, stderr=log,
                            start_new_session=True)   # (its uvicorn and grpc servers stop together on SIGTERM)
    address = f"127.0.0.1:{grpc_port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            c = client.InferenceServerClient(address)
            if all(c.is_model_ready(m) for m in paths):
                c.close()
                return proc, address, f"127.0.0.1:{http_port}"
            c.close()
        except Exception:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the KServe peer did not get ready; see its log")


def _server_order(label: str) -> list[str]:
    """Every server this benchmark knows, in the report's order: gRPC first, ours then its peers."""
    families = ["modelcache", label, *TRITON_CONFIGS]
    return [f"{f}-grpc" for f in families] + ["kserve-grpc"] + [f"{f}-http" for f in families] + ["kserve-http"]


def _servers(args, ap) -> list[str]:
    """The servers to run: --servers, else ours and those the flags set up; in the report's order."""
    known = _server_order(args.baseline_label)
    if args.servers:
        unknown = [s for s in args.servers if s not in known]
        if unknown:
            ap.error(f"unknown servers {unknown}; known: {' '.join(known)}")
        if any(s.startswith("kserve-") for s in args.servers) and not args.kserve_python:
            ap.error("kserve-grpc and -http need --kserve-python")
        if any(s.startswith(f"{args.baseline_label}-") for s in args.servers) and not args.baseline:
            ap.error(f"{args.baseline_label}-grpc and -http need --baseline")
        return [s for s in known if s in args.servers]
    family = {f"{f}-{p}": f for f in ("modelcache", args.baseline_label, *TRITON_CONFIGS) for p in PROTOCOLS}
    on = {"modelcache": True, args.baseline_label: bool(args.baseline), "kserve": bool(args.kserve_python),
          **dict.fromkeys(TRITON_CONFIGS, args.triton)}
    return [s for s in known if on[family.get(s, "kserve")]]


def _cli(env: dict, *args: str) -> str:
    """`modelcache ARGS` under `env` (a checkout's PYTHONPATH: its own client for its own daemon): stdout."""
    r = subprocess.run([sys.executable, "-m", "modelcache.cli", *args], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"modelcache {args[0]} failed: {r.stderr[-2000:]}")
    return r.stdout


def _serve_modelcache(stack: contextlib.ExitStack, home: Path, family: str, protocols: list, paths: dict, log,
                      checkout: str | None = None, settings: dict | None = None) -> dict:
    """A daemon of its own (default settings) holding the zoo models, and its fronts for `protocols`, all run
    from `checkout`'s code (PYTHONPATH, as ab.py runs two checkouts) or else this one's, with `settings` (environment
    variables, MODELCACHE_BATCHING=dynamic say) added; stopped with `stack`.
    {server: (host:port, {"front": pid, "daemon": pid})}."""
    from modelcache.bench.http import start_front
    from modelcache.measure import managed_daemon
    home.mkdir(parents=True)
    socket_ = f"ipc://{home}/daemon.sock"
    # PYTHONSAFEPATH (3.11+): `python -m` would put the working directory before PYTHONPATH, and run this
    # checkout's code under the other's name whenever the benchmark runs from this one's root.
    code = {"PYTHONPATH": str(Path(checkout).resolve()), "PYTHONSAFEPATH": "1"} if checkout else {}
    own = {"MODELCACHE_CONFIG": "", **code, **(settings or {})}
    env = {**os.environ, "MODELCACHE_SOCKET": socket_, "MODELCACHE_REPOSITORY": f"{home}/repo", **own}
    stack.enter_context(managed_daemon(socket_, f"{home}/repo", env=own))
    for name, path in paths.items():
        print(f"adding {name} to {family}'s daemon ...", file=sys.stderr, flush=True)
        _cli(env, "add", path, "--name", name)
    daemon = json.loads(_cli(env, "stats"))["pid"]
    out = {}
    for kind in protocols:
        proc, address = start_front(env, log, kind)
        stack.callback(_stop, proc)
        out[f"{family}-{kind}"] = (address, {"front": proc.pid, "daemon": daemon})
    return out


def _setting(text: str) -> tuple[str, str]:
    name, eq, value = text.partition("=")
    if not eq or not name.startswith("MODELCACHE_"):
        raise argparse.ArgumentTypeError(f"{text!r}: give MODELCACHE_NAME=VALUE")
    return name, value


def _py312() -> str | None:
    """The Python 3.12 whose shared libpython serve.sh puts on tritonserver's library path: $PY312, else pyenv's."""
    if os.environ.get("PY312"):
        return os.environ["PY312"]
    root = subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip() \
        if shutil.which("pyenv") else ""
    found = sorted(Path(root).glob("versions/3.12*/bin/python3.12")) if root else []
    return str(found[-1]) if found else None   # (None: serve.sh looks for itself)


def _start_triton(stack: contextlib.ExitStack, serve: str, path: str, name: str, settings: dict, repo: Path,
                  log) -> tuple[str, str, int]:
    """Triton 2.51 with its C++ ONNX Runtime backend serving one model (serve.sh, `settings` its environment:
    INSTANCES, INTRA_OP), on free ports; stopped with `stack`. (http host:port, grpc host:port, its pid)."""
    http_port, grpc_port = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # (nothing of ours in its Python)
    env.update(settings, REPO=str(repo))
    py312 = _py312()
    if py312:
        env["PY312"] = py312
    ready = repo.parent / f"{repo.name}.out"   # (serve.sh's stdout: its READY line; a file, so nothing can block on it)
    with open(ready, "wb") as out:
        # its own session: ^C stops it through us, and _stop ends its readiness watcher with it
        proc = subprocess.Popen(["bash", serve, path, name, str(http_port), str(grpc_port)], env=env, stdout=out,
                                stderr=log, start_new_session=True)
    stack.callback(_stop, proc, True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        for line in ready.read_text().splitlines():
            if line.startswith("READY "):
                fields = dict(f.split("=", 1) for f in line.split()[1:])
                return fields["http"], fields["grpc"], int(fields["pid"])
        time.sleep(0.2)
    raise RuntimeError(f"Triton did not get ready serving {name} ({' '.join(f'{k}={v}' for k, v in settings.items())})")


def start_servers(stack: contextlib.ExitStack, args, servers: list, paths: dict, tmp: Path, log) -> dict:
    """Start every server in `servers` (each once, for the whole run; stopped with `stack`):
    {server: {model: (host:port, {process name: pid})}}; a server's CPU is read from those processes."""
    targets = {}

    def protocols(family):
        return [p for p in PROTOCOLS if f"{family}-{p}" in servers]

    for family, checkout, settings in (("modelcache", None, None),
                                       (args.baseline_label, args.baseline, dict(args.baseline_env))):
        if protocols(family):
            for server, where in _serve_modelcache(stack, tmp / family, family, protocols(family), paths, log,
                                                   checkout, settings).items():
                targets[server] = dict.fromkeys(paths, where)
    for config, settings in TRITON_CONFIGS.items():   # serve.sh serves one model: a Triton per model and config
        for name, path in paths.items() if protocols(config) else ():
            print(f"starting {config} for {name} ...", file=sys.stderr, flush=True)
            http, grpc, pid = _start_triton(stack, args.triton_serve, path, name, settings,
                                            tmp / f"{config}-{name}", log)
            for kind in protocols(config):
                targets.setdefault(f"{config}-{kind}", {})[name] = (http if kind == "http" else grpc,
                                                                    {"tritonserver": pid})
    if any(s.startswith("kserve-") for s in servers):
        proc, grpc_address, http_address = _start_kserve(args.kserve_python, paths, log,
                                                         spin=not args.kserve_no_spin)
        stack.callback(_stop, proc, True)
        for kind, address in (("grpc", grpc_address), ("http", http_address)):
            if f"kserve-{kind}" in servers:
                targets[f"kserve-{kind}"] = dict.fromkeys(paths, (address, {"kserve": proc.pid}))
    return targets


def _stop(proc: subprocess.Popen, group: bool = False) -> None:
    if proc.poll() is None:
        (os.killpg(proc.pid, signal.SIGTERM) if group else proc.send_signal(signal.SIGTERM))
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            (os.killpg(proc.pid, signal.SIGKILL) if group else proc.kill())
            proc.wait()


def _versions(args) -> dict:
    from importlib.metadata import version
    out = {p: version(p) for p in ("grpcio", "protobuf", "tritonclient", "onnxruntime", "httptools")}
    out["modelcache"] = _git(str(Path(__file__).resolve().parent))
    if args.kserve_python:
        r = subprocess.run([args.kserve_python, "-c", "from importlib.metadata import version as v; "
                                                      "print(v('kserve'), v('grpcio'), v('onnxruntime'))"],
                           capture_output=True, text=True)
        out["kserve (peer venv: kserve grpcio onnxruntime)"] = r.stdout.strip()
    if args.triton or any(s.startswith("triton") for s in args.servers or ()):
        venv = os.environ.get("PYT_VENV") or f"{os.environ.get('TMPDIR') or '/tmp'}/pyt-venv"   # (serve.sh's)
        r = subprocess.run([f"{venv}/bin/python", "-c", "from importlib.metadata import version as v; "
                                                        "print(v('nvidia-pytriton'), v('onnxruntime'))"],
                           capture_output=True, text=True)
        out["triton 2.51 (its venv: nvidia-pytriton onnxruntime)"] = r.stdout.strip()
    if args.perf_analyzer:
        r = subprocess.run([f"{args.pa_dir}/perf_analyzer", "--version"], capture_output=True, text=True,
                           env={**os.environ, "LD_LIBRARY_PATH": args.pa_dir})
        out["perf_analyzer"] = (r.stdout + r.stderr).strip().removeprefix("Perf Analyzer Version ")
    return out


def cpu_report(by_server: dict, out) -> None:
    """Each server's and the clients' CPU time a request, and the requests/s ratio that CPU alone allows: where
    clients and servers share the cores and keep them busy, requests/s is at most cores / (CPU a request)."""
    def cell(values):
        return f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]"

    def total(run):
        return sum(run["server_cpu_us"].values())

    procs = list(dict.fromkeys(k for runs in by_server.values() for r in runs for k in r["server_cpu_us"]))
    print("  CPU a request, us (median [min-max] over rounds); cores = requests/s x CPU a request:", file=out)
    print(f"  {'server':<18}" + "".join(f"{p:>22}" for p in procs) +
          f"{'server, all':>22}{'clients':>22}{'cores':>8}", file=out)
    for server, runs in by_server.items():
        mine = runs[0]["server_cpu_us"]
        print(f"  {server:<18}" + "".join(f"{cell([r['server_cpu_us'][p] for r in runs]) if p in mine else '':>22}"
                                          for p in procs) +
              f"{cell([total(r) for r in runs]):>22}{cell([r['client_cpu_us'] for r in runs]):>22}"
              f"{statistics.median(r['rps'] * (total(r) + r['client_cpu_us']) / 1e6 for r in runs):>8.2f}", file=out)
    for server, runs in by_server.items():   # where a process's CPU goes: its threads of 10% and more
        busy = []
        for proc in runs[0]["thread_cpu_us"]:
            labels = dict.fromkeys(t for r in runs for t in r["thread_cpu_us"][proc])
            for t in labels:
                us = statistics.median(r["thread_cpu_us"][proc].get(t, 0.0) for r in runs)
                if us >= 0.1 * statistics.median(total(r) for r in runs):
                    busy.append(f"{proc} {t} {us:.0f}")
        print(f"    {server} threads: " + ", ".join(busy), file=out)
    ours, theirs = by_server.get("modelcache-grpc"), by_server.get("kserve-grpc")
    if ours and theirs:
        bound = [(b["client_cpu_us"] + total(b)) / (a["client_cpu_us"] + total(a)) for a, b in zip(ours, theirs)]
        need = [(b["client_cpu_us"] + total(b)) / 2 - a["client_cpu_us"] for a, b in zip(ours, theirs)]
        print(f"  CPU bound on modelcache-grpc / kserve-grpc requests/s, (clients + kserve) / (clients + front + "
              f"daemon): x{statistics.median(bound):.2f} [{min(bound):.2f}-{max(bound):.2f}] (per round)", file=out)
        print(f"  for x2 with these clients, front + daemon <= {cell(need)} us a request (< 0: out of reach "
              f"whatever the server does); now {cell([total(a) for a in ours])}", file=out)


def _spread(values: list, fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def _pairs(servers, label: str | None) -> list[tuple[str, str]]:
    """(ours, a peer) pairs, both in `servers`, whose per-round ratios the report gives."""
    pairs = [("modelcache-grpc", "kserve-grpc"), ("modelcache-http", "kserve-http"),
             ("modelcache-grpc", "modelcache-http")]
    pairs += [(f"modelcache-{p}", f"{peer}-{p}") for p in PROTOCOLS for peer in (*TRITON_CONFIGS, label) if peer]
    pairs += [(f"modelcache{SHM}-{p}", f"{peer}-{p}") for p in PROTOCOLS
              for peer in ("modelcache", *(c + SHM for c in TRITON_CONFIGS))]
    pairs += [(f"{c}{SHM}-{p}", f"{c}-{p}") for p in PROTOCOLS for c in TRITON_CONFIGS]
    return [(a, b) for a, b in pairs if a in servers and b in servers]


def _ratios(a: list, b: list, key: str) -> list[float]:
    """a / b of `key`, round by round (the same round: the same machine)."""
    return [x[key] / y[key] for x, y in zip(a, b)]


def table(by_server: dict, label: str | None, out, rate: str = "requests/s") -> None:
    """Each server's rate, p50 and p99 (median [min-max] over rounds), then each pair's ratios, round by round."""
    print(f"  {'server':<18} {rate:>22} {'p50 ms':>22} {'p99 ms':>22}", file=out)
    for server, runs in by_server.items():
        failed = [r["error"] for r in runs if "error" in r]
        if failed:
            print(f"  {server:<18} failed ({len(failed)} of {len(runs)} rounds): {failed[-1]}", file=out)
            continue
        print(f"  {server:<18} {_spread([r['rps'] for r in runs], '.1f'):>22} "
              f"{_spread([r['p50_us'] / 1e3 for r in runs], '.2f'):>22} "
              f"{_spread([r['p99_us'] / 1e3 for r in runs], '.2f'):>22}", file=out)
    for a, b in _pairs(by_server, label):
        if any("error" in r for r in by_server[a] + by_server[b]):
            continue
        print(f"  {a} / {b}: {rate} x{_spread(_ratios(by_server[a], by_server[b], 'rps'), '.2f')}, "
              f"p99 x{_spread(_ratios(by_server[a], by_server[b], 'p99_us'), '.2f')} (per round, same round)",
              file=out)


def goals(res: dict, out) -> None:
    """Each of issue 46's goals against this run's closed loops: the median over rounds (of the per-round ratio,
    for a ratio), its [min-max], met or not; "not measured" where the run lacks the servers or the model."""
    def runs(model, clients, server):
        return res["runs"].get(model, {}).get(str(clients), {}).get(server) or []

    def ratio(model, clients, a, b, key="rps"):
        return _ratios(runs(model, clients, a), runs(model, clients, b), key)

    def cell(values, ok, prefix=""):
        if not values:
            return "not measured"
        return f"{prefix}{_spread(values, '.2f')} {'met' if ok(statistics.median(values)) else 'NOT met'}"

    def each(p, c):
        return f"{p} {c} client{'s' if c > 1 else ''}"

    tiny_rps = [f"{each(p, c)} {cell(ratio('tiny-cnn', c, f'modelcache-{p}', f'triton-{p}'), lambda v: v >= 0.7, 'x')}"
                for p in PROTOCOLS for c in (1, 4)]
    tiny_cpu = [f"{each(p, c)} " + cell([sum(r["server_cpu_us"].values()) / 1e3
                                         for r in runs("tiny-cnn", c, f"modelcache-{p}")], lambda v: v <= 0.35)
                for p in PROTOCOLS for c in (1, 4)]
    p50 = [r["p50_us"] / 1e3 for r in runs("tiny-cnn", 1, "modelcache-grpc")]
    big = [f"{p} " + cell(ratio("resnet50", 4, f"modelcache-{p}", f"triton-tuned-{p}"), lambda v: v >= 1.0, "x") +
           (", p99 " + cell(ratio("resnet50", 4, f"modelcache-{p}", f"triton-tuned-{p}", "p99_us"),
                            lambda v: v <= 1.0, "x") if runs("resnet50", 4, f"triton-tuned-{p}") else "")
           for p in PROTOCOLS]
    kserve = [f"{m} {p} " + cell(ratio(m, 4, f"modelcache-{p}", f"kserve-{p}"), lambda v: v >= 2.0, "x")
              for m in res["runs"] for p in PROTOCOLS if runs(m, 4, f"kserve-{p}")]
    spun = res.get("kserve_spin", True) and any(runs(m, 4, f"kserve-{p}") for m in res["runs"] for p in PROTOCOLS)
    print("goals, this run (median [min-max] over rounds; a ratio per round, same round):", file=out)
    print("  tiny-cnn requests/s >= x0.7 Triton (defaults): " + "; ".join(tiny_rps), file=out)
    print("  server CPU a tiny-cnn request (front + daemon) <= 0.35 ms: " + "; ".join(tiny_cpu), file=out)
    print(f"  tritonclient.grpc p50, tiny-cnn, 1 client, <= 1.0 ms: {cell(p50, lambda v: v <= 1.0)}", file=out)
    print("  ResNet-50, 4 clients, requests/s >= x1.0 tuned Triton, p99 <= x1.0 its p99: " + "; ".join(big), file=out)
    print("  requests/s >= x2 KServe, its ORT not spinning, 4 clients: " + ("; ".join(kserve) or "not measured") +
          (" (KServe spun here: the goal wants --kserve-no-spin)" if spun else ""), file=out)


def report(res: dict, out=sys.stdout) -> None:
    label = res.get("baseline", {}).get("label")
    if res["runs"]:
        print(f"closed loop, tritonclient, batch 1, {res['seconds']:g} s per run, {res['rounds']} rounds alternating "
              "the servers' order" + (f", after {res['warm_s']:g} s of warm-up each" if res.get("warm_s") else "") +
              "; median [min-max] over rounds" +
              ("" if res.get("kserve_spin", True) else "; the KServe peer's ORT threads do not spin"), file=out)
    if "baseline" in res:
        print(f"{label}-*: {res['baseline']['checkout']} at {res['baseline']['commit']}" +
              "".join(f", {k}={v}" for k, v in res["baseline"].get("env", {}).items()), file=out)
    for model, by_clients in res["runs"].items():
        for clients, by_server in by_clients.items():
            print(f"\n{model}, {clients} client{'s' if clients != '1' else ''}:", file=out)
            table(by_server, label, out)
            if all(r.get("server_cpu_us") for runs in by_server.values() for r in runs):
                cpu_report(by_server, out)
    pa = res.get("perf_analyzer")
    if pa:
        print(f"\nperf_analyzer (Triton's C++ client, sync, batch 1, random inputs): {pa['interval_ms']} ms windows "
              f"until 3 agree within 100% or {pa['trials']}, the last window's figures; {res['rounds']} rounds "
              "alternating the servers' order; median [min-max] over rounds" +
              ("; not KServe (no ModelConfig in its gRPC service: perf_analyzer asks for it)"
               if any(s.startswith("kserve-") for s in res.get("servers", ())) else ""), file=out)
        for model, by_concurrency in pa["runs"].items():
            for concurrency, by_server in by_concurrency.items():
                print(f"\n{model}, concurrency {concurrency}:", file=out)
                table(by_server, label, out, rate="infer/s")
    print(f"\n{GOALS}", file=out)
    goals(res, out)
    print(f"machine: {os.cpu_count()} cores; " + "; ".join(f"{k} {v}" for k, v in res["versions"].items()), file=out)


def _git(path: str) -> str:
    r = subprocess.run(["git", "-C", path, "describe", "--always", "--dirty"], capture_output=True, text=True)
    return r.stdout.strip() or "?"


def _interrupt(signum, frame):
    raise KeyboardInterrupt   # (SIGTERM as ^C: every server started is stopped on the way out)


def main(argv=None) -> int:
    ap = Parser(prog="python benchmarks/grpc/run.py", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny-cnn", "resnet50"], help="zoo names (one FP32 input)")
    ap.add_argument("--warm-s", type=float, default=3.0,
                    help="an untimed closed loop of one client against each server and model first, this long: the "
                         "servers measured warm (modelcache's fronts run a short model themselves once the daemon "
                         "has timed it); 0 = none")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--seconds", type=float, default=5.0, help="closed-loop time per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--triton", action="store_true",
                    help="Triton 2.51 with its C++ ONNX Runtime backend, as its defaults (triton-grpc, triton-http) "
                         "and tuned, INSTANCES=1 INTRA_OP=1 (triton-tuned-grpc, triton-tuned-http)")
    ap.add_argument("--triton-serve", default=TRITON_SERVE, help="the peer's serve.sh (default: %(default)s)")
    ap.add_argument("--baseline", metavar="CHECKOUT",
                    help="another modelcache checkout: a daemon and fronts of its own, run from its code")
    ap.add_argument("--baseline-label", default="base", help="its servers' names: LABEL-grpc, LABEL-http")
    ap.add_argument("--baseline-env", nargs="+", default=[], metavar="NAME=VALUE", type=_setting,
                    help="settings for the baseline's daemon and fronts (MODELCACHE_BATCHING=dynamic, "
                         "MODELCACHE_WORKERS=1): with --baseline of this checkout, an A/B of a setting")
    ap.add_argument("--kserve-python", help="the python of a venv with kserve and onnxruntime: the KServe peer")
    ap.add_argument("--kserve-no-spin", action="store_true",
                    help="the peer's ORT sessions block between runs rather than spin (ORT's default)")
    ap.add_argument("--servers", nargs="+", metavar="SERVER",
                    help="only these (default: modelcache-grpc, modelcache-http and those the flags above set up; "
                         "a Triton server named here needs no --triton)")
    ap.add_argument("--perf-analyzer", nargs="?", const="after", choices=("after", "only"),
                    help="perf_analyzer against every server at each --clients concurrency, after the closed loops "
                         "(or, with `only`, instead of them)")
    ap.add_argument("--pa-dir", default=PERF_ANALYZER, help="perf_analyzer's folder (default: %(default)s)")
    ap.add_argument("--pa-interval-ms", type=int, default=2000, help="perf_analyzer's measurement window")
    ap.add_argument("--pa-trials", type=int, default=6, help="perf_analyzer's most windows a run")
    ap.add_argument("--shared-memory", action="store_true",
                    help="also run each modelcache and Triton server with its tensors in system shared memory "
                         "(SERVER.shm), alternated with the others")
    ap.add_argument("--out")
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(*args.worker)
        return 0
    if args.baseline_label in ("modelcache", "kserve", *TRITON_CONFIGS) or "-" in args.baseline_label:
        ap.error(f"--baseline-label {args.baseline_label!r} would clash with another server's name")
    servers = _servers(args, ap)
    if args.shared_memory:   # each variant right after its server, in the same rounds
        os.environ["MODELCACHE_CLIENT_SHARED_MEMORY"] = "1"   # (our fronts' opt-in; Triton 2.51 serves it by default)
        servers = [v for s in servers
                   for v in ((s, shm_variant(s)) if s.startswith(("modelcache-", "triton")) else (s,))]
    from modelcache import zoo
    from modelcache.bench.http import one_input_io
    from modelcache.measure import save_results
    res = {"seconds": args.seconds, "rounds": args.rounds, "warm_s": args.warm_s, "kserve_spin": not args.kserve_no_spin,
           "servers": servers, "versions": _versions(args), "runs": {}}
    if args.baseline:
        res["baseline"] = {"label": args.baseline_label, "checkout": str(Path(args.baseline).resolve()),
                           "commit": _git(args.baseline), "env": dict(args.baseline_env)}
    signal.signal(signal.SIGTERM, _interrupt)
    with tempfile.TemporaryDirectory(prefix="modelcache-bench-grpc-") as tmp, contextlib.ExitStack() as stack:
        tmp = Path(tmp)
        log = stack.enter_context(open(tmp / "servers.log", "ab"))   # (closed last: the servers' stderr)
        try:
            paths = {}   # the zoo's .onnx files: what every server serves
            for name in args.models:
                paths[name] = str(tmp / f"{name}.onnx")
                zoo.save(zoo.build(name), paths[name])
            io = {m: one_input_io(p) for m, p in paths.items()}
            targets = start_servers(stack, args, [s for s in servers if SHM not in s], paths, tmp, log)
            targets.update({s: targets[base_server(s)] for s in servers if SHM in s})
            for model in args.models if args.warm_s > 0 else []:   # steady state: what a serving server is in
                for server in servers:
                    print(f"warming: {model}, {server} ...", file=sys.stderr, flush=True)
                    address, pids = targets[server][model]
                    closed_loop(server, address, model, io[model], 1, args.warm_s, pids)
            for r in range(args.rounds if args.perf_analyzer != "only" else 0):
                order = servers[r % len(servers):] + servers[:r % len(servers)]
                for model in args.models:
                    for clients in args.clients:
                        for server in order:
                            print(f"round {r + 1}: {model}, {clients} clients, {server} ...", file=sys.stderr,
                                  flush=True)
                            address, pids = targets[server][model]
                            run = closed_loop(server, address, model, io[model], clients, args.seconds, pids)
                            res["runs"].setdefault(model, {}).setdefault(str(clients), {}) \
                                .setdefault(server, []).append(run)
            # (not KServe: its gRPC service has no ModelConfig, which perf_analyzer asks for first)
            pa_servers = [s for s in servers if not s.startswith("kserve-")]
            if args.perf_analyzer:
                res["perf_analyzer"] = {"interval_ms": args.pa_interval_ms, "trials": args.pa_trials, "runs": {}}
            for r in range(args.rounds if args.perf_analyzer and pa_servers else 0):
                order = pa_servers[r % len(pa_servers):] + pa_servers[:r % len(pa_servers)]
                for model in args.models:
                    for concurrency in args.clients:
                        for server in order:
                            print(f"round {r + 1}: perf_analyzer, {model}, concurrency {concurrency}, {server} ...",
                                  file=sys.stderr, flush=True)
                            run = perf_analyzer(args.pa_dir, server, targets[server][model][0], model, io[model],
                                                concurrency, args.pa_interval_ms, args.pa_trials, tmp / "pa.csv")
                            res["perf_analyzer"]["runs"].setdefault(model, {}).setdefault(str(concurrency), {}) \
                                .setdefault(server, []).append(run)
        except Exception:
            log.flush()
            print("the servers' log, its end:\n" + (tmp / "servers.log").read_text(errors="replace")[-4000:],
                  file=sys.stderr)
            raise
    for runs in (res["runs"], res.get("perf_analyzer", {}).get("runs", {})):   # (the servers in a fixed order)
        for by_clients in runs.values():
            for clients, by_server in by_clients.items():
                by_clients[clients] = {s: by_server[s] for s in servers if s in by_server}
    report(res)
    save_results(args.out, "grpc", argv, res, report, command="python benchmarks/grpc/run.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
