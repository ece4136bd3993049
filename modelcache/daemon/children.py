"""The daemon's child processes, started and stopped with it: the protocol fronts (`modelcache http` on
`http_port`, `modelcache grpc` on `grpc_port`) and the Triton repository import at start (`triton_repository`).

Children, not threads: a front parses HTTP or protobuf in Python, and in the daemon's process it would take
the GIL from the owner loop on every request; an import packs models as any client's `add` does. Each
reaches the daemon over the serve lane like any client. The kernel sends a child SIGTERM if the daemon dies
(PR_SET_PDEATHSIG), so a killed daemon leaves no front holding its port.

The daemon takes each front's port itself, when it starts: a port it cannot have (in use, privileged) fails
the daemon's start with one line naming the setting, rather than a child's traceback in the log and a daemon
up without its front. The HTTP front gets the listening socket itself (--listen-fd). grpc cannot serve on a
socket it did not bind, so for the gRPC front the daemon holds the port bound with SO_REUSEPORT and not
listening, and the child binds it beside that (grpc sets SO_REUSEPORT too): no other program can take it
meanwhile, and no call is queued on the daemon's copy.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import signal
import subprocess
import sys

log = logging.getLogger("modelcache.daemon")
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:   # runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Child:
    """One `modelcache ...` child of the daemon (its lines go to the daemon's stderr)."""

    what = "child"
    exits_when_done = False   # a job (the import) rather than a server
    says_on_stdout = False    # its lines on stdout go to the daemon's log (the import's report); else to /dev/null

    def __init__(self, args: list[str], pass_fds: tuple = ()):
        self.cmd = [sys.executable, "-m", "modelcache.cli", *args]
        self.pass_fds = pass_fds
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        # systemd's notify socket and watchdog are the daemon's alone (NotifyAccess=main)
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        # A front's lines go to our stderr (its log); the import's report, on its stdout, too
        self.proc = subprocess.Popen(self.cmd, env=env, stdin=subprocess.DEVNULL,
                                     stdout=sys.stderr if self.says_on_stdout else subprocess.DEVNULL,
                                     pass_fds=self.pass_fds, preexec_fn=_die_with_parent)
        log.info("%s starting (pid %d)", self.what, self.proc.pid)

    def check(self) -> None:
        """Say so once if the child exited (a server crashed: its port was taken, its extra checked, at start)."""
        if self.proc is None or self.proc.poll() is None:
            return
        if self.exits_when_done and self.proc.returncode == 0:
            log.info("%s done", self.what)
        else:
            log.error("%s exited with status %s; see its lines above", self.what, self.proc.returncode)
        self.proc = None

    def terminate(self) -> None:
        """SIGTERM, without waiting: a front stops taking requests and finishes those in flight, which the
        daemon's stop drains and answers meanwhile."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()

    def close(self) -> None:
        """What the daemon holds for the child (a front's port), when it stops or its start fails."""

    def wait(self, timeout_s: float = 10.0) -> None:
        self.close()
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Front(Child):
    """A protocol front on `<kind>_port`: http (the v2 REST front) or grpc (Triton's gRPC service)."""

    EXTRAS = {"http": "httptools", "grpc": "grpc"}   # the module each front's extra brings

    def __init__(self, kind: str, socket: str, host: str, port: int, triton_repository: str = ""):
        from ..address import listen_tcp, reserve_tcp
        from ..config import ConfigError
        setting = f"{kind}_port {port}"
        if importlib.util.find_spec(self.EXTRAS[kind]) is None:
            raise ConfigError(f"{setting}: the {kind} front needs the [{kind}] extra (pip install "
                              f"'modelcache[{kind}]'), or set {kind}_port = 0")
        args = [kind, "--socket", socket, "--daemons"]
        if triton_repository:   # where its repository loads read a model again (triton_repo/load.py)
            args += ["--triton-repository", os.path.abspath(triton_repository)]
        if kind == "http":   # handed over: the child serves on our listening socket
            self.sock = listen_tcp(host, port, setting)
            args += ["--listen-fd", str(self.sock.fileno())]
            pass_fds = (self.sock.fileno(),)
        else:   # held: the child binds the same port beside it (see the module's docstring)
            self.sock = reserve_tcp(host, port, setting)
            args += ["--host", host, "--port", str(self.sock.getsockname()[1])]
            pass_fds = ()
        super().__init__(args, pass_fds)
        self.kind = kind
        where = f"{'[' + host + ']' if ':' in host else host}:{self.sock.getsockname()[1]}"
        self.what = f"the {'Open Inference Protocol (v2 HTTP)' if kind == 'http' else 'Triton gRPC'} front on " \
                    f"{'http://' if kind == 'http' else ''}{where}"

    def start(self) -> None:
        super().start()
        if self.kind == "http":
            self.close()   # the child's now: a front that dies must not leave connections queued on our copy

    def close(self) -> None:
        """Our copy of the port: handed over (HTTP) or held (gRPC) until the front stops, or closed when the
        daemon's start fails before the front started."""
        self.sock.close()


class TritonImport(Child):
    """`modelcache import-triton DIR` against this daemon, once it listens: models new since the last start are
    added (an unchanged one is not), each line in the daemon's log. With `poll_s` it stays, watching the repository
    (`--poll`: triton_repo/poll.py), and imports again each model whose directory changes."""

    what = "the Triton repository import"
    exits_when_done = True
    says_on_stdout = True

    def __init__(self, socket: str, repository: str, poll_s: float = 0.0):
        super().__init__(["import-triton", repository, "--socket", socket] + (["--poll", repr(poll_s)] if poll_s else []))
        self.what = f"the Triton repository {'poller' if poll_s else 'import'} of {repository}"
        self.exits_when_done = not poll_s


def daemon_children(settings) -> list[Child]:
    """The children the settings ask for; the fronts' ports are taken here (a ConfigError if one cannot be)."""
    children: list[Child] = []
    try:
        for kind in ("http", "grpc"):
            port = getattr(settings, f"{kind}_port")
            if port:
                children.append(Front(kind, settings.socket, getattr(settings, f"{kind}_host"), port,
                                      settings.triton_repository))
    except BaseException:
        for c in children:
            c.close()
        raise
    if settings.triton_repository:
        children.append(TritonImport(settings.socket, settings.triton_repository,
                                     settings.repository_poll_s if settings.model_control == "poll" else 0.0))
    return children
