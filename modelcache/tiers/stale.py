"""The host tiers dead daemons left in shm_dir: whose each is (its `owner` file), which are dead, and
removing those that are ours to remove. A tier's directory is `<shm_dir>/modelcache.<uid>.<pid>/`
(host.py); tiers/adopt.py re-adopts one of them before these go.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .files import remove_quietly

log = logging.getLogger("modelcache.host")
PREFIX = "modelcache."
OWNER_FILE = "owner"


def read_owner(tier_dir: Path) -> str:
    """The socket named in a tier's `owner` file; "" when it has none, or one no daemon can have written
    (random bytes, an unreadable file: said once, naming the file)."""
    path = Path(tier_dir) / OWNER_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return ""
    except OSError as e:
        log.warning("the owner file %s cannot be read (%s): no daemon re-adopts that tier", path, e.strerror)
        return ""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or not text.isprintable():
        log.warning("the owner file %s holds %d bytes that name no socket: no daemon re-adopts that tier",
                    path, len(raw))
        return ""
    return text


def _pid_is_daemon(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"modelcache" in f.read()
    except OSError:
        return False


def dead_tiers(shm_dir: Path) -> list[tuple[Path, str]]:
    """(directory, owner socket) of each host tier of this user's daemons that died without cleaning up
    (SIGKILL, crash, or a stop that kept it: keep_host_tier); owner "" for tiers made before owners."""
    found = []
    for d in Path(shm_dir).glob(f"{PREFIX}{os.getuid()}.*"):
        try:
            pid = int(d.name.rsplit(".", 1)[1])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_is_daemon(pid):
            found.append((d, read_owner(d)))
    return found


def remove_stale(shm_dir: Path, owner: str) -> None:
    """Remove the dead host tiers that are ours to remove: our own socket's (what adoption did not take)
    and those with no owner. Another socket's stays for its own daemon to re-adopt when it restarts."""
    for d, their_owner in dead_tiers(shm_dir):
        if their_owner in ("", owner):
            log.info("removing stale host tier %s of a dead daemon", d)
            remove_quietly(d)
