"""Descriptor exhaustion: the daemon stops listening when short, never spins, never aborts, and
serves again once connections close."""

from __future__ import annotations

import resource
import socket
import time

import psutil
import pytest
import zmq

from modelcache.daemon.fds import FdBudget
from modelcache.errors import CapacityError

from conftest import DaemonProcess, stop_cleanly, wait_until

LIMIT = 160


def test_budget_pauses_under_the_reserve_and_resumes_at_twice_it():
    used = [100]
    b = FdBudget(limit=200, reserve=40, count=lambda: used[0])
    assert not b.check()
    used[0] = 161                    # 39 free
    assert b.check()
    used[0] = 150                    # 50 free: still under twice the reserve
    assert b.check()
    used[0] = 120                    # 80 free
    assert not b.check()
    assert FdBudget(limit=20, reserve=64, count=lambda: 0).reserve == 8    # a tiny limit keeps room to serve


def _listening(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def _low_limit():
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))


def test_the_daemon_survives_running_out_of_descriptors(tmp_path):
    d = DaemonProcess(tmp_path)
    d.preexec = _low_limit
    d.start()
    lane_path = d.socket[len("ipc://"):] + ".lane"
    ctx = zmq.Context()
    lanes, dealers = [], []
    try:
        proc = psutil.Process(d.pid)
        assert proc.rlimit(psutil.RLIMIT_NOFILE) == (LIMIT, LIMIT)
        # Lane connections until the daemon stops taking them (the rest wait in its backlog).
        for _ in range(LIMIT):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(1)
            try:
                s.connect(lane_path)
            except OSError:
                s.close()
                break
            lanes.append(s)
        # ZeroMQ connections, one at a time, until the daemon stops listening there too.
        sock_path = d.socket[len("ipc://"):]
        for _ in range(LIMIT):
            if not _listening(sock_path):
                break
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(d.socket)
            dealers.append(s)
            time.sleep(0.02)
        assert wait_until(lambda: not _listening(sock_path), what="the daemon to stop listening")
        assert wait_until(lambda: proc.num_fds() <= LIMIT, what="fds within the limit")
        cpu0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
        time.sleep(2)
        cpu_s = sum(proc.cpu_times()[:2]) - cpu0
        assert d.proc.poll() is None, d.log_path.read_text()[-3000:]
        assert cpu_s < 0.3 * (time.monotonic() - t0), f"daemon used {cpu_s:.2f} s of CPU while out of fds"
        log = d.log_path.read_text()
        assert log.count("not accepting") <= 4 and "accept failed" not in log
        for s in lanes:
            s.close()
        for s in dealers:
            s.close(linger=0)
        lanes, dealers = [], []
        assert wait_until(lambda: _listening(sock_path), what="the daemon to listen again")
        with d.client() as c:                        # serves again, over ZeroMQ and the lane
            assert c.stats().pid == d.pid
            assert c.uses_lane
        assert d.proc.poll() is None
    finally:
        for s in lanes:
            s.close()
        for s in dealers:
            s.close(linger=0)
        ctx.term()
        stop_cleanly(d)


def test_clients_beyond_max_clients_are_refused_clearly(tmp_path):
    d = DaemonProcess(tmp_path, extra_env={"MODELCACHE_MAX_CLIENTS": "2"}).start()
    try:
        a, b = d.client(), d.client()
        with pytest.raises(CapacityError, match="max_clients"):
            d.client()
        a.close()
        with d.client() as c:                        # a place came free
            assert len(c.stats().clients) == 2
        b.close()
    finally:
        stop_cleanly(d)
