"""Model instances (issue 43, part 3): one Triton repository whose model asks for `instance_group { count: N }`,
served by Triton with its native ONNX Runtime backend and by modelcache (the same repository imported), side by
side: the memory each system holds and the requests/s it serves at 4 gRPC clients.

Each instance Triton runs is an ORT session of its own, with its own copy of the weights (and of the weights ORT
prepacks); modelcache keeps one copy in its host tier, its serve-mode workers run every model, and `count` is
not honoured (`modelcache import-triton` says so). Memory is each system's memory cgroup's working set (usage
less page cache: tmpfs tier pages and every process's anonymous memory, what a pod's limit counts), after the
load. Each server runs in a cgroup of its own, all started before the first round; the load rounds alternate
between them. Triton is set as its users run it: `serve.sh` from ../shared/peers/triton-native (Triton 2.51,
its CPU defaults, max_batch_size 4 with dynamic batching, the count asked); modelcache on its defaults.

    PYTHONPATH=. python benchmarks/instances/run.py --out benchmarks/instances
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
import threading
import time
from pathlib import Path

import numpy as np

from modelcache import memlimit, zoo

from benchmarks.systems.triton import PEER, free_port   # (run with PYTHONPATH=., as its docstring says)

MiB = 1 << 20


class Server:
    """A server process in a memory cgroup of its own: `label`, its gRPC port, its cgroup."""

    def __init__(self, label: str, cmd: list, env: dict, grpc_port: int, log: Path):
        self.label, self.grpc_port = label, grpc_port
        self.cg = memlimit.ChildCgroup.make(f"mc-instances-{label}-{os.getpid()}", 64 << 30)
        if self.cg is None:
            sys.exit(f"no memory cgroup: {memlimit.ChildCgroup.why}")
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=f, preexec_fn=self.cg.enter,
                                         start_new_session=True)

    def wait_ready(self, model: str, timeout_s: float = 300) -> None:
        import tritonclient.grpc as grpcclient
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{self.grpc_port}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"{self.label} exited: rc {self.proc.returncode}")
            try:
                if client.is_model_ready(model):
                    return
            except Exception:
                pass
            time.sleep(0.5)
        sys.exit(f"{self.label}: {model} not ready after {timeout_s} s")

    def working_set_mib(self) -> float:
        return memlimit.working_set_bytes(self.cg.limit) / MiB

    def stop(self) -> None:
        stop_group(self.proc)
        self.cg.remove()


def stop_group(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """A server started in a session of its own, and all it started: SIGTERM, then SIGKILL after `timeout_s`."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def load(port: int, model: str, x: np.ndarray, clients: int, seconds: float) -> dict:
    """`clients` closed-loop tritonclient gRPC clients for `seconds`: requests/s and latency percentiles."""
    import tritonclient.grpc as grpcclient
    latencies, errors, start = [], [], threading.Event()

    def client():
        c = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        i = grpcclient.InferInput("input", list(x.shape), "FP32")
        i.set_data_from_numpy(x)
        c.infer(model, [i])                        # connected and warm before the window
        start.wait()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t = time.perf_counter()
            try:
                c.infer(model, [i])
                latencies.append(time.perf_counter() - t)
            except Exception as e:
                errors.append(str(e)[:200])
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    time.sleep(1)
    start.set()
    for t in threads:
        t.join()
    ms = sorted(v * 1e3 for v in latencies)
    return {"requests_s": len(ms) / seconds, "p50_ms": ms[len(ms) // 2] if ms else None,
            "p99_ms": ms[int(len(ms) * 0.99)] if ms else None, "errors": len(errors)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet50", help="zoo model (default resnet50)")
    ap.add_argument("--count", type=int, default=4, help="instance_group count in the repository (default 4)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not (PEER / "serve.sh").exists():
        sys.exit(f"no Triton peer at {PEER}: ../shared/peers/triton-native (run its build.sh first)")
    lines = [f"command: python benchmarks/instances/run.py {' '.join(sys.argv[1:] if argv is None else argv)}",
             f"date: {time.strftime('%Y-%m-%d %H:%M:%S')}"]
    with tempfile.TemporaryDirectory(prefix="mc-instances-") as tmp:
        work = Path(tmp)
        src = work / f"{args.model}.onnx"
        zoo.save(zoo.build(args.model), str(src))
        x = np.asarray(list(zoo.sample_inputs(str(src)).values())[0], dtype=np.float32)
        servers = []
        try:
            for count in (1, args.count):     # Triton with one instance, and with the repository's count
                http, grpc = free_port(), free_port()
                env = {**os.environ, "INSTANCES": str(count), "REPO": str(work / f"triton-{count}")}
                servers.append(Server(f"triton-count{count}", ["bash", str(PEER / "serve.sh"), str(src), args.model,
                                                               str(http), str(grpc)], env, grpc, work / "triton.log"))
            # modelcache imports the very repositories Triton serves (serve.sh wrote them), each its own daemon.
            for s in servers:
                s.wait_ready(args.model)
            for count in (1, args.count):
                grpc = free_port()
                env = {**os.environ, "MODELCACHE_SOCKET": f"ipc://{work}/mc{count}/daemon.sock", "MODELCACHE_CONFIG": "",
                       "MODELCACHE_REPOSITORY": str(work / f"mc-repo-{count}"), "MODELCACHE_GRPC_PORT": str(grpc),
                       "MODELCACHE_TRITON_REPOSITORY": str(work / f"triton-{count}")}
                servers.append(Server(f"modelcache-count{count}", [sys.executable, "-m", "modelcache.cli", "daemon"],
                                      env, grpc, work / f"modelcache-{count}.log"))
            for s in servers:
                s.wait_ready(args.model)
            rounds = []
            for r in range(args.rounds):
                for s in (servers if r % 2 == 0 else servers[::-1]):
                    row = {"round": r, "server": s.label, **load(s.grpc_port, args.model, x, args.clients, args.seconds)}
                    rows_text = f"round {r} {s.label}: {row['requests_s']:.1f} req/s, p50 {row['p50_ms']:.1f} ms, " \
                                f"p99 {row['p99_ms']:.1f} ms, {row['errors']} errors"
                    print(rows_text, flush=True)
                    rounds.append(row)
            memory = {s.label: s.working_set_mib() for s in servers}
            warning = [line for line in (work / f"modelcache-{args.count}.log").read_text().splitlines()
                       if "not honour" in line]
        finally:
            for s in servers:
                s.stop()
    lines.append(f"model {args.model}, repository instance_group count {args.count}, {args.clients} gRPC clients, "
                 f"{args.seconds:g} s a round, {args.rounds} rounds alternated")
    lines.append(f"{'server':<22} {'memory MiB':>11} {'req/s median [min-max]':>26} {'p50 ms':>8} {'p99 ms':>8} "
                 f"{'errors':>6}")
    result = {"rounds": rounds, "memory_mib": memory, "modelcache_says": warning}
    for s in memory:
        rows = [r for r in rounds if r["server"] == s]
        rps = [r["requests_s"] for r in rows]
        lines.append(f"{s:<22} {memory[s]:>11.0f} {statistics.median(rps):>9.1f} [{min(rps):.1f}-{max(rps):.1f}]"
                     f"{'':>4} {statistics.median(r['p50_ms'] for r in rows):>8.1f} "
                     f"{statistics.median(r['p99_ms'] for r in rows):>8.1f} {sum(r['errors'] for r in rows):>6}")
    t1, tn = memory["triton-count1"], memory[f"triton-count{args.count}"]
    m1, mn = memory["modelcache-count1"], memory[f"modelcache-count{args.count}"]
    med = {s: statistics.median(r["requests_s"] for r in rounds if r["server"] == s) for s in memory}
    lines.append(f"memory of count {args.count} over count 1: Triton {tn / t1:.2f}x, modelcache {mn / m1:.2f}x; "
                 f"modelcache at count {args.count} is {mn / tn:.2f}x Triton's memory")
    lines.append(f"requests/s, modelcache over Triton count {args.count}: "
                 f"{med[f'modelcache-count{args.count}'] / med[f'triton-count{args.count}']:.2f}x")
    lines += [f"modelcache said: {w.split(': ', 1)[-1]}" for w in warning]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.txt").write_text(text + "\n")
        (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
