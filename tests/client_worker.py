"""A separate client process for the integration tests.

    client_worker.py run NAME FEEDS.npz OUT.npz     open NAME, run it on FEEDS, save outputs, report
    client_worker.py hold NAME [cuda]               open NAME (on a GPU with cuda), print OPEN, wait to be killed
    client_worker.py churn REFS.npz SECONDS SEED    open/run/close random models for SECONDS, check outputs
    client_worker.py serve REFS.npz N               N serve-mode runs over the models in REFS, check outputs
    client_worker.py soak REFS.npz SECONDS SEED     serve-mode runs of random models for SECONDS, check outputs

`run` prints one JSON line: whether the weights blob is mapped into this process
(read-only, from /dev/shm) and the process's anonymous memory.
"""

import json
import sys
import time


def mapped(path: str) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line.split()[1] for line in f if line.rstrip().endswith(path)]


def main() -> int:
    import numpy as np
    import modelcache

    cmd, name = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""
    if cmd == "run":
        feeds = dict(np.load(sys.argv[3]))
        with modelcache.InferenceSession(name) as sess:
            outs = sess.run(None, feeds)
            np.savez(sys.argv[4], *outs)
            segments = sess._lease.segments
            perms = [p for seg in segments for p in mapped(seg)]
            print(json.dumps({"perms": perms, "segments": segments, "hit": sess.was_cache_hit}))
        return 0
    if cmd == "churn":
        import random
        refs = dict(np.load(sys.argv[2]))
        feeds = dict(np.load(sys.argv[2].replace(".npz", "-feeds.npz")))
        rng = random.Random(int(sys.argv[4]))
        deadline = time.monotonic() + float(sys.argv[3])
        counts = {"runs": 0, "wrong": 0, "capacity_errors": 0, "other_errors": []}
        while time.monotonic() < deadline:
            name = rng.choice(sorted(refs))
            try:
                with modelcache.InferenceSession(name) as sess:
                    out = sess.run(None, feeds)[0]
                counts["runs"] += 1
                counts["wrong"] += int(not np.allclose(out, refs[name], rtol=1e-3, atol=1e-4))
            except modelcache.CapacityError:
                counts["capacity_errors"] += 1
            except Exception as e:  # reported, and the test fails on it
                counts["other_errors"].append(f"{type(e).__name__}: {e}")
        print(json.dumps(counts))
        return 0
    if cmd == "serve":
        refs = dict(np.load(sys.argv[2]))
        sessions = {n: modelcache.InferenceSession(n, mode="serve") for n in refs}
        wrong = 0
        for i in range(int(sys.argv[3])):
            for n, s in sessions.items():
                feeds = dict(np.load(sys.argv[2].replace(".npz", f"-{n}-feeds.npz")))
                wrong += int(not np.allclose(s.run(None, feeds)[0], refs[n], rtol=1e-3, atol=1e-4))
        print(json.dumps({"wrong": wrong, "onnxruntime_imported": "onnxruntime" in sys.modules}))
        return 0
    if cmd == "soak":
        import random
        refs = dict(np.load(sys.argv[2]))
        feeds = {n: dict(np.load(sys.argv[2].replace(".npz", f"-{n}-feeds.npz"))) for n in refs}
        rng = random.Random(int(sys.argv[4]))
        deadline = time.monotonic() + float(sys.argv[3])
        counts = {"requests": 0, "wrong": 0, "errors": []}
        with modelcache.connect() as client:
            while time.monotonic() < deadline and len(counts["errors"]) < 10:
                name = rng.choice(sorted(refs))
                try:
                    out = client.infer(name, feeds[name])[0]
                    counts["requests"] += 1
                    counts["wrong"] += int(not np.allclose(next(iter(out.values())), refs[name], rtol=1e-3, atol=1e-4))
                except Exception as e:  # reported, and the test fails on it
                    counts["errors"].append(f"{type(e).__name__}: {e}")
        print(json.dumps(counts))
        return 0
    if cmd == "hold":
        on_gpu = sys.argv[3:] == ["cuda"]
        sess = modelcache.InferenceSession(name, providers=["CUDAExecutionProvider"] if on_gpu else None)
        print("OPEN", flush=True)
        while True:
            time.sleep(1)
        del sess
    return 2


if __name__ == "__main__":
    sys.exit(main())
