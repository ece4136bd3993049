"""Who is writing which version into the repository, so that concurrent writers never collide.

A pack (daemon or offline `modelcache add`) or a remote fetch writes a version into a temporary
directory `<root>/.tmp-<name>@<version>-<random>` and renames it into place when complete. The
temporary directory is the version's reservation: its writer holds an exclusive flock on a file
inside it for as long as it works, so

- a writer that dies (crash, SIGKILL) releases its lock with its last fd, and the next sweep
  removes its directory;
- a sweep (every `Repository.scan`) never removes the directory of a writer still at work;
- two writers never pick the same version: the choice of a version and the creation of its
  reservation happen under a short lock on `<root>/.lock`, looking at both the finished versions
  and the live reservations.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import PackError

REPOSITORY_LOCK = ".lock"   # held only while choosing a version or sweeping, never while packing
WRITER_LOCK = ".writer"     # inside a reservation, held by its writer until it finishes
TEMP_PREFIX = ".tmp-"


@dataclass
class Reservation:
    """A version being written: `tmp` is where to write it; `release` after renaming or removing it."""
    name: str
    version: int
    tmp: Path
    _fd: int

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # drops the flock
            self._fd = -1


class _RepositoryLock:
    """The short exclusive lock on `<root>/.lock`. `held` is False where it cannot be taken because
    the repository is read-only or not ours to write: then nobody can be writing into it either."""

    def __init__(self, root: Path):
        self.root = root
        self.fd = -1

    def __enter__(self) -> "_RepositoryLock":
        try:
            self.fd = os.open(self.root / REPOSITORY_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        except OSError as e:
            if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            return self
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    @property
    def held(self) -> bool:
        return self.fd >= 0

    def __exit__(self, *exc) -> None:
        if self.fd >= 0:
            os.close(self.fd)


def _writer_alive(tmp: Path) -> bool:
    """Whether some process still holds the reservation's writer lock."""
    try:
        fd = os.open(tmp / WRITER_LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False  # no lock file: a writer that died before creating it, or an older version's temp dir
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _sweep_dead(root: Path) -> list[Path]:
    """Remove the temp dirs of writers that died; returns the live ones. Call under the repository lock."""
    live = []
    for tmp in root.glob(TEMP_PREFIX + "*"):
        if _writer_alive(tmp):
            live.append(tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return live


def _reserved_version(tmp: Path, name: str) -> int | None:
    """The version a live temp dir reserves for `name`, from its `.tmp-<name>@<version>-` prefix."""
    head, sep, rest = tmp.name[len(TEMP_PREFIX):].partition("@")
    version = rest.partition("-")[0]
    return int(version) if sep and head == name and version.isdigit() else None


def finished_versions(root: Path, name: str) -> set[int]:
    model_dir = root / name
    if not model_dir.is_dir():
        return set()
    return {int(p.name) for p in model_dir.iterdir() if p.name.isdigit()}


def sweep(root: Path) -> None:
    """Remove half-written versions whose writer died; leave those still being written."""
    if not root.is_dir():
        return
    with _RepositoryLock(root) as lock:
        if lock.held:
            _sweep_dead(root)


def reserve(root: Path, name: str, version: int | None) -> Reservation:
    """Reserve `name@version` (the next free version when None) and return where to write it.

    Raises PackError when that version exists or another process is writing it."""
    root.mkdir(parents=True, exist_ok=True)
    with _RepositoryLock(root):
        live = _sweep_dead(root)
        being_written = {v for v in (_reserved_version(t, name) for t in live) if v is not None}
        finished = finished_versions(root, name)
        if version is None:
            version = max(finished | being_written, default=0) + 1
        elif version in finished:
            raise PackError(f"model {name} version {version} already exists")
        elif version in being_written:
            raise PackError(f"model {name} version {version} is being added by another process; "
                            "wait for it, or add without a version to get the next free one")
        tmp, fd = _locked_temp_dir(root, f"{TEMP_PREFIX}{name}@{version}-")
    return Reservation(name, version, tmp, fd)


def scratch(root: Path) -> Reservation:
    """A private working directory in the repository's file system (a client's model copied in to be
    packed): held like a reservation, so sweeps leave it alone while its writer lives. `abandon` it."""
    root.mkdir(parents=True, exist_ok=True)
    with _RepositoryLock(root):
        tmp, fd = _locked_temp_dir(root, f"{TEMP_PREFIX}scratch-")
    return Reservation("", 0, tmp, fd)


def _locked_temp_dir(root: Path, prefix: str) -> tuple[Path, int]:
    """A new temp dir with its writer lock held by us (the fd). Call under the repository lock."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    fd = os.open(tmp / WRITER_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return tmp, fd


def publish(reservation: Reservation, final: Path) -> None:
    """Make the reserved version visible: the writer lock file goes, then one rename, both under the
    repository lock so that no sweep sees the reservation without its lock file in between."""
    with _RepositoryLock(reservation.tmp.parent):
        (reservation.tmp / WRITER_LOCK).unlink()
        final.parent.mkdir(parents=True, exist_ok=True)
        os.rename(reservation.tmp, final)
    reservation.release()


def abandon(reservation: Reservation) -> None:
    shutil.rmtree(reservation.tmp, ignore_errors=True)
    reservation.release()
