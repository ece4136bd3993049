"""What a starting daemon takes over from a dead one on the same socket: one daemon per socket (a lock
file held for the daemon's life), and the host tier the dead one left (tiers/adopt.py does the files;
here its models become RESIDENT again in the registry and the eviction policy)."""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from ..errors import ModelCacheError
from ..storage import remove_tree
from ..tiers.adopt import Adoption, adopt_host_tier

log = logging.getLogger("modelcache.daemon")


class SocketLock:
    """An exclusive flock on `<socket path>.lock`, held while the daemon lives: the kernel drops it when
    the process dies however it dies, so a crashed daemon never blocks the next, and two daemons can
    never both start on one socket (or both re-adopt one host tier)."""

    def __init__(self, socket_path: Path):
        self.path = Path(f"{socket_path}.lock")
        self.fd: int | None = None

    def acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise ModelCacheError(f"another modelcache daemon is already serving this socket "
                                      f"(it holds {self.path})") from None
            # A stopping daemon unlinks the file after we opened it: then our lock guards nothing; retry.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return
            os.close(fd)

    def release(self) -> None:
        if self.fd is not None:
            error = remove_tree(self.path)   # while still held: a newcomer then locks a fresh file
            if error is not None:   # (left: the next daemon locks it as it is, the kernel having dropped ours)
                log.warning("could not remove the lock file %s: %s", self.path, error)
            os.close(self.fd)
            self.fd = None


def adopt_resident_models(host) -> Adoption:
    """Re-adopt the dead daemon's host tier into `host` (the host tier's Residency, before its tier starts);
    its models become resident in settle_adopted."""
    manifests = {key: m.manifest for key, m in _by_key(host).items()}
    return adopt_host_tier(host.tier, manifests, {})


def settle_adopted(host, found: Adoption) -> None:
    """After the GPU tiers start (the host tier first: they live in its directory): mark the adopted models
    resident, or free those that lack the GPU variant this daemon's promotions copy."""
    models = _by_key(host)
    for key in found.adopted:
        rejected = host.adopt(models[key])
        if rejected:
            found.rejected[key] = rejected
            log.info("warm restart: %s re-promotes: %s", key, rejected)
    found.adopted = [k for k in found.adopted if k not in found.rejected]


def _by_key(host) -> dict:
    return {m.key: m for m in host.registry.models.values()}
