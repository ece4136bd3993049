"""Storage failures said plainly, and the few ways of writing that survive them.

A full disk during `add`, a full /dev/shm during promotion, a read-only repository, a disk that answers
EIO: each is something an operator fixes, so the error names what was being done, where, and for which
model, as one StorageError line, never a bare errno or an "internal error". ONNX Runtime loses the errno
when it fails to write (it reports "Failed to write external initializers to file"), so
`explain_failed_write` asks the file system itself.

The ways of writing: `write_atomic` (a reader sees the old file or the new one, and a failure leaves no
temp file), `remove_tree` (a removal that fails once is tried again before anyone is told), and
`StateFile` (a state file the daemon keeps in memory: a save that fails is logged once and tried again
at the next save, never fatal).
"""

from __future__ import annotations

import errno
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from .errors import ModelCacheError, StorageError

# logging and shutil are imported where they are used: a client's cold start imports this module (through
# wire.tensors), and the two cost it ~10 ms of a fresh process's imports (-X importtime), where a client needs
# neither.

# The errnos an operator fixes by freeing space or remounting: said with the free space left.
_CAUSES = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
           errno.EROFS: "read-only file system", errno.EFBIG: "file too large"}


def storage_error(e: OSError, doing: str, where: str | Path) -> StorageError | None:
    """The StorageError that explains `e` (any failure the kernel gave an errno: ENOSPC, EIO, EACCES...),
    or None for an OSError with none (raised by our own code with its own message)."""
    if isinstance(e, ModelCacheError) or e.errno is None:
        return None
    at = str(e.filename or where)
    path = at if os.path.isabs(at) else f"{at} under {where}"   # (relative to a descriptor: shutil.rmtree's)
    cause = _CAUSES.get(e.errno)
    if cause is not None:
        return StorageError(f"{cause}: {doing} failed writing {path} ({_free_space(at if at == path else where)})")
    name = errno.errorcode.get(e.errno, str(e.errno))
    return StorageError(f"{os.strerror(e.errno).lower()} ({name}): {doing} failed at {path}")


@contextmanager
def storage_errors(doing: str, where: str | Path):
    """Re-raise a failed system call inside the block as a StorageError saying `doing` and where; a
    StorageError raised inside (by a lower layer, which knows the file but not the model) says `doing` too."""
    try:
        yield
    except StorageError as e:
        if doing in str(e):
            raise
        raise StorageError(f"{doing}: {e}") from e
    except OSError as e:
        error = storage_error(e, doing, where)
        if error is None:
            raise
        raise error from e


def write_atomic(path: Path, data: str | bytes, mode: int | None = None, durable: bool = False) -> None:
    """Replace `path` whole: written beside it, then renamed over it, so a reader sees the old file or the
    new one. A failure removes the temp file and raises the OSError. `durable`: fsync before the rename
    (a manifest in the repository; a crash must not leave it empty)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _unlink_quietly(path: Path) -> None:
    for _ in range(2):   # (a removal that failed once is tried again: see remove_tree)
        try:
            os.unlink(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            continue


def remove_tree(path: str | Path) -> OSError | None:
    """Remove a directory tree (or a file), trying once more what failed the first time (a transient EIO,
    a file another process was creating in it). Returns the error that kept something there, or None."""
    import shutil
    path = Path(path)
    error = None
    for _ in range(2):
        failures: list = []
        if path.is_dir() and not path.is_symlink():
            if sys.version_info >= (3, 12):   # (onerror is deprecated there)
                shutil.rmtree(path, onexc=lambda *a: failures.append(a[2]))
            else:
                shutil.rmtree(path, onerror=lambda *a: failures.append(a[2][1]))
        else:
            try:
                path.unlink(missing_ok=True)
            except OSError as e:
                failures.append(e)
        error = next((e for e in failures if not isinstance(e, FileNotFoundError)), None)
        if error is None or not os.path.lexists(path):
            return None
    return error


class StateFile:
    """A file of the daemon's state directory that it rewrites whole from what it holds in memory (the
    performance models). A save that fails (a full disk) is logged once, as one line naming the file; the
    daemon goes on with what it has in memory, and the next save tries again (and says when one works)."""

    def __init__(self, path: str | Path, what: str):
        self.path = Path(path)
        self.what = what
        self.failing = False

    def save(self, data: str | bytes) -> bool:
        import logging
        log = logging.getLogger("modelcache.storage")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, data)
        except OSError as e:
            if not self.failing:
                error = storage_error(e, f"saving {self.what}", self.path) or e
                log.warning("%s; kept in memory, saved again later", error)
            self.failing = True
            return False
        if self.failing:
            log.info("%s saved again to %s", self.what, self.path)
        self.failing = False
        return True


def explain_failed_write(where: str | Path, doing: str, needed_bytes: int) -> StorageError | None:
    """After a library failed to write under `where` without saying why: the storage cause, if the file
    system shows one (read-only, or less free space than the write needed)."""
    try:
        st = os.statvfs(where)
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return StorageError(f"read-only file system: {doing} failed writing under {where}")
    if st.f_bavail * st.f_frsize < needed_bytes:
        return StorageError(f"no space left on device: {doing} failed writing under {where} "
                            f"({_free_space(where)}, about {needed_bytes >> 20} MiB needed)")
    return None


def _free_space(path: str | Path) -> str:
    """'N MiB free of M MiB' on the file system holding `path` (or its nearest existing parent)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return "free space unknown"
    return f"{st.f_bavail * st.f_frsize >> 20} MiB free of {st.f_blocks * st.f_frsize >> 20} MiB"
