"""Does a worker thread that idled run its next run slower? Paired: a run right after the previous one,
then one after the thread slept `gap` ms (as a stage served one request at a time meets its worker).

    PYTHONPATH=. python benchmarks/placement/check/wake_probe.py MODEL THREADS PAIRS GAPS_MS
    e.g. ... wake_probe.py alexnet 1 40 3,20,60

Measured here (2-core VM, idle; median of cold/warm, quartiles): AlexNet on 1 thread 1.011 after
3 ms, 1.011 after 10, 1.073 (1.036-1.098) after 20, 1.074 after 60; on 2 threads 1.010, 1.037,
1.054 after 3, 20, 60 ms; ResNet-50 on 1 thread 1.001, 1.023, 1.022 after 10, 30, 100 ms: about
2 ms a run, not a share of it. placement/profile.py's cold runs (WAKE_GAP_S, WAKE_AFTER_S) come
from this.
"""
import os, sys, time, statistics, tempfile
import onnxruntime as ort
from modelcache import zoo
from modelcache.zoo import sample_inputs
from modelcache.session_options import attach_session_options
name, threads, pairs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
gaps = [float(g) / 1e3 for g in sys.argv[4].split(",")]
with tempfile.TemporaryDirectory() as tmp:
    path = f"{tmp}/m.onnx"; zoo.save(zoo.build(name), path)
    feeds = sample_inputs(path, batch=1)
    os.sched_setaffinity(0, {1} if threads == 1 else {0, 1})
    so = attach_session_options(spinning=False); so.intra_op_num_threads = threads
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    for _ in range(3): sess.run(None, feeds)
    def run():
        t = time.perf_counter(); sess.run(None, feeds); return time.perf_counter() - t
    for gap in gaps:
        r = []
        for _ in range(pairs):
            warm = run()           # right after the previous run
            time.sleep(gap); cold = run()
            r.append(cold / warm)
        q = statistics.quantiles(r, n=4)
        print(f"{name} {threads}t: after {gap*1e3:.0f} ms idle / back to back: median {statistics.median(r):.3f} (q1 {q[0]:.3f}, q3 {q[2]:.3f}), {pairs} pairs")
