"""Two checkouts' serve paths side by side on one machine: the lane and tritonclient.grpc's infer, interleaved.

    python benchmarks/grpc/ab.py A_CHECKOUT B_CHECKOUT [--rounds 20] [--calls 200] [--out DIR]

For a change to the lane or the gRPC front, measured where timing is noisy (a shared 2-core VM): each
checkout gets a daemon of its own (tiny-cnn added), its `modelcache grpc` in front, and a driver process,
all run from that checkout's code (PYTHONPATH). Each round, every driver makes `--calls` sequential calls
(batch 1) of each path, the checkouts in alternating order; so slow spells hit both. A path's figure per
checkout is the median over all its calls, with the spread of its per-round medians, and B/A per round.
Beside latency, the CPU time each call cost the front and the daemon (from /proc, per block of calls): the
work a change cuts shows there even when the machine's load swamps it in the latency.

  lane                ServeSession.run: driver -> the daemon's serve lane -> engine -> back
  grpc ModelInfer     a bare grpc channel's ModelInfer -> `modelcache grpc` -> lane -> daemon -> back
  tritonclient infer  tritonclient.grpc's infer + as_numpy (issue 39's goal: p50 <= 1.0 ms)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PATHS = ("lane", "grpc ModelInfer", "tritonclient infer")


def _cpu_s(pid: int) -> float:
    """The process's CPU time so far (user + system), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _daemon_pid(sock: str) -> int:
    from modelcache.client.connection import connect
    with connect(sock) as c:
        return c.stats().pid


def drive(checkout: str) -> None:
    """A driver (run from `checkout`): starts its daemon and front, then answers "PATH N" lines on stdin with
    one line of JSON: N latencies in microseconds, and the front's and the daemon's CPU time per call in
    microseconds; an empty line ends it."""
    import time

    import grpc
    import tritonclient.grpc as tg

    from modelcache.client.serve import ServeSession
    from path import model_infer, sample_input, tiny_cnn_served   # (beside this file: sys.path[0])

    with tiny_cnn_served(("grpc",), "modelcache-grpc-ab-") as (sock, _, [(front, where)]):
        pids = {"front": front.pid, "daemon": _daemon_pid(sock)}
        lane = ServeSession("tiny-cnn", socket=sock)
        i, o = lane.get_inputs()[0], lane.get_outputs()[0].name
        x = sample_input(i)
        channel = grpc.insecure_channel(where)
        client = tg.InferenceServerClient(where)
        ti = tg.InferInput(i.name, list(x.shape), "FP32")
        ti.set_data_from_numpy(x)
        touts = [tg.InferRequestedOutput(o)]
        calls = {"lane": lambda: lane.run(None, {i.name: x}), "grpc ModelInfer": model_infer(channel, i.name, x),
                 "tritonclient infer": lambda: client.infer("tiny-cnn", [ti], outputs=touts).as_numpy(o)}
        for call in calls.values():   # warm: sessions, channels, the engine's perf model
            for _ in range(300):
                call()
        print("READY", flush=True)
        for line in sys.stdin:
            if not line.strip():
                break
            path, n = line.rsplit(" ", 1)
            call, lat = calls[path], []
            cpu = {k: _cpu_s(p) for k, p in pids.items()}
            for _ in range(int(n)):
                t = time.perf_counter()
                call()
                lat.append((time.perf_counter() - t) * 1e6)
            cpu = {k: (_cpu_s(p) - cpu[k]) / len(lat) * 1e6 for k, p in pids.items()}
            print(json.dumps({"latency_us": lat, "cpu_us": cpu}), flush=True)
        client.close()
        channel.close()


def measure(checkouts: dict, rounds: int, calls: int) -> dict:
    drivers = {}
    for label, checkout in checkouts.items():
        env = {**os.environ, "PYTHONPATH": str(Path(checkout).resolve())}
        drivers[label] = subprocess.Popen([sys.executable, __file__, "--drive", checkout], env=env,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        for label, d in drivers.items():
            line = d.stdout.readline()
            if not line.startswith("READY"):
                raise RuntimeError(f"the driver of {label} ({checkouts[label]}) did not start")
        res = {label: {p: [] for p in PATHS} for label in checkouts}   # per round: that round's latencies
        cpu = {label: {p: [] for p in PATHS} for label in checkouts}   # per round: {front, daemon} us/call
        labels = list(checkouts)
        for r in range(rounds):
            for path in PATHS:
                for label in (labels if r % 2 == 0 else labels[::-1]):
                    d = drivers[label]
                    d.stdin.write(f"{path} {calls}\n")
                    d.stdin.flush()
                    block = json.loads(d.stdout.readline())
                    res[label][path].append(block["latency_us"])
                    cpu[label][path].append(block["cpu_us"])
    finally:
        for d in drivers.values():
            try:
                d.stdin.write("\n")
                d.stdin.flush()
            except OSError:
                pass
            d.wait(120)
    return {"checkouts": checkouts, "rounds": rounds, "calls": calls, "latency_us": res, "cpu_us": cpu}


def report(res: dict, out=sys.stdout) -> None:
    from modelcache.measure import summary
    (a, ca), (b, cb) = res["checkouts"].items()
    lat = res["latency_us"]
    print(f"A = {a} ({ca}), B = {b} ({cb}); {res['rounds']} rounds x {res['calls']} sequential calls a path, "
          "interleaved", file=out)
    print("tiny-cnn, batch 1; microseconds: p50 over every call (per-round medians: median [min-max]) / p99",
          file=out)
    for path in PATHS:
        print(f"  {path}", file=out)
        for label in (a, b):
            per_round = [statistics.median(x) for x in lat[label][path]]
            every = sorted(v for x in lat[label][path] for v in x)
            p50, p99 = every[len(every) // 2], every[int(len(every) * 0.99)]
            print(f"    {label:<8} {p50:7.0f}  ({statistics.median(per_round):.0f} "
                  f"[{min(per_round):.0f}-{max(per_round):.0f}])  / {p99:7.0f}", file=out)
        ratios = [statistics.median(y) / statistics.median(x) for x, y in zip(lat[a][path], lat[b][path])]
        print(f"    B/A per round: {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]", file=out)
        for proc in ("front", "daemon"):
            per = {label: [c[proc] for c in res["cpu_us"][label][path]] for label in (a, b)}
            if max(per[a]) < 5:   # (the lane does not pass the front)
                continue
            print(f"    {proc} CPU us/call: " + ", ".join(f"{label} {summary(per[label], '.0f')}" for label in (a, b))
                  + f"; B/A {statistics.median(per[b]) / statistics.median(per[a]):.3f}", file=out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", nargs="?")
    ap.add_argument("b", nargs="?")
    ap.add_argument("--labels", default="A,B", help="names for the two checkouts in the report")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out")
    ap.add_argument("--drive", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.drive:
        drive(args.drive)
        return 0
    if not (args.a and args.b):
        ap.error("give two checkouts")
    labels = args.labels.split(",")
    res = measure({labels[0]: args.a, labels[1]: args.b}, args.rounds, args.calls)
    report(res)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(res))
        with open(out / "report.txt", "w") as f:
            f.write(f"$ python benchmarks/grpc/ab.py {' '.join(argv if argv is not None else sys.argv[1:])}\n")
            report(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
