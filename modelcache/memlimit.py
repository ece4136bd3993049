"""The memory this process may use: the machine's RAM or its memory cgroup's limit, whichever is smaller,
and how much of that is in use now.

A cache in /dev/shm holds tmpfs pages the kernel cannot reclaim (no swap): inside a memory limit
(systemd's MemoryMax=, a container, a pod) the limit, not the machine's RAM, is what the host tier must
fit, with room left for the daemon, its fronts and its clients. The limit that binds is the smallest
along the process's cgroup and its ancestors: cgroup v1 `memory.limit_in_bytes`, cgroup v2 `memory.max`
and `memory.high` (above `high` the kernel throttles and reclaims hard: for a cache it is the limit).

What counts against it is that cgroup's usage less its file pages (the page cache, active and inactive),
which the kernel reclaims before it kills anyone; tmpfs pages are not among them (they sit on the anon
lists). Kubelet's working set keeps the active file pages, but a promotion's source file is read right
after `add` wrote it, which makes its pages active: counted, they took 188 MiB of headroom for a 64 MiB
model. The machine's MemAvailable bounds it too.
Reading both costs tens of microseconds (benchmarks/memlimit/reaction.txt), so the daemon polls them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

UNLIMITED = 1 << 62        # cgroup v1 writes "no limit" as a page-rounded 2^63-1


@dataclass(frozen=True)
class MemoryLimit:
    limit_bytes: int              # the smaller of RAM and every cgroup limit above this process
    source: str                   # for messages: "RAM" or "cgroup v1 memory.limit_in_bytes of <dir>"
    cgroup: Path | None = None    # the cgroup whose limit binds (its usage counts against it); None: RAM
    version: int = 0              # that cgroup's version: 1 or 2; 0 when RAM binds


def ram_bytes() -> int:
    # sysconf, not psutil: settings are validated in every client, which should not import psutil
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def read_limit(proc: str | Path = "/proc/self") -> MemoryLimit:
    """This process's memory limit, found from `proc`/cgroup and `proc`/mountinfo (v1 and v2, hybrid too);
    RAM when no cgroup limits it or none can be read."""
    ram = ram_bytes()
    best = MemoryLimit(ram, "RAM")
    for version, directory, top in _memory_cgroups(Path(proc)):
        for path in _up_to(directory, top):
            for name in (("memory.limit_in_bytes",) if version == 1 else ("memory.max", "memory.high")):
                value = _read_int(path / name)
                if value is not None and value < best.limit_bytes:
                    best = MemoryLimit(value, f"cgroup v{version} {name} of {path}", path, version)
    return best


def working_set_bytes(limit: MemoryLimit) -> int:
    """What counts against `limit` now: the binding cgroup's usage less its page cache, or, when RAM binds,
    RAM less MemAvailable."""
    if limit.cgroup is None:
        return max(0, ram_bytes() - available_bytes())
    usage_file, prefix = ("memory.usage_in_bytes", "total_") if limit.version == 1 else ("memory.current", "")
    usage = _read_int(limit.cgroup / usage_file) or 0
    stat = _stats(limit.cgroup / "memory.stat", (f"{prefix}active_file", f"{prefix}inactive_file"))
    return max(0, usage - sum(stat.values()))


def headroom_bytes(limit: MemoryLimit) -> int:
    """How much more may be allocated before the limit (or the machine) runs out: may be negative."""
    if limit.cgroup is None:
        return available_bytes() - (ram_bytes() - limit.limit_bytes)
    return min(limit.limit_bytes - working_set_bytes(limit), available_bytes())


def available_bytes() -> int:
    """The machine's MemAvailable: what can be allocated without swapping, page cache reclaimed."""
    return _stat("/proc/meminfo", "MemAvailable:") * 1024


def release_freed_heap() -> None:
    """Give the heap that freed C allocations left resident back to the OS (glibc's malloc_trim(0), every arena).
    glibc keeps freed memory for reuse: its dynamic mmap threshold rises to the size of the large blocks freed,
    so later large blocks (ORT's packings, a session's arena) land in the heap, and a thread's arena returns
    only its top. Measured: +16 MiB anonymous memory after a client's two 16 MiB packings, and for ViT-B/16
    ~310 MiB made resident again in about one session in four (client/session.py); in the daemon, whose
    workers trim after dropping a model's stage sessions (executor/workers.py), 159 MiB against 68 after
    serving 15 models twice through a 512 MiB tier (benchmarks/memlimit/heap.txt). Costs 0.5-90 ms, the most
    when there is most to give back. Nothing to do off glibc."""
    try:
        import ctypes
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


# -- reading /proc and the cgroup files ------------------------------------------------------------
def _memory_cgroups(proc: Path):
    """(version, this process's memory cgroup directory, its mount point) for each hierarchy that has one."""
    try:
        lines = (proc / "cgroup").read_text().splitlines()
        mounts = (proc / "mountinfo").read_text().splitlines()
    except OSError:
        return
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        version = 2 if hierarchy == "0" and controllers == "" else 1 if "memory" in controllers.split(",") else 0
        if not version:
            continue
        for mount in mounts:
            # mountinfo: id parent major:minor root mountpoint options... - fstype source superoptions
            fields, _, tail = mount.partition(" - ")
            fields, tail = fields.split(), tail.split()
            if len(fields) < 5 or len(tail) < 3:
                continue
            fstype, super_options = tail[0], tail[2].split(",")
            if (version == 2 and fstype == "cgroup2") or (version == 1 and fstype == "cgroup"
                                                           and "memory" in super_options):
                root, point = fields[3], Path(fields[4])
                relative = path[len(root):] if path.startswith(root) and root != "/" else path
                directory = point / relative.lstrip("/")
                if directory.is_dir():
                    yield version, directory, point
                elif point.is_dir():     # a namespaced view: the mount's root is this cgroup
                    yield version, point, point
                break


def _up_to(directory: Path, top: Path):
    """`directory`, then each parent up to and including `top`."""
    path = directory
    while True:
        yield path
        if path == top or path.parent == path:
            return
        path = path.parent


def _read_int(path: Path) -> int | None:
    """A limit file's value; None for "max", an unlimited v1 value, or a file that is not there."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():
        return None
    value = int(text)
    return value if value < UNLIMITED else None


def _stat(path: str | Path, key: str) -> int:
    """One `key value` line of memory.stat or /proc/meminfo; 0 when absent."""
    return _stats(path, (key,))[key]


def _stats(path: str | Path, keys) -> dict:
    """`key value` lines of memory.stat or /proc/meminfo, by key; 0 for those absent."""
    found = dict.fromkeys(keys, 0)
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(" ")
                if key in found:
                    found[key] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return found


class ChildCgroup:
    """A memory cgroup of its own below this process's, with a limit: how tests and benchmarks run the daemon
    and its neighbours inside a memory limit, as systemd's MemoryMax= or a container would (root, or a
    delegated cgroup). `ChildCgroup.make(name, limit)` returns None, with `why`, where none can be made."""

    why = ""

    def __init__(self, path: Path, version: int):
        self.path, self.version = path, version

    @classmethod
    def make(cls, name: str, limit_bytes: int, proc: str | Path = "/proc/self"):
        found = next(iter(_memory_cgroups(Path(proc))), None)
        if found is None:
            cls.why = "no memory cgroup controller is mounted"
            return None
        version, directory, _ = found
        path = directory / name
        try:
            path.mkdir()
            (path / ("memory.limit_in_bytes" if version == 1 else "memory.max")).write_text(str(limit_bytes))
        except OSError as e:
            cls.why = f"cannot make a memory cgroup under {directory}: {e.strerror}"
            if path.is_dir():
                path.rmdir()
            return None
        return cls(path, version)

    def enter(self, pid: int | None = None) -> None:
        """Move a process (default: this one, e.g. as a subprocess's preexec_fn) into the cgroup."""
        (self.path / "cgroup.procs").write_text(str(pid or os.getpid()))

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def oom_kills(self) -> int:
        """Processes the OOM killer has killed in this cgroup."""
        return _stat(self.path / ("memory.oom_control" if self.version == 1 else "memory.events"), "oom_kill")

    @property
    def limit(self) -> MemoryLimit:
        name = "memory.limit_in_bytes" if self.version == 1 else "memory.max"
        return MemoryLimit(_read_int(self.path / name) or 0, f"cgroup v{self.version} {name} of {self.path}",
                           self.path, self.version)

    def grow(self, nbytes: int, rate_bytes_s: float):
        """A process in the cgroup that grows by `nbytes` at a steady rate, touching every page, then holds it:
        a neighbour of the daemon. It prints "held SECONDS" once all of it is resident and keeps it until its
        stdin closes; the OOM killer ends it with SIGKILL where nothing gives memory back."""
        import subprocess
        import sys
        return subprocess.Popen([sys.executable, "-c", _GROWER, str(nbytes), str(rate_bytes_s)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, preexec_fn=self.enter)

    def remove(self) -> None:
        """Kill what is still inside, then remove the cgroup (its charged tmpfs pages move to the parent)."""
        import signal
        import time
        for _ in range(50):
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        try:
            self.path.rmdir()
        except OSError:
            pass


_GROWER = """
import sys, time
total, rate = int(sys.argv[1]), float(sys.argv[2])
held, step, t0 = [], 4 << 20, time.monotonic()
while len(held) * step < total:
    chunk = bytearray(step)
    chunk[::4096] = b"\\1" * (step // 4096)
    held.append(chunk)
    ahead = len(held) * step / rate - (time.monotonic() - t0)
    if ahead > 0:
        time.sleep(ahead)
print("held", round(time.monotonic() - t0, 2), flush=True)
sys.stdin.read()
"""
