"""Opens the host tier cannot take now, answered from the repository's files (daemon/disk_opens.py), on a real
daemon: at once and correct where the tier is full of models in use, or too small for the model; checked against
the version's checksums first; `open_when_full = wait` keeps the wait for room."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import onnxruntime as ort
import pytest

from modelcache import InferenceSession, zoo
from modelcache.errors import CapacityError, IntegrityError

from conftest import DaemonProcess, stop_cleanly, wait_until


def plain_output(path: str):
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    feeds = zoo.sample_inputs(path)
    return feeds, sess.run(None, feeds)


def state(c, name) -> str:
    return next(m["state"] for m in c.listing().models if m["name"] == name)


@pytest.fixture
def daemon(tmp_path):
    """start(host_capacity, **settings): a real daemon holding a and b, ~4.7 MiB each with nothing shared (one fits
    a 6M host tier, two do not), stopped cleanly after the test."""
    for name, seed in (("a", 0), ("b", 1)):
        zoo.save(zoo.build("squeezenet1_1", seed), str(tmp_path / f"{name}.onnx"))
    started = []

    def start(host_capacity: str, **settings) -> DaemonProcess:
        env = {"MODELCACHE_HOST_CAPACITY": host_capacity, **{f"MODELCACHE_{k.upper()}": v for k, v in settings.items()}}
        d = DaemonProcess(tmp_path, env).start()
        started.append(d)
        with d.client() as c:
            for name in ("a", "b"):
                c.add(str(tmp_path / f"{name}.onnx"), name)
        return d
    yield start
    for d in started:
        try:
            stop_cleanly(d)
        finally:
            d.kill()


def test_an_open_for_a_tier_full_of_models_in_use_maps_the_repository_at_once(daemon):
    d = daemon("6M")
    with d.client() as holder:
        lease = holder.open("a")                     # the tier's one slot, held
        sess = InferenceSession("b", socket=d.socket)
        assert sess.was_cache_hit is False
        assert state(holder, "b") == "on_disk"       # served from the files: nothing promoted, nothing waits
        assert holder.stats().counters["opens_from_disk"] == 1
        b = next(m for m in holder.listing().models if m["name"] == "b")
        assert b["file_leases"] == 1 and b["why"] == "1 session over its files"
        status = subprocess.run([sys.executable, "-m", "modelcache.cli", "status"], env=d.env, capture_output=True,
                                text=True, timeout=60, check=True).stdout
        assert "from the repository's files 1)" in status, status
        feeds, want = plain_output(str(d.root / "b.onnx"))
        got = sess.run(None, feeds)
        assert all(np.allclose(g, w, rtol=1e-4, atol=1e-5) for g, w in zip(got, want))
        # The second open finds the version checked: the same answer, no second check (nothing to see but
        # the count), and closing both leaves a tier that takes b again once a is let go.
        again = InferenceSession("b", socket=d.socket)
        assert all(np.array_equal(g, w) for g, w in zip(again.run(None, feeds), got))
        assert holder.stats().counters["opens_from_disk"] == 2
        again.close()
        sess.close()
        holder.release(lease.lease_id)
        b = holder.open("b")                         # room now: promoted as ever
        assert b.hit is False and state(holder, "b") == "resident"
        holder.release(b.lease_id)


def test_a_model_larger_than_the_whole_tier_is_served_from_the_repository(daemon):
    d = daemon("2M")
    with d.client() as c:
        sess = InferenceSession("a", socket=d.socket)
        feeds, want = plain_output(str(d.root / "a.onnx"))
        assert all(np.allclose(g, w, rtol=1e-4, atol=1e-5) for g, w in zip(sess.run(None, feeds), want))
        assert state(c, "a") == "on_disk"
        sess.close()


def test_damaged_weights_are_refused_before_any_lease_over_them_and_the_daemon_stays_up(daemon):
    d = daemon("2M")
    with d.client() as c:
        weights = d.repository / "a" / "1" / "weights.bin"
        with open(weights, "r+b") as f:             # bit rot in the middle of a weight
            f.seek(weights.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(IntegrityError, match="a@1"):
            c.open("a")
        assert c.stats().counters["corrupt_detected"] == 1
        with pytest.raises(IntegrityError):          # marked: refused at once from now on
            c.open("a")
        assert c.stats().counters["opens"] >= 2     # (still answering)


def test_a_model_in_use_over_its_files_is_not_removed_until_its_sessions_close(daemon):
    d = daemon("2M")
    with d.client() as c:
        sess = InferenceSession("a", socket=d.socket)
        with pytest.raises(CapacityError, match="a@1 is in use or loading; it cannot be removed now"):
            c.remove("a", 1)
        sess.close()
        c.remove("a", 1)
        assert not (d.repository / "a" / "1").exists()


def test_open_when_full_wait_keeps_the_wait_for_room(daemon):
    d = daemon("6M", open_when_full="wait")
    with d.client() as holder, d.client() as waiter:
        lease = holder.open("a")
        got = []
        t = threading.Thread(target=lambda: got.append(waiter.open("b")))
        t.start()
        wait_until(lambda: state(holder, "b") == "waiting", 30, "b's open waiting for room")
        assert got == [] and holder.stats().counters["opens_from_disk"] == 0
        holder.release(lease.lease_id)
        t.join(30)
        assert len(got) == 1 and got[0].hit is False and state(holder, "b") == "resident"
        waiter.release(got[0].lease_id)
