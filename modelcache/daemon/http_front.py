"""The daemon's HTTP front (`http_port`): `modelcache http` as a child process, started and stopped with it.

A child, not a thread: the front parses HTTP and JSON in Python, and in the daemon's process it
would take the GIL from the owner loop on every request. It reaches the daemon over the serve
lane like any client. The kernel sends it SIGTERM if the daemon dies (PR_SET_PDEATHSIG), so a
killed daemon leaves no front holding its port.

The daemon binds the port itself, when it starts, and hands the listening socket to the child: a port
it cannot have (in use, privileged) fails the daemon's start with one line naming http_port, rather
than a child's traceback in the log and a daemon up without its front.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys

log = logging.getLogger("modelcache.daemon")
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:   # runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class HttpFront:
    def __init__(self, socket: str, host: str, port: int):
        import importlib.util
        from ..address import listen_tcp
        from ..config import ConfigError
        if importlib.util.find_spec("aiohttp") is None:
            raise ConfigError(f"http_port {port}: the HTTP front needs the [http] extra (pip install "
                              "'modelcache[http]'), or set http_port = 0")
        self.sock = listen_tcp(host, port, f"http_port {port}")
        self.cmd = [sys.executable, "-m", "modelcache.cli", "http", "--socket", socket,
                    "--listen-fd", str(self.sock.fileno())]
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        # systemd's notify socket and watchdog are the daemon's alone (NotifyAccess=main)
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        self.proc = subprocess.Popen(self.cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     pass_fds=(self.sock.fileno(),),
                                     preexec_fn=_die_with_parent)   # its log lines go to our stderr
        self.close()   # the child's now: a front that dies must not leave connections queued on our copy
        log.info("Open Inference Protocol (v2) front starting on %s (pid %d)", self.url, self.proc.pid)

    def check(self) -> None:
        """Say so once if the front exited on its own (it crashed: its port was bound, its extra checked, at start)."""
        if self.proc is not None and self.proc.poll() is not None:
            log.error("the HTTP front on %s exited with status %s; see its lines above", self.url,
                      self.proc.returncode)
            self.proc = None

    def terminate(self) -> None:
        """SIGTERM, without waiting: it stops taking requests and finishes those in flight, which the
        daemon's stop drains and answers meanwhile."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()

    def close(self) -> None:
        """Our copy of the listening socket (the child has its own): closed when the front stops, or when
        the daemon's start fails before the front started."""
        self.sock.close()

    def wait(self, timeout_s: float = 10.0) -> None:
        self.close()
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
