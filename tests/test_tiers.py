"""Tier contract: every backend keeps its accounting honest and frees what it allocated.

The host tier runs on real /dev/shm; the GPU suite skips cleanly without a device.
"""

import os
from pathlib import Path

import numpy as np
import onnx
import pytest

from modelcache import zoo
from modelcache.store.packing import pack
from modelcache.tiers import gpu


def packed(tmp_path, name, model):
    src = tmp_path / f"{name}.onnx"
    onnx.save(model, str(src))
    manifest = pack(str(src), tmp_path / "repo", name, 1)
    return tmp_path / "repo" / name / "1", manifest


def promote(tier, key, model_dir, manifest):
    plan = tier.plan_from(key, model_dir, manifest)
    tier.write(plan)
    tier.commit(plan)
    return plan


def variant(seed: int, change_last: int = 0) -> onnx.ModelProto:
    """tiny-vit with seed 0, except its last `change_last` initializers, which get other values."""
    base = zoo.build("tiny-vit", 0)
    if change_last:
        big = [t for t in base.graph.initializer if len(t.raw_data) >= 1024][-change_last:]
        rng = np.random.default_rng(seed)
        for t in big:
            arr = onnx.numpy_helper.to_array(t)
            t.CopyFrom(onnx.numpy_helper.from_array(rng.standard_normal(arr.shape).astype(arr.dtype), t.name))
    return base


def test_host_promote_export_free(host, tmp_path):
    d, m = packed(tmp_path, "a", zoo.build("tiny-cnn"))
    plan = promote(host, "a@1", d, m)
    assert host.used_bytes == plan.segment_bytes >= sum(t.nbytes for t in m.tensors)
    skeleton, segments, tensors = host.layout("a@1", m)
    assert Path(skeleton).exists() and all(Path(s).exists() for s in segments)
    blob = (d / "weights.bin").read_bytes()
    for (name, dtype, shape, seg, off, nbytes), t in zip(tensors, m.tensors):
        with open(segments[seg], "rb") as f:
            f.seek(off)
            assert f.read(nbytes) == blob[t.offset:t.offset + nbytes]
    assert oct(os.stat(segments[0]).st_mode & 0o777) == "0o440"
    assert host.free_model("a@1") == plan.segment_bytes
    assert host.used_bytes == 0 and not any(host.root.iterdir())


def test_host_holds_the_gpu_variant_beside_the_cpu_one(host, tmp_path):
    """With a GPU tier the host tier holds both variants (the GPU one is what devices copy from), once each
    tensor: at opt_level basic they coincide, so the GPU variant costs (almost) nothing more."""
    d, m = packed(tmp_path, "a", zoo.build("tiny-cnn"))
    probe = host.plan_from("a@1", d, m)
    cpu_only = probe.segment_bytes
    host.abort(probe)
    plan = host.plan_from("a@1", d, m, ("cpu", "gpu"))
    host.write(plan)
    host.commit(plan)
    assert plan.segment_bytes >= cpu_only and host.has_variant("a@1", "gpu")
    skeleton, segments, tensors = host.layout("a@1", m, "gpu")
    assert skeleton.endswith("a@1.gpu.onnx") and Path(skeleton).exists()
    stub = Path(skeleton).with_suffix(".stub")
    assert stub.stat().st_size == max(t.nbytes for t in m.gpu_tensors) and stub.stat().st_blocks == 0
    blob = (d / "weights.bin").read_bytes()
    for (name, dtype, shape, seg, off, nbytes), t in zip(tensors, m.gpu_tensors):
        with open(segments[seg], "rb") as f:
            f.seek(off)
            assert f.read(nbytes) == blob[t.offset:t.offset + nbytes]
    assert host.file_locations("a@1", "gpu")[tensors[0][0]] == (segments[tensors[0][3]], tensors[0][4])
    host.free_model("a@1")
    assert host.used_bytes == 0 and not any(host.root.iterdir())


def test_host_stores_shared_tensors_once(host, tmp_path):
    da, ma = packed(tmp_path, "a", variant(0))
    db, mb = packed(tmp_path, "b", variant(1, change_last=2))
    pa = promote(host, "a@1", da, ma)
    pb = promote(host, "b@1", db, mb)
    assert 0 < pb.segment_bytes < 0.15 * pa.segment_bytes     # b copied only what differs (~13 %)
    assert host.used_bytes == pa.segment_bytes + pb.segment_bytes
    # The shared segment survives a's eviction while b uses it, less the tensors only a used: their pages are
    # punched out of the file (issue 42), as much as bytes_freed_by said, and no more.
    shared = host.segment_path(pa.segment)
    frees = host.bytes_freed_by(["a@1"])
    assert 0 < frees < 0.5 * pa.segment_bytes
    blocks = os.stat(shared).st_blocks
    assert host.free_model("a@1") == frees
    assert (blocks - os.stat(shared).st_blocks) * 512 == frees
    assert host.used_bytes == pa.segment_bytes + pb.segment_bytes - frees
    assert host.model_bytes("b@1") == host.used_bytes
    # A punched tensor is no longer offered for sharing: a comes back with those tensors copied again, every
    # tensor of both models reads back as stored.
    pa2 = promote(host, "a@1", da, ma)
    assert pa2.segment_bytes >= frees
    for key, d, m in (("a@1", da, ma), ("b@1", db, mb)):
        blob = (d / "weights.bin").read_bytes()
        _, segments, tensors = host.layout(key, m)
        for (name, dtype, shape, seg, off, nbytes), t in zip(tensors, m.tensors):
            with open(segments[seg], "rb") as f:
                f.seek(off)
                assert f.read(nbytes) == blob[t.offset:t.offset + nbytes], (key, name)
    host.free_model("a@1")
    assert host.bytes_freed_by(["b@1"]) == host.used_bytes
    assert host.free_model("b@1") == pa.segment_bytes + pb.segment_bytes - frees
    assert host.used_bytes == 0 and host.segments == {}


def test_abort_releases_the_reservation(host, tmp_path):
    d, m = packed(tmp_path, "a", zoo.build("tiny-cnn"))
    plan = host.plan_from("a@1", d, m)
    assert host.used_bytes == plan.segment_bytes   # reserved before a byte is written
    host.abort(plan)
    assert host.used_bytes == 0 and host.segments == {}


@pytest.mark.skipif(not gpu.probe(), reason="no CUDA device (or no cupy): the GPU tier is absent here")
def test_gpu_tier_bookkeeping():
    dev = gpu.probe()[0]
    tier = gpu.DeviceTier(gpu.CudaAllocator(dev), capacity_bytes=1 << 30)
    assert tier.free_bytes == min(1 << 30, dev.total_bytes) and len(dev.uuid) > 0


def test_gpu_probe_is_clean_without_a_gpu():
    assert isinstance(gpu.probe(), list)
