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

Whoever takes `<root>/.lock` writes its pid and the time into it, so that one who waits for it can say
who holds it, and since when (the kernel's /proc/locks says the pid; the file says since when).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import PackError, StorageError
from ..storage import remove_tree, storage_error

log = logging.getLogger("modelcache.repository")

REPOSITORY_LOCK = ".lock"   # held only while choosing a version or sweeping, never while packing
WRITER_LOCK = ".writer"     # inside a reservation, held by its writer until it finishes
TEMP_PREFIX = ".tmp-"
# A version packed to replace one already there waits beside it as <root>/<name>/.staged-<version> until the daemon
# swaps it in (tiers/disk.py Repository.replace); no listing takes it for a version (format.version_dirs).
STAGED_PREFIX = ".staged-"
# Another process's hold on the repository lock is short (it picks a version, or renames one into place):
# one that lasts longer is waited for this long, saying who holds it every LOCK_SAY_EVERY_S, then refused.
LOCK_WAIT_S = 60.0
LOCK_SAY_EVERY_S = 5.0


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
    the repository is read-only or not ours to write: then nobody can be writing into it either.
    Waits up to LOCK_WAIT_S for another process's hold, logging who holds it (then StorageError)."""

    def __init__(self, root: Path):
        self.root = root
        self.fd = -1

    def __enter__(self) -> "_RepositoryLock":
        path = self.root / REPOSITORY_LOCK
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        except OSError as e:
            if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise storage_error(e, "locking the repository", path) from None
            return self
        try:
            _wait_for(self.fd, path)
        except BaseException:
            os.close(self.fd)
            self.fd = -1
            raise
        try:   # who holds it, since when: for whoever waits meanwhile (a failure only costs them that line)
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"pid {os.getpid()} since {time.time():.0f}\n".encode(), 0)
        except OSError:
            pass
        return self

    @property
    def held(self) -> bool:
        return self.fd >= 0

    def __exit__(self, *exc) -> None:
        if self.fd >= 0:
            os.close(self.fd)


def _wait_for(fd: int, path: Path) -> None:
    """Take the flock on `fd`; while another process holds it, say who, at once and every LOCK_SAY_EVERY_S."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    began = time.monotonic()
    said, waited_since = began, time.time()
    log.warning("waiting for the repository lock %s, %s (waiting up to %.0f s)", path, _holder(fd, path, waited_since),
                LOCK_WAIT_S)
    while True:
        time.sleep(0.05)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            log.info("got the repository lock %s after %.1f s", path, time.monotonic() - began)
            return
        except BlockingIOError:
            pass
        now = time.monotonic()
        if now - began >= LOCK_WAIT_S:
            raise StorageError(f"the repository lock {path} is still {_holder(fd, path, waited_since)}, after "
                               f"{LOCK_WAIT_S:.0f} s: stop that process, or try again once it is done")
        if now - said >= LOCK_SAY_EVERY_S:
            said = now
            log.warning("still waiting for the repository lock %s (%.0f s), %s", path, now - began,
                        _holder(fd, path, waited_since))


def _holder(fd: int, path: Path, waited_since: float) -> str:
    """'held by pid N (its command) since HH:MM:SS', from /proc/locks and what the holder wrote in the file."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pid = None
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode:
                    pid = int(fields[4])
                    break
    except (OSError, ValueError):
        pass
    if pid is None:
        return "held by another process"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read(200).replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        command = ""
    try:
        said = os.pread(fd, 100, 0).decode(errors="replace").split()
        since = float(said[3]) if said[:3] == ["pid", str(pid), "since"] else None
    except (OSError, ValueError, IndexError):
        since = None
    when = time.strftime("%H:%M:%S", time.localtime(since)) if since is not None else \
        f"before {time.strftime('%H:%M:%S', time.localtime(waited_since))}"
    return f"held by pid {pid}" + (f" ({command[:80]})" if command else "") + f" since {when}"


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
            remove_tree(tmp)   # (what stays is tried again at the next sweep)
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
    """Remove half-written versions whose writer died; leave those still being written. Only tidying: where
    the lock cannot be had (held too long, a disk error), it says so and leaves them for the next sweep."""
    if not root.is_dir():
        return
    try:
        with _RepositoryLock(root) as lock:
            if lock.held:
                _sweep_dead(root)
    except StorageError as e:
        log.warning("not sweeping half-written versions now: %s", e)


def staged_path(root: Path, name: str, version: int) -> Path:
    """Where a pack that replaces `name@version` publishes (STAGED_PREFIX)."""
    return Path(root) / name / f"{STAGED_PREFIX}{version}"


def reserve(root: Path, name: str, version: int | None, replacing: bool = False) -> Reservation:
    """Reserve `name@version` (the next free version when None) and return where to write it.

    Raises PackError when that version exists (unless `replacing` it: then it is published beside it, staged_path)
    or another process is writing it."""
    root.mkdir(parents=True, exist_ok=True)
    with _RepositoryLock(root):
        live = _sweep_dead(root)
        being_written = {v for v in (_reserved_version(t, name) for t in live) if v is not None}
        finished = finished_versions(root, name)
        if version is None:
            version = max(finished | being_written, default=0) + 1
        elif version in finished and not replacing:
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
    try:
        fd = os.open(tmp / WRITER_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except BaseException:
        remove_tree(tmp)
        raise
    fcntl.flock(fd, fcntl.LOCK_EX)
    return tmp, fd


def publish(reservation: Reservation, final: Path) -> None:
    """Make the reserved version visible: the writer lock file goes, then one rename, both under the
    repository lock so that no sweep sees the reservation without its lock file in between. On a failure
    the version is not visible, and the caller abandons the reservation."""
    with _RepositoryLock(reservation.tmp.parent):
        (reservation.tmp / WRITER_LOCK).unlink()
        made_parent = not final.parent.exists()
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(reservation.tmp, final)
        except BaseException:
            if made_parent:   # (a first version's name directory goes with it)
                try:
                    final.parent.rmdir()
                except OSError:
                    pass
            raise
    reservation.release()


def abandon(reservation: Reservation) -> None:
    """Remove a reservation's directory and let go of it (what a failure leaves, the next sweep removes)."""
    error = remove_tree(reservation.tmp)
    reservation.release()
    if error is not None:
        log.warning("could not remove %s (%s); the next sweep of the repository will", reservation.tmp, error)
