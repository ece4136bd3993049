"""Integrity end to end: every kind of damage to a stored file is refused, named, and never served.

Each test damages a packed version the way disks and people do (a flipped byte, an edited
offset, a truncated or missing file) and checks, through a real daemon subprocess, that
attach and serve mode both refuse it with an error naming the model, the version and the
file, that the daemon stays up, and that `modelcache verify` finds the same damage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import modelcache
from modelcache import zoo
from modelcache.errors import IntegrityError
from modelcache.store import integrity
from modelcache.store.format import parse_manifest
from modelcache.store.packing import pack
from modelcache.tiers.files import copy_hashed
from modelcache.tiers.remote import publish
from conftest import DaemonProcess, stop_cleanly, wait_until
from test_service import free_port, parse_prometheus

NAME = "cnn"


@pytest.fixture
def packed(tmp_path, zoo_file):
    """tiny-cnn packed as cnn@1 into tmp_path/repo (no daemon yet); returns its version directory."""
    pack(zoo_file("tiny-cnn"), tmp_path / "repo", NAME, 1)
    return tmp_path / "repo" / NAME / "1"


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def manifest_of(version_dir: Path) -> dict:
    return json.loads((version_dir / "manifest.json").read_text())


def reference(src: str, feeds: dict):
    return ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def verify(tmp_path, *args, env: dict | None = None) -> subprocess.CompletedProcess:
    """`modelcache verify` with no daemon (it reads the repository), or through the daemon of `env`."""
    env = env or {**os.environ, "MODELCACHE_CONFIG": "", "MODELCACHE_REPOSITORY": str(tmp_path / "repo"),
                  "MODELCACHE_SOCKET": f"ipc://{tmp_path}/no-daemon.sock"}
    return subprocess.run([sys.executable, "-m", "modelcache.cli", "verify", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def assert_refused(d: DaemonProcess, feeds: dict, *words: str) -> str:
    """Attach open and serve infer of cnn both fail with IntegrityError naming cnn@1 and `words`;
    the daemon stays up and lists the version as corrupt. Returns the error message."""
    with d.client() as c:
        with pytest.raises(IntegrityError) as attach:
            modelcache.InferenceSession(NAME, client=c)
        with pytest.raises(IntegrityError) as serve:
            c.infer(NAME, feeds)
        for err in (attach.value, serve.value):
            for word in (f"{NAME}@1", *words):
                assert word in str(err), str(err)
        listed = {(m["name"], m["version"]): m for m in c.list()}
        assert listed[(NAME, 1)]["state"] == "corrupt" and f"{NAME}@1" in listed[(NAME, 1)]["corrupt"]
    return str(attach.value)


def assert_verify_finds(tmp_path, *words: str) -> None:
    r = verify(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "DAMAGED" in r.stdout and all(w in r.stdout for w in words), r.stdout


# -- one test per damage kind, through the real daemon --------------------------------------

def test_flipped_weight_byte_detected_at_promotion(tmp_path, packed, zoo_file):
    port = free_port()
    d = DaemonProcess(tmp_path, {"MODELCACHE_METRICS_PORT": str(port)}).start()
    try:
        feeds = zoo.sample_inputs(zoo_file("tiny-cnn"))
        tensor = manifest_of(packed)["tensors"][-1]
        flip_byte(packed / "weights.bin", tensor["offset"] + tensor["nbytes"] // 2)
        message = assert_refused(d, feeds, "weights.bin", tensor["name"])
        assert "corrupt" in message
        with d.client() as c:
            assert c.stats().counters["corrupt_detected"] == 1
        status = subprocess.run([sys.executable, "-m", "modelcache.cli", "status"], capture_output=True, text=True,
                                env={**d.env}, timeout=60)
        assert status.returncode == 0 and "1 corrupt version (" in status.stdout, status.stdout + status.stderr
        assert f"{NAME}@1: weights.bin is damaged" in status.stdout

        def scrape():
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                return parse_prometheus(r.read().decode())

        # (the daemon renders a snapshot each sweep, about once a second)
        samples = wait_until(lambda: (lambda m: m if m.get("modelcache_corrupt_detected_total") else None)(scrape()),
                             what="a metrics snapshot after the refusal")
        assert samples[f'modelcache_model_corrupt{{model="{NAME}",version="1"}}'] == 1
        assert samples['modelcache_models{state="corrupt"}'] == 1
    finally:
        stop_cleanly(d)
    assert_verify_finds(tmp_path, "weights.bin", tensor["name"])


@pytest.mark.parametrize("fname", ["weights.bin", "manifest.json"])
def test_a_corrupt_version_can_be_removed(tmp_path, packed, zoo_file, fname):
    """Refused requests hold nothing: the damaged version (registered, or not even readable) can be removed."""
    flip_byte(packed / fname, 40)
    d = DaemonProcess(tmp_path).start()
    try:
        feeds = zoo.sample_inputs(zoo_file("tiny-cnn"))
        for _ in range(3):
            assert_refused(d, feeds, fname)
        with d.client() as c:
            c.remove(NAME, 1)
            assert c.list() == [] and not packed.exists()
    finally:
        stop_cleanly(d)


def test_changed_tensor_offset_in_manifest_refused_after_restart(tmp_path, packed, zoo_file):
    # The edit keeps valid JSON and a plausible offset: only the manifest's own checksum catches it.
    m = manifest_of(packed)
    m["tensors"][0]["offset"] += 4096
    (packed / "manifest.json").write_text(json.dumps(m, indent=1))
    d = DaemonProcess(tmp_path).start()
    try:
        assert_refused(d, zoo.sample_inputs(zoo_file("tiny-cnn")), "manifest.json", "checksum")
    finally:
        stop_cleanly(d)
    assert_verify_finds(tmp_path, "manifest.json")


@pytest.mark.parametrize("damage", ["invalid utf-8", "not json", "wrong type", "missing key"])
def test_malformed_manifest_is_a_clear_error(tmp_path, packed, zoo_file, damage):
    path = packed / "manifest.json"
    raw = path.read_bytes()
    if damage == "invalid utf-8":
        path.write_bytes(raw[:40] + b"\xff\xfe" + raw[42:])
    elif damage == "not json":
        path.write_bytes(raw[: len(raw) // 2])
    else:  # hand edits that also drop the checksum, so only validation stands in the way
        m = json.loads(raw)
        m["checksum"] = ""
        if damage == "wrong type":
            m["tensors"][0]["offset"] = "0"
        else:
            del m["tensors"][0]["nbytes"]
        path.write_text(json.dumps(m))
    d = DaemonProcess(tmp_path).start()
    try:
        assert_refused(d, zoo.sample_inputs(zoo_file("tiny-cnn")), "manifest.json")
    finally:
        stop_cleanly(d)
    assert_verify_finds(tmp_path, "manifest.json")


@pytest.mark.parametrize("fname", ["model.onnx", "model.gpu.onnx"])
def test_flipped_skeleton_byte_refused(tmp_path, packed, zoo_file, fname):
    flip_byte(packed / fname, (packed / fname).stat().st_size // 2)
    d = DaemonProcess(tmp_path).start()
    try:
        assert_refused(d, zoo.sample_inputs(zoo_file("tiny-cnn")), fname)
    finally:
        stop_cleanly(d)
    assert_verify_finds(tmp_path, fname)


def test_flipped_stage_skeleton_byte_refused(tmp_path, zoo_file):
    """A partitioned model's stage skeletons are stored files too (serve mode builds its sessions on them)."""
    src = zoo_file("tiny-cnn")
    d = DaemonProcess(tmp_path).start()
    with d.client() as c:
        c.add(src, NAME)
        c.partition(NAME, stages=2)
    stop_cleanly(d)
    stage = d.repository / NAME / "1" / "stage-0.onnx"
    assert "stage-0.onnx" in manifest_of(stage.parent)["files"]
    flip_byte(stage, stage.stat().st_size // 2)
    d.start()
    try:
        assert_refused(d, zoo.sample_inputs(src), "stage-0.onnx")
    finally:
        stop_cleanly(d)


def test_truncated_weights_named(tmp_path, packed, zoo_file):
    size = (packed / "weights.bin").stat().st_size
    os.truncate(packed / "weights.bin", size - 1000)
    d = DaemonProcess(tmp_path).start()
    try:
        assert_refused(d, zoo.sample_inputs(zoo_file("tiny-cnn")), "weights.bin", "truncated")
    finally:
        stop_cleanly(d)
    assert_verify_finds(tmp_path, "weights.bin", "truncated")


@pytest.mark.parametrize("fname", ["weights.bin", "model.onnx", "model.gpu.onnx", "manifest.json"])
def test_missing_file_named(tmp_path, packed, zoo_file, fname):
    (packed / fname).unlink()
    d = DaemonProcess(tmp_path).start()
    try:
        assert_refused(d, zoo.sample_inputs(zoo_file("tiny-cnn")), fname, "missing")
    finally:
        stop_cleanly(d)
    assert_verify_finds(tmp_path, fname, "missing")


# -- repair, and versions from before checksums --------------------------------------------

def test_corrupt_version_is_fetched_again_from_the_remote_store(tmp_path, zoo_file):
    src = zoo_file("tiny-cnn")
    store = tmp_path / "store"
    pack(src, store, NAME, 1)
    publish(store)
    d = DaemonProcess(tmp_path, {"MODELCACHE_REMOTE": store.as_uri()}).start()
    try:
        feeds = zoo.sample_inputs(src, batch=2)
        want = reference(src, feeds)
        with d.client() as c:
            c.load(NAME)                      # fetched into the repository, promoted
            c.evict(NAME)
            local = d.repository / NAME / "1"
            tensor = manifest_of(local)["tensors"][0]
            flip_byte(local / "weights.bin", tensor["offset"] + 7)
            with modelcache.InferenceSession(NAME, client=c) as s:   # damage found, fetched again, served
                np.testing.assert_allclose(s.run(None, feeds)[0], want, rtol=1e-4, atol=1e-5)
            outputs, _ = c.infer(NAME, feeds)
            np.testing.assert_allclose(outputs[next(iter(outputs))], want, rtol=1e-4, atol=1e-5)
            counters = c.stats().counters
            assert counters["corrupt_detected"] == 1 and counters["refetched"] == 1
            assert [m["corrupt"] for m in c.list()] == [""]
        assert (local / "weights.bin").read_bytes() == (store / NAME / "1" / "weights.bin").read_bytes()
        assert "fetching it again" in d.log_path.read_text()
    finally:
        stop_cleanly(d)


def test_version_packed_before_checksums_opens_unverified(tmp_path, packed, zoo_file):
    m = manifest_of(packed)
    del m["files"], m["checksum"]
    for t in m["tensors"] + m["gpu_tensors"]:
        del t["xxh3"]
    (packed / "manifest.json").write_text(json.dumps(m, indent=1))
    src = zoo_file("tiny-cnn")
    feeds = zoo.sample_inputs(src, batch=2)
    d = DaemonProcess(tmp_path).start()
    try:
        with d.client() as c, modelcache.InferenceSession(NAME, client=c) as s:
            np.testing.assert_allclose(s.run(None, feeds)[0], reference(src, feeds), rtol=1e-4, atol=1e-5)
    finally:
        stop_cleanly(d)
    assert "cnn@1: unverified" in d.log_path.read_text()
    r = verify(tmp_path, NAME)
    assert r.returncode == 0 and "unverified" in r.stdout, r.stdout + r.stderr
    # What can still be checked without file checksums is: the tensors' sha256 from add time.
    flip_byte(packed / "weights.bin", m["tensors"][0]["offset"])
    r = verify(tmp_path, NAME)
    assert r.returncode == 1 and m["tensors"][0]["name"] in r.stdout, r.stdout


def test_verify_reports_each_version(tmp_path, packed, zoo_file):
    pack(zoo_file("tiny-cnn"), tmp_path / "repo", "other", 1)
    r = verify(tmp_path)
    assert r.returncode == 0 and r.stdout.count(" ok ") == 2, r.stdout
    flip_byte(packed / "model.onnx", 100)
    r = verify(tmp_path, "other")          # only NAME's versions are checked when a name is given
    assert r.returncode == 0, r.stdout
    r = verify(tmp_path, "nosuch")         # one line on stderr that names what there is
    assert (r.returncode, r.stdout) == (1, "") and \
        r.stderr == f"modelcache: no model named 'nosuch' in {tmp_path / 'repo'}; it has cnn, other\n", r.stderr


def test_a_repaired_file_is_served_again_after_verify(tmp_path, packed, zoo_file):
    """The corrupt mark has a way back that the refusal names: repair the file, `modelcache verify NAME`
    (the daemon re-checks it), and the version is served again, with no restart and no re-add."""
    src = zoo_file("tiny-cnn")
    feeds = zoo.sample_inputs(src)
    tensor = manifest_of(packed)["tensors"][-1]
    offset = tensor["offset"] + tensor["nbytes"] // 2
    d = DaemonProcess(tmp_path).start()
    try:
        flip_byte(packed / "weights.bin", offset)
        message = assert_refused(d, feeds, "weights.bin")
        assert message.endswith(f"repair or replace the file, then run `modelcache verify {NAME}` to re-check it")
        r = verify(tmp_path, NAME, env=d.env)
        assert r.returncode == 1 and "DAMAGED" in r.stdout and "served again" not in r.stdout, r.stdout + r.stderr
        flip_byte(packed / "weights.bin", offset)                 # repaired: the mark alone still refuses it
        assert_refused(d, feeds, "weights.bin")
        r = verify(tmp_path, NAME, env=d.env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"{NAME}@1" in r.stdout and "(was marked corrupt: served again)" in r.stdout
        assert r.stdout.rstrip().endswith("1 version checked in " + str(d.repository) + ": no damage")
        with d.client() as c:
            with modelcache.InferenceSession(NAME, client=c) as s:
                np.testing.assert_allclose(s.run(None, feeds)[0], reference(src, feeds), rtol=1e-4, atol=1e-5)
            assert {m["name"]: m["state"] for m in c.list()} == {NAME: "resident"}
        r = verify(tmp_path, "nosuch", env=d.env)
        assert (r.returncode, r.stdout) == (1, "") and r.stderr.count("\n") == 1 and \
            f"no model named 'nosuch' in {d.repository}; it has {NAME}" in r.stderr, r.stderr
    finally:
        stop_cleanly(d)


def test_a_restored_manifest_is_served_again_after_verify_and_serve_says_what_attach_says(tmp_path, packed,
                                                                                          zoo_file):
    """A manifest truncated before the start: attach, a serve session and `infer` give one answer (the
    damaged manifest, typed); once it is put back, `verify NAME` finds it intact and serves it again, with
    no restart."""
    src = zoo_file("tiny-cnn")
    feeds = zoo.sample_inputs(src)
    manifest = packed / "manifest.json"
    good = manifest.read_bytes()
    manifest.write_bytes(good[:100])
    d = DaemonProcess(tmp_path).start()
    try:
        with d.client() as c:
            answers = []
            for how in (lambda: modelcache.InferenceSession(NAME, client=c),
                        lambda: modelcache.InferenceSession(NAME, client=c, mode="serve"),
                        lambda: c.infer(NAME, feeds), lambda: c.describe(NAME, 1)):
                with pytest.raises(IntegrityError) as e:
                    how()
                answers.append(str(e.value))
            assert len(set(answers)) == 1 and "cnn@1: manifest.json is damaged" in answers[0], answers
        manifest.write_bytes(good)
        r = verify(tmp_path, NAME, env=d.env)
        assert r.returncode == 0 and "(was marked corrupt: served again)" in r.stdout, r.stdout + r.stderr
        with d.client() as c:
            with modelcache.InferenceSession(NAME, client=c) as s:
                np.testing.assert_allclose(s.run(None, feeds)[0], reference(src, feeds), rtol=1e-4, atol=1e-5)
            with modelcache.InferenceSession(NAME, client=c, mode="serve") as s:
                np.testing.assert_allclose(s.run(None, feeds)[0], reference(src, feeds), rtol=1e-4, atol=1e-5)
            assert [(m["name"], m["state"]) for m in c.list()] == [(NAME, "resident")]
    finally:
        stop_cleanly(d)


# -- pure parts -----------------------------------------------------------------------------

def test_parse_manifest_never_raises_a_decode_error(packed):
    raw = (packed / "manifest.json").read_bytes()
    assert parse_manifest(raw, "cnn@1").name == NAME
    for bad in (b"\xff" * 10, b"[1, 2]", raw[:-5], raw.replace(b'"nbytes"', b'"nbytez"', 1)):
        with pytest.raises(IntegrityError, match="cnn@1: manifest.json is damaged"):
            parse_manifest(bad, "cnn@1")


def test_copy_hashed_copies_and_hashes_each_range(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    (tmp_path / "src").write_bytes(data)
    ranges = [(0, 3 << 20, 5000), (1 << 20, 0, (2 << 20) - 3)]   # unaligned, and longer than one chunk
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_RDWR | os.O_CREAT)
    try:
        digests = copy_hashed(src, dst, ranges, integrity.new_hasher, chunk=1 << 20)
    finally:
        os.close(src)
        os.close(dst)
    out = (tmp_path / "dst").read_bytes()
    for (s, d_off, n), got in zip(ranges, digests):
        assert out[d_off:d_off + n] == data[s:s + n]
        assert got == integrity.digest(data[s:s + n])
