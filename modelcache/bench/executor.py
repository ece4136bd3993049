"""Serve-mode benchmark: overhead over in-process ORT, throughput per worker layout and scheduler,
and how well the performance models predict.

    modelcache bench executor [--seconds 10] [--clients 4] [--out DIR]

1. Overhead: a tiny model run sequentially, in-process ORT (1 thread) against serve mode
   on one 1-thread worker group; the difference of the medians is what the daemon adds.
   Measured over the serve lane and over ZeroMQ alone, each in two patterns, interleaved
   in rounds so that all see the same machine:
     back-to-back: a block of served calls, then a block of in-process runs;
     alternating:  served, in-process, served, ... so the daemon idles ~0.2 ms before
                   each call (on a VM, an idle CPU that must be woken costs real time).
   For scale, the same is measured against "floor": a minimal server on a lane socket
   (msgpack in, plain ORT, msgpack out; no engine, checks or timings): what any Python
   serve path pays on this machine at that moment. Over the back-to-back blocks, the CPU
   time the server process and the client process used per call is summed too: the work
   done, apart from how long the machine took to wake either side.
2. Throughput: ResNet-50 split into 2 stages, closed loop from --clients threads for
   --seconds, under worker groups "2" (one group of 2 threads) and "1,1" (two groups of
   1), each with the eager and the dmda scheduler; CPU only, and where a GPU with
   onnxruntime-gpu exists, also "2+gpu" (the 2-thread group beside a worker per GPU).
3. Prediction error: the daemon's median |predicted - measured| / measured over the
   stage times it predicted before running them, per configuration.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..measure import managed_daemon, plain_session, save_results
from ..usage import Parser


def _daemon_env(**settings):
    for k, v in settings.items():
        os.environ[f"MODELCACHE_{k.upper()}"] = str(v)


OVERHEAD_BLOCK = 25   # calls per block; blocks of every (transport, pattern) take turns


def floor_server(path: str, src: str) -> None:
    """The floor's server: one connection, each message a msgpack map name -> [dtype, shape, bytes]."""
    import msgpack
    import numpy as np
    from ..measure import serve_one_lane_client

    sess = plain_session(src)
    names = [o.name for o in sess.get_outputs()]

    def answer(body: bytes) -> bytes:
        feeds = {k: np.frombuffer(b, dtype=dt).reshape(shape) for k, (dt, shape, b) in msgpack.unpackb(body).items()}
        return msgpack.packb({n: [v.dtype.str, list(v.shape), v.tobytes()] for n, v in zip(names, sess.run(None, feeds))})

    serve_one_lane_client(path, answer)


class FloorClient:
    def __init__(self, tmp: Path, src: str):
        from ..wire.lane import LaneClient
        path = str(tmp / "floor.sock")
        self.proc = subprocess.Popen([sys.executable, "-m", "modelcache.bench.executor", "--floor-server", path, src],
                                     stdout=subprocess.PIPE, text=True)
        self.proc.stdout.readline()
        self.lane = LaneClient(path)

    def infer(self, feeds: dict) -> dict:
        import msgpack
        import numpy as np
        deadline = time.monotonic() + 30
        self.lane.send(b"infer", msgpack.packb({k: [v.dtype.str, list(v.shape), v.tobytes()]
                                                for k, v in feeds.items()}), deadline)
        _, body = self.lane.receive(deadline)
        return {k: np.frombuffer(b, dtype=dt).reshape(shape) for k, (dt, shape, b) in msgpack.unpackb(body).items()}

    def close(self) -> None:
        self.lane.close()
        self.proc.wait(10)


def _cpu_s(pid: int) -> float | None:
    """CPU seconds the threads of a process have run so far: Linux's schedstat, in nanoseconds (its
    /proc/PID/stat counts 10 ms ticks, coarser than a block of calls); None where there is none."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
            except FileNotFoundError:
                pass    # a thread that ended; its time is lost, and threads do not end mid-benchmark
    except (OSError, ValueError, IndexError):
        return None
    return total / 1e9


def overhead(tmp: Path, src: str, calls: int) -> dict:
    from .. import zoo
    from ..client.connection import connect

    _daemon_env(workers="1", gpus="none", scheduler="dmda")
    socket = f"ipc://{tmp}/overhead.sock"
    feeds = zoo.sample_inputs(src)
    local = plain_session(src)

    def run_local(times):
        t = time.perf_counter()
        local.run(None, feeds)
        times.append((time.perf_counter() - t) * 1e3)

    def run_served(client, s):
        t = time.perf_counter()
        if client is floor:
            floor.infer(feeds)
            s["serve"].append((time.perf_counter() - t) * 1e3)
            return
        _, timings = client.infer("tiny", feeds)
        s["serve"].append((time.perf_counter() - t) * 1e3)
        stage = timings["stages"][0]
        s["daemon"].append(timings["total_ms"])   # arrival -> answer ready, in the daemon
        s["run"].append(stage["run_ms"])          # ORT
        s["handoff"].append(stage["wait_ms"])     # placed -> done, less the run: hand-offs, if not inline
        s["inline"].append(bool(stage.get("inline")))

    with managed_daemon(socket, str(tmp / "repo")), connect(socket) as lane_c, connect(socket, lane=False) as zmq_c:
        if not any(m["name"] == "tiny" for m in lane_c.list()):
            lane_c.add(src, "tiny")
        floor = FloorClient(tmp, src)
        for _ in range(50):
            lane_c.infer("tiny", feeds)
            zmq_c.infer("tiny", feeds)
            floor.infer(feeds)
            local.run(None, feeds)
        clients = {"lane": lane_c, "zmq": zmq_c, "floor": floor}
        # CPU used per call by the server process and by this one, over the back-to-back blocks: work
        # done, apart from how long the machine took to wake anyone up.
        server_pid = {"lane": lane_c.stats().pid, "zmq": zmq_c.stats().pid, "floor": floor.proc.pid}
        cpu = {tr: {"server_s": 0.0, "client_s": 0.0, "calls": 0} for tr in clients}
        samples = {(tr, pat): {"serve": [], "local": [], "daemon": [], "run": [], "handoff": [], "inline": []}
                   for tr in clients for pat in ("back-to-back", "alternating")}
        list_ms: list[float] = []
        for _ in range(max(1, calls // OVERHEAD_BLOCK)):
            for (transport, pattern), s in samples.items():
                client = clients[transport]
                if pattern == "back-to-back":
                    server_0, client_0 = _cpu_s(server_pid[transport]), time.process_time()
                    for _ in range(OVERHEAD_BLOCK):
                        run_served(client, s)
                    server_1, c = _cpu_s(server_pid[transport]), cpu[transport]
                    if server_0 is not None and server_1 is not None:
                        c["server_s"] += server_1 - server_0
                        c["client_s"] += time.process_time() - client_0
                        c["calls"] += OVERHEAD_BLOCK
                    for _ in range(OVERHEAD_BLOCK):
                        run_local(s["local"])
                else:
                    for _ in range(OVERHEAD_BLOCK):
                        run_served(client, s)
                        run_local(s["local"])
            for _ in range(OVERHEAD_BLOCK):
                t = time.perf_counter()
                zmq_c.list()                  # the smallest request/reply over ZeroMQ: our RPC floor
                list_ms.append((time.perf_counter() - t) * 1e3)
        floor.close()
    rows = []
    for (transport, pattern), s in samples.items():
        med = {k: statistics.median(v) if v else None for k, v in s.items() if k != "inline"}
        q = statistics.quantiles(s["serve"], n=10)
        row = {"transport": transport, "pattern": pattern, "calls": len(s["serve"]),
               "serve_p50_ms": med["serve"], "serve_p10_ms": q[0], "serve_p90_ms": q[-1],
               "local_p50_ms": med["local"], "overhead_p50_ms": med["serve"] - med["local"]}
        rows.append(row)
        if transport == "floor":
            continue
        row.update({"inline_share": sum(s["inline"]) / len(s["inline"]),
                    # Where a served request's time goes (medians, so the parts need not add up exactly).
                    "breakdown_ms": {"stage_run": med["run"], "handoffs": med["handoff"],
                                     "engine_bookkeeping": med["daemon"] - med["run"] - med["handoff"],
                                     "messaging_outside_engine": med["serve"] - med["daemon"]}})
    cpu_us = {tr: {"server": c["server_s"] / c["calls"] * 1e6, "client": c["client_s"] / c["calls"] * 1e6}
              for tr, c in cpu.items() if c["calls"]}
    return {"rows": rows, "list_rpc_p50_ms": statistics.median(list_ms), "cpu_us_per_call": cpu_us}


def layouts() -> list[tuple[str, str]]:
    """(CPU worker groups, gpus setting) to measure: 1 group of 2 threads and 2 of 1, CPU only, so the
    figures compare across machines; and where a GPU and onnxruntime-gpu exist, the 2-thread group
    beside the GPU workers."""
    from ..executor.workers import discover_gpus

    return [("2", "none"), ("1,1", "none")] + ([("2", "auto")] if discover_gpus("auto") else [])


def throughput(tmp: Path, src: str, workers: str, scheduler: str, seconds: float, clients: int,
               gpus: str = "none") -> dict:
    from .. import zoo
    from ..client.connection import connect

    label = workers if gpus == "none" else f"{workers}+gpu"
    _daemon_env(workers=workers, gpus=gpus, scheduler=scheduler, state_dir=tmp / f"state-{label}-{scheduler}")
    socket = f"ipc://{tmp}/tp.sock"
    feeds = zoo.sample_inputs(src)
    # For GPU workers, a model packed with the basic optimizations only: the CPU-specific fused and
    # layout ops of the 'all' level would stay on the CPU.
    name, opt_level = ("r50", None) if gpus == "none" else ("r50-basic", "basic")
    with managed_daemon(socket, str(tmp / "repo")), connect(socket) as c:
        if not any(m["name"] == name for m in c.list()):
            c.add(src, name, opt_level=opt_level)
            c.partition(name, stages=2)
        conns = [connect(socket) for _ in range(clients)]
        for conn in conns:                     # calibrate every (stage, worker kind) first
            for _ in range(3):
                conn.infer(name, feeds)
        latencies: list[float] = []
        stop_at = time.perf_counter() + seconds

        def loop(conn):
            while time.perf_counter() < stop_at:
                t = time.perf_counter()
                conn.infer(name, feeds)
                latencies.append((time.perf_counter() - t) * 1e3)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=loop, args=(conn,)) for conn in conns]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        ex = c.stats().executor
        for conn in conns:
            conn.close()
    return {"workers": label, "scheduler": scheduler, "requests": len(latencies),
            "throughput_rps": len(latencies) / elapsed, "p50_ms": statistics.median(latencies),
            "prediction_error_median": ex["perf_models"]["median_error"],
            "predictions_checked": ex["perf_models"]["predictions_checked"]}


def report(res: dict, out=sys.stdout) -> None:
    o = res["overhead"]
    print("serve-mode overhead on tiny-cnn over in-process ORT (ms, p50; served p10-p90 in brackets):", file=out)
    print(f"{'transport':<10} {'pattern':<13} {'served':>15} {'in-process':>11} {'added':>7} {'inline':>7}   "
          f"where it goes: ORT / hand-offs / engine / messaging", file=out)
    for r in o["rows"]:
        served = f"{r['serve_p50_ms']:.3f} [{r['serve_p10_ms']:.2f}-{r['serve_p90_ms']:.2f}]"
        b = r.get("breakdown_ms")
        where = "-" if b is None else (f"{b['stage_run']:.3f} / {b['handoffs']:.3f} / {b['engine_bookkeeping']:.3f} / "
                                       f"{b['messaging_outside_engine']:.3f}")
        inline = "-" if b is None else f"{100 * r['inline_share']:.0f}%"
        print(f"{r['transport']:<10} {r['pattern']:<13} {served:>15} {r['local_p50_ms']:>11.3f} "
              f"{r['overhead_p50_ms']:>7.3f} {inline:>7}   {where}", file=out)
    print(f"a bare `list` round trip over ZeroMQ: {o['list_rpc_p50_ms']:.3f} ms", file=out)
    if o.get("cpu_us_per_call"):
        print("CPU per call, back to back (us; server process / client process): " + ", ".join(
            f"{tr} {c['server']:.0f} / {c['client']:.0f}" for tr, c in o["cpu_us_per_call"].items()), file=out)
    print(f"\nResNet-50 in 2 stages, {res['clients']} closed-loop clients, {res['seconds']:.0f} s each:", file=out)
    print(f"{'workers':<8} {'scheduler':<10} {'req/s':>7} {'p50 ms':>8} {'pred. error (median)':>21} {'checked':>8}",
          file=out)
    for r in res["throughput"]:
        err = r["prediction_error_median"]
        print(f"{r['workers']:<8} {r['scheduler']:<10} {r['throughput_rps']:>7.2f} {r['p50_ms']:>8.1f} "
              f"{'-' if err is None else f'{100 * err:.1f} %':>21} {r['predictions_checked']:>8}", file=out)


def main(argv=None) -> int:
    ap = Parser(prog="modelcache bench executor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--calls", type=int, default=1000,
                    help="sequential served calls per transport and pattern for the overhead figure")
    ap.add_argument("--overhead-only", action="store_true", help="measure the overhead only, skip throughput")
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--tiny", default="tiny-cnn")
    ap.add_argument("--floor-server", nargs=2, metavar=("SOCKET", "MODEL"), help=argparse.SUPPRESS)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.floor_server:
        floor_server(*args.floor_server)
        return 0
    from .. import zoo
    saved = {k: v for k, v in os.environ.items() if k.startswith("MODELCACHE_")}
    with tempfile.TemporaryDirectory(prefix="modelcache-executor-") as tmp:
        tmp = Path(tmp)
        paths = {}
        for name in (args.tiny,) if args.overhead_only else (args.tiny, args.model):
            paths[name] = str(tmp / f"{name}.onnx")
            zoo.save(zoo.build(name), paths[name])
        try:
            res = {"overhead": overhead(tmp, paths[args.tiny], args.calls), "clients": args.clients,
                   "seconds": args.seconds, "throughput": []}
            for workers, gpus in () if args.overhead_only else layouts():
                for scheduler in ("eager", "dmda"):
                    print(f"throughput: workers={workers} gpus={gpus} scheduler={scheduler} ...", file=sys.stderr,
                          flush=True)
                    res["throughput"].append(throughput(tmp, paths[args.model], workers, scheduler,
                                                        args.seconds, args.clients, gpus))
        finally:
            for k in [k for k in os.environ if k.startswith("MODELCACHE_")]:
                del os.environ[k]
            os.environ.update(saved)
    report(res)
    save_results(args.out, "executor", argv, res, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
