"""A host lease's files as descriptors: for clients that cannot open the paths (another container).

A host lease names the files a client maps: the host tier's skeleton and segments, or the repository's
skeleton and weights (an open answered from the files: disk_opens.py). A client in another mount
namespace (a pod beside the daemon's with only the socket's directory mounted) sees none of those paths.
A client on the lane asks for descriptors (Open.descriptors), and gets, with the reply (SCM_RIGHTS), the
version's portable skeleton (store/portable.py) and each segment, opened read-only here: it maps the
weights from those, wherever it runs. A version packed before portable skeletons gets none, and the
client falls back to the paths.

A descriptor must not give what the files' permissions do not. What entitles a client to a model's
weights is the host tier's permissions: its directory's group (the unit's), which every host lease's files
have. So the client must be one that could read the tier's directory with its own rights
(identity.check_may_read: its uid and groups, as the kernel recorded them at connect), whichever files
serve the lease: an open answered from the repository's files then needs no read access to the repository,
which a lease by path did.
"""

from __future__ import annotations

import os

from ..store.format import PORTABLE_SKELETON_FILE
from .identity import check_may_read


def wanted(ident, msg) -> bool:
    """Whether the open `msg` gets descriptors: it asked, and came over the lane (ZeroMQ carries none)."""
    return msg.descriptors and ident.carries_fds


def open_lease_files(ident, model, segments: list[str], tier_root) -> list[int]:
    """[portable skeleton, *segments] of a host lease (`segments`: the tier's, or the repository's weights), opened
    read-only, in the order OpenReply.ipc_fds declares; [] for a version without a portable skeleton.
    PermissionDenied where the client could not read the host tier (`tier_root`) itself. The caller owns them."""
    if PORTABLE_SKELETON_FILE not in model.manifest.files:
        return []
    check_may_read(ident, str(tier_root), f"{model.key}'s files")
    fds: list[int] = []
    try:
        for path in (str(model.disk_dir / PORTABLE_SKELETON_FILE), *segments):
            fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds
