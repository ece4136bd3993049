"""A changed model reloaded while clients keep sending it requests: how many requests fail, how long the longest one
waits, and whose answers clients get, modelcache beside Triton 2.51 native (and beside a baseline checkout).

    python benchmarks/repoload/traffic.py [--rounds 3] [--clients 4] [--baseline CHECKOUT] [--out benchmarks/repoload]

Each round starts each system afresh on a Triton repository holding tiny-cnn (the zoo's, seed 1) as version 1, in one
of two configurations: `batched` (max_batch_size 4, dynamic batching: modelcache's engine runs it) and `serial`
(max_batch_size 0: modelcache's gRPC front runs it itself, holding a session over the daemon's weights). Triton runs
with --model-control-mode=explicit; modelcache with its gRPC front, importing the repository at start. `--clients`
closed-loop tritonclient gRPC clients send the same input for 2 s; then model.onnx is replaced by seed 2's and a
gRPC load of the model is timed; the clients go on for 2 s after it returns. Every answer is compared with plain ORT's
for seed 1 and seed 2: an answer from neither exits 1, as does seed 1's after the load returned.
`--baseline CHECKOUT` runs that checkout's modelcache too (from there), as `modelcache-base`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.responsecache.run import start_modelcache, start_triton, write_repository  # noqa: E402
from benchmarks.systems.triton import peer_paths, wait_server_ready  # noqa: E402

MODEL = "tiny"
BEFORE_S = AFTER_S = 2.0
CONFIGS = {"batched": 4, "serial": 0}


def one_run(system: str, config: str, rnd: int, args, work: Path, models: dict, x) -> dict:
    import numpy as np
    import tritonclient.grpc as grpcclient
    label = f"{system}-{config}-r{rnd}"
    repo = work / f"repo-{label}"
    io = write_repository(repo, MODEL, models[1]["path"], max_batch_size=CONFIGS[config], response_cache=False)
    onnx_file = repo / MODEL / "1" / "model.onnx"
    if system == "triton":
        server = start_triton(label, repo, None, "glibc", work, control="explicit")
    else:
        server = start_modelcache(label, repo, 0, work, checkout=args.baseline if system == "modelcache-base" else None)
    try:
        wait_server_ready(server.address, server.proc, server.label, str(server.log), 300)
        if system == "triton":
            grpcclient.InferenceServerClient(server.address).load_model(MODEL)
        server.wait_ready(MODEL)
        stop, loaded_at, records = threading.Event(), [None], []

        def client() -> None:
            c = grpcclient.InferenceServerClient(server.address)
            i = grpcclient.InferInput(io["input"], list(x.shape), "FP32")
            i.set_data_from_numpy(x)
            try:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    try:
                        y, error = c.infer(MODEL, [i]).as_numpy(io["output"]), None
                    except Exception as e:
                        y, error = None, str(e).splitlines()[0][:160]
                    t1 = time.perf_counter()
                    records.append((t0, t1, y, error))
            finally:
                c.close()

        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(BEFORE_S)
        onnx_file.unlink()
        onnx_file.symlink_to(models[2]["path"])
        loader = grpcclient.InferenceServerClient(server.address)
        t0 = time.perf_counter()
        try:
            loader.load_model(MODEL)
            load_error = None
        except Exception as e:
            load_error = str(e).splitlines()[0][:200]
        loaded_at[0] = time.perf_counter()
        loader.close()
        time.sleep(AFTER_S)
        stop.set()
        for t in threads:
            t.join()
    finally:
        server.stop()

    def whose(y) -> int | None:
        for seed in (1, 2):
            if np.allclose(y, models[seed]["want"], rtol=1e-3, atol=1e-4):
                return seed
        return None

    row = {"system": system, "config": config, "round": rnd, "load_s": loaded_at[0] - t0, "load_error": load_error,
           "ok": 0, "failed": 0, "errors": {}, "old_after_load": 0, "new": 0}
    longest = 0.0
    for s, e, y, error in records:
        if t0 - 0.5 <= s <= loaded_at[0] + 0.5:   # (the requests around the load: their longest wait)
            longest = max(longest, e - s)
        if error is not None:
            row["failed"] += 1
            row["errors"][error] = row["errors"].get(error, 0) + 1
            continue
        row["ok"] += 1
        seed = whose(y)
        if seed is None:
            raise SystemExit(f"{label}: an answer from neither version (seed 1's nor seed 2's)")
        row["new"] += seed == 2
        row["old_after_load"] += seed == 1 and s > loaded_at[0] and load_error is None
    row["longest_ms"] = longest * 1e3
    lat = sorted(e - s for s, e, _, error in records if error is None)
    row["p50_ms"] = statistics.median(lat) * 1e3 if lat else None
    print(f"{label}: load {row['load_s']:.2f} s{' FAILED ' + load_error if load_error else ''}, {row['ok']} ok, "
          f"{row['failed']} failed, longest around the load {row['longest_ms']:.0f} ms, "
          f"old answers after the load {row['old_after_load']}", file=sys.stderr)
    return row


def report(rows: list, args) -> str:
    lines = [f"$ python benchmarks/repoload/traffic.py --rounds {args.rounds} --clients {args.clients}"
             + (f" --baseline {args.baseline}" if args.baseline else "") + (f" --out {args.out}" if args.out else ""),
             f"{args.clients} gRPC clients in a closed loop, tiny-cnn, model.onnx replaced {BEFORE_S:g} s in, then "
             f"loaded; {AFTER_S:g} s more. Medians over rounds [min-max]",
             f"{'system':16} {'config':8} {'load s':>18} {'failed requests':>22} {'longest wait ms':>22} "
             f"{'requests ok':>18}  errors"]

    def cell(values, fmt):
        values = [v for v in values if v is not None]
        return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]" if values else "-"

    for system in dict.fromkeys(r["system"] for r in rows):
        for config in CONFIGS:
            rs = [r for r in rows if r["system"] == system and r["config"] == config]
            if not rs:
                continue
            errors = {}
            for r in rs:
                for k, n in r["errors"].items():
                    errors[k] = errors.get(k, 0) + n
            loads_failed = [r["load_error"] for r in rs if r["load_error"]]
            lines.append(f"{system:16} {config:8} {cell([r['load_s'] for r in rs], '.2f'):>18} "
                         f"{cell([r['failed'] for r in rs], '.0f'):>22} "
                         f"{cell([r['longest_ms'] for r in rs], '.0f'):>22} "
                         f"{cell([r['ok'] for r in rs], '.0f'):>18}  "
                         + "; ".join(f"{n}x {k}" for k, n in sorted(errors.items(), key=lambda kv: -kv[1])[:2])
                         + (f" LOAD FAILED {len(loads_failed)}x: {loads_failed[0]}" if loads_failed else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--baseline", type=Path, help="another checkout's modelcache beside this one's")
    ap.add_argument("--out", type=Path, help="write traffic.txt there too")
    args = ap.parse_args(argv)
    import json

    import numpy as np
    import onnxruntime as ort

    from modelcache import zoo
    systems = ["modelcache"] + (["modelcache-base"] if args.baseline else []) + (["triton"] if peer_paths() else [])
    rows = []
    with tempfile.TemporaryDirectory(prefix="repoload-traffic-") as tmp:
        work = Path(tmp)
        x = np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)
        models = {}
        for seed in (1, 2):
            path = work / f"tiny-{seed}.onnx"
            zoo.save(zoo.build("tiny-cnn", seed=seed), str(path))
            models[seed] = {"path": path, "want": ort.InferenceSession(str(path)).run(None, {"input": x})[0]}
        for rnd in range(args.rounds):
            for config in args.configs:
                order = systems[rnd % len(systems):] + systems[:rnd % len(systems)]   # (rotated each round)
                for system in order:
                    rows.append(one_run(system, config, rnd, args, work, models, x))
    text = report(rows, args)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "traffic.txt").write_text(text + "\n")
        (args.out / "traffic.json").write_text(json.dumps(rows, indent=1) + "\n")
    bad = [r for r in rows if r["old_after_load"]]
    if bad:
        print(f"old answers after a load returned: {[(r['system'], r['config'], r['round']) for r in bad]}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
