"""Triton's model_warmup: a client's first request after the server starts, with and without it, modelcache beside
Triton 2.51 native (its C++ fronts and ONNX Runtime backend), the same Triton repository for both.

    python benchmarks/warmup/run.py [--model resnet50] [--rounds 3] [--out benchmarks/warmup]

The repository: one zoo model, `max_batch_size: 0` with its input and output written out, one CPU instance with
one intra-op thread (benchmarks/responsecache's write_repository, its response cache left off here); the `-warmup`
systems' config adds one `model_warmup` sample of zeros (batch_size 1, count 1). Four systems, each round in a
rotated order, each started afresh (modelcache: a new repository and host tier, importing the Triton repository at
start; Triton: --model-control-mode=none, --strict-readiness): once the model is ready (ModelReady over gRPC; for
modelcache-warmup, also once its log says the warm-up ended: modelcache serves while it warms, Triton only after),
one tritonclient gRPC infer of fresh random input, timed, then a second. Per system: the first and second requests'
latency and the seconds from the server's start to ready, median [min-max] over rounds. Every answer is compared
with plain ONNX Runtime's (1e-3): a difference exits 1.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.responsecache.run import start_modelcache, start_triton, write_repository  # noqa: E402

SYSTEMS = ("modelcache", "modelcache-warmup", "triton", "triton-warmup")
WARMED = re.compile(r"warmed up: \d+ runs in ([0-9.]+) s")


def repositories(work: Path, model: str) -> tuple[dict, dict]:
    """({"plain": repo, "warmup": repo}, the model's input and output): the same model and config, but the warm-up."""
    from modelcache import zoo
    onnx_path = work / f"{model}.onnx"
    zoo.save(zoo.build(model), str(onnx_path))
    repos = {}
    for kind in ("plain", "warmup"):
        repo = work / f"repo-{kind}"
        io = write_repository(repo, model, onnx_path, response_cache=False)
        config = repo / model / "config.pbtxt"
        text = config.read_text()
        if kind == "warmup":
            dims = ", ".join(map(str, io["shape"]))
            text += (f'model_warmup [ {{ name: "zeros" batch_size: 1 inputs {{ key: "{io["input"]}" value {{ '
                     f'data_type: TYPE_FP32 dims: [ {dims} ] zero_data: true }} }} }} ]\n')
        config.write_text(text)
        repos[kind] = repo
    return repos, io


def one_system(system: str, rnd: int, repos: dict, io: dict, model: str, work: Path, reference) -> dict:
    import numpy as np
    import tritonclient.grpc as grpcclient
    repo = repos["warmup" if system.endswith("-warmup") else "plain"]
    label = f"{system}-r{rnd}"
    t0 = time.monotonic()
    server = start_triton(label, repo, None, "glibc", work) if system.startswith("triton") else \
        start_modelcache(label, repo, 0, work)
    try:
        server.wait_ready(model)
        warm_s = None
        if system == "modelcache-warmup":   # (ready while it warms: wait for the warm-up's line in its log)
            deadline = time.monotonic() + 300
            while (found := WARMED.search(server.log.read_text())) is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{label}: no warm-up line in {server.log}")
                time.sleep(0.05)
            warm_s = float(found.group(1))
        ready_s = time.monotonic() - t0
        client = grpcclient.InferenceServerClient(server.address)
        latencies = []
        try:
            for k in range(2):
                x = np.random.default_rng(1000 * rnd + k).standard_normal(io["shape"]).astype(np.float32)
                i = grpcclient.InferInput(io["input"], io["shape"], "FP32")
                i.set_data_from_numpy(x)
                start = time.perf_counter()
                y = client.infer(model, [i]).as_numpy(io["output"])
                latencies.append((time.perf_counter() - start) * 1e3)
                want = reference.run([io["output"]], {io["input"]: x})[0]
                if not np.allclose(y, want, rtol=1e-3, atol=1e-3):
                    raise SystemExit(f"{label}: a wrong answer (max difference {np.abs(y - want).max():.3g})")
        finally:
            client.close()
    finally:
        server.stop()
    return {"system": system, "round": rnd, "first_ms": latencies[0], "second_ms": latencies[1],
            "ready_s": ready_s, "warmup_s": warm_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--systems", nargs="+", default=None, choices=SYSTEMS,
                    help="default: all four, or modelcache's two where Triton's peer is not built")
    ap.add_argument("--out", default=None, help="write report.txt and results.json here")
    args = ap.parse_args(argv)
    if args.systems is None:
        from benchmarks.systems.triton import peer_paths
        args.systems = list(SYSTEMS) if peer_paths() is not None else [s for s in SYSTEMS if s.startswith("modelcache")]
    import onnxruntime as ort
    from modelcache.measure import compile_bytecode, save_results, summary
    compile_bytecode()   # (each modelcache process is fresh: as installed, not compiling modelcache each time)
    with tempfile.TemporaryDirectory(prefix="mc-warmup-") as tmp:
        work = Path(tmp)
        repos, io = repositories(work, args.model)
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        reference = ort.InferenceSession(str(work / f"{args.model}.onnx"), so, providers=["CPUExecutionProvider"])
        rows = []
        for rnd in range(args.rounds):
            order = args.systems[rnd % len(args.systems):] + args.systems[:rnd % len(args.systems)]
            for system in order:
                rows.append(one_system(system, rnd, repos, io, args.model, work, reference))
                print(f"round {rnd} {system}: first {rows[-1]['first_ms']:.1f} ms, second "
                      f"{rows[-1]['second_ms']:.1f} ms, ready after {rows[-1]['ready_s']:.2f} s", file=sys.stderr)
    load = os.getloadavg()
    lines = [f"{args.model}, {args.rounds} rounds (systems rotated), load average {load[0]:.1f} {load[1]:.1f} at the end",
             "", f"{'system':<20} {'first request ms':>22} {'second request ms':>22} {'start to ready s':>20}"]
    for system in args.systems:
        mine = [r for r in rows if r["system"] == system]
        lines.append(f"{system:<20} {summary([r['first_ms'] for r in mine]):>22} "
                     f"{summary([r['second_ms'] for r in mine]):>22} {summary([r['ready_s'] for r in mine], '.2f'):>20}")
    warm = [r["warmup_s"] for r in rows if r["warmup_s"] is not None]
    if warm:
        lines.append(f"\nmodelcache's warm-up itself (its log): {summary(warm, '.2f')} s")
    report = "\n".join(lines)
    print(report)
    save_results(args.out, "warmup", sys.argv[1:], rows, lambda data, f: f.write(report + "\n"),
                 command="python benchmarks/warmup/run.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
