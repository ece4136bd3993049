"""Triton's repository load as it serves (explicit model control): how long each kind of load takes until the model
answers, modelcache beside Triton 2.51 native (its C++ fronts and ONNX Runtime backend).

    python benchmarks/repoload/run.py [--model resnet50] [--rounds 3] [--out benchmarks/repoload]

Each round starts each system afresh on an empty Triton repository (modelcache: a new store and host tier, its
triton_repository that directory, its gRPC front; Triton: --model-control-mode=explicit, --strict-readiness, one
CPU instance with one intra-op thread and max_batch_size 1 in the config, as benchmarks/responsecache writes it), the systems in a
rotated order; modelcache's max_message_size 1G, Triton's gRPC limit is 2 GiB. Then, over tritonclient gRPC, five loads one after the other, each timed from the call to its
return, then one infer timed (the model's first request after that load):
  new        the model copied into the repository, then loaded by name
  unchanged  loaded again, nothing changed
  reload     config.pbtxt edited (dynamic_batching added), then loaded
  override   a `config` parameter: the configuration ModelConfig answers, with max_queue_delay_microseconds 100
  files      a second name, its config and its .onnx bytes sent as `file:1/model.onnx` (nothing in the repository)
Every answer is compared with plain ONNX Runtime's (1e-3): a difference exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.responsecache.run import start_modelcache, start_triton, write_repository  # noqa: E402
from benchmarks.systems.triton import wait_server_ready  # noqa: E402

SYSTEMS = ("modelcache", "triton")
STEPS = ("new", "unchanged", "reload", "override", "files")


def one_system(system: str, rnd: int, model: str, onnx_path: Path, work: Path, reference) -> list[dict]:
    import numpy as np
    import tritonclient.grpc as grpcclient
    label = f"{system}-r{rnd}"
    repo = work / f"repo-{label}"
    repo.mkdir()
    server = start_triton(label, repo, None, "glibc", work, control="explicit") if system == "triton" else \
        start_modelcache(label, repo, 0, work)
    rows = []
    try:
        wait_server_ready(server.address, server.proc, server.label, str(server.log), 300)
        client = grpcclient.InferenceServerClient(server.address)
        try:
            def step(name: str, target: str, load) -> None:
                t0 = time.perf_counter()
                load()
                load_s = time.perf_counter() - t0
                x = np.random.default_rng([rnd, len(rows)]).standard_normal(io["shape"]).astype(np.float32)
                i = grpcclient.InferInput(io["input"], io["shape"], "FP32")
                i.set_data_from_numpy(x)
                t0 = time.perf_counter()
                y = client.infer(target, [i]).as_numpy(io["output"])
                first_ms = (time.perf_counter() - t0) * 1e3
                want = reference.run([io["output"]], {io["input"]: x})[0]
                if not np.allclose(y, want, rtol=1e-3, atol=1e-3):
                    raise SystemExit(f"{label} {name}: a wrong answer (max difference {np.abs(y - want).max():.3g})")
                rows.append({"system": system, "round": rnd, "step": name, "load_s": load_s, "first_ms": first_ms})
                print(f"round {rnd} {system} {name}: load {load_s:.2f} s, first request {first_ms:.1f} ms",
                      file=sys.stderr)

            io = write_repository(repo, model, onnx_path, max_batch_size=1, response_cache=False)
            config_file = repo / model / "config.pbtxt"
            step("new", model, lambda: client.load_model(model))
            step("unchanged", model, lambda: client.load_model(model))
            config_file.write_text(config_file.read_text() + "dynamic_batching { }\n")
            step("reload", model, lambda: client.load_model(model))
            config = client.get_model_config(model, as_json=True)["config"]
            config["dynamic_batching"] = {"max_queue_delay_microseconds": 100}
            step("override", model, lambda: client.load_model(model, config=json.dumps(config)))
            sent = f"{model}_sent"
            sent_config = json.dumps({**config, "name": sent})
            step("files", sent, lambda: client.load_model(sent, config=sent_config,
                                                          files={"file:1/model.onnx": onnx_path.read_bytes()}))
        finally:
            client.close()
    finally:
        server.stop()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--systems", nargs="+", default=None, choices=SYSTEMS,
                    help="default: both, or modelcache alone where Triton's peer is not built")
    ap.add_argument("--out", default=None, help="write report.txt and results.json here")
    args = ap.parse_args(argv)
    if args.systems is None:
        from benchmarks.systems.triton import peer_paths
        args.systems = list(SYSTEMS) if peer_paths() is not None else ["modelcache"]
    import onnxruntime as ort
    from modelcache import zoo
    from modelcache.measure import compile_bytecode, save_results, summary
    compile_bytecode()   # (each modelcache process is fresh: as installed, not compiling modelcache each time)
    # (the `files` load sends the whole .onnx in one gRPC message: over the 64 MiB default for ResNet-50)
    os.environ["MODELCACHE_MAX_MESSAGE_SIZE"] = "1G"
    with tempfile.TemporaryDirectory(prefix="mc-repoload-") as tmp:
        work = Path(tmp)
        onnx_path = work / f"{args.model}.onnx"
        zoo.save(zoo.build(args.model), str(onnx_path))
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        reference = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
        rows = []
        for rnd in range(args.rounds):
            order = args.systems[rnd % len(args.systems):] + args.systems[:rnd % len(args.systems)]
            for system in order:
                rows += one_system(system, rnd, args.model, onnx_path, work, reference)
    load = os.getloadavg()
    lines = [f"{args.model}, {args.rounds} rounds (systems rotated), load average {load[0]:.1f} {load[1]:.1f} at the end",
             "", f"{'step':<11} {'system':<12} {'load s':>18} {'first request ms':>22}"]
    for step in STEPS:
        for system in args.systems:
            mine = [r for r in rows if r["system"] == system and r["step"] == step]
            lines.append(f"{step:<11} {system:<12} {summary([r['load_s'] for r in mine], '.2f'):>18} "
                         f"{summary([r['first_ms'] for r in mine]):>22}")
    report = "\n".join(lines)
    print(report)
    save_results(args.out, "repoload", sys.argv[1:], rows, lambda data, f: f.write(report + "\n"),
                 command="python benchmarks/repoload/run.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
