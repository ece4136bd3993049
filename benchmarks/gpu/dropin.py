"""The drop-in open on the CUDA EP against plain ort-cuda: open time, first run, and the outputs compared.

    PYTHONPATH=.:SITE python3 benchmarks/gpu/dropin.py [--models vgg16 resnet50 vit_b_16] [--rounds 3] --out F.json

A private daemon holds each zoo model on the GPU (the GPU tier: weights exported by CUDA IPC). Each round,
for each model, three fresh processes open it on the same input and run it once:
  modelcache      modelcache.InferenceSession(name, providers=["CUDAExecutionProvider"]) (attach, no copy)
  ort-cuda        onnxruntime.InferenceSession(model.onnx) on CUDA, default optimizations (ENABLE_ALL)
  ort-cuda-basic  the same at ORT_ENABLE_BASIC: the graph `add` optimized, so outputs should be bit-identical
Issue #30's bounds: modelcache within 1e-3 relative of ort-cuda (max |a - b| / max |b|), bit-identical to
ort-cuda-basic. `bench coldstart --device cuda` times these opens more closely; this checks the results.
`--device cpu` rehearses the same flow on the CPU provider with no GPU tier (benchmarks/tests run it here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODES = ["modelcache", "ort-cuda", "ort-cuda-basic"]
PROVIDERS = {"cuda": ["CUDAExecutionProvider"], "cpu": ["CPUExecutionProvider"]}


def child(mode: str, name: str, src: str, inputs: str, output: str, t_exec: int, device: str) -> None:
    """One fresh process: import, open, run once, save the first output; one JSON line of times."""
    t_start = time.monotonic_ns()
    import numpy as np
    import onnxruntime as ort
    ort.preload_dlls()
    if mode == "modelcache":
        import modelcache
    t_imports = time.monotonic_ns()
    if mode == "modelcache":
        sess = modelcache.InferenceSession(name, providers=PROVIDERS[device])
    else:
        so = ort.SessionOptions()
        if mode == "ort-cuda-basic":
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        sess = ort.InferenceSession(src, so, providers=PROVIDERS[device])
    t_ready = time.monotonic_ns()
    feeds = dict(np.load(inputs))
    out = sess.run(None, feeds)[0]
    t_first = time.monotonic_ns()
    np.save(output, out)
    ms = lambda a, b: (b - a) / 1e6  # noqa: E731
    print(json.dumps({"mode": mode, "model": name, "provider": sess.get_providers()[0],
                      "interpreter_ms": ms(t_exec, t_start), "imports_ms": ms(t_start, t_imports),
                      "open_ms": ms(t_imports, t_ready), "first_run_ms": ms(t_ready, t_first),
                      "ready_ms": ms(t_exec, t_ready), "first_ms": ms(t_exec, t_first)}), flush=True)


def spawn(mode, name, src, inputs, output, env, device) -> dict:
    t = time.monotonic_ns()
    r = subprocess.run([sys.executable, __file__, "--child", mode, name, src, inputs, output, str(t), device],
                       capture_output=True, text=True, env=env, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"{mode} {name} failed (rc {r.returncode}): {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def compare(a, b) -> dict:
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return {"shape_mismatch": [list(a.shape), list(b.shape)]}
    diff = float(np.max(np.abs(a - b))) if a.size else 0.0
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    return {"max_abs_diff": diff, "max_rel_diff": diff / scale if scale else (0.0 if diff == 0 else float("inf")),
            "bit_identical": bool(np.array_equal(a, b))}


def summarize(mine: list[dict], outputs: dict) -> dict:
    import numpy as np
    med = {m: {k: float(np.median([s[k] for s in mine if s["mode"] == m]))
               for k in ("open_ms", "first_run_ms", "ready_ms", "first_ms")} for m in MODES}
    return {"median": med, "providers": sorted({s["provider"] for s in mine}),
            "vs_ort_cuda": compare(outputs["modelcache"], outputs["ort-cuda"]),
            "vs_ort_cuda_basic": compare(outputs["modelcache"], outputs["ort-cuda-basic"])}


def measure(models: list[str], rounds: int, work: str, log, device: str = "cuda", save=lambda data: None) -> dict:
    """Model by model (each added, put on the GPU, then `rounds` x the three modes), handing the figures so far
    to `save` after each: a step cut short by its time limit keeps the models it finished."""
    import numpy as np
    from modelcache import zoo
    from modelcache.bench.coldstart_cuda import DAEMON_ENV, preflight
    from modelcache.measure import ensure_models, managed_daemon
    from modelcache.client.connection import connect

    if device == "cuda":
        preflight()
    socket = f"ipc://{work}/daemon.sock"
    env = {**os.environ, "MODELCACHE_SOCKET": socket}
    data = {"device": device, "rounds": rounds, "models": {}, "samples": []}
    with managed_daemon(socket, f"{work}/repo", env=DAEMON_ENV, log_path=f"{work}/daemon.log"):
        for name in models:
            src = ensure_models(socket, [name], Path(work) / "zoo")[name]
            if device == "cuda":
                with connect(socket) as client:
                    if not any(t["tier"] == "gpu" for t in client.stats().tiers):
                        raise RuntimeError("the daemon has no GPU tier (is cupy importable by it, and gpus not "
                                           "'none'?)")
                    client.load(name, tier="gpu")
            inputs = f"{work}/{name}.inputs.npz"
            np.savez(inputs, **zoo.sample_inputs(src))
            mine, outputs = [], {}
            for r in range(rounds):
                for mode in MODES:
                    out = f"{work}/{name}.{mode}.npy"
                    mine.append({**spawn(mode, name, src, inputs, out, env, device), "round": r})
                    outputs[mode] = np.load(out)
                log(f"round {r + 1}/{rounds} {name}: " + ", ".join(
                    f"{s['mode']} open {s['open_ms']:.0f} ms first run {s['first_run_ms']:.0f} ms"
                    for s in mine if s["round"] == r))
            data["samples"] += mine
            data["models"][name] = summarize(mine, outputs)
            save(data)
    return data


def main(argv=None) -> int:
    import argparse
    import tempfile
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        child(*argv[1:6], int(argv[6]), argv[7])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["vgg16", "resnet50", "vit_b_16"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", choices=list(PROVIDERS), default="cuda",
                    help="cpu: rehearse the flow here, on the CPU provider and the host tier")
    ap.add_argument("--out", required=True, help="JSON file for the figures and samples")
    args = ap.parse_args(argv)
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731

    def save(data: dict) -> None:
        with open(args.out + ".tmp", "w") as f:
            json.dump(data, f, indent=1)
        os.replace(args.out + ".tmp", args.out)

    with tempfile.TemporaryDirectory(prefix="modelcache-dropin-") as work:
        data = measure(args.models, args.rounds, work, log, args.device, save)
    for name, r in data["models"].items():
        print(f"{name}: providers {r['providers']}; vs ort-cuda {r['vs_ort_cuda']}; "
              f"vs ort-cuda-basic {r['vs_ort_cuda_basic']}; medians {json.dumps(r['median'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
