"""Where an attach-mode open spends its time in a fresh process, step by step, per client path.

    PYTHONPATH=. python benchmarks/coldstart/breakdown.py [--models squeezenet1_1 alexnet] [--runs 15] [--out DIR]

Each sample is a fresh process that imports numpy and onnxruntime (as a function would), then
times each step of opening the model, read with perf_counter inside the process:
  modules   importing the client's modules (for `zmq`: pyzmq, logging, the settings loader)
  connect   the connection (for `zmq`: a ZeroMQ context and socket, the hello round trip,
            the heartbeat thread, the serve lane)
  open      the open round trip: the lease and where the weights are
  bind      an OrtValue over the mapped segment per weight, handed to SessionOptions
  session   onnxruntime.InferenceSession over the packed skeleton
Paths: `zmq` is connection.Client, the full client every call used before client/leases.py;
`lane` is the lease client a drop-in session now uses; `tuned` is the same ORT session over
the skeleton and weights copied into /dev/shm by hand (coldstart's ort-tuned), no daemon.
"""

from __future__ import annotations

# Nothing more here: the child runs this file, and a module imported before its clock starts (subprocess
# brings threading and select) would hide that module's cost from the step that needs it.
import json
import sys

PATHS = ("zmq", "lane", "tuned")
STEPS = ("modules", "connect", "open", "bind", "session")


def child(path: str, name: str, tuned_dir: str) -> None:
    """One fresh process: the steps of one open, as JSON on stdout (run as a script, not -m)."""
    import time
    import numpy  # noqa: F401,I001  (a function imports these before it opens anything)
    import onnxruntime as ort
    t = [time.perf_counter()]
    if path == "tuned":
        import os
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.add_session_config_entry("session.disable_prepacking", "1")
        t += [time.perf_counter()] * 4
        ort.InferenceSession(os.path.join(tuned_dir, "model.onnx"), so, providers=["CPUExecutionProvider"])
        t.append(time.perf_counter())
    else:
        from modelcache.session_options import attach_session_options, bind_weights
        if path == "zmq":
            from modelcache.client.connection import Client
        else:
            from modelcache.client.leases import shared_lease_client
        t.append(time.perf_counter())
        client = Client() if path == "zmq" else shared_lease_client()
        t.append(time.perf_counter())
        lease = client.open(name)
        t.append(time.perf_counter())
        so = attach_session_options()
        maps, values = bind_weights(so, lease.segments, lease.tensors)
        t.append(time.perf_counter())
        ort.InferenceSession(lease.skeleton_path, so, providers=["CPUExecutionProvider"])
        t.append(time.perf_counter())
    print(json.dumps({step: (b - a) * 1e3 for step, a, b in zip(STEPS, t, t[1:])}), flush=True)


def measure(socket: str, names: list[str], tuned: dict, runs: int, log) -> list[dict]:
    import os
    import subprocess
    from pathlib import Path

    import modelcache
    # The child runs as a script, so its sys.path starts here: it finds modelcache where this process did.
    where = str(Path(modelcache.__file__).resolve().parents[1])
    env = {**os.environ, "MODELCACHE_SOCKET": socket,
           "PYTHONPATH": os.pathsep.join(filter(None, [where, os.environ.get("PYTHONPATH")]))}
    samples = []
    for r in range(runs):
        for name in names:
            for path in PATHS:   # interleaved, so machine drift hits every path alike
                out = subprocess.run([sys.executable, __file__, "child", path, name, tuned[name]], env=env,
                                     capture_output=True, text=True, timeout=300)
                if out.returncode != 0:
                    raise RuntimeError(f"breakdown {path} {name} failed: {out.stderr[-1500:]}")
                samples.append({"model": name, "path": path, "run": r, **json.loads(out.stdout.splitlines()[-1])})
        log(f"breakdown round {r + 1}/{runs}")
    return samples


def report(samples: list[dict], out=sys.stdout) -> None:
    import statistics
    print(f"{'model':<14} {'path':<6} " + " ".join(f"{s:>9}" for s in STEPS) + f" {'total':>9} {'over tuned':>11}",
          file=out)
    for name in dict.fromkeys(s["model"] for s in samples):
        rows = {p: [s for s in samples if s["model"] == name and s["path"] == p] for p in PATHS}
        total = {p: statistics.median(sum(r[k] for k in STEPS) for r in rows[p]) for p in PATHS}
        for p in PATHS:
            steps = " ".join(f"{statistics.median(r[k] for r in rows[p]):>9.2f}" for k in STEPS)
            print(f"{name:<14} {p:<6} {steps} {total[p]:>9.2f} {total[p] - total['tuned']:>+11.2f}", file=out)
        print(f"{name:<14} -> the open costs ort-tuned's session plus {total['zmq'] - total['tuned']:.1f} ms on the "
              f"full client, {total['lane'] - total['tuned']:.1f} ms on the lane (medians of {len(rows['lane'])} "
              "fresh processes)", file=out)


def main(argv=None) -> int:
    import argparse
    import tempfile
    from pathlib import Path

    from modelcache.bench.coldstart import prepare_tuned
    from modelcache.measure import compile_bytecode, ensure_models, managed_daemon
    from modelcache.client.connection import connect

    ap = argparse.ArgumentParser(prog="benchmarks/coldstart/breakdown.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["squeezenet1_1", "alexnet"])
    ap.add_argument("--runs", type=int, default=15, help="fresh processes per path and model (default 15)")
    ap.add_argument("--socket", help="use this running daemon (default: start a private one)")
    ap.add_argument("--shm-dir", default="/dev/shm", help="where the daemon's host tier and ort-tuned's copy live")
    ap.add_argument("--out", help="directory for breakdown.txt and breakdown.json")
    args = ap.parse_args(argv)
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    compile_bytecode()
    with tempfile.TemporaryDirectory(prefix="modelcache-coldstart-") as tmp, \
            tempfile.TemporaryDirectory(prefix="modelcache-coldstart-", dir=args.shm_dir) as shm:
        socket = args.socket or f"ipc://{tmp}/daemon.sock"
        with managed_daemon(socket, None if args.socket else f"{tmp}/repo", env={"MODELCACHE_SHM_DIR": args.shm_dir}):
            ensure_models(socket, args.models, Path(tmp) / "zoo")
            with connect(socket) as client:
                tuned = {n: prepare_tuned(client, n, Path(shm)) for n in args.models}
                for n in args.models:
                    client.release(client.open(n).lease_id)   # resident: every path opens a host hit
            samples = measure(socket, args.models, tuned, args.runs, log)
    report(samples)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "breakdown.txt", "w") as f:
            given = sys.argv[1:] if argv is None else list(argv)
            print("$ PYTHONPATH=. python benchmarks/coldstart/breakdown.py " + " ".join(given), file=f)
            report(samples, f)
        (out / "breakdown.json").write_text(json.dumps(samples))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(*sys.argv[2:5])
    else:
        sys.exit(main())
