"""Warm restart: a daemon that starts where one died re-adopts its host tier, byte-checked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import modelcache
from modelcache import zoo

from conftest import DaemonProcess


def _sigkill(d: DaemonProcess) -> Path:
    """Kill the daemon as a crash would (no cleanup); returns the host tier it leaves."""
    tier = d.shm_dir
    d.proc.kill()
    d.proc.wait()
    d.log.close()
    assert tier.exists()
    return tier


def _restart(d: DaemonProcess, **kw) -> DaemonProcess:
    return DaemonProcess(d.root, **kw).start()


def _stop(d: DaemonProcess) -> None:
    shm = d.shm_dir
    rc = d.stop()
    d.kill()
    assert rc == 0, d.log_path.read_text()
    assert not shm.exists()


def test_restart_after_a_crash_readopts_the_host_tier(tmp_path, zoo_file):
    d = DaemonProcess(tmp_path).start()
    with d.client() as c:
        c.add(zoo_file("tiny-cnn"), "cnn")
        c.add(zoo_file("tiny-vit"), "vit")
        assert not c.open("cnn").hit
        assert not c.open("vit").hit
    old = _sigkill(d)
    d2 = _restart(d)
    try:
        assert not old.exists() and d2.shm_dir.exists()      # claimed: renamed to the new daemon's name
        with d2.client() as c:
            assert c.stats().counters["adopted"] == 2
            assert c.open("cnn").hit and c.open("vit").hit
            assert c.stats().counters["promotions"] == 0
            sess = modelcache.InferenceSession("cnn", client=c)
            assert sess.was_cache_hit
            feeds = zoo.sample_inputs(zoo_file("tiny-cnn"))
            ref = _plain_ort(zoo_file("tiny-cnn"), feeds)
            assert abs(sess.run(None, feeds)[0] - ref).max() < 1e-4
            sess.close()
    finally:
        _stop(d2)


def test_a_corrupted_segment_is_not_adopted(tmp_path, zoo_file):
    d = DaemonProcess(tmp_path).start()
    with d.client() as c:
        c.add(zoo_file("tiny-cnn"), "cnn")
        c.open("cnn")
    old = _sigkill(d)
    seg = next(old.glob("seg-*.bin"))
    os.chmod(seg, 0o640)
    with open(seg, "r+b") as f:           # one flipped byte, in the first tensor
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))
    d2 = _restart(d)
    try:
        with d2.client() as c:
            assert c.stats().counters["adopted"] == 0
            assert not c.open("cnn").hit                     # promoted again from disk
            feeds = zoo.sample_inputs(zoo_file("tiny-cnn"))
            with modelcache.InferenceSession("cnn", client=c) as sess:
                assert abs(sess.run(None, feeds)[0] - _plain_ort(zoo_file("tiny-cnn"), feeds)).max() < 1e-4
        assert "does not match the manifest" in d2.log_path.read_text()
    finally:
        _stop(d2)


def test_a_clean_stop_clears_the_tier_unless_told_to_keep_it(tmp_path, zoo_file):
    keep = {"MODELCACHE_KEEP_HOST_TIER": "1"}
    d = DaemonProcess(tmp_path, extra_env=keep).start()
    with d.client() as c:
        c.add(zoo_file("tiny-cnn"), "cnn")
        c.open("cnn")
    tier = d.shm_dir
    assert d.stop() == 0
    assert tier.exists()                                    # kept for the next daemon
    d2 = _restart(d)                                        # (without keep: its own stop clears)
    try:
        with d2.client() as c:
            assert c.open("cnn").hit
    finally:
        _stop(d2)


def test_a_dead_tier_of_another_socket_is_left_alone(tmp_path, zoo_file):
    a = DaemonProcess(tmp_path / "a")
    (tmp_path / "a").mkdir()
    a.start()
    with a.client() as c:
        c.add(zoo_file("tiny-cnn"), "cnn")
        c.open("cnn")
    tier_a = _sigkill(a)
    (tmp_path / "b").mkdir()
    b = DaemonProcess(tmp_path / "b").start()
    try:
        assert tier_a.exists()                              # a's, for a's next daemon
        a2 = _restart(a)
        with a2.client() as c:
            assert c.open("cnn").hit
        _stop(a2)
    finally:
        _stop(b)


def _plain_ort(path: str, feeds: dict):
    import onnxruntime as ort
    return ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
