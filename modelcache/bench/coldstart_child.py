"""One cold-start sample: a fresh function process from exec to first result, with its phases.

    python coldstart_child.py MODE NAME SRC TUNED_DIR T_EXEC_NS

Run as a plain script (not `-m`) so the interpreter loads only what the mode needs.
CLOCK_MONOTONIC is system-wide on Linux, so the parent's pre-exec timestamp and ours
compare directly. Prints one JSON line; with HOLD set it then waits on stdin (memory
measurements read this process while it holds its session).
"""

import json
import os
import sys
import time

T_START = time.monotonic_ns()


def ones_feeds(sess, np) -> dict:
    """Ones of each input's shape (free dims 1): the first run's input, with no import the modes differ in."""
    dtypes = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
              "tensor(bool)": np.bool_}
    return {i.name: np.ones([d if isinstance(d, int) else 1 for d in i.shape], dtypes[i.type])
            for i in sess.get_inputs()}


def main() -> None:
    mode, name, src, tuned_dir, t_exec = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    import numpy as np
    if mode == "serve":  # the point of serve mode: this process never loads onnxruntime or the model
        import modelcache
    else:
        import onnxruntime as ort
        if mode.startswith("attach"):
            import modelcache
    t_imports = time.monotonic_ns()

    if mode == "ort":
        sess = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    elif mode == "ort-mmap":
        # ORT's own mmap of an .ort model (bench/coldstart.py converted it beside the .onnx): no daemon, the
        # page cache shared; prepacking left on, as its users run it. measure.ORT_MMAP_KEYS, written out here:
        # this child's imports are what it times, and it does not import modelcache for the ORT modes.
        so = ort.SessionOptions()
        for key in ("session.use_memory_mapped_ort_model", "session.use_ort_model_bytes_directly",
                    "session.use_ort_model_bytes_for_initializers"):
            so.add_session_config_entry(key, "1")
        sess = ort.InferenceSession(os.path.splitext(src)[0] + ".ort", so, providers=["CPUExecutionProvider"])
    elif mode == "ort-tuned":
        # The best a careful user does by hand: skeleton + weights in /dev/shm, ORT maps them.
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.add_session_config_entry("session.disable_prepacking", "1")
        sess = ort.InferenceSession(os.path.join(tuned_dir, "model.onnx"), so, providers=["CPUExecutionProvider"])
    elif mode.startswith("attach"):
        sess = modelcache.InferenceSession(name)
    elif mode == "serve":
        sess = modelcache.InferenceSession(name, mode="serve")
    elif mode == "ideal":
        sess = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    else:
        raise SystemExit(f"unknown mode {mode}")
    t_ready = time.monotonic_ns()

    if "onnxruntime" in sys.modules and mode == "serve":
        raise SystemExit("serve mode imported onnxruntime")
    feeds = ones_feeds(sess, np)
    if mode == "ideal":
        sess.run(None, feeds)  # warm-up: ideal counts only the compute of a warm session
        t_ready = t_imports
        t0 = time.monotonic_ns()
        sess.run(None, feeds)
        t_done = t_ready + (time.monotonic_ns() - t0)
    else:
        sess.run(None, feeds)
        t_done = time.monotonic_ns()
    ms = lambda a, b: (b - a) / 1e6  # noqa: E731
    hit = getattr(sess, "was_cache_hit", None)   # attach: were the weights resident before this open (the FaaS real replay)
    print(json.dumps({"mode": mode, "model": name, "hit": hit, "total_ms": ms(t_exec, t_done),
                      "interpreter_ms": ms(t_exec, T_START), "imports_ms": ms(T_START, t_imports),
                      "session_ms": ms(t_imports, t_ready), "first_run_ms": ms(t_ready, t_done)}), flush=True)
    if os.environ.get("HOLD"):
        sys.stdin.readline()


if __name__ == "__main__":
    main()
