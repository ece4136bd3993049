"""What the demo and the benchmarks measure with: a daemon to measure against, zoo models in it, fresh child
processes, memory readings, summaries, and where results are saved."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path


@contextlib.contextmanager
def managed_daemon(socket: str | None = None, repository: str | None = None, env: dict | None = None,
                   log_path: str | None = None, command: list | None = None):
    """Yield the address of a running daemon: the one at `socket` if it answers, else one we start and stop
    (with `env` added to its environment and its log in `log_path`, where given; `command`: the program
    that runs it, which prints READY as `modelcache daemon` does)."""
    from .client.connection import connect
    from .config import load
    from .errors import ModelCacheError

    settings = load(overrides={"socket": socket, "repository": repository})
    try:
        connect(settings.socket, timeout_s=2).close()
        yield settings.socket
        return
    except ModelCacheError:
        pass
    env = {**os.environ, "MODELCACHE_SOCKET": settings.socket, "MODELCACHE_REPOSITORY": settings.repository,
           **(env or {})}
    log = open(log_path, "ab") if log_path else None
    proc = subprocess.Popen(command or [sys.executable, "-m", "modelcache.cli", "daemon", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 0.5)[0]:
                line = proc.stdout.readline()
                if line.startswith(b"READY") or not line:
                    break
            if proc.poll() is not None:
                break
        if proc.poll() is not None:
            raise RuntimeError("the benchmark's daemon failed to start (see its log above)")
        yield settings.socket
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        if log:
            log.close()


def ort_mmap_model(src: str) -> str:
    """ORT's own memory-mapped baseline's model: `src` converted to ORT format beside it, as its users do it
    (onnxruntime.tools.convert_onnx_models_to_ort with its defaults: fixed optimizations at level all), once."""
    ort_path = Path(src).with_suffix(".ort")
    if not ort_path.exists():
        subprocess.run([sys.executable, "-m", "onnxruntime.tools.convert_onnx_models_to_ort", src,
                        "--output_dir", str(ort_path.parent)], check=True, capture_output=True)
    return str(ort_path)


# What ORT's users set to map an .ort model and take its initializers from the mapping (no daemon).
ORT_MMAP_KEYS = ("session.use_memory_mapped_ort_model", "session.use_ort_model_bytes_directly",
                 "session.use_ort_model_bytes_for_initializers")


def ort_mmap_session(src: str):
    """A session over `src`'s .ort model (ort_mmap_model), memory-mapped with its initializers taken from the
    mapping, no daemon: processes share the page cache's copy. Prepacking left on, as its users run it."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    for key in ORT_MMAP_KEYS:
        so.add_session_config_entry(key, "1")
    return ort.InferenceSession(str(Path(src).with_suffix(".ort")), so, providers=["CPUExecutionProvider"])


def alternate_runs(sessions: dict, feeds: dict, runs: int) -> dict[str, list[float]]:
    """Warm run times (ms) of each session, runs alternated so that every session sees the same machine."""
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for _ in range(runs):
        for k, s in sessions.items():
            t = time.perf_counter()
            s.run(None, feeds)
            times[k].append((time.perf_counter() - t) * 1e3)
    return times


def run_child(module: str, socket: str, *args) -> dict:
    """`python -m module --child ARGS` (or `python module ...`, a script's path) against the daemon at `socket`,
    in a fresh process: its last line, as JSON."""
    import json
    env = {**os.environ, "MODELCACHE_SOCKET": socket}
    command = [sys.executable, module] if module.endswith(".py") else [sys.executable, "-m", module]
    out = subprocess.run([*command, "--child", *args], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"benchmark child failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def answer_child(child: list, child_open, child_warm) -> int:
    """The child's side of `run_child`: `--child open ARGS` or `--child warm ARGS RUNS` (RUNS an int) runs
    that function in this fresh process and prints its result as JSON, the line run_child reads."""
    import json
    kind, *rest = child
    result = child_open(*rest) if kind == "open" else child_warm(*rest[:-1], int(rest[-1]))
    print(json.dumps(result))
    return 0


def compile_bytecode() -> None:
    """Compile modelcache's modules as an install does. With PYTHONDONTWRITEBYTECODE set (as on the machines
    here) an editable install compiles every client module again in every fresh process: ~10 ms of an attach
    open that no installed package pays (pip compiles at install), and that plain ORT never pays."""
    import compileall
    compileall.compile_dir(str(Path(__file__).resolve().parent), quiet=2)


def plain_session(src: str):
    """The in-process baseline serve mode is measured against: plain ORT on the .onnx file, 1 thread."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def serve_one_lane_client(path: str, answer) -> None:
    """A benchmark's stand-in server: listen on the Unix socket `path`, print "ready", take one
    connection and reply to each lane message with answer(body) -> reply body, until the client
    hangs up or answer returns None."""
    import socket

    from .wire.lane import CLIENT_READ_BYTES, FrameReader, frame, recv_chunk

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    print("ready", flush=True)
    conn, _ = listener.accept()
    reader = FrameReader()
    scratch = memoryview(bytearray(CLIENT_READ_BYTES))
    while True:
        message = reader.next()
        if message is None:
            data = recv_chunk(conn, scratch)
            if not data:
                return
            reader.feed(data)
            continue
        reply = answer(message[1])
        if reply is None:
            return
        conn.sendall(frame(b"ok", reply))


def ensure_models(socket: str, names: list[str], work: Path) -> dict[str, str]:
    """Add each zoo model to the daemon unless it holds it already; returns name -> .onnx path."""
    from . import zoo
    from .client.connection import connect

    paths = {}
    work.mkdir(parents=True, exist_ok=True)
    with connect(socket) as c:
        have = {m["name"] for m in c.list()}
        for name in names:
            path = work / f"{name}.onnx"
            if not path.exists():
                zoo.save(zoo.build(name), str(path))
            paths[name] = str(path)
            if name not in have:
                print(f"adding {name} ...", file=sys.stderr, flush=True)
                c.add(str(path), name)
    return paths


def memory_mib(pid: int | None = None) -> dict:
    """A process's memory (this one's by default): USS (pages only it maps), PSS, and anonymous (what it
    allocated itself)."""
    import psutil
    info = psutil.Process(pid).memory_full_info()
    anon = 0
    with open(f"/proc/{pid or 'self'}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                anon = int(line.split()[1]) * 1024
    return {"uss_mib": info.uss / 2**20, "pss_mib": info.pss / 2**20, "anon_mib": anon / 2**20}


def summary(values: list[float], fmt: str = ".1f") -> str:
    """median [min-max] — the spread tells how far to trust the median on a noisy machine."""
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]" if len(values) > 1 else f"{med:{fmt}}"


def save_results(out_dir: str | None, bench: str, argv, data, report, command: str | None = None) -> None:
    """OUT/results.json (every sample) and OUT/report.txt (the command, then the printed table). `command`
    names a script run as itself (the decision records in benchmarks/), else it is `modelcache bench BENCH`."""
    if not out_dir:
        return
    import json
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(data, indent=1))
    if argv is not None:
        args = list(argv)
    elif command:
        args = sys.argv[1:]
    else:
        args = sys.argv[sys.argv.index(bench) + 1:] if bench in sys.argv else []
    with open(out / "report.txt", "w") as f:
        f.write(f"$ {command or 'modelcache bench ' + bench} {' '.join(args)}\n")
        report(data, f)

