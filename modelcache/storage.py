"""Storage failures said plainly: "no space left on device" with the path and the model, not a bare errno.

A full disk during `add`, a full /dev/shm during promotion, a read-only repository: each is
something an operator fixes, so the error names what was being written, where, and for which
model. ONNX Runtime loses the errno when it fails to write (it reports "Failed to write external
initializers to file"), so `explain_failed_write` asks the file system itself.
"""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from pathlib import Path

from .errors import StorageError

# The errnos an operator fixes by freeing space or remounting; others stay what they are.
_CAUSES = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
           errno.EROFS: "read-only file system"}


def storage_error(e: OSError, doing: str, where: str | Path) -> StorageError | None:
    """The StorageError that explains `e`, or None when `e` is not a storage failure."""
    cause = _CAUSES.get(e.errno)
    if cause is None:
        return None
    path = e.filename or where
    return StorageError(f"{cause}: {doing} failed writing {path} ({_free_space(path)})")


@contextmanager
def storage_errors(doing: str, where: str | Path):
    """Re-raise ENOSPC / EDQUOT / EROFS inside the block as a StorageError saying `doing` and where."""
    try:
        yield
    except OSError as e:
        raise (storage_error(e, doing, where) or e) from e


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
