"""Triton's metrics page beside modelcache's, after the same requests: what a Triton user's Prometheus scrape job,
dashboards and alerts would read from each.

    python benchmarks/tritonmetrics/compare.py [--requests 20] [--out benchmarks/tritonmetrics]

Both serve one Triton repository: tiny-cnn (the zoo's, seed 1), `max_batch_size: 4`, one CPU instance with one
intra-op thread, `response_cache { enable: true }` (benchmarks/responsecache/run.py's write_repository).
Triton 2.51 native (../shared/peers/triton-native, as benchmarks/responsecache starts it) runs with
`--allow-metrics=true --allow-cpu-metrics=true --allow-gpu-metrics=false` and a 64 MiB local cache; modelcache
imports the repository (its gRPC front) with `metrics_port` set and a 64 MiB response cache.

To each, one after the other, over tritonclient gRPC: `--requests` requests of fresh random inputs, alternately
1 and 2 rows; the first of them again (a response-cache hit); one with a wrong shape (refused before the model).
Then each page is read with Prometheus's own parser (prometheus_client) once its success count has them all, and
every Triton family is set beside modelcache's: TYPE, HELP and label names equal or not, and the values. Exits 1
when a family both print differs in TYPE, HELP or labels, or a count differs (successes, failures, inferences,
executions, cache hits and misses); durations are each server's own.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.responsecache.run import free_port, start_modelcache, start_triton, write_repository  # noqa: E402

MODEL = "tiny"
CACHE_BYTES = 64 << 20
# Counts that the same requests must make the same on both pages (not durations, nor the machine's gauges).
COUNTS = ("nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
          "nv_inference_exec_count", "nv_inference_pending_request_count", "nv_cache_num_hits_per_model",
          "nv_cache_num_misses_per_model", "nv_cache_num_entries", "nv_cache_num_hits", "nv_cache_num_misses",
          "nv_cache_num_lookups", "nv_cache_num_evictions")


def families(text: str) -> dict:
    """name -> (type, help, {labels as a sorted tuple: value}), as a Prometheus server reads the page."""
    from prometheus_client.parser import text_string_to_metric_families
    return {f.name: (f.type, f.documentation, {tuple(sorted(s.labels.items())): s.value for s in f.samples})
            for f in text_string_to_metric_families(text)}


def drive(server, io: dict, requests: int, seed: int) -> int:
    """The requests; returns how many succeeded (every one but the wrong shape's)."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
    rng = np.random.default_rng(seed)
    client = grpcclient.InferenceServerClient(server.address)

    def infer(x):
        i = grpcclient.InferInput(io["input"], list(x.shape), "FP32")
        i.set_data_from_numpy(x)
        return client.infer(MODEL, [i])

    try:
        sent = [rng.standard_normal((1 + k % 2, *io["shape"][1:])).astype(np.float32) for k in range(requests)]
        for x in sent:
            infer(x)
        infer(sent[0])                        # again: the response cache's
        try:
            infer(np.zeros((1, *io["shape"][1:-1], io["shape"][-1] + 1), np.float32))
            raise SystemExit("a wrong shape was answered")
        except InferenceServerException:
            pass
    finally:
        client.close()
    return requests + 1


def scrape(port: int, successes: int, timeout_s: float = 20.0) -> str:
    """The page once it counts `successes` successful requests of the model (or at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                page = r.read().decode()
        except OSError:        # (not listening yet)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)
            continue
        got = families(page).get("nv_inference_request_success", (None, None, {}))[2]
        if got.get((("model", MODEL), ("version", "1"))) == successes or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    # Triton polls its gauges (CPU, the response cache's own) every --metrics-interval-ms, 2000 by default; modelcache
    # renders its page every heartbeat_interval_s (1 s): both pages again after a full interval, gauges and all.
    time.sleep(2.5)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def compare(triton: dict, ours: dict) -> tuple[list[str], list[str]]:
    """The report's lines, and what differs where it should not."""
    lines, wrong = [], []
    lines.append(f"{'family':42} {'type':>5} {'help':>5} {'labels':>6}  {'Triton 2.51':>16}  {'modelcache':>16}")
    for name in sorted(set(triton) | set(ours)):
        t, o = triton.get(name), ours.get(name)
        if t is None or o is None:
            lines.append(f"{name:42} {'only on ' + ('modelcache' if t is None else 'Triton'):>20}  "
                         f"{summary(t):>16}  {summary(o):>16}")
            continue
        same = [t[0] == o[0], t[1] == o[1], label_names(t) == label_names(o)]
        lines.append(f"{name:42} {'same' if same[0] else 'DIFF':>5} {'same' if same[1] else 'DIFF':>5} "
                     f"{'same' if same[2] else 'DIFF':>6}  {summary(t):>16}  {summary(o):>16}")
        if not all(same):
            wrong.append(f"{name}: TYPE {t[0]}/{o[0]}, HELP {t[1]!r}/{o[1]!r}, samples {sorted(t[2])}/{sorted(o[2])}")
        elif name in COUNTS and t[2] != o[2]:
            wrong.append(f"{name}: Triton {t[2]}, modelcache {o[2]}")
    return lines, wrong


def label_names(family) -> set:
    """Each sample's label names (values aside: the models' and reasons' are compared with the counts)."""
    return {tuple(n for n, _ in labels) for labels in family[2]}


def summary(family) -> str:
    """A family's samples in a few characters: the one value, or their sum and count."""
    if family is None:
        return "-"
    values = list(family[2].values())
    if len(values) == 1:
        return f"{values[0]:.6g}"
    return f"sum {sum(values):.6g} ({len(values)})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=20, help="requests of fresh inputs to each (default 20)")
    ap.add_argument("--out", type=Path, help="write report.txt there too, and each page (triton.txt, modelcache.txt)")
    args = ap.parse_args(argv)
    from benchmarks.systems.triton import peer_paths
    if peer_paths() is None:
        raise SystemExit("the Triton peer is not built: see ../shared/peers/triton-native/README.md")
    from modelcache import zoo
    pages = {}
    with tempfile.TemporaryDirectory(prefix="tritonmetrics-") as tmp:
        work = Path(tmp)
        onnx_path = work / "tiny.onnx"
        zoo.save(zoo.build("tiny-cnn", seed=1), str(onnx_path))
        repo = work / "models"
        io = write_repository(repo, MODEL, onnx_path, max_batch_size=4, response_cache=True)
        for label in ("triton", "modelcache"):
            port = free_port()
            server = (start_triton(label, repo, CACHE_BYTES, "glibc", work, metrics_port=port) if label == "triton"
                      else start_modelcache(label, repo, CACHE_BYTES, work, {"MODELCACHE_METRICS_PORT": str(port)}))
            try:
                server.wait_ready(MODEL)
                successes = drive(server, io, args.requests, seed=7)
                pages[label] = scrape(port, successes)
            finally:
                server.stop()
    lines, wrong = compare(families(pages["triton"]), families(pages["modelcache"]))
    verdict = ["differs where it should not:", *wrong] if wrong else \
        ["every family both print has the same TYPE, HELP and labels; every count agrees"]
    text = "\n".join([f"$ python benchmarks/tritonmetrics/compare.py --requests {args.requests}"
                      + (f" --out {args.out}" if args.out else ""),
                      f"{args.requests} requests of fresh inputs (1 and 2 rows), 1 repeated, 1 of a wrong shape",
                      *lines, "", *verdict])
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.txt").write_text(text + "\n")
        for label, page in pages.items():   # the pages themselves, as each server printed them
            (args.out / f"{label}.txt").write_text(page)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
