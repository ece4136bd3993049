"""A host lease's files as descriptors (daemon/lease_files.py, store/portable.py), on a real daemon.

A client in another mount namespace, as in another container (its own /dev/shm, the repository hidden
under an empty tmpfs, only the daemon's socket in view), opens models by name and gets plain ORT's
outputs: from the host tier, from the repository's files (an open the tier cannot take), and for a
model with pre-packed blobs (opened unpacked, since ORT maps those by path). A version packed before
portable skeletons still opens by path; no descriptor stays open on either side.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import modelcache
from modelcache import zoo
from modelcache.session_options import PORTABLE_FOLDER, PORTABLE_LOCATION
from modelcache.store import format
from modelcache.store.format import PORTABLE_SKELETON_FILE, iter_graphs

from conftest import DaemonProcess, daemon_with_models, left_open, open_fds, stop_cleanly, wait_until

needs_namespaces = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                      reason="a private mount namespace needs root and unshare(1)")

# Run in the isolated namespace: open the model, say what it could see, save its outputs for the test.
ISOLATED = r"""
import json, os, sys
import numpy as np
import modelcache
name, feeds_path, out_path = sys.argv[1:4]
feeds = dict(np.load(feeds_path))
s = modelcache.InferenceSession(name)
outputs = s.run(None, feeds)
np.savez(out_path, *outputs)
print(json.dumps({"hit": s.was_cache_hit, "prepacked": s.prepacked, "sees_tier": os.listdir("/dev/shm") != [],
                  "sees_skeleton": os.path.exists(s._lease.skeleton_path)}))
"""


def run_isolated(d: DaemonProcess, name: str, feeds: dict, tmp_path) -> tuple[dict, list]:
    """Open `name` and run it on `feeds` in a process with its own mount namespace, /dev/shm and repository
    each replaced by an empty tmpfs: only the socket (under tmp_path) stays in view."""
    np.savez(tmp_path / "feeds.npz", **feeds)
    hide = " && ".join(f"mount -t tmpfs none {p}" for p in ("/dev/shm", d.repository))
    proc = subprocess.run(["unshare", "-m", "sh", "-c", f'{hide} && exec "$0" -c "$1" "$2" "$3" "$4"',
                           sys.executable, ISOLATED, name, str(tmp_path / "feeds.npz"), str(tmp_path / "out.npz")],
                          env={**d.env, "MODELCACHE_SOCKET": d.socket}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with np.load(tmp_path / "out.npz") as out:
        outputs = [out[f"arr_{i}"] for i in range(len(out.files))]
    return json.loads(proc.stdout.strip().splitlines()[-1]), outputs


def plain(path: str, feeds: dict) -> list:
    return ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)


def assert_close(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.fixture
def two_models(tmp_path):
    """(daemon, {name: .onnx path}): a real daemon holding a and b, ~4.7 MiB each (one fits a 6M host tier)."""
    paths = {}
    for name, seed in (("a", 0), ("b", 1)):
        paths[name] = str(tmp_path / f"{name}.onnx")
        zoo.save(zoo.build("squeezenet1_1", seed), paths[name])
    with daemon_with_models(tmp_path, paths, {"MODELCACHE_HOST_CAPACITY": "6M"}) as (d, _):
        yield d, paths


def test_add_writes_a_portable_skeleton_that_names_no_file_of_ours(two_models):
    d, _ = two_models
    version = d.repository / "a" / "1"
    manifest = format.load_manifest(version)
    assert PORTABLE_SKELETON_FILE in manifest.files           # under the version's checksums
    portable = onnx.load(str(version / PORTABLE_SKELETON_FILE), load_external_data=False)
    packed = onnx.load(str(version / format.SKELETON_FILE), load_external_data=False)
    external = [t for g in iter_graphs(portable.graph) for t in g.initializer
                if t.data_location == onnx.TensorProto.EXTERNAL]
    assert {t.name for t in external} == {t.name for t in manifest.tensors}   # every one handed over by a client
    assert {e.value for t in external for e in t.external_data if e.key == "location"} == {PORTABLE_LOCATION}
    assert os.path.exists(os.path.join(PORTABLE_FOLDER, PORTABLE_LOCATION))
    assert [n.op_type for n in portable.graph.node] == [n.op_type for n in packed.graph.node]


@needs_namespaces
def test_a_client_in_another_mount_namespace_opens_from_the_tier_and_from_the_files(two_models, tmp_path):
    d, paths = two_models
    feeds = zoo.sample_inputs(paths["a"])
    with modelcache.InferenceSession("a", socket=d.socket) as holder:   # a resident, in use: the 6M tier is full
        seen, got = run_isolated(d, "a", feeds, tmp_path)
        assert seen == {"hit": True, "prepacked": False, "sees_tier": False, "sees_skeleton": False}, seen
        assert_close(got, plain(paths["a"], feeds))
        assert_close(got, holder.run(None, feeds))

        seen, got = run_isolated(d, "b", feeds, tmp_path)                 # no room: the repository's files
        assert seen["hit"] is False and not seen["sees_skeleton"], seen
        assert_close(got, plain(paths["b"], feeds))
        with d.client() as c:
            assert c.stats().counters["opens_from_disk"] == 1


def test_no_descriptor_stays_open_in_the_client_or_the_daemon(two_models):
    d, paths = two_models
    feeds = zoo.sample_inputs(paths["a"])
    with modelcache.InferenceSession("a", socket=d.socket) as first:   # the lane and the daemon's side settled
        first.run(None, feeds)
        before = open_fds("self"), open_fds(d.pid)
        for name in ("a", "b", "a", "b"):                              # the tier, then the files
            with modelcache.InferenceSession(name, socket=d.socket) as s:
                s.run(None, feeds)
        assert not left_open(open_fds("self"), before[0])
        # The daemon handles a release after the client's close returns: give it a moment, then name what stayed.
        try:
            wait_until(lambda: not left_open(open_fds(d.pid), before[1]), timeout_s=3, what="the daemon's descriptors")
        except AssertionError:
            raise AssertionError(f"daemon descriptors left: {left_open(open_fds(d.pid), before[1])}") from None


def test_a_version_packed_before_portable_skeletons_opens_by_path(two_models):
    d, paths = two_models
    version = d.repository / "a" / "1"
    manifest = format.load_manifest(version)
    del manifest.files[PORTABLE_SKELETON_FILE]
    (version / PORTABLE_SKELETON_FILE).unlink()
    (version / format.MANIFEST_FILE).write_text(manifest.to_json())
    stop_cleanly(d)
    d.start()                                           # (the registry reads the manifest at start)
    feeds = zoo.sample_inputs(paths["a"])
    with modelcache.InferenceSession("a", socket=d.socket) as s:
        assert not getattr(s._lease, "received_fds", None) and s._lease.ipc_fds == 0
        assert_close(s.run(None, feeds), plain(paths["a"], feeds))


def test_a_damaged_portable_skeleton_is_refused_as_any_stored_file(two_models):
    d, paths = two_models
    portable = d.repository / "a" / "1" / PORTABLE_SKELETON_FILE
    portable.chmod(0o644)
    data = bytearray(portable.read_bytes())
    data[len(data) // 2] ^= 0xFF
    portable.write_bytes(bytes(data))
    with pytest.raises(modelcache.errors.IntegrityError, match=PORTABLE_SKELETON_FILE):
        modelcache.InferenceSession("a", socket=d.socket)
    with modelcache.InferenceSession("b", socket=d.socket) as s:   # the daemon stays up for the others
        s.run(None, zoo.sample_inputs(paths["b"]))


@needs_namespaces
def test_a_prepacked_model_opens_unpacked_where_the_tier_is_out_of_sight(tmp_path):
    from test_prepack import HIDDEN, mlp
    src = mlp(tmp_path / "mlp.onnx")
    d = DaemonProcess(tmp_path).start()
    try:
        with d.client() as c:
            c.add(src, "mlp", prepack=True)
        feeds = {"x": np.random.default_rng(1).standard_normal((4, HIDDEN)).astype(np.float32)}
        with modelcache.InferenceSession("mlp", socket=d.socket) as here:   # in sight: the blobs, by path
            assert here.prepacked
            seen, got = run_isolated(d, "mlp", feeds, tmp_path)
        assert seen["prepacked"] is False and not seen["sees_skeleton"], seen
        assert_close(got, plain(src, feeds))
        stop_cleanly(d)
    finally:
        d.kill()
