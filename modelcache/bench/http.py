"""HTTP front benchmark: what the Open Inference Protocol front (`modelcache http`) adds to a served request.

    modelcache bench http [--model tiny-cnn] [--big resnet50] [--calls 400] [--big-calls 40] [--seconds 8]
                          [--clients 4] [--out DIR]

A daemon of its own (in a temporary directory) serves a tiny model and a big one (zoo names), and `modelcache
http` listens on a free loopback port. Each model, batch 1, is called sequentially four ways,
interleaved in rounds so that all see the same machine:

  lane          client.infer over the serve lane: the path the front itself takes to the daemon
  http-binary   a minimal keep-alive client (http.client): binary tensors in and out (the
                binary-tensor extension): the front's own cost, with little of the client's
  http-json     the same client, JSON tensors
  tritonclient  tritonclient.http's InferenceServerClient, binary tensors: what a Triton user runs
  http-floor    GET /v2/health/live on the minimal client: an HTTP round trip to the front that never
                reaches the daemon (the front's HTTP server, asyncio, the kernel's loopback TCP, and the
                wake-ups)

The latency the front adds is an HTTP path's p50 (p99) less the lane's. Then throughput: --clients
processes in a closed loop for --seconds each, over the lane and over http-binary.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from ..usage import Parser

MODES = ("lane", "http-binary", "http-json", "tritonclient", "http-floor")
# Triton's own published HTTP figure, for scale (see report()).
TRITON_REF = ("triton-inference-server/server docs/user_guide/perf_analyzer.md: inception_graphdef (1x299x299x3 "
              "FP32 in, ~1 MB) over HTTP at concurrency 1: client p50 13936 us, avg HTTP time 14017 us against "
              "a server-side request latency of 12005 us (of which 36 us server overhead): ~2.0 ms between "
              "Triton's C++ client and its server, 200 us of it the client's send/recv")


class RawV2:
    """A minimal v2 client on one keep-alive connection; little Python between the socket and the array."""

    def __init__(self, hostport: str):
        host, port = hostport.rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=120)

    def infer(self, model: str, name: str, x, output: str, binary: bool):
        import numpy as np
        if binary:
            head = json.dumps({"inputs": [{"name": name, "shape": list(x.shape), "datatype": "FP32",
                                           "parameters": {"binary_data_size": x.nbytes}}],
                               "outputs": [{"name": output, "parameters": {"binary_data": True}}]}).encode()
            self.conn.request("POST", f"/v2/models/{model}/infer", body=head + x.tobytes(),
                              headers={"Inference-Header-Content-Length": str(len(head))})
        else:
            body = json.dumps({"inputs": [{"name": name, "shape": list(x.shape), "datatype": "FP32",
                                           "data": x.ravel().tolist()}],
                               "outputs": [{"name": output}]}).encode()
            self.conn.request("POST", f"/v2/models/{model}/infer", body=body,
                              headers={"Content-Type": "application/json"})
        r = self.conn.getresponse()
        payload = r.read()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {payload[:300]!r}")
        n = r.getheader("Inference-Header-Content-Length")
        if n is None:
            out = json.loads(payload)["outputs"][0]
            return np.asarray(out["data"], np.float32).reshape(out["shape"])
        doc = json.loads(payload[:int(n)])
        return np.frombuffer(payload[int(n):], np.float32).reshape(doc["outputs"][0]["shape"])

    def close(self):
        self.conn.close()


def _caller(mode: str, socket: str, hostport: str, model: str, x, io: tuple):
    """A function that makes one call of `mode` and returns its output array."""
    name, output = io[0], io[1]
    if mode == "lane":
        from ..client.connection import connect
        c = connect(socket)
        return (lambda: c.infer(model, {name: x})[0][output]), c.close
    if mode == "http-floor":
        raw = RawV2(hostport)

        def live():
            raw.conn.request("GET", "/v2/health/live")
            raw.conn.getresponse().read()
            return want_shape
        want_shape = None
        return live, raw.close
    if mode in ("http-binary", "http-json"):
        raw = RawV2(hostport)
        binary = mode == "http-binary"
        return (lambda: raw.infer(model, name, x, output, binary)), raw.close
    import tritonclient.http as th
    tc = th.InferenceServerClient(hostport)
    inp = th.InferInput(name, list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    outs = [th.InferRequestedOutput(output, binary_data=True)]
    return (lambda: tc.infer(model, [inp], outputs=outs).as_numpy(output)), tc.close


def latency(socket: str, hostport: str, model: str, io: tuple, calls: int, block: int, modes) -> dict:
    """Per-call latency in us of each mode, `block` calls at a time, modes taking turns."""
    import numpy as np
    x = np.random.default_rng(0).standard_normal(io[2]).astype(np.float32)
    callers = {m: _caller(m, socket, hostport, model, x, io) for m in modes}
    want = callers["lane"][0]()
    for m, (call, _) in callers.items():   # warm each path, and check they agree
        out = call()
        if m != "http-floor":
            np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
    samples = {m: [] for m in modes}
    try:
        while len(samples["lane"]) < calls:
            for m, (call, _) in callers.items():
                for _ in range(block):
                    t0 = time.perf_counter()
                    call()
                    samples[m].append((time.perf_counter() - t0) * 1e6)
    finally:
        for _, close in callers.values():
            close()
    return samples


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


def throughput(socket: str, hostport: str, model: str, io: tuple, mode: str, clients: int, seconds: float,
               watch: dict | None = None) -> dict:
    """Requests/s of `clients` processes each calling in a closed loop for `seconds`, started together; and the
    CPU time each process in `watch` (name -> pid) spent per request meanwhile."""
    import psutil
    procs_watched = {name: psutil.Process(pid) for name, pid in (watch or {}).items()}

    def cpu() -> dict:
        return {name: sum(p.cpu_times()[:2]) for name, p in procs_watched.items()}
    start_at = time.time() + 3.0   # every worker imports and connects before the clock starts
    procs = [subprocess.Popen([sys.executable, "-m", "modelcache.bench.http", "--worker", mode, socket, hostport,
                               model, json.dumps(io), str(start_at), str(seconds)], stdout=subprocess.PIPE, text=True)
             for _ in range(clients)]
    cpu_before = cpu()
    counts = []
    for p in procs:
        out, _ = p.communicate(timeout=seconds + 120)
        if p.returncode != 0:
            raise RuntimeError(f"throughput worker failed: {out}")
        counts.append(int(out.split()[-1]))
    cpu_after = cpu()   # (includes the workers' warm-up calls and 3 s of idling: a slight overestimate)
    n = max(1, sum(counts))
    return {"requests": sum(counts), "seconds": seconds, "rps": sum(counts) / seconds, "per_client": counts,
            "cpu_us_per_request": {k: (cpu_after[k] - cpu_before[k]) / n * 1e6 for k in cpu_before}}


def _worker(mode: str, socket: str, hostport: str, model: str, io: str, start_at: str, seconds: str) -> None:
    import numpy as np
    io = json.loads(io)
    x = np.random.default_rng(os.getpid()).standard_normal(io[2]).astype(np.float32)
    call, close = _caller(mode, socket, hostport, model, x, io)
    call()
    time.sleep(max(0.0, float(start_at) - time.time()))
    end, n = time.time() + float(seconds), 0
    while time.time() < end:
        call()
        n += 1
    close()
    print(n, flush=True)


def one_input_io(path: str) -> tuple:
    """(input name, first output's name, input shape at batch 1) of a one-input model."""
    import onnx
    g = onnx.load(path, load_external_data=False).graph
    weights = {t.name for t in g.initializer}
    inp = next(i for i in g.input if i.name not in weights)
    shape = [d.dim_value if d.HasField("dim_value") else 1 for d in inp.type.tensor_type.shape.dim]
    return inp.name, g.output[0].name, shape


def start_front(env: dict, log, kind: str = "http") -> tuple[subprocess.Popen, str]:
    """`modelcache http` (or grpc) on a free port: (process, host:port)."""
    proc = subprocess.Popen([sys.executable, "-m", "modelcache.cli", kind, "--port", "0", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            line = proc.stdout.readline()
            if line.startswith(b"READY "):
                return proc, line.split()[1].decode().removeprefix("http://")
    proc.kill()
    raise RuntimeError(f"modelcache {kind} did not start")


def report(res: dict, out=sys.stdout) -> None:
    print("per-request latency, sequential calls, batch 1 (us): p50 / p99; added = HTTP path less the lane",
          file=out)
    for model, r in res["latency"].items():
        lane = r["lane"]
        print(f"{model}  ({len(lane)} calls per path)", file=out)
        for m, values in r.items():
            p50, p99 = _pct(values, 50), _pct(values, 99)
            added = "" if m in ("lane", "http-floor") else \
                f"   added {p50 - _pct(lane, 50):+8.0f} / {p99 - _pct(lane, 99):+8.0f}"
            print(f"  {m:<13} {p50:9.0f} / {p99:9.0f}{added}", file=out)
    print(f"throughput, {res['clients']} client processes in a closed loop, {res['seconds']:g} s each (req/s):",
          file=out)
    for model, r in res["throughput"].items():
        print(f"  {model:<10} " + "   ".join(f"{m} {t['rps']:.1f}" for m, t in r.items()) +
              (f"   (http/lane {r['http-binary']['rps'] / r['lane']['rps']:.2f}x)" if r["lane"]["rps"] else ""),
              file=out)
        for m, t in r.items():
            if t.get("cpu_us_per_request"):
                print(f"    {m:<12} CPU per request: " + ", ".join(
                    f"{k} {v:.0f} us" for k, v in t["cpu_us_per_request"].items()), file=out)
    print(f"for scale, Triton's published HTTP figure: {TRITON_REF}", file=out)
    front = res.get("front") or f"aiohttp {res.get('aiohttp', '?')}"   # runs before the front left aiohttp
    print(f"machine: {os.cpu_count()} cores; the front's HTTP server: {front}", file=out)


def main(argv=None) -> int:
    ap = Parser(prog="modelcache bench http", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-cnn", help="the tiny model (zoo name; one FP32 input)")
    ap.add_argument("--big", default="resnet50", help="the big model (zoo name; one FP32 input)")
    ap.add_argument("--calls", type=int, default=400, help="sequential calls per path, the tiny model")
    ap.add_argument("--big-calls", type=int, default=40, help="sequential calls per path, the big model")
    ap.add_argument("--seconds", type=float, default=8.0, help="closed-loop time per throughput run")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--out")
    ap.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(*args.worker)
        return 0
    import httptools

    from ..measure import ensure_models, managed_daemon, save_results
    with tempfile.TemporaryDirectory(prefix="modelcache-bench-http-") as tmp:
        socket = f"ipc://{tmp}/daemon.sock"
        env = {**os.environ, "MODELCACHE_SOCKET": socket, "MODELCACHE_REPOSITORY": f"{tmp}/repo",
               "MODELCACHE_CONFIG": ""}
        log = open(Path(tmp) / "http.log", "ab")
        with managed_daemon(socket, f"{tmp}/repo", env={"MODELCACHE_CONFIG": ""}):
            paths = ensure_models(socket, [args.model, args.big], Path(tmp) / "zoo")
            io = {m: one_input_io(path) for m, path in paths.items()}
            front, hostport = start_front(env, log)
            from ..client.connection import connect
            with connect(socket) as c:
                daemon_pid = c.stats().pid
            try:
                res = {"front": f"llhttp (httptools {httptools.__version__})", "clients": args.clients,
                       "seconds": args.seconds, "latency": {}, "throughput": {}}
                for model, calls, block in ((args.model, args.calls, 20), (args.big, args.big_calls, 2)):
                    print(f"latency: {model} ...", file=sys.stderr, flush=True)
                    res["latency"][model] = latency(socket, hostport, model, io[model], calls, block, MODES)
                for model in io:
                    print(f"throughput: {model} ...", file=sys.stderr, flush=True)
                    res["throughput"][model] = {
                        "lane": throughput(socket, hostport, model, io[model], "lane", args.clients, args.seconds,
                                           {"daemon": daemon_pid}),
                        "http-binary": throughput(socket, hostport, model, io[model], "http-binary", args.clients,
                                                  args.seconds, {"front": front.pid, "daemon": daemon_pid})}
            finally:
                front.send_signal(signal.SIGTERM)
                front.wait(30)
                log.close()
    report(res)
    save_results(args.out, "http", argv, res, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
