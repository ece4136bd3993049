"""Opens the host tier cannot take now, answered from the repository's files (`open_when_full = "disk"`).

An attach open whose model is not in the host tier, where the tier is full of models in use (it would wait
for room) or the memory limit is short (it would be refused), is answered at once with a lease over the
version's packed files in the repository instead: the client maps `weights.bin` read-only and ORT loads
the packed skeleton beside it, exactly as a host lease maps its segments (or, to a client that asks, the
same files as descriptors: lease_files.py). The weights then live in the
kernel's page cache, not in the tier: one copy for every client of the version, charged to the memory
limit as ORT's own memory-mapped models are, and clean pages the kernel takes back under pressure (and
reads again) instead of memory the tier must keep. That is what a FaaS platform's warm instances need
when they hold every model in the tier: a new function's open served now, at the speed of ORT's mmap,
rather than a wait of its whole deadline for a lease that may be held for hours.

A promotion checks every byte it copies against the checksums taken at add time, so a lease over the
files must not be the one path that skips the check: each version's files are checked once per daemon
(on a loader thread, one check however many opens wait on it) before its first such lease.
Pre-packed blobs are not used on this path (the client's prepacking is off), as with a model packed
without them.
"""

from __future__ import annotations

import logging
import weakref

from ..errors import IntegrityError
from ..store import integrity
from ..store.format import PORTABLE_SKELETON_FILE, SKELETON_FILE, WEIGHTS_FILE, Manifest

log = logging.getLogger("modelcache.daemon")


class DiskOpens:
    def __init__(self, *, loaders, counters: dict):
        self.loaders = loaders          # run(work, done): the check, on a loader thread
        self.counters = counters
        # The versions (their records: a version removed and added again is a new record) whose files passed
        # their checksums in this daemon's life.
        self.checked = weakref.WeakSet()
        self.checking: dict = {}        # model key -> callbacks waiting on its check in flight

    def when_checked(self, model, then) -> None:
        """Call then(error) once the version's files are known intact: at once if they were checked before."""
        if model in self.checked:
            then(None)
            return
        waiting = self.checking.get(model.key)
        if waiting is not None:
            waiting.append(then)
            return
        self.checking[model.key] = [then]

        def done(_result, error):
            if error is None:
                self.checked.add(model)
            elif isinstance(error, IntegrityError):
                self.counters["corrupt_detected"] = self.counters.get("corrupt_detected", 0) + 1
                model.mark_corrupt(str(error))
                log.error("%s", error)
            for wake in self.checking.pop(model.key, []):
                wake(error)

        self.loaders.run(lambda: check_files(model.key, model.disk_dir, model.manifest), done)

    @staticmethod
    def export(model) -> dict:
        """What a lease over the repository's files maps, as OpenReply's fields (tiers/host.py's export, over
        the packed version itself: its skeleton names weights.bin and the offsets the manifest lists)."""
        tensors = [[t.name, t.dtype, t.shape, 0, t.offset, t.nbytes] for t in model.manifest.tensors]
        return {"skeleton_path": str(model.disk_dir / SKELETON_FILE),
                "segments": [str(model.disk_dir / WEIGHTS_FILE)] if tensors else [], "tensors": tensors,
                "prepacked": []}


def check_files(key: str, model_dir, manifest: Manifest) -> None:
    """IntegrityError unless the files a client of the version maps match what add recorded (a version from
    before file checksums: its weights' size)."""
    records = manifest.files
    if WEIGHTS_FILE not in records:
        integrity.check_size(key, model_dir / WEIGHTS_FILE, manifest.weights_bytes)
        return
    for fname in (WEIGHTS_FILE, SKELETON_FILE, PORTABLE_SKELETON_FILE):   # (the last: to a client that asks)
        if fname in records:
            integrity.check_file(key, model_dir, fname, records[fname])
