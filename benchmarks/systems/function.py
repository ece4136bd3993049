"""One function instance of the systems benchmark, as a FaaS platform runs it: a fresh process that loads its
model the way SYSTEM's users do and runs it once (the cold start), then runs it once more for every line on
stdin (warm calls) until stdin closes.

    python function.py SYSTEM MODEL.onnx NAME

SYSTEM: `ort` (plain ONNX Runtime from the .onnx), `ort-mmap` (ORT's memory-mapped .ort beside it, no daemon),
`attach` (modelcache.InferenceSession(NAME): the daemon's shared weights). Every session: ORT's intra-op
threads not spinning (many processes share two cores), everything else ORT's defaults. One JSON line per call:
the first with `start_ms` (exec to ready) and `hit` (attach: whether the daemon had the weights resident),
every one with `run_ms`, or `error`. Run as a plain script: the ORT modes import neither modelcache nor more
than they need.
"""

import json
import os
import sys
import time

T_EXEC = time.monotonic()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "modelcache", "bench"))
from coldstart_child import ones_feeds  # noqa: E402  (the cold-start benchmark's inputs: ones, free dims 1)

# What ORT's users set to map an .ort model and take its initializers from the mapping (measure.ORT_MMAP_KEYS).
ORT_MMAP_KEYS = ("session.use_memory_mapped_ort_model", "session.use_ort_model_bytes_directly",
                 "session.use_ort_model_bytes_for_initializers")


def load(system: str, path: str, name: str):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if system == "ort":
        return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]), None
    if system == "ort-mmap":
        for key in ORT_MMAP_KEYS:
            so.add_session_config_entry(key, "1")
        return ort.InferenceSession(os.path.splitext(path)[0] + ".ort", so, providers=["CPUExecutionProvider"]), None
    if system == "attach":
        import modelcache
        sess = modelcache.InferenceSession(name, so)
        return sess, sess.was_cache_hit
    raise SystemExit(f"unknown system {system!r}: ort, ort-mmap or attach")


def main() -> None:
    system, path, name = sys.argv[1:4]
    import numpy as np
    try:
        sess, hit = load(system, path, name)
        feeds = ones_feeds(sess, np)
        ready = time.monotonic()
        sess.run(None, feeds)
        done = time.monotonic()
    except Exception as e:   # the call's failure is its answer (a daemon's refusal, a broken model)
        print(json.dumps({"error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
        sys.exit(1)
    print(json.dumps({"start_ms": (ready - T_EXEC) * 1e3, "run_ms": (done - ready) * 1e3, "hit": hit}), flush=True)
    for _ in sys.stdin:
        t = time.monotonic()
        try:
            sess.run(None, feeds)
        except Exception as e:
            print(json.dumps({"error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
            sys.exit(1)
        print(json.dumps({"run_ms": (time.monotonic() - t) * 1e3}), flush=True)


if __name__ == "__main__":
    main()
