"""A scripted pass over the command line with bad arguments: each case must fail with one `modelcache: ...`
line on stderr (no traceback), a non-zero exit status, and nothing left behind (no host tier in shm_dir or
in /dev/shm, no socket or lock file).

Every command runs as a fresh `python -m modelcache.cli` subprocess whose socket, repository, shm_dir and
config directory lie under tmp_path, so nothing touches the user's defaults; none needs a daemon (those
that ask one find none), and none needs Ray (the cluster cases find none). Busy ports are bound here first.

Run as a script (`python tests/test_cli_errors.py`) it prints every case and its line: the table for the
closing note.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (case id, argv, extra environment, text the one line must contain). In argv and the environment, {tmp}
# is the case's directory, {file} a regular file in it, {port} a port bound (and listening) by the test.
CASES = [
    ("no command", [], {}, "the following arguments are required: cmd"),
    ("unknown command", ["nosuch"], {}, "invalid choice: 'nosuch'"),
    ("unknown flag", ["ls", "--nosuch"], {}, "unrecognized arguments: --nosuch"),
    ("zoo unknown model", ["zoo", "nosuch"], {}, "no zoo model 'nosuch'"),
    ("zoo typo", ["zoo", "resnet5"], {}, "did you mean resnet50"),
    ("zoo seed not a number", ["zoo", "tiny-cnn", "--seed", "x"], {}, "argument --seed: invalid int value: 'x'"),
    ("add version 0", ["add", "{file}", "--name", "m", "--version", "0"], {}, "--version: 0 must be >= 1"),
    ("add version -3", ["add", "{file}", "--name", "m", "--version", "-3"], {}, "--version: -3 must be"),
    ("add version x", ["add", "{file}", "--name", "m", "--version", "x"], {}, "--version: x is not a whole number"),
    ("add missing file", ["add", "{tmp}/missing.onnx", "--name", "m"], {}, "missing.onnx: no such file"),
    ("add a directory", ["add", "{tmp}", "--name", "m"], {}, "a directory, not an .onnx file"),
    ("add needs a daemon", ["add", "{file}", "--name", "m", "--require-daemon"], {}, "no modelcache daemon at"),
    ("add bad opt level", ["add", "{file}", "--name", "m", "--opt-level", "max"], {}, "argument --opt-level: invalid choice"),
    ("add prepack=enabled", ["add", "{file}", "--name", "m"], {"MODELCACHE_PREPACK": "enabled"},
     "MODELCACHE_PREPACK=enabled: prepack is not a boolean"),
    ("add repository is a file", ["add", "{file}", "--name", "m"], {"MODELCACHE_REPOSITORY": "{file}"},
     "repository must be a directory"),
    ("ls --repository", ["ls", "--repository", "{tmp}"], {}, "this command asks the running daemon"),
    ("status --repository", ["status", "--repository", "{tmp}"], {}, "this command asks the running daemon"),
    ("load --repository", ["load", "m", "--repository", "{tmp}"], {}, "this command asks the running daemon"),
    ("ls no daemon", ["ls"], {}, "no modelcache daemon at ipc://"),
    ("status no daemon", ["status"], {}, "no modelcache daemon at ipc://"),
    ("stats no daemon", ["stats"], {}, "no modelcache daemon at ipc://"),
    ("load no daemon", ["load", "m"], {}, "no modelcache daemon at ipc://"),
    ("pin no daemon", ["pin", "m"], {}, "no modelcache daemon at ipc://"),
    ("unpin no daemon", ["unpin", "m"], {}, "no modelcache daemon at ipc://"),
    ("rm no daemon", ["rm", "m", "--version", "1"], {}, "no modelcache daemon at ipc://"),
    ("evict no daemon", ["evict", "m"], {}, "no modelcache daemon at ipc://"),
    ("partition no daemon", ["partition", "m", "--stages", "2"], {}, "no modelcache daemon at ipc://"),
    ("calibrate no daemon", ["calibrate", "m"], {}, "no modelcache daemon at ipc://"),
    ("status, daemon-only setting bad in the file", ["status"], {"config": 'host_capacity = "banana"\n'},
     "no modelcache daemon at ipc://"),
    ("load bad tier", ["load", "m", "--tier", "disk"], {}, "argument --tier: 'disk': use host, gpu"),
    ("load version 0", ["load", "m", "--version", "0"], {}, "--version: 0 must be"),
    ("rm without version", ["rm", "m"], {}, "the following arguments are required: --version"),
    ("partition 0 stages", ["partition", "m", "--stages", "0"], {}, "--stages: 0 must be"),
    ("partition tail fraction 1.5", ["partition", "m", "--tail-fraction", "1.5"], {}, "--tail-fraction: 1.5 must be"),
    ("calibrate runs 0", ["calibrate", "m", "--runs", "0"], {}, "--runs: 0 must be"),
    ("place missing system", ["place", "m", "--system", "{tmp}/missing.toml"], {}, "missing.toml does not exist"),
    ("place batch 0", ["place", "m", "--batch", "0"], {}, "--batch: 0 must be"),
    ("place without a name", ["place"], {}, "give NAME and --system FILE"),
    ("socket garbage", ["ls"], {"MODELCACHE_SOCKET": "garbage"},
     "MODELCACHE_SOCKET=garbage: socket is not a daemon address: write ipc://PATH (or an absolute PATH), or tcp://HOST:PORT"),
    ("--socket without a port", ["ls", "--socket", "tcp://localhost"], {}, "is not a daemon address"),
    ("config file missing", ["ls"], {"MODELCACHE_CONFIG": "{tmp}/missing.toml"}, "missing.toml does not exist"),
    ("config file not TOML", ["ls"], {"config": "socket = \n"}, "is not valid TOML"),
    ("config file unknown key", ["ls"], {"config": "sockett = 1\n"}, "unknown setting 'sockett'; did you mean socket?"),
    ("config file workers list of words", ["daemon"], {"config": 'workers = ["1", "x"]\n'},
     "workers must be 'auto' or threads per group"),
    ("http port 99999", ["http", "--port", "99999"], {}, "--port: 99999 must be >= 0 and <= 65535"),
    ("http port busy", ["http", "--port", "{port}"], {}, "--port {port}: cannot listen on 127.0.0.1:{port}: Address already in use"),
    ("http no daemon", ["http", "--port", "0"], {}, "no modelcache daemon at ipc://"),
    ("daemon metrics port busy", ["daemon", "--metrics-port", "{port}"], {}, "metrics_port {port}: cannot listen on 127.0.0.1:{port}: Address already in use"),
    ("daemon metrics port 99999", ["daemon", "--metrics-port", "99999"], {}, "--metrics-port: 99999 must be"),
    ("daemon http port busy", ["daemon"], {"MODELCACHE_HTTP_PORT": "{port}"}, "http_port {port}: cannot listen on 127.0.0.1:{port}"),
    ("daemon http port 99999", ["daemon"], {"MODELCACHE_HTTP_PORT": "99999"}, "MODELCACHE_HTTP_PORT=99999: http_port must be >= 0 and <= 65535"),
    # (a failure after the host tier was made: the start is undone, shm_dir is left empty)
    ("daemon tcp socket busy", ["daemon"], {"MODELCACHE_SOCKET": "tcp://127.0.0.1:{port}"},
     "socket tcp://127.0.0.1:{port}: cannot listen there: Address already in use"),
    ("daemon socket garbage", ["daemon"], {"MODELCACHE_SOCKET": "garbage"}, "MODELCACHE_SOCKET=garbage: socket is not a daemon address"),
    ("daemon loader threads 0", ["daemon"], {"MODELCACHE_LOADER_THREADS": "0"}, "MODELCACHE_LOADER_THREADS=0: loader_threads must be >= 1"),
    ("daemon repository is a file", ["daemon"], {"MODELCACHE_REPOSITORY": "{file}"}, "repository must be a directory: {file} is a file"),
    ("daemon host capacity -5G", ["daemon"], {"MODELCACHE_HOST_CAPACITY": "-5G"}, "host_capacity must be a positive size"),
    ("daemon host capacity 150%", ["daemon"], {"MODELCACHE_HOST_CAPACITY": "150%"}, "at most 100% of RAM"),
    ("daemon host capacity 1T", ["daemon", "--host-capacity", "1T"], {}, "--host-capacity 1T: host_capacity must be at most this machine's RAM"),
    ("daemon host capacity 0", ["daemon"], {"MODELCACHE_HOST_CAPACITY": "0"}, "host_capacity must be at least 64K"),
    ("daemon host capacity 10K", ["daemon"], {"MODELCACHE_HOST_CAPACITY": "10K"}, "host_capacity must be at least 64K"),
    ("daemon host capacity in the file", ["daemon"], {"config": 'host_capacity = "banana"\n'}, "host_capacity = 'banana' in"),
    ("daemon log level verbose", ["daemon"], {"MODELCACHE_LOG_LEVEL": "verbose"}, "log_level must be one of debug, info"),
    ("daemon --log-level verbose", ["daemon", "--log-level", "verbose"], {}, "argument --log-level: invalid choice"),
    ("daemon lease timeout -1", ["daemon"], {"MODELCACHE_LEASE_TIMEOUT_S": "-1"}, "lease_timeout_s must be > 0"),
    ("daemon eviction policy", ["daemon"], {"MODELCACHE_EVICTION_POLICY": "random"}, "eviction_policy must be one of lru"),
    ("daemon scheduler", ["daemon"], {"MODELCACHE_SCHEDULER": "fastest"}, "scheduler must be one of eager"),
    ("daemon unknown admin group", ["daemon"], {"MODELCACHE_ADMIN_GROUP": "no-such-group-here"}, "admin_group 'no-such-group-here': no such group"),
    ("daemon shm dir missing", ["daemon"], {"MODELCACHE_SHM_DIR": "{tmp}/missing"}, "shm_dir must be an existing directory"),
    ("verify repository is a file", ["verify"], {"MODELCACHE_REPOSITORY": "{file}"}, "repository must be a directory"),
    ("bench unknown", ["bench", "nosuch"], {}, "argument which: invalid choice: 'nosuch'"),
    ("bench unknown option", ["bench", "coldstart", "--nosuch"], {}, "bench coldstart: unrecognized arguments: --nosuch"),
    ("bench bad value", ["bench", "soak", "--minutes", "x"], {}, "bench soak: argument --minutes: invalid float value"),
    ("cluster status, no Ray", ["cluster", "status"], {}, "no Ray cluster at auto: start one with `ray start --head`"),
    ("cluster up, no Ray", ["cluster", "up"], {}, "no Ray cluster at auto"),
    ("cluster down, no Ray", ["cluster", "down"], {}, "no Ray cluster at auto"),
    ("cluster status, nothing at the address", ["cluster", "status", "--address", "127.0.0.1:{port0}"], {},
     "no Ray cluster at 127.0.0.1:{port0} (Connection refused)"),
]


def run_case(argv, env_extra, tmp: Path, port: int, port0: int) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run one case in `tmp`; returns its outcome (and pid) and what it left behind (files in shm_dir and the socket's
    directory, and a /dev/shm host tier named after its pid)."""
    fill = lambda text: text.format(tmp=tmp, file=tmp / "file.onnx", port=port, port0=port0)  # noqa: E731
    (tmp / "file.onnx").write_bytes(b"not an onnx model")
    (tmp / "shm").mkdir(exist_ok=True)
    (tmp / "run").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MODELCACHE_", "RAY_"))}
    env.update(PYTHONPATH=str(ROOT), XDG_CONFIG_HOME=str(tmp / "config"), XDG_RUNTIME_DIR=str(tmp / "run"),
               MODELCACHE_SOCKET=f"ipc://{tmp}/run/daemon.sock", MODELCACHE_REPOSITORY=str(tmp / "repo"),
               MODELCACHE_SHM_DIR=str(tmp / "shm"))
    for key, value in env_extra.items():
        if key == "config":   # a config file with this text
            (tmp / "mc.toml").write_text(value)
            env["MODELCACHE_CONFIG"] = str(tmp / "mc.toml")
        else:
            env[key] = fill(value)
    with subprocess.Popen([sys.executable, "-m", "modelcache.cli", *map(fill, argv)], env=env, cwd=tmp, text=True,
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as popen:
        out, err = popen.communicate(timeout=120)
    proc = subprocess.CompletedProcess(popen.args, popen.returncode, out, err)
    proc.pid = popen.pid
    left = [str(p) for d in (tmp / "shm", tmp / "run") for p in d.iterdir()]
    # A failed daemon start must not leave a host tier where the default shm_dir would have it either.
    left += [str(p) for p in Path("/dev/shm").glob(f"modelcache.{os.getuid()}.*") if _pid_of(p) == proc.pid]
    return proc, left


def _pid_of(path: Path) -> int | None:
    tail = path.name.rsplit(".", 1)[-1]
    return int(tail) if tail.isdigit() else None


@pytest.fixture(scope="module")
def busy_port():
    """A loopback port that is bound and listening here, and one nothing listens on."""
    with socket.socket() as busy, socket.socket() as closed:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        closed.bind(("127.0.0.1", 0))   # bound, never listening: a connect there is refused
        yield busy.getsockname()[1], closed.getsockname()[1]


@pytest.mark.parametrize("case_id, argv, env, says", CASES, ids=[c[0] for c in CASES])
def test_bad_arguments_fail_with_one_line(case_id, argv, env, says, tmp_path, busy_port):
    port, port0 = busy_port
    if argv[:1] == ["cluster"]:
        pytest.importorskip("ray")
    proc, left = run_case(argv, env, tmp_path, port, port0)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert len(lines) == 1 and lines[0].startswith("modelcache: "), proc.stderr
    assert "Traceback" not in proc.stderr
    assert says.format(tmp=tmp_path, file=tmp_path / "file.onnx", port=port, port0=port0) in lines[0]
    assert left == [], f"left behind: {left}"


def test_debug_adds_the_traceback(tmp_path, busy_port):
    proc, _ = run_case(["--debug", "zoo", "nosuch"], {}, tmp_path, *busy_port)
    assert proc.returncode == 1 and "Traceback" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("modelcache: no zoo model 'nosuch'")


def test_a_closed_pipe_is_quiet():
    """`modelcache ls | head -3`: the reader is gone (here, before we start: deterministic); EPIPE, and no
    BrokenPipeError traceback, no message; the exit status is 1, as Python's documentation has it."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "modelcache.cli", "zoo", "--list"], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (1, "")


def test_an_unknown_failure_is_one_line_that_says_so(monkeypatch, capsys):
    from modelcache import cli
    assert cli.fail(ZeroDivisionError("division by zero")) == 1
    assert capsys.readouterr().err == ("modelcache: internal error: ZeroDivisionError: division by zero "
                                       "(run with --debug for the traceback)\n")


def test_the_node_actor_finds_the_daemon_where_the_daemon_listens(tmp_path):
    """`cluster up` adopts a node's daemon on MODELCACHE_SOCKET or the config file's socket: the actor resolves
    the address by the daemon's own layers (it looked at the built-in default only, and collided)."""
    pytest.importorskip("ray")
    from modelcache.cluster.rayserve import daemon_address, daemon_env
    conf = tmp_path / "mc.toml"
    conf.write_text(f'socket = "ipc://{tmp_path}/from-file.sock"\n')
    assert daemon_address({"MODELCACHE_CONFIG": str(conf)}) == f"ipc://{tmp_path}/from-file.sock"
    env = {"MODELCACHE_CONFIG": str(conf), "MODELCACHE_SOCKET": f"{tmp_path}/from-env.sock"}
    assert daemon_address(env) == f"ipc://{tmp_path}/from-env.sock"              # environment beats the file
    settings = {"socket": f"ipc://{tmp_path}/given.sock"}
    assert daemon_address({**env, **daemon_env(settings)}) == f"ipc://{tmp_path}/given.sock"   # `up --socket`


@pytest.mark.slow
def test_cluster_up_adopts_the_daemon_on_modelcache_socket(tmp_path, monkeypatch):
    """The bug itself, on a real one-node Ray cluster: a daemon runs on MODELCACHE_SOCKET, and `up` adopts it
    (it started a second daemon, which found the socket taken: 'did not get ready')."""
    pytest.importorskip("ray.serve")
    from conftest import DaemonProcess
    from modelcache.cluster import local, rayserve
    d = DaemonProcess(tmp_path).start()
    try:
        monkeypatch.setenv("MODELCACHE_SOCKET", d.socket)   # the raylet inherits it, and from it the actor
        monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))   # (no user's config file)
        with local.ray_cluster(1):
            [info] = rayserve.start_daemons({})
            assert (info["address"], info["owned"]) == (d.socket, False)
    finally:
        assert d.stop() == 0


def main() -> int:
    """Print every case and its one line (the table for the closing note); exit 1 if any case fails."""
    bad = 0
    with socket.socket() as busy, socket.socket() as closed:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        closed.bind(("127.0.0.1", 0))
        for case_id, argv, env, says in CASES:
            with tempfile.TemporaryDirectory() as tmp:
                proc, left = run_case(argv, env, Path(tmp), busy.getsockname()[1], closed.getsockname()[1])
            lines = proc.stderr.strip().splitlines()
            ok = proc.returncode != 0 and len(lines) == 1 and lines[0].startswith("modelcache: ") and not left
            bad += not ok
            shown = " ".join(["modelcache", *argv] + [f"[{k}={v.strip()}]" for k, v in env.items()])
            print(f"| {case_id} | `{shown}` | {proc.returncode} | {' / '.join(lines) or '(nothing)'} |"
                  + ("" if ok else " **FAIL**"), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
