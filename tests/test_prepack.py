"""Pre-packed MatMul weights shared through the host tier (modelcache/store/prepack.py), with a real daemon and ORT.

A MatMul-heavy model gets its blobs at add time; clients build sessions with prepacking on over a
skeleton that names the blobs in the host tier, get plain ORT's outputs, and make no private packed
copy. Models that are not MatMul-heavy, and machines the blobs were not made for, open as before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import modelcache
from modelcache.errors import IntegrityError
from modelcache.store import format, packing, prepack

# Two dense layers of 1024x4096 and 4096x1024: 32 MiB of MatMul weights, so a private packed
# copy (another 32 MiB) stands out from the noise of a process's own allocations.
HIDDEN, WIDE = 1024, 4096


def mlp(path: Path) -> str:
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array((rng.standard_normal((HIDDEN, WIDE)) / 32).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((rng.standard_normal((WIDE, HIDDEN)) / 64).astype(np.float32), "w2")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
                           helper.make_node("MatMul", ["r", "w2"], ["y"])], "mlp",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", HIDDEN])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", HIDDEN])], [w1, w2])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


CHILD = r"""
import json, sys
import numpy as np
from modelcache.measure import memory_mib
import modelcache, onnxruntime
before = memory_mib()["anon_mib"]
s = modelcache.InferenceSession(sys.argv[1])
s.run(None, {"x": np.ones((4, %d), np.float32)})
# ORT maps a pre-packed weight and its blobs copy-on-write (rw-p): count pages it ever wrote
cow_kib, current = 0, None
for line in open("/proc/self/smaps"):
    parts = line.split()
    if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:
        current = parts[-1]
    elif line.startswith("Anonymous:") and current in s._lease.segments:
        cow_kib += int(parts[1])
print(json.dumps({"grew_mib": memory_mib()["anon_mib"] - before, "prepacked": s.prepacked, "cow_kib": cow_kib}))
""" % HIDDEN


def second_client(daemon, name: str) -> dict:
    env = {**os.environ, "MODELCACHE_SOCKET": daemon.socket}
    out = subprocess.run([sys.executable, "-c", CHILD, name], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_matmul_model_shares_prepacked_blobs(daemon, tmp_path):
    src = mlp(tmp_path / "mlp.onnx")
    with daemon.client() as c:
        c.add(src, "mlp", prepack=True)
    manifest = format.load_manifest(daemon.repository / "mlp" / "1")
    assert {r["tensor"] for r in manifest.prepacked} == {"w1", "w2"}
    assert manifest.prepacked_for == prepack.cpu_fingerprint()
    assert format.PREPACKED_FILE in manifest.files   # covered by the version's checksums

    feeds = {"x": np.random.default_rng(1).standard_normal((4, HIDDEN)).astype(np.float32)}
    want = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    with modelcache.InferenceSession("mlp", socket=daemon.socket) as first:
        assert first.prepacked and first._lease.prepacked == ["w1", "w2"]
        np.testing.assert_allclose(first.run(None, feeds)[0], want, rtol=1e-5, atol=1e-5)
        skeleton = onnx.load(first._lease.skeleton_path, load_external_data=False)
        entries = {t.name: {e.key for e in t.external_data} for t in skeleton.graph.initializer}
        assert "prepacked_0" in entries["w1"] and "prepacked_0" in entries["w2"]

        # A second client: its packing is found in the host tier, so no private 32 MiB copy.
        child = second_client(daemon, "mlp")
        assert child["prepacked"] and child["cow_kib"] == 0, child
        assert child["grew_mib"] < 12, child


def test_without_blobs_a_client_would_copy(daemon, tmp_path):
    """The control for the figure above: the same model with its blobs refused on this machine."""
    src = mlp(tmp_path / "mlp.onnx")
    with daemon.client() as c:
        c.add(src, "mlp", prepack=True)
    daemon.stop()      # the daemon reads manifests at start: edit it while none runs
    model_dir = daemon.repository / "mlp" / "1"
    manifest = format.load_manifest(model_dir)
    manifest.prepacked_for = "another-machine"
    format.write_manifest(model_dir, manifest)
    daemon.start()
    with modelcache.InferenceSession("mlp", socket=daemon.socket) as s:
        assert not s.prepacked and s._lease.prepacked == []     # opened as before: prepacking off
        child = second_client(daemon, "mlp")
        assert not child["prepacked"] and child["grew_mib"] < 12, child


def test_blobs_are_made_only_when_asked_for(daemon, tmp_path):
    """Off by default: blobs cost each open ~0.3 s and the host tier their size (docs/sessions.md, Known limits)."""
    src = mlp(tmp_path / "mlp.onnx")
    with daemon.client() as c:
        c.add(src, "mlp")
    manifest = format.load_manifest(daemon.repository / "mlp" / "1")
    assert manifest.prepacked == [] and format.PREPACKED_FILE not in manifest.files
    with modelcache.InferenceSession("mlp", socket=daemon.socket) as s:
        assert not s.prepacked and s._lease.prepacked == []


def test_cnn_is_not_matmul_heavy(daemon, zoo_file):
    with daemon.client() as c:
        c.add(zoo_file("tiny-cnn"), "cnn", prepack=True)
    manifest = format.load_manifest(daemon.repository / "cnn" / "1")
    assert manifest.prepacked == [] and format.PREPACKED_FILE not in manifest.files
    with modelcache.InferenceSession("cnn", socket=daemon.socket) as s:
        assert not s.prepacked and s._lease.prepacked == []


def test_damaged_blob_is_refused(host, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    packing.pack(mlp(tmp_path / "mlp.onnx"), repo, "mlp", 1, with_prepacked=True)
    model_dir = repo / "mlp" / "1"
    manifest = format.load_manifest(model_dir)
    blob_offset = manifest.prepacked[0]["packs"][0][1][0][0]
    with open(model_dir / format.PREPACKED_FILE, "r+b") as f:
        f.seek(blob_offset + 100)
        byte = f.read(1)
        f.seek(blob_offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    host.capacity_bytes = 1 << 30
    plan = host.plan_from("mlp@1", model_dir, manifest)
    assert plan.blob_copies
    with pytest.raises(IntegrityError, match="prepacked.bin"):
        host.write(plan)
    host.abort(plan)


def test_malformed_record_is_a_damaged_manifest(tmp_path):
    """A record that would send the host tier past the blobs' file is refused when the manifest is read."""
    repo = tmp_path / "repo"
    repo.mkdir()
    packing.pack(mlp(tmp_path / "mlp.onnx"), repo, "mlp", 1, with_prepacked=True)
    model_dir = repo / "mlp" / "1"
    manifest = format.load_manifest(model_dir)
    manifest.prepacked[0]["packs"][0][1][0][0] = manifest.files[format.PREPACKED_FILE]["bytes"]
    format.write_manifest(model_dir, manifest)   # (its checksum recomputed: only the record is wrong)
    with pytest.raises(IntegrityError, match="prepacked record"):
        format.load_manifest(model_dir)


def test_a_readopted_tier_keeps_each_weights_blobs_and_gives_back_nothing_in_use(tmp_path):
    """A restart trims what no model uses from the re-adopted segments (tiers/host.py, issue 42): a weight's
    pre-packed blobs lie after it, unnamed by the tensors' places, and must stay with it."""
    from conftest import DaemonProcess, stop_cleanly
    src = mlp(tmp_path / "mlp.onnx")
    d = DaemonProcess(tmp_path).start()
    with d.client() as c:
        c.add(src, "mlp", prepack=True)
        c.load("mlp")
    tier = d.shm_dir

    def held_bytes(directory):
        return sum(p.stat().st_blocks * 512 for p in directory.glob("seg-*.bin"))
    before = held_bytes(tier)
    d.proc.kill()
    d.proc.wait()
    d2 = DaemonProcess(tmp_path).start()
    try:
        assert held_bytes(d2.shm_dir) == before > 48 * 2**20      # 32 MiB of weights and their blobs, whole
        x = np.ones((4, HIDDEN), np.float32)
        ref = ort.InferenceSession(src).run(None, {"x": x})[0]
        with d2.client() as c:
            assert c.stats().counters["adopted"] == 1
            s = modelcache.InferenceSession("mlp", client=c)
            assert s.was_cache_hit and np.abs(s.run(None, {"x": x})[0] - ref).max() < 1e-3
            s.close()
    finally:
        stop_cleanly(d2)
        d.kill()
