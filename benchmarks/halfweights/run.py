"""Half-precision weights benchmark: what keeping fp16 weights in their dtype costs and saves.

    PYTHONPATH=. python benchmarks/halfweights/run.py [--models resnet50-fp16] [--runs 5] [--warm-runs 20] [--out benchmarks/halfweights]

Each fp16 model is packed twice into one repository: as `add` packs it (fp16 weights kept, the CPU EP's
Casts run in the client: packing._half_weight_exclusions) and as it was packed before (`NAME-upcast`:
ORT's FuseFp16InitializerToFp32NodeTransformer left on, fp32 weights in the blob beside the GPU
skeleton's fp16 ones). Side by side in one run, against plain ORT on the .onnx file:

- host-tier bytes: the size of the model's /dev/shm segment (a CPU open promotes the CPU skeleton's
  weights only), and what the tier plans for both variants, vs the source's fp16 weight bytes;
- session ready time and private memory (USS, after the first run, so the arena's fp32 temporaries
  count), each in fresh processes, interleaved; as in `bench open`, this process holds each model
  open so the measured process is a second client;
- warm run time, in one process holding all four sessions and alternating their runs;
- the largest difference of each attach mode's outputs from plain ORT's.

"fold-at-open" is the alternative measured against the design chosen: fp16 in the host tier, each
client widening the weights into private fp32 arrays when it opens (fold_at_open_session).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from modelcache.measure import (alternate_runs, answer_child, managed_daemon, memory_mib, run_child, save_results,
                                     summary)

UPCAST_SUFFIX = "-upcast"
MODES = ("ort", "attach", "attach-upcast", "fold-at-open")


def _session(mode: str, name: str, src: str, repository: str):
    import onnxruntime as ort
    import modelcache
    if mode == "ort":
        return ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    if mode == "fold-at-open":
        return fold_at_open_session(name, Path(repository))
    return modelcache.InferenceSession(name + (UPCAST_SUFFIX if mode == "attach-upcast" else ""))


def fold_at_open_session(name: str, repository: Path):
    """The design not taken, as a prototype: the host tier holds fp16 only (the lease on `name`), and the
    client widens each weight into a private fp32 array at open, over the upcast skeleton (ORT's own
    `FusedBack_<weight>` initializers), so its runs cost what they cost before. The lease and the
    arrays live as long as the returned session (attributes on it)."""
    import numpy as np
    import onnxruntime as ort
    from modelcache.client.connection import shared_client
    from modelcache.client.leases import shared_lease_client
    from modelcache.session_options import attach_session_options, map_readonly
    from modelcache.store.format import SKELETON_FILE, WEIGHTS_FILE, load_manifest

    lease_client = shared_lease_client(None) or shared_client()   # the path attach mode's open takes
    lease = lease_client.open(name, None, device="cpu")
    maps = [map_readonly(p) for p in lease.segments]
    fp16 = {t[0]: np.frombuffer(maps[t[3]], np.uint8)[t[4]:t[4] + t[5]].view(t[1]).reshape(t[2])
            for t in lease.tensors}
    upcast_dir = repository / (name + UPCAST_SUFFIX) / "1"
    so, values = attach_session_options(), []
    with open(upcast_dir / WEIGHTS_FILE, "rb") as blob:
        for t in load_manifest(upcast_dir).tensors:
            source = fp16.get(t.name[len("FusedBack_"):] if t.name.startswith("FusedBack_") else t.name)
            if source is not None:
                private = source.astype(t.dtype)
            else:  # fp32 at the upcast level but small enough to be inline at fp16: read, a private copy too
                blob.seek(t.offset)
                private = np.frombuffer(blob.read(t.nbytes), t.dtype).reshape(t.shape).copy()
            values.append(ort.OrtValue.ortvalue_from_numpy(private))
            so.add_initializer(t.name, values[-1])
    sess = ort.InferenceSession(str(upcast_dir / SKELETON_FILE), so, providers=["CPUExecutionProvider"])
    return _Held(sess, (lease, maps, values))


class _Held:
    """A session and what must outlive it."""
    def __init__(self, sess, keep):
        self.sess, self.keep = sess, keep

    def run(self, *args):
        return self.sess.run(*args)


def child_open(mode: str, name: str, src: str, repository: str) -> dict:
    import numpy as np  # noqa: F401  (imported before the clock starts in every mode alike)
    import onnxruntime  # noqa: F401
    import modelcache  # noqa: F401
    from modelcache import zoo
    feeds = zoo.sample_inputs(src)
    t0 = time.perf_counter()
    sess = _session(mode, name, src, repository)
    t_ready = time.perf_counter()
    sess.run(None, feeds)
    t_first = time.perf_counter()
    return {"mode": mode, "model": name, "ready_ms": (t_ready - t0) * 1e3, "first_run_ms": (t_first - t_ready) * 1e3,
            **memory_mib()}


def child_warm(name: str, src: str, repository: str, runs: int) -> dict:
    import numpy as np
    from modelcache import zoo
    feeds = zoo.sample_inputs(src)
    sessions = {mode: _session(mode, name, src, repository) for mode in MODES}
    outputs = {mode: s.run(None, feeds) for mode, s in sessions.items()}
    max_abs_diff = {mode: max(float(np.max(np.abs(g.astype(np.float64) - e.astype(np.float64))))
                              for g, e in zip(outputs[mode], outputs["ort"])) for mode in MODES}
    times = alternate_runs(sessions, feeds, runs)
    return {"model": name, "warm_ms": times, "max_abs_diff_vs_ort": max_abs_diff}


def half_weight_bytes(src: str, min_bytes: int = 0) -> int:
    """Bytes of the model's fp16/bf16 initializers of at least `min_bytes` each, every (sub)graph."""
    import onnx
    from modelcache.store.format import iter_graphs, tensor_nbytes
    from modelcache.store.packing import HALF_TYPES
    model = onnx.load(src, load_external_data=False)
    sizes = [tensor_nbytes(t) for g in iter_graphs(model.graph) for t in g.initializer if t.data_type in HALF_TYPES]
    return sum(n for n in sizes if n >= min_bytes)


def pack_both(src: str, repository: Path, name: str) -> None:
    """`name`: packed as `add` packs it; `name`-upcast: with ORT's fp16 -> fp32 weight fusion left on."""
    from modelcache.store.packing import pack
    pack(src, repository, name, 1)
    pack(src, repository, name + UPCAST_SUFFIX, 1, keep_half_weights=False)


def host_tier_bytes_with_gpu(repository: Path, name: str) -> int:
    """The segment bytes a fresh host tier would hold for the model with both variants (a GPU open
    promotes the GPU skeleton's weights through the host tier): the tier's own plan, nothing written."""
    from modelcache.store.format import load_manifest
    from modelcache.tiers.host import HostTier
    with tempfile.TemporaryDirectory() as shm:
        model_dir = repository / name / "1"
        return HostTier(shm, 1 << 62).plan_from(name, model_dir, load_manifest(model_dir), ("cpu", "gpu")).segment_bytes


def measure(socket: str, paths: dict[str, str], runs: int, warm_runs: int, repository: Path) -> dict:
    import modelcache
    from modelcache import zoo
    from modelcache.store.packing import INLINE_MAX_BYTES
    samples, warm, host = [], [], []
    for name, src in paths.items():
        holders = []
        for suffix in ("", UPCAST_SUFFIX):  # the first clients: weights resident and touched
            holder = modelcache.InferenceSession(name + suffix, socket=socket)
            holder.run(None, zoo.sample_inputs(src))
            holders.append(holder)
            segments = holder._lease.segments
            host.append({"model": name + suffix, "segment_bytes": sum(os.stat(p).st_size for p in segments),
                         "segment_resident_bytes": sum(os.stat(p).st_blocks * 512 for p in segments),
                         "with_gpu_variant_bytes": host_tier_bytes_with_gpu(repository, name + suffix),
                         "tensor_dtypes": sorted({t[1] for t in holder._lease.tensors})})
        for _ in range(runs):
            for mode in MODES:
                samples.append(run_child(__file__, socket, "open", mode, name, src, str(repository)))
        warm.append(run_child(__file__, socket, "warm", name, src, str(repository), str(warm_runs)))
        for holder in holders:
            holder.close()
        host.append({"model": name, "source_fp16_bytes": half_weight_bytes(src),
                     "source_fp16_bytes_in_blob": half_weight_bytes(src, INLINE_MAX_BYTES)})
    return {"samples": samples, "warm": warm, "host": host}


def report(results: dict, out=sys.stdout) -> None:
    host = {}
    for h in results["host"]:
        host.setdefault(h["model"], {}).update(h)
    for name in dict.fromkeys(w["model"] for w in results["warm"]):
        fp16 = host[name]
        print(f"{name}: fp16 weights {fp16['source_fp16_bytes'] / 2**20:.2f} MiB "
              f"({fp16['source_fp16_bytes_in_blob'] / 2**20:.2f} MiB in tensors the blob holds)", file=out)
        for suffix, label in (("", "attach"), (UPCAST_SUFFIX, "attach-upcast")):
            h = host[name + suffix]
            print(f"  host tier, {label:<13}: {h['segment_bytes'] / 2**20:8.2f} MiB "
                  f"= {h['segment_bytes'] / fp16['source_fp16_bytes_in_blob']:.3f}x the fp16 bytes; "
                  f"CPU tensors {','.join(h['tensor_dtypes'])}; with the GPU variant too "
                  f"{h['with_gpu_variant_bytes'] / 2**20:.2f} MiB "
                  f"= {h['with_gpu_variant_bytes'] / fp16['source_fp16_bytes_in_blob']:.3f}x", file=out)
    samples, warm = results["samples"], {w["model"]: w for w in results["warm"]}
    print(f"{'model':<16} {'mode':<14} {'ready ms':>22} {'USS MiB':>22} {'warm ms':>22} {'max |diff| vs ORT':>18}",
          file=out)
    for name in dict.fromkeys(s["model"] for s in samples):
        for mode in MODES:
            rows = [s for s in samples if s["model"] == name and s["mode"] == mode]
            print(f"{name:<16} {mode:<14} {summary([r['ready_ms'] for r in rows]):>22} "
                  f"{summary([r['uss_mib'] for r in rows]):>22} {summary(warm[name]['warm_ms'][mode]):>22} "
                  f"{warm[name]['max_abs_diff_vs_ort'][mode]:>18.3g}", file=out)
        for mode in MODES[1:]:
            pairs = [m / o for o, m in zip(warm[name]["warm_ms"]["ort"], warm[name]["warm_ms"][mode])]
            print(f"{name:<16} -> {mode}: warm run {statistics.median(pairs):.2f}x plain ORT's time "
                  f"(median of adjacent pairs)", file=out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/halfweights/run.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["resnet50-fp16"])
    ap.add_argument("--runs", type=int, default=5, help="fresh processes per mode and model (default 5)")
    ap.add_argument("--warm-runs", type=int, default=20, help="alternating warm runs per session (default 20)")
    ap.add_argument("--out", help="write all samples to OUT/results.json and the table to OUT/report.txt")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return answer_child(args.child, child_open, child_warm)
    from modelcache import zoo
    with tempfile.TemporaryDirectory(prefix="modelcache-bench-") as tmp:
        socket, repository = f"ipc://{tmp}/daemon.sock", Path(tmp) / "repo"
        paths = {}
        for name in args.models:
            paths[name] = f"{tmp}/{name}.onnx"
            zoo.save(zoo.build(name), paths[name])
            print(f"packing {name} twice ...", file=sys.stderr, flush=True)
            pack_both(paths[name], repository, name)
        with managed_daemon(socket, str(repository)):
            results = measure(socket, paths, args.runs, args.warm_runs, repository)
    report(results)
    save_results(args.out, "halfweights", argv, results, report,
                 command="PYTHONPATH=. python benchmarks/halfweights/run.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
