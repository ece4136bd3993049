"""The warm packer (modelcache/store/warm_packer.py): packs forked from a server that has its imports done,
each still a process of its own. Real processes, real packs, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import psutil
import pytest

from modelcache.errors import PackError
from modelcache.store.format import SKELETON_FILE
from modelcache.store.packing import pack_in_subprocess
from modelcache.store.warm_packer import SCM_MAX_FD, WarmPacker
from conftest import DaemonProcess, stop_cleanly
from fake_clock import FakeClock


def gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def packer():
    wp = WarmPacker()
    yield wp
    wp.stop()


def test_packs_fork_from_one_server_and_store_what_a_fresh_interpreter_stores(packer, zoo_file, tmp_path):
    src = zoo_file("tiny-cnn")
    fresh = pack_in_subprocess(src, tmp_path, "fresh", 1)
    warm = [pack_in_subprocess(src, tmp_path, "warm", v, spawn=packer.spawn) for v in (1, 2)]
    server = psutil.Process(packer.pid)
    assert "modelcache.store.warm_packer" in " ".join(server.cmdline())
    assert packer.pid == server.pid   # both packs came from one server
    for m in warm:
        assert [(t.name, t.offset, t.nbytes) for t in m.tensors] == [(t.name, t.offset, t.nbytes) for t in fresh.tensors]
        assert m.files["weights.bin"] == fresh.files["weights.bin"]
    assert (tmp_path / "fresh" / "1" / SKELETON_FILE).read_bytes() == (tmp_path / "warm" / "2" / SKELETON_FILE).read_bytes()
    assert server.children() == []   # each pack reaped by the server


def test_a_packs_descriptors_keep_their_numbers(packer, zoo_file, tmp_path):
    # The daemon passes the client's descriptors; the child reads them by the numbers in its argv.
    fd = os.open(zoo_file("tiny-cnn"), os.O_RDONLY)
    high = os.dup2(fd, 250, inheritable=False)
    os.close(fd)
    try:
        m = pack_in_subprocess("/client/model.onnx", tmp_path, "cnn", 1, sources=([high], ["model.onnx"]),
                               spawn=packer.spawn)
    finally:
        os.close(high)
    assert m.tensors


def test_a_pack_killed_is_said_killed_and_the_server_forks_the_next(packer, zoo_file, tmp_path):
    src = zoo_file("tiny-cnn")
    with pytest.raises(PackError, match="killed by signal 9"):
        pack_in_subprocess(src, tmp_path, "cnn", 1, spawn=packer.spawn, on_start=lambda proc: proc.kill())
    server = packer.pid
    assert not (tmp_path / "cnn" / "1").exists()
    assert pack_in_subprocess(src, tmp_path, "cnn", 1, spawn=packer.spawn).version == 1
    assert packer.pid == server


def test_a_server_that_died_is_started_again(packer, zoo_file, tmp_path):
    src = zoo_file("tiny-cnn")
    pack_in_subprocess(src, tmp_path, "cnn", 1, spawn=packer.spawn)
    first = packer.pid
    os.kill(first, signal.SIGKILL)
    assert gone(first)
    assert pack_in_subprocess(src, tmp_path, "cnn", 2, spawn=packer.spawn).version == 2
    assert packer.pid not in (None, first)


def test_the_server_stops_when_idle_and_a_stop_takes_the_packs_in_flight(zoo_file, tmp_path):
    clock = FakeClock()
    wp = WarmPacker(idle_s=30, clock=clock)
    src = zoo_file("tiny-cnn")
    try:
        pack_in_subprocess(src, tmp_path, "cnn", 1, spawn=wp.spawn)
        server = wp.pid
        clock.now += 29
        assert not wp.stop_if_idle() and wp.pid == server
        clock.now += 2
        assert wp.stop_if_idle() and wp.pid is None
        assert gone(server, 1)

        # A stop while a pack runs (the daemon's stop after its loaders, or its death) kills that pack.
        started, failed = threading.Event(), []

        def add():
            try:
                pack_in_subprocess(zoo_file("squeezenet1_1"), tmp_path, "big", 1, spawn=wp.spawn,
                                   on_start=lambda proc: (failed.append(proc.pid), started.set()))
            except PackError as e:
                failed.append(e)
        t = threading.Thread(target=add)
        t.start()
        assert started.wait(60)
        wp.stop()
        t.join(60)
        pack_pid, error = failed
        assert "killed by signal 9" in str(error)
        assert gone(pack_pid, 5)
        assert not (tmp_path / "big" / "1").exists()
    finally:
        wp.stop()


def test_a_server_that_stops_answering_stalls_only_the_add_waiting_on_it(zoo_file, tmp_path):
    # SIGSTOP (or a server swapped out): the idle check on the daemon's owner loop must not wait behind the add.
    wp = WarmPacker(answer_s=2)
    src = zoo_file("tiny-cnn")
    try:
        pack_in_subprocess(src, tmp_path, "cnn", 1, spawn=wp.spawn)
        stopped = wp.pid
        os.kill(stopped, signal.SIGSTOP)
        failed = []
        t = threading.Thread(target=lambda: failed.append(pytest.raises(
            PackError, pack_in_subprocess, src, tmp_path, "cnn", 2, spawn=wp.spawn)))
        t.start()
        time.sleep(0.5)   # (the add is waiting for the server's answer)
        t0 = time.monotonic()
        assert not wp.stop_if_idle() and wp.give_back() == 0
        assert time.monotonic() - t0 < 0.5
        t.join(30)
        assert "did not answer within 2 s" in str(failed[0].value)
        assert gone(stopped, 5)
        wp.answer_s = 30   # (a new server's start: on a loaded machine, another suite beside, it once took over 2 s)
        assert pack_in_subprocess(src, tmp_path, "cnn", 2, spawn=wp.spawn).version == 2   # a new server
        assert wp.pid != stopped
    finally:
        wp.stop()


def test_what_a_model_declares_may_be_larger_than_an_argument(packer, zoo_file, tmp_path):
    # ImageNet-21k's class labels are ~0.5 MB: past argv's 128 KiB a string and a socket message's buffer.
    labels = {"logits": [f"class number {i} of the twenty-one thousand" for i in range(21841)]}
    for spawn in (packer.spawn, None):
        m = pack_in_subprocess(zoo_file("tiny-cnn"), tmp_path, f"cnn{spawn is None}", 1, declared={"labels": labels},
                               **({"spawn": spawn} if spawn else {}))
        assert m.labels == labels


def test_memory_pressure_takes_an_idle_server_and_what_it_held(packer, zoo_file, tmp_path):
    assert packer.give_back() == 0   # no server yet
    pack_in_subprocess(zoo_file("tiny-cnn"), tmp_path, "cnn", 1, spawn=packer.spawn)
    server = packer.pid
    assert packer.give_back() > 10 << 20   # onnx and numpy imported: tens of MiB of its own
    assert packer.pid is None and gone(server, 1)
    assert pack_in_subprocess(zoo_file("tiny-cnn"), tmp_path, "cnn", 2, spawn=packer.spawn).version == 2


def test_more_descriptors_than_one_message_carries_go_to_a_fresh_interpreter(packer, tmp_path):
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(SCM_MAX_FD - 2)]
    try:
        proc = packer.spawn(["too", "few", "arguments"], fds)
        assert isinstance(proc, subprocess.Popen)
        assert proc.wait(60) != 0 and "ValueError" in proc.stderr.read()
        assert packer.pid is None
    finally:
        for fd in fds:
            os.close(fd)


def test_the_daemons_warm_packer_goes_with_the_daemon_stopped_or_killed(zoo_file, tmp_path):
    def warm_packer_of(d):
        found = [p for p in psutil.Process(d.pid).children()
                 if "modelcache.store.warm_packer" in " ".join(p.cmdline())]
        assert len(found) == 1, found
        return found[0].pid

    for how in ("stop", "kill"):
        d = DaemonProcess(tmp_path / how)
        (tmp_path / how).mkdir()
        d.start()
        try:
            with d.client() as c:
                c.add(zoo_file("tiny-cnn"), "cnn")
                c.add(zoo_file("tiny-cnn"), "cnn")
            server = warm_packer_of(d)
            if how == "stop":
                stop_cleanly(d)
            else:
                d.kill()
            assert gone(server), f"the warm packer outlived the daemon ({how})"
        finally:
            d.kill()
