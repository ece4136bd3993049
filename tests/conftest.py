"""Fixtures: zoo models on disk, and a real daemon subprocess on an ipc:// socket in tmp_path."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from modelcache import zoo
from modelcache.measure import compile_bytecode

HERE = Path(__file__).parent
TINY = ["tiny-cnn", "tiny-vit", "tiny-if", "tiny-fp16", "tiny-embed", "tiny-ir3"]


def pytest_configure(config):
    """Compile modelcache's modules once, before the workers start: every daemon, front and client process the
    tests start is a fresh interpreter, and with PYTHONDONTWRITEBYTECODE set (as on the machines here) each would
    compile every module it imports again, ~14 % of the suite's CPU (tests/test_serve.py: 37.2 s of user time
    without, 32.6 s with). An installed package has its bytecode from pip already."""
    if not hasattr(config, "workerinput"):   # the controller (or a run without xdist), not each xdist worker
        compile_bytecode()


@pytest.fixture(scope="session")
def zoo_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("zoo")


@pytest.fixture(scope="session")
def zoo_file(zoo_dir):
    """zoo_file(name) -> path of that zoo model as .onnx, built once per test session."""
    def get(name: str) -> str:
        path = zoo_dir / f"{name}.onnx"
        if not path.exists():
            zoo.save(zoo.build(name), str(path))
        return str(path)
    return get


class DaemonProcess:
    """A `modelcache daemon` subprocess; `stop()` checks it left nothing behind."""

    def __init__(self, root: Path, extra_env: dict | None = None, args: tuple = ()):
        self.root = root
        self.socket = f"ipc://{root}/run/daemon.sock"
        self.repository = root / "repo"
        self.env = {**os.environ, "MODELCACHE_SOCKET": self.socket, "MODELCACHE_REPOSITORY": str(self.repository),
                    "MODELCACHE_CONFIG": "", "MODELCACHE_LOG_LEVEL": "debug", **(extra_env or {})}
        self.args = args
        self.preexec = None          # run in the daemon's process before exec (e.g. to set a resource limit)
        self.proc: subprocess.Popen | None = None
        self.log_path = root / "daemon.log"

    def start(self, timeout_s: float = 30.0) -> "DaemonProcess":
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "modelcache.cli", "daemon", *self.args],
                                     env=self.env, stdout=subprocess.PIPE, stderr=self.log, preexec_fn=self.preexec)
        # Wait on the ready handshake, never on a sleep.
        deadline = time.monotonic() + timeout_s
        line = b""
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if r:
                line = self.proc.stdout.readline()
                if line.startswith(b"READY"):
                    return self
                if not line:
                    break
            if self.proc.poll() is not None:
                break
        self.kill()
        raise RuntimeError(f"daemon did not get ready: {line!r}\n{self.log_path.read_text()}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def shm_dir(self) -> Path:
        return Path(self.env.get("MODELCACHE_SHM_DIR", "/dev/shm")) / f"modelcache.{os.getuid()}.{self.pid}"

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout_s)
        self.log.close()
        return rc

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        import shutil
        shutil.rmtree(self.shm_dir, ignore_errors=True)  # what a SIGKILLed daemon could not clean

    def client(self, **kw):
        import modelcache
        return modelcache.connect(self.socket, **kw)


def stop_cleanly(d: DaemonProcess) -> None:
    """Stop a test's daemon and check it exited well and left nothing behind."""
    rc = d.stop()
    shm = d.shm_dir
    d.kill()
    assert rc == 0, d.log_path.read_text()
    assert not shm.exists(), "daemon left its host tier (or a simulated GPU's memory) in /dev/shm"
    assert not Path(d.socket[len("ipc://"):]).exists(), "daemon left its socket file"


@contextlib.contextmanager
def daemon_with_models(root: Path, paths: dict, env: dict | None = None):
    """(daemon, client) with each {name: .onnx path} added (`env`: the daemon's extra environment); stopped
    cleanly, and checked, on exit."""
    d = DaemonProcess(root, env).start()
    try:
        with d.client() as c:
            for name, path in paths.items():
                c.add(path, name)
            yield d, c
        stop_cleanly(d)
    finally:
        d.kill()


@pytest.fixture
def small_tmpfs(tmp_path):
    """small_tmpfs(size) -> a directory on a fresh tmpfs of that size; unmounted after the test."""
    mounts = []

    def mount(size: str, name: str = "fs", options: str = "") -> Path:
        where = tmp_path / f"{name}-{len(mounts)}"
        where.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}" + (f",{options}" if options else ""),
                            "tmpfs", str(where)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def daemon(tmp_path):
    d = DaemonProcess(tmp_path).start()
    yield d
    stop_cleanly(d)


@pytest.fixture
def host(tmp_path):
    """A host tier of 64 MiB in a private /dev/shm directory, removed after the test."""
    from modelcache.tiers.host import HostTier
    shm = Path("/dev/shm") / f"mc-test-{os.getpid()}-{tmp_path.name}"
    shm.mkdir()
    tier = HostTier(shm, capacity_bytes=64 << 20)
    tier.start()
    yield tier
    tier.stop()
    shm.rmdir()


@pytest.fixture
def client(daemon):
    c = daemon.client()
    yield c
    c.close()


def run_client(socket: str, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """Run tests/client_worker.py in a fresh process (a separate client of the daemon)."""
    env = {**os.environ, "MODELCACHE_SOCKET": socket}
    return subprocess.run([sys.executable, str(HERE / "client_worker.py"), *args], env=env,
                          capture_output=True, text=True, timeout=timeout_s)


def dead_pid() -> int:
    """A process id that no process has now (one that just exited)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def open_fds(pid) -> dict:
    """A process's open descriptors ("self", or a pid): number -> what it names (one closed while listed is left
    out: our own listdir's)."""
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            pass
    return out


def left_open(now: dict, before: dict) -> dict:
    """The descriptors of `now` that `before` (open_fds's) did not have. Not equality: in a pytest worker an
    earlier test's objects may be collected meanwhile and close a pipe of theirs (CI saw one); a closed descriptor
    is no leak, and a leaked one that reuses its number still shows, naming something else."""
    return dict(now.items() - before.items())


def in_threads(work, n: int, timeout_s: float = 120.0) -> list:
    """Run work(k) for k in range(n), each on a thread of its own, all at once; the exceptions they raised."""
    import threading
    errors = []

    def run(k: int):
        try:
            work(k)
        except Exception as e:   # (the caller asserts there are none)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return errors


def wait_until(predicate, timeout_s: float = 15.0, what: str = "condition"):
    """Poll a condition with a deadline (for effects that take real time, e.g. lease expiry)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
