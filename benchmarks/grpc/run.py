"""gRPC front benchmark: Triton's gRPC protocol on modelcache against a KServe Python server, and against our
own HTTP front, with the same stock client (tritonclient) and the same closed-loop load.

    python benchmarks/grpc/run.py [--models tiny-cnn resnet50] [--clients 1 4] [--seconds 5] [--rounds 3]
                                  [--kserve-python /path/to/venv/bin/python] [--out DIR]

A daemon of its own (in a temporary directory, default settings) serves the zoo models; `modelcache grpc` and
`modelcache http` run in front of it on free loopback ports. With --kserve-python (a venv with `kserve` and
`onnxruntime`: modelcache is not needed there), KServe's ModelServer serves the same .onnx files with plain
ORT (kserve_peer.py), over gRPC. Each server, model and client count is one closed loop: N client processes,
each calling tritonclient's infer (batch 1, inputs and outputs raw/binary) as fast as answers come, for
--seconds. Rounds alternate the servers' order, so every server sees the same machine; the report gives each
figure's median over the rounds and its spread [min-max]. Beside requests/s and latency, the CPU time
(/proc, user + system) a request cost each server process (and its busiest threads) and the clients, over the
clients' window: where clients and servers share the cores, their ratio bounds the requests/s ratio.

  modelcache-grpc   tritonclient.grpc -> `modelcache grpc` -> the daemon's serve lane
  kserve-grpc       tritonclient.grpc -> KServe's gRPC server -> onnxruntime in its process
  modelcache-http   tritonclient.http (binary tensors) -> `modelcache http` -> the daemon's serve lane
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from modelcache.usage import Parser

SERVERS = ("modelcache-grpc", "kserve-grpc", "modelcache-http")
GOALS = "goals: at 4 clients, modelcache-grpc >= 2x kserve-grpc requests/s and p99 <= 0.5x; tiny model p50 " \
        "through tritonclient.grpc <= 1.0 ms"


def _caller(server: str, address: str, model: str, x, io: tuple):
    """(call, close): one infer of `x` through tritonclient, returning the first output."""
    name, output = io[0], io[1]
    if server.endswith("-http"):
        import tritonclient.http as client
    else:
        import tritonclient.grpc as client
    c = client.InferenceServerClient(address)
    inp = client.InferInput(name, list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    outs = [client.InferRequestedOutput(output)]
    return (lambda: c.infer(model, [inp], outputs=outs).as_numpy(output)), c.close


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
    """CPU time (user + system) so far of a process and of its descendants now alive, seconds."""
    from ab import _cpu_s as own
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += (task / "children").read_text().split()
    return own(pid) + sum(_cpu_s(int(c)) for c in children)


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
    for p in procs:   # every client has imported, connected and warmed before the clock starts
        if p.stdout.readline().strip() != "READY":
            raise RuntimeError(f"{server} client did not start (status {p.wait()})")
    pids = pids or {}
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_kserve(python: str, paths: dict, log, spin: bool = True) -> tuple[subprocess.Popen, str]:
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
                return proc, address
            c.close()
        except Exception:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the KServe peer did not get ready; see its log")


def _stop(proc: subprocess.Popen, group: bool = False) -> None:
    if proc.poll() is None:
        (os.killpg(proc.pid, signal.SIGTERM) if group else proc.send_signal(signal.SIGTERM))
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            (os.killpg(proc.pid, signal.SIGKILL) if group else proc.kill())
            proc.wait()


def _versions(python: str | None) -> dict:
    from importlib.metadata import version
    out = {p: version(p) for p in ("grpcio", "protobuf", "tritonclient", "onnxruntime", "aiohttp")}
    if python:
        r = subprocess.run([python, "-c", "from importlib.metadata import version as v; "
                                          "print(v('kserve'), v('grpcio'), v('onnxruntime'))"],
                           capture_output=True, text=True)
        out["kserve (peer venv: kserve grpcio onnxruntime)"] = r.stdout.strip()
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
    print(f"  {'server':<16}" + "".join(f"{p:>18}" for p in procs) +
          f"{'server, all':>18}{'clients':>18}{'cores':>8}", file=out)
    for server, runs in by_server.items():
        mine = runs[0]["server_cpu_us"]
        print(f"  {server:<16}" + "".join(f"{cell([r['server_cpu_us'][p] for r in runs]) if p in mine else '':>18}"
                                          for p in procs) +
              f"{cell([total(r) for r in runs]):>18}{cell([r['client_cpu_us'] for r in runs]):>18}"
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


def report(res: dict, out=sys.stdout) -> None:
    def med(runs, key):
        return statistics.median(r[key] for r in runs)

    def spread(runs, key, scale=1.0, fmt=".0f"):
        v = [r[key] * scale for r in runs]
        return f"{statistics.median(v):{fmt}} [{min(v):{fmt}}-{max(v):{fmt}}]"

    print(f"closed loop, tritonclient, batch 1, {res['seconds']:g} s per run, {res['rounds']} rounds alternating "
          "the servers' order; median [min-max] over rounds" +
          ("" if res.get("kserve_spin", True) else "; the KServe peer's ORT threads do not spin"), file=out)
    for model, by_clients in res["runs"].items():
        for clients, by_server in by_clients.items():
            print(f"\n{model}, {clients} client{'s' if clients != '1' else ''}:", file=out)
            print(f"  {'server':<16} {'requests/s':>22} {'p50 ms':>22} {'p99 ms':>22}", file=out)
            for server, runs in by_server.items():
                print(f"  {server:<16} {spread(runs, 'rps', fmt='.1f'):>22} {spread(runs, 'p50_us', 1e-3, '.2f'):>22} "
                      f"{spread(runs, 'p99_us', 1e-3, '.2f'):>22}", file=out)
            ours = by_server.get("modelcache-grpc")
            for peer in ("kserve-grpc", "modelcache-http"):
                theirs = by_server.get(peer)
                if ours and theirs:
                    rps = [a["rps"] / b["rps"] for a, b in zip(ours, theirs)]
                    p99 = [a["p99_us"] / b["p99_us"] for a, b in zip(ours, theirs)]
                    print(f"  modelcache-grpc / {peer}: requests/s x{statistics.median(rps):.2f} "
                          f"[{min(rps):.2f}-{max(rps):.2f}], p99 x{statistics.median(p99):.2f} "
                          f"[{min(p99):.2f}-{max(p99):.2f}] (per round, same round)", file=out)
            if all(r.get("server_cpu_us") for runs in by_server.values() for r in runs):
                cpu_report(by_server, out)
    print(f"\n{GOALS}", file=out)
    print(f"machine: {os.cpu_count()} cores; " + "; ".join(f"{k} {v}" for k, v in res["versions"].items()), file=out)


def main(argv=None) -> int:
    ap = Parser(prog="python benchmarks/grpc/run.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny-cnn", "resnet50"], help="zoo names (one FP32 input)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--seconds", type=float, default=5.0, help="closed-loop time per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kserve-python", help="the python of a venv with kserve and onnxruntime: the KServe peer")
    ap.add_argument("--kserve-no-spin", action="store_true",
                    help="the peer's ORT sessions block between runs rather than spin (ORT's default)")
    ap.add_argument("--out")
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(*args.worker)
        return 0
    from modelcache.bench.http import one_input_io, start_front
    from modelcache.measure import ensure_models, managed_daemon, save_results
    servers = [s for s in SERVERS if s != "kserve-grpc" or args.kserve_python]
    res = {"seconds": args.seconds, "rounds": args.rounds, "kserve_spin": not args.kserve_no_spin,
           "versions": _versions(args.kserve_python), "runs": {}}
    with tempfile.TemporaryDirectory(prefix="modelcache-bench-grpc-") as tmp:
        socket_ = f"ipc://{tmp}/daemon.sock"
        env = {**os.environ, "MODELCACHE_SOCKET": socket_, "MODELCACHE_REPOSITORY": f"{tmp}/repo",
               "MODELCACHE_CONFIG": ""}
        log = open(Path(tmp) / "fronts.log", "ab")
        procs = []
        try:
            with managed_daemon(socket_, f"{tmp}/repo", env={"MODELCACHE_CONFIG": ""}):
                paths = ensure_models(socket_, args.models, Path(tmp) / "zoo")
                io = {m: one_input_io(p) for m, p in paths.items()}
                from ab import _daemon_pid
                address, pids = {}, {}
                for kind in ("grpc", "http"):
                    proc, address[f"modelcache-{kind}"] = start_front(env, log, kind)
                    procs.append((proc, False))
                    pids[f"modelcache-{kind}"] = {"front": proc.pid, "daemon": _daemon_pid(socket_)}
                if args.kserve_python:
                    proc, address["kserve-grpc"] = _start_kserve(args.kserve_python, paths, log,
                                                                   spin=not args.kserve_no_spin)
                    procs.append((proc, True))
                    pids["kserve-grpc"] = {"kserve": proc.pid}
                for r in range(args.rounds):
                    order = servers[r % len(servers):] + servers[:r % len(servers)]
                    for model in args.models:
                        for clients in args.clients:
                            for server in order:
                                print(f"round {r + 1}: {model}, {clients} clients, {server} ...", file=sys.stderr,
                                      flush=True)
                                run = closed_loop(server, address[server], model, io[model], clients, args.seconds,
                                                  pids[server])
                                res["runs"].setdefault(model, {}).setdefault(str(clients), {}) \
                                    .setdefault(server, []).append(run)
                for model in res["runs"]:   # (a fixed order of servers in the report)
                    for clients, by_server in res["runs"][model].items():
                        res["runs"][model][clients] = {s: by_server[s] for s in servers}
        finally:
            for proc, group in procs:
                _stop(proc, group)
            log.close()
    report(res)
    save_results(args.out, "grpc", argv, res, report, command="python benchmarks/grpc/run.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
