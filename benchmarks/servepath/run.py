"""Where a served call's time goes: a profile of the serve path, for whoever works on its latency.

    PYTHONPATH=. python benchmarks/servepath/run.py [--calls 2000] [--profile] [--out DIR]

Runs a real daemon (one 1-thread worker group) and a lane client on tiny-cnn, back to back,
and splits each call:
  client Python   the client's time outside waiting for the answer (encode, decode, checks)
  daemon handling the daemon's time from the request's bytes being readable to the reply sent
                  (lane read, decode, handler, engine, the stage's ORT run, encode, send),
                  wall and CPU; the ORT run alone comes from the call's timings
  the rest        waiting less the daemon's handling: the kernel and waking each side up
With --profile, the daemon's handling also runs under cProfile (which slows it: read the
shares, not the times) and the functions taking most of it are listed.

The daemon is started by this module, not by `modelcache daemon`: it wraps the lane's
read handler to time it, and nothing else is changed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WARMUP = 300


def run_daemon(socket: str, repository: str, out: str, profile: bool) -> None:
    """The daemon, with the lane's read handler timed (wall and thread CPU) and maybe profiled."""
    from modelcache.config import load
    from modelcache.daemon import lane_server, server

    stamps: list[tuple[float, float]] = []
    profiler = None
    if profile:
        import cProfile
        profiler = cProfile.Profile()
    handle_ready = lane_server.LaneServer.on_ready

    def timed_on_ready(self, fd, events, handle):
        if profiler:
            profiler.enable()
        wall, cpu = time.perf_counter(), time.thread_time()
        handle_ready(self, fd, events, handle)
        stamps.append((time.perf_counter() - wall, time.thread_time() - cpu))
        if profiler:
            profiler.disable()

    lane_server.LaneServer.on_ready = timed_on_ready
    daemon = server.Daemon(load(overrides={"socket": socket, "repository": repository, "workers": "1",
                                           "gpus": "none"}))
    signal.signal(signal.SIGTERM, daemon.request_stop)
    signal.signal(signal.SIGUSR1, lambda *_: (stamps.clear(), profiler and profiler.clear()))  # warm-up over
    daemon.serve_forever(lambda: print("READY", flush=True))
    top = []
    if profiler:
        import pstats
        stats = pstats.Stats(profiler).stats
        total = sum(tt for (_, _, tt, _, _) in stats.values()) or 1.0
        for (file, line, name), (_, calls, tt, _, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:25]:
            top.append({"where": f"{os.path.basename(file)}:{line}({name})", "calls": calls, "share": tt / total})
    Path(out).write_text(json.dumps({"stamps": stamps, "top": top}))


def measure(calls: int, profile: bool) -> dict:
    from modelcache import zoo
    from modelcache.client.connection import connect
    from modelcache.measure import plain_session

    with tempfile.TemporaryDirectory(prefix="modelcache-servepath-") as tmp:
        src = os.path.join(tmp, "tiny-cnn.onnx")
        zoo.save(zoo.build("tiny-cnn"), src)
        socket, stamps_file = f"ipc://{tmp}/d.sock", os.path.join(tmp, "stamps.json")
        cmd = [sys.executable, __file__, "--daemon", socket, os.path.join(tmp, "repo"),
               stamps_file] + (["--profile"] if profile else [])
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE)
        try:
            if not proc.stdout.readline().startswith(b"READY"):
                raise RuntimeError("the profiled daemon failed to start (see its log above)")
            feeds = zoo.sample_inputs(src)
            local = plain_session(src)
            served, waiting, runs, local_ms = [], [], [], []
            with connect(socket) as client:
                client.add(src, "tiny")
                for _ in range(WARMUP):
                    client.infer("tiny", feeds)
                    local.run(None, feeds)
                lane = client._lane.connect()   # the request core's current lane connection
                receive = lane.receive_all

                def timed_receive(deadline):
                    t = time.perf_counter()
                    try:
                        return receive(deadline)
                    finally:
                        waiting.append(time.perf_counter() - t)

                lane.receive_all = timed_receive
                proc.send_signal(signal.SIGUSR1)
                time.sleep(0.2)
                waiting.clear()
                for _ in range(calls):
                    t = time.perf_counter()
                    _, timings = client.infer("tiny", feeds)
                    served.append(time.perf_counter() - t)
                    runs.append(timings["stages"][0]["run_ms"] / 1e3)
                for _ in range(calls):
                    t = time.perf_counter()
                    local.run(None, feeds)
                    local_ms.append(time.perf_counter() - t)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        result = json.loads(Path(stamps_file).read_text())
    handled = result["stamps"][-calls:]
    us = lambda values: statistics.median(values) * 1e6  # noqa: E731
    return {"calls": calls, "profile": profile,
            "served_us": us(served), "in_process_us": us(local_ms),
            "client_python_us": us([s - w for s, w in zip(served, waiting)]),
            "daemon_handling_us": us([h[0] for h in handled]), "daemon_handling_cpu_us": us([h[1] for h in handled]),
            "ort_run_us": us(runs),
            "rest_us": us([w - h[0] for w, h in zip(waiting, handled)]),
            "daemon_top": result["top"]}


def report(res: dict, out=sys.stdout) -> None:
    print(f"tiny-cnn over the lane, {res['calls']} calls back to back, medians in us"
          + (" (daemon under cProfile: slower)" if res["profile"] else "") + ":", file=out)
    print(f"  served {res['served_us']:.0f}, in-process ORT {res['in_process_us']:.0f}: "
          f"added {res['served_us'] - res['in_process_us']:.0f}", file=out)
    print(f"  client Python          {res['client_python_us']:6.0f}", file=out)
    print(f"  daemon handling        {res['daemon_handling_us']:6.0f}  (CPU {res['daemon_handling_cpu_us']:.0f}; "
          f"of which the ORT run {res['ort_run_us']:.0f})", file=out)
    print(f"  kernel and wake-ups    {res['rest_us']:6.0f}", file=out)
    if res["daemon_top"]:
        print("daemon handling, by function (own time, share of the profiled total):", file=out)
        for row in res["daemon_top"]:
            print(f"  {100 * row['share']:5.1f} %  {row['calls']:>7}  {row['where']}", file=out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/servepath/run.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000, help="served calls measured, after a warm-up")
    ap.add_argument("--profile", action="store_true", help="also profile the daemon's handling (cProfile)")
    ap.add_argument("--daemon", nargs=3, metavar=("SOCKET", "REPOSITORY", "STAMPS"), help=argparse.SUPPRESS)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.daemon:
        run_daemon(*args.daemon, profile=args.profile)
        return 0
    from modelcache.measure import save_results
    res = measure(args.calls, args.profile)
    report(res)
    save_results(args.out, "servepath", argv, res, report,
                 command="PYTHONPATH=. python benchmarks/servepath/run.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
