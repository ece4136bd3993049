"""Serve mode's large inputs, by memory files passed with the request (this checkout) against /dev/shm files named
in it (--baseline: a checkout before client/input_buffers.py), each on a real daemon of its own code.

    python benchmarks/inputs/run.py --baseline /tmp/scr/base --rounds 5 [--fronts [http] [grpc]] [--compares TEXT] \
        --out benchmarks/inputs

Per round, for each checkout in turn (the order alternated round by round): a fresh daemon, two models added, and
one client process (that checkout's code too) with a serve session on each:
- `sum`: ReduceSum over a float32 vector, so that the hand-over is most of the request: 0.3, 0.6, 4.8 and 48 MB;
- ResNet-50 (the zoo's), one 1x3x224x224 image (0.6 MB) and a batch of 8 (4.8 MB): what it is worth on a model;
- with --neg-mb, `neg`: y = -x, whose output is as large as its input: large outputs, which come back inline.
Timed: the client's `run()` (its median over the round's calls), and the daemon's CPU time over those calls, per call.

With --fronts, the same through `modelcache http` and `modelcache grpc` (each checkout's own front before its daemon;
`--fronts http` for one): a tritonclient client (HTTP with the tensors as binary data, or gRPC), as a Triton user
runs, timed per `infer()`, with the front's CPU and the daemon's a
call. The daemons then run with `front_runs = "never"`: by default a front runs a model itself where the engine would
run it alone within `inline_run_ms`, and a sum, even of 48 MB, never reached the daemon; a longer model (ResNet-50)
goes to the daemon either way. The cases over 256 KiB (INLINE_MAX_BYTES: smaller inputs travel in the message).

Then the reason for the change: the same client in a mount namespace of its own with an empty /dev/shm (what a
container beside the daemon's has; needs root and unshare), one 0.6 MB `sum` call on each checkout's daemon.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUM_MB = (0.3, 0.6, 4.8, 48.0)
RESNET_BATCHES = (1, 8)
FRONTS = ("http", "grpc")            # (--fronts with none named)
FRONT_CHOICES = FRONTS + ("grpc-stream",)   # grpc-stream: ModelStreamInfer, one request at a time on one stream
INLINE_MAX_BYTES = 256 * 1024   # (wire/tensors.py's: an input this small travels in the message, any way)

# The client: one serve session per model; prints {"case": [median run us, daemon CPU us a call]} as JSON.
CLIENT = r"""
import json, os, statistics, sys, time
import numpy as np, psutil
import modelcache
socket, cases = sys.argv[1], json.loads(sys.argv[2])
daemon = psutil.Process(modelcache.connect(socket).stats().pid)
out = {}
for case, model, shape, calls in cases:
    s = modelcache.InferenceSession(model, mode="serve", socket=socket)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    name = s.get_inputs()[0].name
    for _ in range(max(3, calls // 10)):   # (the daemon's first run of a model builds its session)
        s.run(None, {name: x})
    times, cpu0 = [], sum(daemon.cpu_times()[:2])
    for i in range(calls):
        x[0] = i        # (a new input each call: an answer to an older one would show)
        t0 = time.perf_counter()
        y = s.run(None, {name: x})[0]
        times.append(time.perf_counter() - t0)
        if model == "sum" and abs(float(y) - float(x.sum(dtype=np.float64))) > 1e-3 * x.size ** 0.5 + 1:
            raise SystemExit(f"wrong answer: {float(y)} for {float(x.sum())}")
        if model == "neg" and not np.array_equal(y, -x):
            raise SystemExit("wrong answer: not -x")
    cpu = sum(daemon.cpu_times()[:2]) - cpu0
    out[case] = [statistics.median(times) * 1e6, cpu / calls * 1e6]
print(json.dumps(out))
"""

# tritonclient against a front (argv[1]: http or grpc): prints {"case": [median infer us, front CPU us a call,
# daemon CPU us a call]}.
FRONT_CLIENT = r"""
import json, statistics, sys, time
import numpy as np, psutil
protocol, url = sys.argv[1], sys.argv[2]
front, daemon, cases = psutil.Process(int(sys.argv[3])), psutil.Process(int(sys.argv[4])), json.loads(sys.argv[5])
if protocol == "http":
    import tritonclient.http as tc
    binary = {"binary_data": True}
else:
    import queue
    import tritonclient.grpc as tc
    binary = {}
client = tc.InferenceServerClient(url)
if protocol == "grpc-stream":
    answers = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
cpu = lambda p: sum(p.cpu_times()[:2])
out = {}
for case, model, shape, calls in cases:
    meta = client.get_model_metadata(model) if protocol == "http" else client.get_model_metadata(model, as_json=True)
    name, oname = meta["inputs"][0]["name"], meta["outputs"][0]["name"]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    def infer():
        i = tc.InferInput(name, list(x.shape), "FP32")
        i.set_data_from_numpy(x, **binary)
        if protocol == "grpc-stream":
            client.async_stream_infer(model, [i], outputs=[tc.InferRequestedOutput(oname)])
            result, error = answers.get(timeout=300)
            if error is not None:
                raise SystemExit(f"stream error: {error}")
            return result.as_numpy(oname)
        return client.infer(model, [i], outputs=[tc.InferRequestedOutput(oname, **binary)]).as_numpy(oname)
    for _ in range(max(3, calls // 10)):
        infer()
    times, f0, d0 = [], cpu(front), cpu(daemon)
    for k in range(calls):
        x[0] = k
        t0 = time.perf_counter()
        y = infer()
        times.append(time.perf_counter() - t0)
        if model == "sum" and abs(float(y) - float(x.sum(dtype=np.float64))) > 1e-3 * x.size ** 0.5 + 1:
            raise SystemExit(f"wrong answer: {float(y)} for {float(x.sum())}")
        if model == "neg" and not np.array_equal(y, -x):
            raise SystemExit("wrong answer: not -x")
    out[case] = [statistics.median(times) * 1e6, (cpu(front) - f0) / calls * 1e6, (cpu(daemon) - d0) / calls * 1e6]
if protocol == "grpc-stream":
    client.stop_stream()
print(json.dumps(out))
"""

# In a mount namespace of its own, /dev/shm an empty tmpfs: one call with a 0.6 MB input.
CONTAINED = r"""
import sys, numpy as np, modelcache
s = modelcache.InferenceSession("sum", mode="serve", socket=sys.argv[1])
try:
    print("answered", float(s.run(None, {"x": np.ones(150_000, np.float32)})[0]))
except Exception as e:
    print(f"refused: {type(e).__name__}: {e}")
"""


def sum_model(path: str, op: str = "ReduceSum") -> None:
    """y = ReduceSum(x) over a float vector (an output of 4 bytes), or y = Neg(x) (`op`: an output as large as x)."""
    import onnx
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [] if op == "ReduceSum" else ["n"])
    graph = helper.make_graph([helper.make_node(op, ["x"], ["y"], **({"keepdims": 0} if op == "ReduceSum" else {}))],
                              "sum", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)


def cases(sum_mb, resnet_batches, neg_mb=()) -> list:
    # (30 calls at least: a process's CPU time moves in 10 ms ticks, and it is read over a case's calls)
    out = [[f"sum {mb:g} MB", "sum", [int(mb * 1e6) // 4], max(30, min(300, int(240 / mb)))] for mb in sum_mb]
    out += [[f"neg {mb:g} MB", "neg", [int(mb * 1e6) // 4], max(30, min(300, int(240 / mb)))] for mb in neg_mb]
    out += [[f"resnet50 batch {b} ({b * 0.6:.1f} MB)", "resnet50", [b, 3, 224, 224], max(10, 40 // b)]
            for b in resnet_batches]
    return out


def one_daemon(checkout: Path, work: Path, label: str, models: dict, run, settings: dict | None = None) -> str:
    """Start a daemon of `checkout`'s code (with `settings` in its environment), add `models`, call run(socket, env);
    its output."""
    from modelcache.measure import managed_daemon
    home = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=work))
    code = {"PYTHONPATH": str(checkout), "PYTHONSAFEPATH": "1", "MODELCACHE_CONFIG": "", **(settings or {})}
    socket = f"ipc://{home}/d.sock"
    with managed_daemon(socket, str(home / "repo"), env=code):
        env = {**os.environ, **code, "MODELCACHE_SOCKET": socket}
        for name, path in models.items():
            subprocess.run([sys.executable, "-m", "modelcache.cli", "add", path, "--name", name], env=env, check=True,
                           capture_output=True)
        return run(socket, env)


def timed(socket: str, env: dict, cases: list) -> dict:
    out = subprocess.run([sys.executable, "-c", CLIENT, socket, json.dumps(cases)], env=env, capture_output=True,
                         text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"client failed: {out.stderr[-1500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def through_front(socket: str, env: dict, protocol: str, cases: list) -> dict:
    """`modelcache http` (or grpc) of the daemon's checkout (env's PYTHONPATH) before it, and FRONT_CLIENT against it."""
    from modelcache.bench.http import start_front
    daemon = json.loads(subprocess.run([sys.executable, "-m", "modelcache.cli", "stats"], env=env, check=True,
                                       capture_output=True, text=True).stdout)["pid"]
    proc, address = start_front(env, subprocess.DEVNULL, protocol.split("-")[0])
    try:
        out = subprocess.run([sys.executable, "-c", FRONT_CLIENT, protocol, address, str(proc.pid), str(daemon),
                              json.dumps(cases)], capture_output=True, text=True, timeout=900)
    finally:
        proc.terminate()
        proc.wait(30)
    if out.returncode != 0:
        raise SystemExit(f"{protocol} client failed: {out.stderr[-1500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def contained(socket: str, env: dict) -> str:
    out = subprocess.run(["unshare", "-m", "sh", "-c", 'mount -t tmpfs none /dev/shm && exec "$0" -c "$1" "$2"',
                          sys.executable, CONTAINED, socket], env=env, capture_output=True, text=True, timeout=120)
    return (out.stdout.strip() or out.stderr.strip()[-300:]).splitlines()[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="a checkout before passed inputs")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sum-mb", type=float, nargs="*", default=list(SUM_MB), help="the sum model's input sizes")
    ap.add_argument("--neg-mb", type=float, nargs="*", default=[],
                    help="y = -x over inputs of these sizes: an output as large as the input (none by default)")
    ap.add_argument("--resnet-batches", type=int, nargs="*", default=list(RESNET_BATCHES),
                    help="ResNet-50's batch sizes (none: no ResNet-50)")
    ap.add_argument("--fronts", nargs="*", choices=FRONT_CHOICES,
                    help="also through these fronts (none named: http and grpc) with tritonclient, inputs over 256 "
                         "KiB; grpc-stream: the gRPC front's ModelStreamInfer; the daemons run with front_runs = never")
    ap.add_argument("--compares", default="passed memory files; baseline: /dev/shm files",
                    help="what the two checkouts do, for the report's header")
    ap.add_argument("--out", help="folder for report.txt and results.json")
    args = ap.parse_args()
    from modelcache import zoo
    work = Path(tempfile.mkdtemp(prefix="inputs-"))
    models = {"sum": str(work / "sum.onnx")}
    sum_model(models["sum"])
    if args.neg_mb:
        models["neg"] = str(work / "neg.onnx")
        sum_model(models["neg"], "Neg")
    if args.resnet_batches:
        models["resnet50"] = str(work / "resnet50.onnx")
        zoo.save(zoo.build("resnet50"), models["resnet50"])
    todo = cases(args.sum_mb, args.resnet_batches, args.neg_mb)
    checkouts = {"this": ROOT, "baseline": Path(args.baseline).resolve()}
    fronts = [] if args.fronts is None else args.fronts or list(FRONTS)
    front_todo = [c for c in todo if c[1] == "resnet50" or c[2][0] * 4 > INLINE_MAX_BYTES] if fronts else []
    rows = []   # {"round", "checkout", "path", "case", "us", "cpu_us", "front_cpu_us"}

    def both(socket: str, env: dict) -> dict:
        return {"session": timed(socket, env, todo)} | {
            front: through_front(socket, env, front, front_todo) for front in fronts if front_todo}

    for r in range(args.rounds):
        for label in (("this", "baseline") if r % 2 == 0 else ("baseline", "this")):
            got = one_daemon(checkouts[label], work, label, models, both,
                             {"MODELCACHE_FRONT_RUNS": "never"} if front_todo else None)
            rows += [{"round": r, "checkout": label, "path": "session", "case": c, "us": v[0], "cpu_us": v[1]}
                     for c, v in got["session"].items()]
            rows += [{"round": r, "checkout": label, "path": front, "case": c, "us": v[0], "front_cpu_us": v[1],
                      "cpu_us": v[2]} for front in fronts for c, v in got.get(front, {}).items()]
            print(f"round {r + 1}/{args.rounds} {label}: " + ", ".join(
                f"{path} {c} {v[0]:.0f} us" for path, cs in got.items() for c, v in cs.items()), flush=True)
    seen = {label: one_daemon(path, work, label, {"sum": models["sum"]}, contained) for label, path in checkouts.items()}
    text = report(rows, seen, args)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "report.txt").write_text(text + "\n")
        (Path(args.out) / "results.json").write_text(json.dumps({"rows": rows, "contained": seen}, indent=1))


def report(rows: list, seen: dict, args) -> str:
    def rev(path: Path) -> str:
        return subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()

    def med(xs: list) -> str:
        return f"{statistics.median(xs):.0f} [{min(xs):.0f}-{max(xs):.0f}]"

    this_does, _, baseline_does = args.compares.partition("; baseline: ")
    lines = ["$ python benchmarks/inputs/run.py " + shlex.join(sys.argv[1:]),   # (the command as it was given)
             f"this checkout ({rev(ROOT)}): {this_does}; baseline ({rev(Path(args.baseline))}): {baseline_does}. "
             f"{args.rounds} rounds, alternated; load average {os.getloadavg()[0]:.1f} at the end",
             "median [min-max] over rounds of each round's median; ratios per round"]
    for path, title in (("session", "a serve session (drop-in InferenceSession, mode='serve')"),
                        ("http", "through `modelcache http`, tritonclient.http with binary tensors"),
                        ("grpc", "through `modelcache grpc`, tritonclient.grpc"),
                        ("grpc-stream", "through `modelcache grpc`'s ModelStreamInfer, tritonclient.grpc's stream, "
                                        "one request at a time")):
        mine = [r for r in rows if r["path"] == path]
        if not mine:
            continue
        front = path != "session"
        lines += ["", title + ":", f"{'case':<28}{'run us: this':>24}{'baseline':>26}{'this / baseline':>22}"
                  + (f"{'front CPU us a call: this':>30}{'baseline':>26}" if front else "")
                  + f"{'daemon CPU us a call: this':>30}{'baseline':>26}"]
        for case in dict.fromkeys(r["case"] for r in mine):
            by = {c: {r["round"]: r for r in mine if r["case"] == case and r["checkout"] == c}
                  for c in ("this", "baseline")}
            ratio = [by["this"][k]["us"] / by["baseline"][k]["us"] for k in by["this"] if k in by["baseline"]]
            cpu = ("front_cpu_us", "cpu_us") if front else ("cpu_us",)
            lines.append(f"{case:<28}{med([r['us'] for r in by['this'].values()]):>24}"
                         f"{med([r['us'] for r in by['baseline'].values()]):>26}"
                         f"{f'x{statistics.median(ratio):.2f} [{min(ratio):.2f}-{max(ratio):.2f}]':>22}"
                         + "".join(f"{med([r[k] for r in by['this'].values()]):>30}"
                                   f"{med([r[k] for r in by['baseline'].values()]):>26}" for k in cpu))
    lines += ["", "a client in a mount namespace of its own (/dev/shm an empty tmpfs), one 0.6 MB input:"]
    lines += [f"  {label}: {what}" for label, what in seen.items()]
    return "\n".join(lines)

if __name__ == "__main__":
    main()
