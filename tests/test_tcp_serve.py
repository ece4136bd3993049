"""Serve mode against a tcp:// daemon, which may be on another machine: a request's large tensors travel in the
message (no file of the client's reaches the daemon), and one too large for a message is refused at once."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import modelcache
from modelcache.errors import InputError

from conftest import DaemonProcess, stop_cleanly
from test_grpc import free_port
from test_lent_outputs import neg_model
from test_passed_inputs import io_files

N = 150_000   # floats: 600 KB, over INLINE_MAX_BYTES


@pytest.fixture
def tcp_daemon(tmp_path):
    """A daemon on tcp://127.0.0.1 serving `neg` (added through a daemon on a lane first: a tcp:// one takes no
    files), and its address."""
    neg_model(tmp_path / "neg.onnx")
    for sub in ("first", "tcp"):
        (tmp_path / sub).mkdir()
    first = DaemonProcess(tmp_path / "first").start()
    try:
        with first.client() as c:
            c.add(str(tmp_path / "neg.onnx"), "neg")
        stop_cleanly(first)
    finally:
        first.kill()
    address = f"tcp://127.0.0.1:{free_port()}"
    d = DaemonProcess(tmp_path / "tcp", {"MODELCACHE_SOCKET": address,
                                         "MODELCACHE_REPOSITORY": str(first.repository)}).start()
    try:
        yield address
        stop_cleanly(d)
    finally:
        d.kill()


ELSEWHERE = r"""
import sys, numpy as np, modelcache
x = np.arange(int(sys.argv[2]), dtype=np.float32)
with modelcache.connect(sys.argv[1]) as c:
    print(np.array_equal(c.infer("neg", {"x": x})[0]["y"], -x))
try:
    modelcache.InferenceSession("neg", socket=sys.argv[1])   # attach mode: the daemon's memory, which is not here
except modelcache.ModelCacheError as e:
    print("refused:", e)
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a private mount namespace needs root and unshare(1)")
def test_a_client_that_shares_no_files_with_a_tcp_daemon_sends_large_inputs(tcp_daemon):
    """A client whose /dev/shm is not the daemon's (another machine, a container): its file was never found. A
    drop-in session in attach mode there is refused saying why (ORT said only that a file did not exist)."""
    r = subprocess.run(["unshare", "-m", "sh", "-c", 'mount -t tmpfs none /dev/shm && exec "$0" -c "$1" "$2" "$3"',
                        sys.executable, ELSEWHERE, tcp_daemon, str(N)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "MODELCACHE_CONFIG": ""})
    assert r.returncode == 0 and r.stdout.splitlines()[0] == "True", r.stdout + r.stderr
    assert "refused: neg: this process cannot see the daemon's host tier" in r.stdout, r.stdout
    assert "mode='serve'" in r.stdout, r.stdout


def test_a_request_too_large_for_a_message_is_refused_at_once(tcp_daemon, monkeypatch):
    monkeypatch.setenv("MODELCACHE_MAX_MESSAGE_SIZE", "1M")
    monkeypatch.setenv("MODELCACHE_CONFIG", "")
    with modelcache.connect(tcp_daemon) as c:
        x = np.arange(N, dtype=np.float32)
        assert np.array_equal(c.infer("neg", {"x": x})[0]["y"], -x)
        assert io_files() == []                              # in the message, no file
        t0 = time.monotonic()
        with pytest.raises(InputError, match=r"neg: the request's tensors come to 2400000 bytes.*max_message_size"):
            c.infer("neg", {"x": np.zeros(4 * N, np.float32)})
        assert time.monotonic() - t0 < 1.0                   # refused here, before anything is sent
        assert np.array_equal(c.infer("neg", {"x": x})[0]["y"], -x)   # and the connection still serves
