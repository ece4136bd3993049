"""The host tier: model weights in POSIX shared memory (files on the /dev/shm tmpfs).

The daemon owns one directory per daemon instance, `<shm_dir>/modelcache.<uid>.<pid>/`,
and one subdirectory per resident model holding the skeleton and the weights blob.
Files are written by the daemon and are read-only for everyone else (mode 0640, so
members of the daemon's group may map them). Clients map them; an unlinked file
stays valid for the clients that still map it, so freeing never pulls memory from
under a running session — the kernel frees the pages when the last mapping goes.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from ..packing import SKELETON_FILE, WEIGHTS_FILE

log = logging.getLogger("modelcache.host")
PREFIX = "modelcache."


def _copy(src: Path, dst: Path) -> None:
    # copyfile uses sendfile(2) on Linux: kernel-to-kernel, no Python buffers.
    shutil.copyfile(src, dst)
    os.chmod(dst, 0o440)


class HostTier:
    def __init__(self, shm_dir: str | Path, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.root = Path(shm_dir) / f"{PREFIX}{os.getuid()}.{os.getpid()}"
        self.used_bytes = 0  # only the owner loop changes this (through reserve/free)

    def start(self) -> None:
        remove_stale(self.root.parent)
        self.root.mkdir(mode=0o750, exist_ok=False)

    def path_of(self, key: str) -> Path:
        return self.root / key

    def promote(self, model_dir: Path, key: str) -> tuple[Path, float]:
        """Copy a packed model from the disk tier into shared memory. Runs on a loader thread.

        Returns the directory and the seconds it took. Written under a temporary name and
        renamed, so a client never sees half a blob.
        """
        t0 = time.perf_counter()
        final = self.path_of(key)
        tmp = self.root / f".loading-{key}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o750)
        try:
            _copy(model_dir / WEIGHTS_FILE, tmp / WEIGHTS_FILE)
            _copy(model_dir / SKELETON_FILE, tmp / SKELETON_FILE)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final, time.perf_counter() - t0

    def free(self, key: str) -> None:
        shutil.rmtree(self.path_of(key), ignore_errors=True)

    def stop(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _pid_is_daemon(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"modelcache" in f.read()
    except OSError:
        return False


def remove_stale(shm_dir: Path) -> None:
    """Remove host tiers of this user's daemons that died without cleaning up (SIGKILL, crash)."""
    for d in Path(shm_dir).glob(f"{PREFIX}{os.getuid()}.*"):
        try:
            pid = int(d.name.rsplit(".", 1)[1])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_is_daemon(pid):
            log.info("removing stale host tier %s of dead daemon %d", d, pid)
            shutil.rmtree(d, ignore_errors=True)
