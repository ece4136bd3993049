"""The daemon inside a memory limit, measured (issue 42's "done means"): each scenario runs the real daemon,
its clients and a neighbour in one real memory cgroup (v1 or v2; root), as a pod or a MemoryMax= unit would.

- limit:    a 1.5 GiB cgroup, host_capacity 8G (refused at start; then run with capacity_over_limit = warn): a
            client inside opens and holds sessions on 12 128 MiB models, until one fails (the memory limit takes
            9 in the tier; the default open_when_full = disk answers the rest over the repository's files, which
            `from_files` counts); then the daemon and the client are SIGKILLed (the tier stays, charged) and the
            daemon restarts in the same cgroup and serves a fresh client, which opens them all again.
- pressure: a 3 GiB cgroup, defaults, the tier full of idle 128 MiB models, two clients running sessions on two
            of them; a neighbour grows 2 GiB at 128 MiB/s: does it get it, do the clients see an error, is
            anything OOM-killed, is every model intact after (`verify`)?
- frees:    models that share a 96 MiB tensor (fine-tuned variants) beside independent ones: each evicted in
            turn, what `ls` said it frees (FREES) against what the tier's files and the cgroup gave back.

    python benchmarks/memlimit/run.py --out benchmarks/memlimit
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import onnx

from modelcache import connect, memlimit, zoo
from modelcache.store.packing import pack

MiB = 1 << 20

# A client inside the cgroup. "hold": opens a session on each model named on stdin, runs it once and keeps it,
# answering "ok NAME" or "error TYPE MESSAGE". "run": runs sessions on its models in a loop and prints
# "requests errors" each second. Both stop when stdin closes.
CLIENT = textwrap.dedent("""
    import sys, threading, time
    import numpy as np
    import modelcache
    ids = np.arange(4, dtype=np.int64)
    if sys.argv[1] == "hold":
        held = []
        for line in sys.stdin:
            try:
                s = modelcache.InferenceSession(line.strip())
                s.run(None, {"ids": ids})
                held.append(s)
                print("ok", line.strip(), flush=True)
            except Exception as e:
                print("error", type(e).__name__, str(e).replace("\\n", " "), flush=True)
    else:
        sessions = [modelcache.InferenceSession(n) for n in sys.argv[2:]]
        counts, done = [0, 0], threading.Event()
        def report():
            while not done.wait(1):
                print(*counts, flush=True)
        threading.Thread(target=report, daemon=True).start()
        threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
        while not done.is_set():
            for s in sessions:
                try:
                    s.run(None, {"ids": ids})
                    counts[0] += 1
                except Exception as e:
                    counts[1] += 1
                    print("error", type(e).__name__, e, file=sys.stderr, flush=True)
            time.sleep(0.002)
        print(*counts, flush=True)
""")



class Daemon:
    """`modelcache daemon` in the cgroup, on a socket under `root`."""

    def __init__(self, root: Path, repository: Path, cg, **settings):
        self.env = {**os.environ, "MODELCACHE_SOCKET": f"ipc://{root}/run/daemon.sock",
                    "MODELCACHE_REPOSITORY": str(repository), "MODELCACHE_CONFIG": "", "MODELCACHE_LOG_LEVEL": "info",
                    **{f"MODELCACHE_{k.upper()}": str(v) for k, v in settings.items()}}
        self.cg, self.log = cg, root / "daemon.log"
        self.proc = None

    def start(self) -> "Daemon":
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "modelcache.cli", "daemon"], env=self.env,
                                         stdout=subprocess.PIPE, stderr=log, preexec_fn=self.cg.enter)
        line = self.proc.stdout.readline()
        if not line.startswith(b"READY"):
            raise RuntimeError(f"daemon did not start: {self.log.read_text()[-2000:]}")
        return self

    def client(self, *args) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", CLIENT, *args], env=self.env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, preexec_fn=self.cg.enter)

    def connect(self):
        return connect(self.env["MODELCACHE_SOCKET"])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)


def make_cgroup(name: str, limit: int):
    cg = memlimit.ChildCgroup.make(f"{name}-{os.getpid()}", limit)
    if cg is None:
        sys.exit(f"no memory cgroup: {memlimit.ChildCgroup.why}")
    return cg


def pack_sized(repository: Path, work: Path, name: str, nbytes: int, seed: int) -> None:
    src = work / f"{name}.onnx"
    onnx.save(zoo.sized(nbytes, seed), str(src))
    pack(str(src), repository, name, 1)
    src.unlink()


def host(c) -> dict:
    return c.stats().tiers[0]


def scenario_limit(work: Path, out: list) -> dict:
    repository = work / "repo-limit"
    for i in range(12):
        pack_sized(repository, work, f"m{i}", 128 * MiB, seed=i)
    cg = make_cgroup("mc-bench-limit", 1536 * MiB)
    r = {"limit_mib": 1536, "models": "12 x 128 MiB"}
    try:
        refused = subprocess.run([sys.executable, "-m", "modelcache.cli", "daemon"], capture_output=True, text=True,
                                 env={**Daemon(work, repository, cg).env, "MODELCACHE_HOST_CAPACITY": "8G"},
                                 preexec_fn=cg.enter, timeout=120)
        r["refused_start"] = {"rc": refused.returncode, "stderr": refused.stderr.strip()}
        d = Daemon(work, repository, cg, host_capacity="8G", capacity_over_limit="warn").start()
        r["first"] = hold_each(d, 12)
        r["first"].update(oom_kills=cg.oom_kills(), daemon_alive=d.proc.poll() is None)
        d.proc.send_signal(signal.SIGKILL)      # with its tier full and a client mapping it: a crash, a pod restart
        d.proc.wait()
        for pid in cg.pids():
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        r["after_kill_working_set_mib"] = round(memlimit.working_set_bytes(cg.limit) / MiB)
        t0 = time.monotonic()
        d = Daemon(work, repository, cg, host_capacity="8G", capacity_over_limit="warn").start()
        r["restart_s"] = round(time.monotonic() - t0, 2)
        log = d.log.read_text()
        r["restart_log"] = [line.split(": ", 1)[1][:300] for line in log.splitlines()[-40:]
                            if "warm restart: re-adopted" in line or "memory pressure" in line]
        r["second"] = hold_each(d, 12)
        r["second"].update(oom_kills=cg.oom_kills(), daemon_alive=d.proc.poll() is None,
                           daemon_starts=log.count(" ready on "))
        d.stop()
    finally:
        cg.remove()
    out.append(f"limit: {json.dumps(r, indent=1)}")
    return r


def hold_each(d: Daemon, n: int) -> dict:
    """A client in the cgroup opens and holds m0, m1, ... until one fails; what the opens got."""
    client = d.client("hold")
    opened, failure = [], None
    try:
        for i in range(n):
            client.stdin.write(f"m{i}\n")
            client.stdin.flush()
            answer = client.stdout.readline().strip()
            if not answer.startswith("ok"):
                failure = answer or f"the client died: rc {client.poll()}"
                break
            opened.append(f"m{i}")
        with d.connect() as c:
            h = host(c)
            from_files = c.stats().counters.get("opens_from_disk", 0)
    finally:
        client.stdin.close()
        client.wait(30)
    return {"opened": opened, "from_files": from_files, "failure": failure,
            "host_used_mib": round(h["used_bytes"] / MiB),
            "headroom_mib": round(h["headroom_bytes"] / MiB), "reserve_mib": round(h["memory_reserve_bytes"] / MiB)}


def scenario_pressure(work: Path, out: list) -> dict:
    repository = work / "repo-pressure"
    for i in range(12):
        pack_sized(repository, work, f"m{i}", 128 * MiB, seed=100 + i)
    cg = make_cgroup("mc-bench-pressure", 3 << 30)
    r = {"limit_mib": 3072, "grow_mib": 2048, "rate_mib_s": 128}
    try:
        d = Daemon(work, repository, cg).start()
        with d.connect() as c:
            for i in range(12):
                c.load(f"m{i}")
            clients = [d.client("run", "m10"), d.client("run", "m11")]
            for client in clients:
                client.stdout.readline()                      # running
            before = host(c)
            r["before"] = {"host_used_mib": round(before["used_bytes"] / MiB),
                           "capacity_mib": round(before["capacity_bytes"] / MiB),
                           "headroom_mib": round(before["headroom_bytes"] / MiB),
                           "reserve_mib": round(before["memory_reserve_bytes"] / MiB)}
            t0 = time.monotonic()
            grower = cg.grow(2 << 30, 128 * MiB)
            lowest, end = before["headroom_bytes"], time.monotonic() + 60
            while time.monotonic() < end:
                ready, _, _ = select.select([grower.stdout], [], [], 0.1)
                lowest = min(lowest, memlimit.headroom_bytes(cg.limit))
                if ready or grower.poll() is not None:
                    break
            held = grower.stdout.readline().strip() if grower.poll() is None else ""
            r["grower"] = {"result": held or f"died: rc {grower.poll()}", "wall_s": round(time.monotonic() - t0, 2)}
            after = host(c)
            r["after"] = {"host_used_mib": round(after["used_bytes"] / MiB),
                          "headroom_mib": round(after["headroom_bytes"] / MiB),
                          "lowest_headroom_mib": round(lowest / MiB),
                          "pressure_evictions": c.stats().counters.get("pressure_evictions", 0)}
            grower.kill()
            grower.wait()
            counts = []
            for client in clients:
                client.stdin.close()
                last = client.stdout.read().split("\n")
                client.wait(30)
                counts.append([int(x) for x in [line for line in last if line.strip()][-1].split()])
            r["clients"] = {"requests": sum(x[0] for x in counts), "errors": sum(x[1] for x in counts)}
            r["oom_kills"], r["daemon_alive"] = cg.oom_kills(), d.proc.poll() is None
            verify = subprocess.run([sys.executable, "-m", "modelcache.cli", "verify"], env=d.env,
                                    capture_output=True, text=True)
            r["verify"] = {"rc": verify.returncode, "last_line": (verify.stdout.strip().splitlines() or [""])[-1]}
        d.stop()
    finally:
        cg.remove()
    out.append(f"pressure: {json.dumps(r, indent=1)}")
    return r


def shared_variant(seed: int, backbone: np.ndarray) -> onnx.ModelProto:
    """A fine-tuned variant: the same backbone tensor, a head of its own (both lookups, summed)."""
    head = np.random.default_rng(seed).standard_normal((32 * MiB // 1024, 256), dtype=np.float32)
    h = onnx.helper
    graph = h.make_graph(
        [h.make_node("Gather", ["backbone", "ids"], ["a"], axis=0), h.make_node("Gather", ["head", "ids"], ["b"], axis=0),
         h.make_node("Add", ["a", "b"], ["rows"])], f"variant_{seed}",
        [h.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["n"])],
        [h.make_tensor_value_info("rows", onnx.TensorProto.FLOAT, ["n", 256])],
        [onnx.numpy_helper.from_array(backbone, "backbone"), onnx.numpy_helper.from_array(head, "head")])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def tier_blocks(tier_dir: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in tier_dir.iterdir() if p.is_file())


def scenario_frees(work: Path, out: list) -> dict:
    repository = work / "repo-frees"
    backbone = np.random.default_rng(7).standard_normal((96 * MiB // 1024, 256), dtype=np.float32)
    names = []
    for i in range(4):
        src = work / f"v{i}.onnx"
        onnx.save(shared_variant(200 + i, backbone), str(src))
        pack(str(src), repository, f"variant{i}", 1)
        names.append(f"variant{i}")
    for i in range(2):
        pack_sized(repository, work, f"solo{i}", 64 * MiB, seed=300 + i)
        names.append(f"solo{i}")
    cg = make_cgroup("mc-bench-frees", 3 << 30)
    rows = []
    try:
        d = Daemon(work, repository, cg).start()
        with d.connect() as c:
            for name in names:
                c.load(name)
            tier_dir = Path(host(c)["path"])
            for name in ["variant0", "solo0", "variant1", "variant2", "solo1", "variant3"]:
                said = {m["name"]: m for m in c.list()}[name]
                blocks, ws = tier_blocks(tier_dir), memlimit.working_set_bytes(cg.limit)
                c.evict(name)
                time.sleep(0.2)
                rows.append({"model": name, "host_mib": said["host_bytes"] / MiB, "frees_mib": said["frees_bytes"] / MiB,
                             "tier_files_freed_mib": (blocks - tier_blocks(tier_dir)) / MiB,
                             "cgroup_freed_mib": (ws - memlimit.working_set_bytes(cg.limit)) / MiB})
        d.stop()
    finally:
        cg.remove()
    said = sum(r["frees_mib"] for r in rows)
    files = sum(r["tier_files_freed_mib"] for r in rows)
    cgroup = sum(r["cgroup_freed_mib"] for r in rows)
    lines = [f"{'model':<10} {'HOST MiB':>9} {'FREES MiB':>10} {'files freed':>12} {'cgroup freed':>13}"]
    lines += [f"{r['model']:<10} {r['host_mib']:>9.1f} {r['frees_mib']:>10.1f} {r['tier_files_freed_mib']:>12.1f} "
              f"{r['cgroup_freed_mib']:>13.1f}" for r in rows]
    lines.append(f"{'total':<10} {'':>9} {said:>10.1f} {files:>12.1f} {cgroup:>13.1f}   "
                 f"(files/said {files / said:.4f}, cgroup/said {cgroup / said:.4f})")
    out.append("frees:\n" + "\n".join(lines))
    return {"rows": rows, "said_mib": said, "files_freed_mib": files, "cgroup_freed_mib": cgroup}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write report.txt and results.json here")
    ap.add_argument("--only", choices=["limit", "pressure", "frees"], action="append",
                    help="run only these scenarios (repeatable; default all)")
    args = ap.parse_args(argv)
    out = [f"command: python benchmarks/memlimit/run.py {' '.join(argv if argv is not None else sys.argv[1:])}",
           f"date: {time.strftime('%Y-%m-%d %H:%M:%S')}"]
    results = {}
    with tempfile.TemporaryDirectory(prefix="mc-memlimit-") as tmp:
        work = Path(tmp)
        for name, run in (("limit", scenario_limit), ("pressure", scenario_pressure), ("frees", scenario_frees)):
            if not args.only or name in args.only:
                results[name] = run(work, out)
                print(out[-1], flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.txt").write_text("\n".join(out) + "\n")
        (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
