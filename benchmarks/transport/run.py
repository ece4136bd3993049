"""Transport benchmark: a bare request/reply round trip over ZeroMQ against the serve lane's
Unix stream socket, between two processes, as the daemon and a client use them.

    PYTHONPATH=. python benchmarks/transport/run.py [--calls 1500] [--work-us 100] [--out DIR]

The server busies itself --work-us per request (a stand-in for a tiny model's run), and
the client busies itself for a "think" time between calls (0, 100, 300, 1000 us), during
which the server idles. On a VM an idle CPU must be woken, which costs more the longer it
slept. Reported: round trip minus the server's work, p50 per think time.

ZeroMQ passes every message through an I/O thread on both ends (4 more thread wake-ups
per round trip than a plain socket); this is the measurement behind the serve lane.

Also "reads": one 12 KB message (tiny-cnn's input) sent and read on a socket pair, read
three ways; the measurement behind modelcache.wire.lane.recv_chunk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

THINK_US = (0, 100, 300, 1000)


def _busy(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def serve(kind: str, address: str, work_us: float) -> None:
    """The server end: answer every request after `work_us` of work, until told to quit."""
    if kind == "zmq":
        import zmq
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.bind(address)
        print("ready", flush=True)
        while True:
            ident, body = sock.recv_multipart()
            if body == b"quit":
                return
            _busy(work_us)
            sock.send_multipart([ident, b"ok"])
    from modelcache.measure import serve_one_lane_client

    def answer(body: bytes) -> bytes | None:
        if body == b"quit":
            return None
        _busy(work_us)
        return b""

    serve_one_lane_client(address, answer)


def measure(kind: str, address: str, calls: int, work_us: float) -> dict:
    server = subprocess.Popen([sys.executable, __file__, "--serve", kind, address,
                               "--work-us", str(work_us)], stdout=subprocess.PIPE, text=True)
    try:
        server.stdout.readline()
        if kind == "zmq":
            import zmq
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)

            def call():
                sock.send(b"x")
                sock.poll(5000)
                sock.recv()

            def quit_():
                sock.send(b"quit")
                time.sleep(0.1)
                sock.close()
        else:
            from modelcache.wire.lane import LaneClient
            lane = LaneClient(address)

            def call():
                deadline = time.monotonic() + 5
                lane.send(b"req", b"x", deadline)
                lane.receive(deadline)

            def quit_():
                lane.send(b"req", b"quit", time.monotonic() + 5)
                lane.close()
        out = {}
        for think in THINK_US:
            ts = []
            for _ in range(calls):
                _busy(think)
                t = time.perf_counter()
                call()
                ts.append((time.perf_counter() - t) * 1e6 - work_us)
            ts = ts[calls // 10:]  # warm-up
            out[str(think)] = {"p50_us": statistics.median(ts), "p10_us": statistics.quantiles(ts, n=10)[0],
                          "p90_us": statistics.quantiles(ts, n=10)[-1]}
        quit_()
        return out
    finally:
        try:
            server.wait(5)
        except subprocess.TimeoutExpired:
            server.kill()


READ_MESSAGE_BYTES = 12 << 10


def reads(calls: int = 20000) -> dict:
    """Microseconds per send + read of one message, by how it is read (best of 5 blocks)."""
    import socket

    from modelcache.wire.lane import recv_chunk

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    message = bytes(READ_MESSAGE_BYTES)
    scratch = memoryview(bytearray(1 << 20))
    ways = {"recv(1 MiB)": lambda: b.recv(1 << 20),
            "recv(64 KiB)": lambda: b.recv(64 << 10),
            "recv_chunk (reused 1 MiB buffer)": lambda: recv_chunk(b, scratch)}
    out = {}
    try:
        for name, read in ways.items():
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(calls):
                    a.send(message)
                    read()
                best = min(best, time.perf_counter() - t)
            out[name] = best / calls * 1e6
    finally:
        a.close()
        b.close()
    return out


def report(res: dict, out=sys.stdout) -> None:
    print(f"round trip less {res['work_us']:.0f} us of server work, p50 [p10-p90] us, by client think time:", file=out)
    print(f"{'transport':<10}" + "".join(f"{f'think {t} us':>22}" for t in THINK_US), file=out)
    for kind in ("zmq", "lane"):
        cells = "".join(f"{'%.0f [%.0f-%.0f]' % (r['p50_us'], r['p10_us'], r['p90_us']):>22}"
                        for r in (res[kind][str(t)] for t in THINK_US))
        print(f"{kind:<10}{cells}", file=out)
    if "reads" in res:
        print(f"reads: send + read of one {READ_MESSAGE_BYTES >> 10} KiB message, us (best of 5 blocks):", file=out)
        for name, us in res["reads"].items():
            print(f"  {name:<34}{us:6.1f}", file=out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/transport/run.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=1500, help="round trips per transport and think time")
    ap.add_argument("--work-us", type=float, default=100.0, help="server work per request")
    ap.add_argument("--serve", nargs=2, metavar=("KIND", "ADDRESS"), help=argparse.SUPPRESS)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve[0], args.serve[1], args.work_us)
        return 0
    from modelcache.measure import save_results
    with tempfile.TemporaryDirectory(prefix="modelcache-transport-") as tmp:
        res = {"work_us": args.work_us, "calls": args.calls,
               "zmq": measure("zmq", f"ipc://{os.path.join(tmp, 'zmq.sock')}", args.calls, args.work_us),
               "lane": measure("lane", os.path.join(tmp, "lane.sock"), args.calls, args.work_us),
               "reads": reads()}
    report(res)
    save_results(args.out, "transport", argv, res, report,
                 command="PYTHONPATH=. python benchmarks/transport/run.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
