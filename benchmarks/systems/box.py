"""A memory budget, enforced: one system's processes in a memory cgroup of the budget's size (and a cpuacct
cgroup beside it, for its CPU-seconds), with the cgroup's usage integrated over time.

Every process a system starts (its server, each function instance) enters the box through `command()`, a
shell that writes its own pid into both cgroups and then execs the program: nothing of the program runs
outside, and no `preexec_fn` runs in the replay's threaded parent. Page cache counts: a file's pages are
charged to the cgroup whose process first reads them, so `forget()` drops the models' files from the page
cache before a replay (else ORT's mmap would read pages the setup charged elsewhere).
"""

from __future__ import annotations

import os
import shlex
import threading
import time
from pathlib import Path

from modelcache import memlimit

CPUACCT = Path("/sys/fs/cgroup/cpuacct")


class Box:
    """`Box.make(name, budget)` or None (with `Box.why`) where no memory cgroup can be made."""

    why = ""

    def __init__(self, memory: memlimit.ChildCgroup, cpu: Path | None):
        self.memory, self.cpu = memory, cpu
        self.byte_s = 0.0           # usage integrated from start_sampling() to stop_sampling()
        self.peak = 0
        self._cpu0 = 0
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()

    @classmethod
    def make(cls, name: str, budget_bytes: int) -> "Box | None":
        memory = memlimit.ChildCgroup.make(name, budget_bytes)
        if memory is None:
            cls.why = memlimit.ChildCgroup.why
            return None
        cpu = CPUACCT / name
        try:
            cpu.mkdir()
        except OSError:
            cpu = None              # no cpuacct controller here: CPU-seconds are not reported
        return cls(memory, cpu)

    @property
    def budget(self) -> int:
        return self.memory.limit.limit_bytes

    def command(self, argv: list[str]) -> list[str]:
        """`argv`, run inside the box from its first instruction."""
        enter = f"echo $$ > {shlex.quote(str(self.memory.path / 'cgroup.procs'))}"
        if self.cpu is not None:
            enter += f" && echo $$ > {shlex.quote(str(self.cpu / 'cgroup.procs'))}"
        return ["/bin/sh", "-c", f"{enter} && exec {' '.join(shlex.quote(a) for a in argv)}"]

    def usage(self) -> int:
        """The cgroup's charge (anonymous memory, tmpfs and page cache): what its limit is enforced on."""
        return int((self.memory.path / "memory.usage_in_bytes").read_text())

    def working_set(self) -> int:
        return memlimit.working_set_bytes(self.memory.limit)

    def oom_kills(self) -> int:
        return self.memory.oom_kills()

    def cpu_seconds(self) -> float | None:
        if self.cpu is None:
            return None
        return (int((self.cpu / "cpuacct.usage").read_text()) - self._cpu0) / 1e9

    def start_sampling(self, interval_s: float = 0.1) -> None:
        """Integrate usage from now (left rectangles), and count CPU from now."""
        self.byte_s, self.peak = 0.0, 0
        self._cpu0 = int((self.cpu / "cpuacct.usage").read_text()) if self.cpu is not None else 0
        self._stop.clear()

        def sample():
            last, used = time.monotonic(), self.usage()
            while not self._stop.wait(interval_s):
                now, current = time.monotonic(), self.usage()
                self.byte_s += used * (now - last)
                self.peak = max(self.peak, current)
                last, used = now, current
        self._sampler = threading.Thread(target=sample, daemon=True)
        self._sampler.start()

    def stop_sampling(self) -> None:
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join()

    def remove(self) -> None:
        """Kill what is left inside and remove both cgroups."""
        self.stop_sampling()
        self.memory.remove()
        if self.cpu is not None:
            try:
                self.cpu.rmdir()
            except OSError:
                pass


def forget(paths) -> None:
    """Drop `paths`' pages from the page cache (clean pages: the models were written and synced), so that the
    box that reads them next is charged for them."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
