"""When the daemon's own disk fails: every I/O fault is one typed line, the service is kept, nothing is lost.

First the symptoms an outside test found, each on a real file system (a tmpfs mounted full or read-only,
a lock held by another process); then the campaign: ENOSPC and EIO injected at the Nth write, fsync,
rename, unlink, mkdir and open-for-writing under the repository, the state directory and the host tier,
N = 1, 2, ... until the operation completes without reaching N, during every operation that writes
(tests/iofault.py has the injector; docs/faults.md how to run the whole campaign).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from modelcache import zoo
from modelcache.errors import StorageError
from conftest import DaemonProcess, stop_cleanly, wait_until


def fill(directory: Path) -> None:
    """Write into `directory` until its file system is full."""
    with open(directory / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError:
            pass


def outputs(c, name: str, feeds: dict, version: int | None = None) -> np.ndarray:
    out, _ = c.infer(name, feeds, version=version)
    return next(iter(out.values()))


def one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text and "internal error" not in text, text
    return text


# -- the symptoms ------------------------------------------------------------------------------------

def test_a_removal_that_fails_leaves_every_version_served(tmp_path, small_tmpfs, zoo_file):
    """A read-only repository: `rm` fails with one storage line naming the version and the repository, every
    version stays served with its outputs, and once the repository is writable again the same rm works."""
    src = zoo_file("tiny-cnn")
    feeds = zoo.sample_inputs(src)
    d = DaemonProcess(tmp_path)
    d.repository = small_tmpfs("16m", "repo")
    d.env["MODELCACHE_REPOSITORY"] = str(d.repository)
    d.start()
    try:
        with d.client() as c:
            c.add(src, "m")
            c.add(src, "m")
            before = {v: outputs(c, "m", feeds, v) for v in (1, 2)}
            subprocess.run(["mount", "-o", "remount,ro", str(d.repository)], check=True)
            with pytest.raises(StorageError) as e:
                c.remove("m", 2)
            assert "read-only file system" in one_line(e.value) and "m@2" in str(e.value) \
                and str(d.repository) in str(e.value)
            for v in (1, 2):
                np.testing.assert_array_equal(outputs(c, "m", feeds, v), before[v])
            with c.open("m", 2):
                pass
            subprocess.run(["mount", "-o", "remount,rw", str(d.repository)], check=True)
            c.remove("m", 2)
            assert [m["version"] for m in c.list()] == [1]
            np.testing.assert_array_equal(outputs(c, "m", feeds, 1), before[1])
            assert not list(d.repository.glob(".tmp-*"))
    finally:
        stop_cleanly(d)


def test_a_full_state_directory_does_not_break_the_stop(tmp_path, small_tmpfs, zoo_file):
    """The performance models cannot be saved: the stop says so in one log line, exits 0, and removes its
    sockets and its host tier all the same."""
    state = small_tmpfs("64k", "state")
    src = zoo_file("tiny-cnn")
    d = DaemonProcess(tmp_path, {"MODELCACHE_STATE_DIR": str(state), "MODELCACHE_WORKERS": "1"}).start()
    with d.client() as c:
        c.add(src, "m")
        outputs(c, "m", zoo.sample_inputs(src))      # the engine has timings to save now
    fill(state)
    lane = Path(d.socket[len("ipc://"):] + ".lane")
    assert lane.exists()
    stop_cleanly(d)          # exit 0, no socket, no host tier
    assert not lane.exists()
    log = d.log_path.read_text()
    said = [line for line in log.splitlines() if "perfmodels.json" in line]
    assert len(said) == 1 and "no space left on device" in said[0], log
    assert "internal error" not in log and "Traceback" not in log
    assert sorted(p.name for p in state.iterdir()) == ["filler"], "a half-written state file stayed"


def test_enospc_while_storing_a_batching_profile_is_a_storage_error(tmp_path, small_tmpfs, zoo_file):
    """`calibrate` stores its profile in the manifest: a full repository refuses it in one storage line, the
    model keeps its old profile (in memory and on disk), and once there is room the same store works."""
    from modelcache.client.calibrate import calibrate
    src = zoo_file("tiny-cnn")
    d = DaemonProcess(tmp_path, {"MODELCACHE_WORKERS": "1", "MODELCACHE_STATE_DIR": str(tmp_path / "state")})
    d.repository = small_tmpfs("4m", "repo")
    d.env["MODELCACHE_REPOSITORY"] = str(d.repository)
    d.start()
    try:
        with d.client() as c:
            c.add(src, "m")
            manifest = d.repository / "m" / "1" / "manifest.json"
            stored = manifest.read_bytes()
            fill(d.repository)
            with pytest.raises(StorageError) as e:
                calibrate(c, "m", batches=[1, 2], runs=1)
            assert "no space left on device" in one_line(e.value) and "m@1" in str(e.value) \
                and str(manifest.parent) in str(e.value)
            assert manifest.read_bytes() == stored
            assert not [p.name for p in manifest.parent.iterdir() if p.name.endswith(".tmp")]
            assert c.describe("m").stages == [] and "n_opt" not in str(c.stats().models)
            (d.repository / "filler").unlink()
            profile = calibrate(c, "m", batches=[1, 2], runs=1)
            assert manifest.read_bytes() != stored and str(profile["n_opt"]) in manifest.read_text()
    finally:
        stop_cleanly(d)


def test_a_start_that_waits_on_the_repository_lock_says_who_holds_it(tmp_path):
    """Another process holds <repository>/.lock: the starting daemon says at once, and again every few
    seconds, which process holds it and since when, and comes up as soon as it is let go."""
    d = DaemonProcess(tmp_path)
    d.repository.mkdir(parents=True)
    fd = os.open(d.repository / ".lock", os.O_RDWR | os.O_CREAT, 0o640)
    fcntl.flock(fd, fcntl.LOCK_EX)
    started: list = []
    starter = threading.Thread(target=lambda: started.append(d.start(timeout_s=60)))
    try:
        starter.start()
        said = f"held by pid {os.getpid()}"
        wait_until(lambda: d.log_path.exists() and said in d.log_path.read_text(), 10, "the first line on the lock")
        t0 = time.monotonic()
        wait_until(lambda: d.log_path.read_text().count(said) >= 2, 15, "the lock's holder said again")
        assert time.monotonic() - t0 < 10
        assert str(d.repository / ".lock") in d.log_path.read_text()
        assert not started
    finally:
        os.close(fd)
        starter.join(60)
    assert started, d.log_path.read_text()
    stop_cleanly(d)
    r = subprocess.run([sys.executable, "-m", "modelcache.cli", "daemon", "--help"], capture_output=True, text=True)
    assert "waits up to" in " ".join(r.stdout.split()) and "repository" in r.stdout, r.stdout
