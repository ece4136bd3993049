"""Who sent a request, as the kernel says (never as the message says), and what that caller may do.

On an ipc:// socket the kernel records the peer's uid, gid and pid at connect (SO_PEERCRED).
The lane reads them once per connection; libzmq (4.3.5) hands them out per message as the
"Peer-Address" property, `localhost:UID:GID:PID`. A tcp:// peer has no credentials: it is
anonymous (uid None) and may not remove, pin, evict, load or see other clients.

A client id is bound to the kernel's (uid, pid) of the process that said hello, not to one
connection: a client's heartbeat thread and its serve lane are connections of their own.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import socket
import struct
from pathlib import Path

from ..errors import PermissionDenied

_UCRED = struct.Struct("3i")      # struct ucred: pid, uid, gid
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)   # Linux 4.13; Python's socket module does not name it


class Peer:
    """A ZeroMQ request's sender: where its reply goes (the routing id) and who it is.
    The lane's connections (daemon/lane_server.py) carry the same uid, gid and pid attributes, and `carries_fds`:
    whether a reply to this requester can pass file descriptors (a GPU lease under read-only sharing).
    Only a lane connection, a Unix stream socket, can; a ZeroMQ peer cannot."""

    carries_fds = False

    __slots__ = ("routing_id", "uid", "gid", "pid")

    def __init__(self, routing_id: bytes, creds: tuple | None):
        self.routing_id = routing_id
        self.uid, self.gid, self.pid = creds if creds is not None else (None, None, 0)


_parsed: dict[str, tuple | None] = {}   # Peer-Address text -> credentials: parsed once per process


def credentials_from_peer_address(address: str | None) -> tuple | None:
    """'localhost:UID:GID:PID' -> (uid, gid, pid); None for anything else (a tcp:// peer's IP)."""
    creds = _parsed.get(address, False)
    if creds is False:
        creds = None
        parts = (address or "").rsplit(":", 3)
        if len(parts) == 4 and all(p.isdigit() for p in parts[1:]):
            creds = (int(parts[1]), int(parts[2]), int(parts[3]))
        if len(_parsed) > 4096:   # one entry per client process; a long-lived daemon sees many
            _parsed.clear()
        _parsed[address] = creds
    return creds


def socket_credentials(sock: socket.socket) -> tuple:
    """(uid, gid, pid) of a connected Unix socket's peer, from the kernel."""
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return uid, gid, pid


def socket_groups(sock: socket.socket) -> tuple:
    """The supplementary groups of a connected Unix socket's peer, as the kernel recorded them at connect."""
    size = 64 * 4
    while True:
        try:
            data = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, size)
            return struct.unpack(f"{len(data) // 4}I", data[:len(data) - len(data) % 4])
        except OSError as e:   # ERANGE: more groups than fit
            if e.errno != errno.ERANGE or size >= 65536 * 4:
                raise
            size *= 16


def may_read(path: str, uid: int, gids) -> bool:
    """Whether a process of `uid` in groups `gids` may open `path` for reading, by the permission bits of the file
    and of each directory on the way (as the kernel decides, less ACLs and capabilities other than root's)."""
    if uid == 0:
        return True
    target = Path(os.path.realpath(path))
    try:
        return all(_allows(os.stat(d), uid, gids, 0o1) for d in reversed(target.parents)) and \
            _allows(os.stat(target), uid, gids, 0o4)
    except OSError:
        return False


def _allows(st: os.stat_result, uid: int, gids, bit: int) -> bool:
    if st.st_uid == uid:            # the owner's bits decide for the owner, even where the group's would allow
        return bool(st.st_mode & (bit << 6))
    if st.st_gid in gids:
        return bool(st.st_mode & (bit << 3))
    return bool(st.st_mode & bit)


def check_may_read(peer, path: str, what: str) -> None:
    """Raise PermissionDenied unless `peer` (a lane connection: the kernel's uid, gid and groups) could read `path`
    itself: before the daemon hands it a descriptor of `what`, which would bypass that file's permissions."""
    sock = getattr(peer, "sock", None)
    if peer.uid is None or sock is None:
        raise PermissionDenied(f"permission denied: {what} is handed out only over the lane, to a client the kernel "
                               "names (its connection has closed, or it has no credentials)")
    if not may_read(path, peer.uid, {peer.gid, *socket_groups(sock)}):
        raise PermissionDenied(f"permission denied: uid {peer.uid} may not read {path} with its own rights, so it is "
                               f"not handed {what} either")


def _group_id(group: str) -> int:
    from ..config import ConfigError
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"admin_group {group!r}: no such group") from None


class Admins:
    """Who may act on any model and see every client: root, the daemon's own user, and `admin_group`."""

    def __init__(self, admin_group: str = "", daemon_uid: int | None = None):
        self.uids = {0, os.geteuid() if daemon_uid is None else daemon_uid}
        self.gid = _group_id(admin_group) if admin_group else None

    def is_admin(self, peer) -> bool:
        if peer.uid is None:
            return False
        if peer.uid in self.uids:
            return True
        if self.gid is None:
            return False
        if peer.gid == self.gid:
            return True
        try:  # supplementary members, as the group database lists them
            return pwd.getpwuid(peer.uid).pw_name in grp.getgrgid(self.gid).gr_mem
        except KeyError:
            return False

    def check_model_owner(self, peer, model, action: str) -> None:
        """Raise PermissionDenied unless `peer` added `model` or is an admin."""
        self.check_owner(peer, model.key, getattr(model.manifest, "owner_uid", -1), action)

    def check_owner(self, peer, key: str, owner: int, action: str) -> None:
        """Raise PermissionDenied unless `peer` is uid `owner` (-1: unrecorded) or an admin; `key` names what."""
        if self.is_admin(peer):
            return
        if peer.uid is not None and peer.uid == owner:
            return
        who = "a tcp:// client (no credentials)" if peer.uid is None else f"uid {peer.uid}"
        added_by = f"uid {owner}" if owner >= 0 else "an unrecorded user (packed before owners were kept)"
        raise PermissionDenied(f"permission denied: {who} may not {action} model {key}: it was added by "
                               f"{added_by}; only its owner and admins (root, the daemon's user, admin_group) may")


def check_client_owner(peer, client) -> None:
    """Raise PermissionDenied unless `peer` is the process that said hello as `client`."""
    if client.uid is None:      # a tcp:// client: its id is all there is to go by
        return
    if (peer.uid, peer.pid) != (client.uid, client.pid):
        raise PermissionDenied(f"permission denied: client id {client.client_id!r} belongs to another process; "
                               "a client acts only on its own leases")
