"""File descriptors: the daemon's limit, the reserve it keeps, and when it stops taking connections.

Every client costs the daemon descriptors (two ZeroMQ connections and a lane each), and running
out must never reach libzmq: its ipc listener aborts the process on EMFILE (libzmq 4.3.5,
ipc_listener.cpp, accept(): EMFILE is not among the errors its errno_assert allows, unlike the
tcp listener's), and creating a socket aborts there too. So the daemon raises its soft limit to
the hard one at start, and when fewer than `reserve` descriptors are left it stops listening on
both sockets (the lane's listener leaves the poller; the ZeroMQ endpoint is unbound, so libzmq
accepts nothing) until twice the reserve is free again. Clients retry with backoff meanwhile.
"""

from __future__ import annotations

import logging
import os
import resource

log = logging.getLogger("modelcache.daemon")

RESERVE_FDS = 64     # headroom for loads, packers, ORT, and connections libzmq accepts before we look


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (only root may go past it); returns the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:
            log.warning("could not raise the file descriptor limit from %d to %d: %s", soft, hard, e)
    return soft


def open_fds() -> int:
    """Descriptors this process has open (less the one that reading the directory takes)."""
    return len(os.listdir("/proc/self/fd")) - 1


class FdBudget:
    """Whether the daemon may take more connections; hysteresis so it does not flap at the edge."""

    def __init__(self, limit: int, reserve: int = RESERVE_FDS, count=open_fds):
        self.limit = limit
        self.reserve = min(reserve, max(8, limit // 4))   # a tiny limit still leaves room to serve
        self.count = count
        self.paused = False

    def free(self) -> int:
        return self.limit - self.count()

    def check(self) -> bool:
        """Update and return `paused`: pause under the reserve, resume at twice it."""
        free = self.free()
        if not self.paused and free < self.reserve:
            self.paused = True
            log.warning("only %d file descriptors left of %d: not accepting connections until %d are free",
                        free, self.limit, 2 * self.reserve)
        elif self.paused and free >= 2 * self.reserve:
            self.paused = False
            log.info("%d file descriptors free again: accepting connections", free)
        return self.paused
