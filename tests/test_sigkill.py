"""SIGKILL of clients and of the daemon during add, promotion and serve-mode infer (issue #15).

Afterwards: the repository shows no half-written version and a restarted daemon serves every
complete one correctly; killed clients leave no /dev/shm files once the daemon has swept them;
surviving clients get typed errors, never a hang.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

from modelcache import zoo
from modelcache.errors import DaemonUnavailable, ModelCacheError, RequestTimeout
from conftest import HERE, DaemonProcess, stop_cleanly, wait_until
from test_serve import add_with_references, reference


def io_files_of(pids) -> list[str]:
    """The serve-mode I/O files in /dev/shm that the processes `pids` wrote (modelcache-io.UID.PID.N)."""
    return [f for f in os.listdir("/dev/shm") if f.startswith("modelcache-io.")
            and f.split(".")[2:3] and f.split(".")[2] in {str(p) for p in pids}]


def kill_daemon(d: DaemonProcess) -> list[psutil.Process]:
    """SIGKILL the daemon; returns its children (packers), which outlive it."""
    children = psutil.Process(d.pid).children(recursive=True)
    d.proc.kill()
    d.proc.wait()
    return children


def serves_every_complete_version(d: DaemonProcess, sources: dict) -> list[str]:
    """Every version the restarted daemon lists has a complete directory and answers as plain ORT does."""
    listed = []
    with d.client(timeout_s=30) as c:
        for m in c.list():
            model_dir = d.repository / m["name"] / str(m["version"])
            assert (model_dir / "manifest.json").is_file(), m
            src = sources[m["name"]]
            feeds = zoo.sample_inputs(src)
            out = c.infer(m["name"], feeds, version=m["version"])[0]
            np.testing.assert_allclose(next(iter(out.values())), reference(src, feeds)[0], rtol=1e-3, atol=1e-4)
            listed.append(m["name"])
    assert not list(d.repository.glob(".tmp-*")), "a half-written pack is left in the repository"
    return listed


def test_sigkill_of_the_daemon_during_add_never_shows_half_a_model(tmp_path, zoo_file):
    src = zoo_file("googlenet")
    d = DaemonProcess(tmp_path, {"MODELCACHE_LOG_LEVEL": "info"})
    outcomes = []
    for i, delay_s in enumerate([0.0, 0.3, 0.6, 3.0]):   # after the packer starts (it takes ~1-2 s here)
        d.start()
        errors = []

        def add():
            try:
                with d.client(timeout_s=60) as c:
                    c.add(src, f"g{i}")
            except ModelCacheError as e:
                errors.append(e)
        t = threading.Thread(target=add)
        t.start()
        wait_until(lambda: psutil.Process(d.pid).children(), timeout_s=30, what="the packer")
        time.sleep(delay_s)
        packers = kill_daemon(d)
        t0 = time.monotonic()
        t.join(30)
        assert not t.is_alive(), "the adding client hangs on a dead daemon"
        assert all(isinstance(e, (DaemonUnavailable, RequestTimeout)) for e in errors), errors
        outcomes.append((delay_s, round(time.monotonic() - t0, 2), type(errors[0]).__name__ if errors else "added",
                         len(packers)))
        psutil.wait_procs(packers, timeout=120)     # an orphaned packer finishes (or not) before the restart
        d.kill()
    d.start()
    try:
        listed = serves_every_complete_version(d, {f"g{i}": src for i in range(4)})
        print(f"kills during add (delay s, client error after s, outcome, packers running): {outcomes}; "
              f"listed after restart: {listed}")
        assert any(n for *_, n in outcomes), "no kill landed while a packer ran: the delays missed the add"
    finally:
        stop_cleanly(d)


def test_sigkill_of_an_offline_add_leaves_nothing_visible(tmp_path, zoo_file):
    """`modelcache add` with no daemon packs into the repository itself: killed at any point, no half model."""
    src = zoo_file("googlenet")
    repo = tmp_path / "repo"
    env = {**os.environ, "MODELCACHE_SOCKET": f"ipc://{tmp_path}/none.sock", "MODELCACHE_REPOSITORY": str(repo),
           "MODELCACHE_CONFIG": ""}
    for i, delay_s in enumerate([0.5, 1.5, 3.0]):
        p = subprocess.Popen([sys.executable, "-m", "modelcache.cli", "add", src, "--name", f"g{i}"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        time.sleep(delay_s)
        os.killpg(p.pid, signal.SIGKILL)          # the CLI and any packer it started
        p.wait()
    d = DaemonProcess(tmp_path).start()
    try:
        serves_every_complete_version(d, {f"g{i}": src for i in range(3)})
    finally:
        stop_cleanly(d)


def test_sigkill_during_promotion(tmp_path, zoo_file):
    """The daemon killed while it copies a model into the host tier, then a client killed while its open
    waits on the copy: a restart serves the model; the dead client's lease is swept."""
    src = zoo_file("googlenet")
    d = DaemonProcess(tmp_path, {"MODELCACHE_LEASE_TIMEOUT_S": "1.0", "MODELCACHE_HEARTBEAT_INTERVAL_S": "0.2"})
    d.start()
    try:
        with d.client() as c:
            c.add(src, "g")
        for delay_s in (0.0, 0.01, 0.03):
            d.stop()
            d.start()                              # a cold host tier: the next load promotes from disk
            loader = subprocess.Popen([sys.executable, "-c", "import modelcache, sys\n"
                                       "c = modelcache.connect(sys.argv[1]); print('HELLO', flush=True); c.load('g')",
                                       d.socket], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert loader.stdout.readline().startswith("HELLO")
            time.sleep(delay_s)
            kill_daemon(d)
            _, err = loader.communicate(timeout=30)
            # done before the kill, or a typed error (never a hang, never another error)
            assert loader.returncode == 0 or "DaemonUnavailable" in err or "RequestTimeout" in err, err[-500:]
            d.kill()
            d.start()
            serves_every_complete_version(d, {"g": src})
        # A client killed while its open waits for the promotion.
        with d.client() as c:
            c.evict("g")
        opener = subprocess.Popen([sys.executable, str(HERE / "client_worker.py"), "hold", "g"],
                                  env={**os.environ, "MODELCACHE_SOCKET": d.socket}, stdout=subprocess.PIPE)
        time.sleep(0.5)
        opener.kill()
        opener.wait()
        with d.client() as c:
            # The dead opener's promotion goes on without it (under load it can outlast the lease's sweep).
            wait_until(lambda: all(m["refcount"] == 0 and m["state"] != "loading" for m in c.list()), timeout_s=30,
                       what="the lease swept and the promotion it started done")
            c.evict("g")                            # nobody holds it: it can go
        serves_every_complete_version(d, {"g": src})
    finally:
        stop_cleanly(d)


def test_sigkill_of_the_daemon_during_serve_infer_gives_clients_typed_errors(tmp_path, zoo_file):
    d = DaemonProcess(tmp_path, {"MODELCACHE_WORKERS": "1"}).start()
    procs = []
    try:
        models = {"cnn": "tiny-cnn", "vit": "tiny-vit"}
        with d.client() as c:
            refs = add_with_references(c, zoo_file, tmp_path, models)
        np.savez(tmp_path / "refs.npz", **refs)
        env = {**os.environ, "MODELCACHE_SOCKET": d.socket, "MODELCACHE_REQUEST_TIMEOUT_S": "5"}
        procs = [subprocess.Popen([sys.executable, str(HERE / "client_worker.py"), "soak", str(tmp_path / "refs.npz"),
                                   "60", str(seed)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for seed in range(3)]
        with d.client() as c:
            wait_until(lambda: len(c.stats().clients) >= 4, timeout_s=30, what="the serve clients")
        time.sleep(1.0)                             # requests in flight
        kill_daemon(d)
        t0 = time.monotonic()
        for p in procs:
            out, err = p.communicate(timeout=60)   # each stops after 10 errors: a hang would time out here
            report = json.loads(out.strip().splitlines()[-1])
            assert report["wrong"] == 0 and report["requests"] > 0, report
            kinds = {e.split(":")[0] for e in report["errors"]}
            assert kinds and kinds <= {"DaemonUnavailable", "RequestTimeout"}, report["errors"][:3]
        print(f"3 serve clients saw typed errors and stopped {time.monotonic() - t0:.1f} s after the kill")
        d.kill()
        d.start()
        serves_every_complete_version(d, {n: zoo_file(z) for n, z in models.items()})
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        stop_cleanly(d)


@pytest.mark.parametrize("client", ["connect", "session"])
def test_killed_serve_clients_leave_no_io_files_after_the_sweep(tmp_path, zoo_file, client):
    """Clients SIGKILLed while their large inputs wait in /dev/shm I/O files: the daemon's sweep of dead
    clients removes their files. `connect`: the full client (ZeroMQ, heartbeats); `session`: a serve-mode
    session, over the lane alone, whose connection's end is its end."""
    d = DaemonProcess(tmp_path, {"MODELCACHE_WORKERS": "1", "MODELCACHE_HEARTBEAT_INTERVAL_S": "0.2",
                                 "MODELCACHE_LEASE_TIMEOUT_S": "1.0"}).start()
    src = zoo_file("tiny-cnn")
    run = {"connect": "c = modelcache.connect(sys.argv[1])\nrun = lambda x: c.infer('cnn', x)\n",
           "session": "s = modelcache.InferenceSession('cnn', mode='serve', socket=sys.argv[1])\n"
                      "run = lambda x: s.run(None, x)\n"}[client]
    script = ("import sys, numpy as np, modelcache\n" + run +
              "x = {'input': np.ones((512, 3, 32, 32), np.float32)}\n"   # 6 MB: an I/O file, not inline
              "print('READY', flush=True)\n"
              "while True: run(x)\n")
    procs = []
    try:
        with d.client() as c:
            c.add(src, "cnn")
        procs = [subprocess.Popen([sys.executable, "-c", script, d.socket], stdout=subprocess.PIPE) for _ in range(4)]
        for p in procs:
            assert p.stdout.readline().startswith(b"READY")
        time.sleep(1.0)
        for p in procs:
            p.kill()
            p.wait()
        pids = [p.pid for p in procs]
        with d.client() as c:
            wait_until(lambda: c.stats().counters.get("clients_lost", 0) >= 4, timeout_s=15, what="the sweep")
            wait_until(lambda: not io_files_of(pids), timeout_s=5, what="the killed clients' I/O files to go")
            np.testing.assert_allclose(c.infer("cnn", zoo.sample_inputs(src))[0]["logits"],
                                       reference(src, zoo.sample_inputs(src))[0], rtol=1e-4, atol=1e-5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in io_files_of([p.pid for p in procs]):
            os.unlink(os.path.join("/dev/shm", f))
        stop_cleanly(d)



def test_a_process_killed_before_its_first_request_reached_the_daemon_leaves_no_io_file(tmp_path, zoo_file):
    """A serve session's connection is no client until its first infer arrives, and the input file is written
    before: a process killed between the two is known only by its connection's end."""
    d = DaemonProcess(tmp_path).start()
    src = zoo_file("tiny-cnn")
    script = ("import os, sys, numpy as np, modelcache\n"
              "from modelcache.wire import tensors\n"
              "s = modelcache.InferenceSession('cnn', mode='serve', socket=sys.argv[1])\n"   # (a describe: no client)
              "tensors.encode({'input': np.ones((512, 3, 32, 32), np.float32)}, group_of=sys.argv[1][6:])\n"
              "print('READY', flush=True)\n"
              "os.kill(os.getpid(), 9)\n")
    try:
        with d.client() as c:
            c.add(src, "cnn")
        p = subprocess.Popen([sys.executable, "-c", script, d.socket], stdout=subprocess.PIPE)
        assert p.stdout.readline().startswith(b"READY")
        assert p.wait(60) == -9
        wait_until(lambda: not io_files_of([p.pid]), timeout_s=10, what="the killed process's I/O file to go")
    finally:
        for f in io_files_of([p.pid]):
            os.unlink(os.path.join("/dev/shm", f))
        stop_cleanly(d)
