"""systemd's notify protocol (sd_notify): READY, STATUS, WATCHDOG, RELOADING, STOPPING.

A datagram to $NOTIFY_SOCKET; without it (not under systemd) every call does nothing.
Written here rather than pulled in as a dependency: it is one sendto().
"""

from __future__ import annotations

import os
import socket
import time


class Notifier:
    def __init__(self, env=None):
        env = os.environ if env is None else env
        addr = env.get("NOTIFY_SOCKET", "")
        if addr.startswith("@"):  # abstract namespace
            addr = "\0" + addr[1:]
        self.address = addr or None
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        watchdog = usec and (not pid or pid == str(os.getpid()))
        # Ping at half the interval, as sd_watchdog_enabled(3) advises.
        self.watchdog_interval_s = int(usec) / 2e6 if watchdog else None
        self._sock = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields) -> None:
        if not self.enabled:
            return
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        text = "\n".join(f"{k.upper()}={v}" for k, v in fields.items())
        try:
            self._sock.sendto(text.encode(), self.address)
        except OSError:
            pass  # systemd gone or socket not ours: nothing useful to do about it

    def ready(self, status: str) -> None:
        self.send(ready=1, status=status, mainpid=os.getpid())

    def reloading(self) -> None:
        # systemd >= 253 wants MONOTONIC_USEC with RELOADING=1 (Type=notify-reload); older ones ignore it.
        self.send(reloading=1, monotonic_usec=int(time.monotonic() * 1e6))

    def watchdog(self) -> None:
        self.send(watchdog=1)

    def stopping(self) -> None:
        self.send(stopping=1)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
