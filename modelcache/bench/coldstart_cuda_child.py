"""One GPU cold-start sample: a fresh process from exec to session ready and to first result, on CUDA.

    python coldstart_cuda_child.py MODE NAME SRC LAYOUT_JSON T_EXEC_NS

MODE: ort-cuda, host-attach, gpu-attach-hit, gpu-attach-miss, serve, ideal; `floor` (ideal's 1-node session
alone, run once: a CUDA client with no weights, for the memory figures); or `bandwidth` (host -> device copies
of LAYOUT_JSON's byte count, pageable and pinned, for the promotion figure beside it). Run as a plain
script so the interpreter loads only what the mode needs. Prints one JSON line; with HOLD set it then waits on
stdin (device memory is read while it holds its session). CLOCK_MONOTONIC is system-wide: the parent's
pre-exec timestamp and ours compare directly.
"""

import json
import os
import sys
import time

T_START = time.monotonic_ns()
CUDA = [("CUDAExecutionProvider", {"device_id": 0})]


def _ort():
    import onnxruntime as ort
    preload = getattr(ort, "preload_dlls", None)
    if preload is not None:
        preload()   # the CUDA and cuDNN libraries the CUDA provider needs (shared/GPU.md)
    return ort


def _check_cuda(sess) -> None:
    if sess.get_providers()[0] != "CUDAExecutionProvider":   # ORT falls back to the CPU with only a warning
        raise SystemExit(f"the session runs on {sess.get_providers()[0]}, not CUDA")


def _one_node_session(ort, path: str):
    """The floor every CUDA process pays: a CUDA context and a 1-node session on the CUDA provider (its
    .onnx written by the parent: importing onnx here would add to the floor)."""
    sess = ort.InferenceSession(path, providers=CUDA)
    _check_cuda(sess)
    return sess


def bandwidth(nbytes: int, repeats: int = 5) -> dict:
    """GB/s of host -> device copies of `nbytes`: from pageable memory, and pinned (cudaHostRegister'ed)."""
    import numpy as np
    from cupy.cuda import runtime
    runtime.setDevice(0)
    host = np.ones(nbytes, np.uint8)
    dev = runtime.malloc(nbytes)
    start, end = runtime.eventCreate(), runtime.eventCreate()

    def timed() -> float:
        times = []
        for _ in range(repeats):
            runtime.eventRecord(start, 0)
            runtime.memcpyAsync(dev, host.ctypes.data, nbytes, runtime.memcpyHostToDevice, 0)
            runtime.eventRecord(end, 0)
            runtime.eventSynchronize(end)
            times.append(runtime.eventElapsedTime(start, end) / 1e3)
        return nbytes / sorted(times)[len(times) // 2] / 1e9

    pageable = timed()
    runtime.hostRegister(host.ctypes.data, nbytes, 0)
    try:
        pinned = timed()
    finally:
        runtime.hostUnregister(host.ctypes.data)
        runtime.free(dev)
    return {"bytes": nbytes, "pageable_gb_s": pageable, "pinned_gb_s": pinned}


def main() -> None:
    mode, name, src, layout_path, t_exec = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    if mode == "bandwidth":
        print(json.dumps(bandwidth(int(json.loads(open(layout_path).read())["bytes"]))), flush=True)
        return
    import numpy as np
    if mode == "serve":   # the point of serve mode: no onnxruntime, no CUDA, no weights in this process
        import modelcache
    else:
        ort = _ort()
        if mode not in ("ort-cuda", "ideal", "floor"):
            import modelcache
    t_imports = time.monotonic_ns()

    keep = []
    if mode == "ort-cuda":
        sess = ort.InferenceSession(src, providers=CUDA)
    elif mode == "host-attach":
        # The host tier's copy of the GPU variant, mapped read-only; ORT copies it to its own device memory.
        from modelcache.session_options import attach_session_options, bind_weights
        layout = json.loads(open(layout_path).read())
        client = modelcache.connect()
        lease = client.open(name)                    # holds the host copy while this session lives
        so = attach_session_options()
        keep = [client, lease, *bind_weights(so, layout["segments"], layout["tensors"])]
        sess = ort.InferenceSession(layout["skeleton"], so, providers=CUDA)
    elif mode.startswith("gpu-attach"):
        sess = modelcache.InferenceSession(name, providers=CUDA)
    elif mode == "serve":
        sess = modelcache.InferenceSession(name, mode="serve")
    elif mode in ("ideal", "floor"):
        floor = _one_node_session(ort, json.loads(open(layout_path).read())["floor"])
        t_floor = time.monotonic_ns()
        sess = ort.InferenceSession(src, providers=CUDA) if mode == "ideal" else floor
    else:
        raise SystemExit(f"unknown mode {mode}")
    if mode != "serve":
        _check_cuda(sess)
    t_ready = time.monotonic_ns()
    if mode == "serve" and "onnxruntime" in sys.modules:
        raise SystemExit("serve mode imported onnxruntime")

    from coldstart_child import ones_feeds   # beside this script (run as one: its folder is on sys.path)
    feeds = ones_feeds(sess, np)
    if mode == "floor":
        sess.run(None, feeds)
        t_done = time.monotonic_ns()
    elif mode == "ideal":
        # Loading costs nothing: ready when the floor is, first result a warm run later.
        for _ in range(3):
            sess.run(None, feeds)
        t0 = time.monotonic_ns()
        sess.run(None, feeds)
        warm = time.monotonic_ns() - t0
        t_ready, t_done = t_floor, t_floor + warm
        del floor
    else:
        sess.run(None, feeds)
        t_done = time.monotonic_ns()
    if mode == "serve" and ("onnxruntime" in sys.modules or "cupy" in sys.modules):
        raise SystemExit("serve mode imported onnxruntime or cupy")
    ms = lambda a, b: (b - a) / 1e6  # noqa: E731
    print(json.dumps({"mode": mode, "model": name, "ready_ms": ms(t_exec, t_ready), "first_ms": ms(t_exec, t_done),
                      "interpreter_ms": ms(t_exec, T_START), "imports_ms": ms(T_START, t_imports),
                      "session_ms": ms(t_imports, t_ready), "first_run_ms": ms(t_ready, t_done)}), flush=True)
    if os.environ.get("HOLD"):
        sys.stdin.readline()
    del keep


if __name__ == "__main__":
    main()
