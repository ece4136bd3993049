"""Warm restart: re-adopting the host tier a dead daemon left in shared memory.

A daemon that dies (SIGKILL, crash) or stops with `keep_host_tier` leaves its directory in
shm_dir: segments, skeletons and a `<key>.where.json` per resident model (tiers/host.py). The
next daemon on the same socket claims the directory by renaming it to its own name (a rename is
atomic: of two daemons only one gets it, and the socket's lock keeps a second daemon out anyway),
checks every tensor of every recorded model against the manifest the repository holds now, and
keeps the models that match. Everything else in it is deleted. The GPU tier is never adopted:
CUDA memory dies with its process, and a simulated GPU's files are cleared like it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..store import integrity
from ..store.format import Manifest
from .files import remove_quietly
from .host import WHERE_SUFFIX, HostTier, segment_number
from .host_plan import variant_tensors
from .stale import OWNER_FILE, dead_tiers, read_owner

log = logging.getLogger("modelcache.host")


def tensor_intact(view: memoryview, offset: int, nbytes: int, sha256: str, xxh3: str = "") -> bool:
    """The one check adoption makes of a resident tensor: its bytes against the manifest's hash, the
    fast one (integrity.py) where the version has it, else the sha256 every version carries."""
    if xxh3:
        return integrity.digest(view[offset:offset + nbytes]) == xxh3
    return hashlib.sha256(view[offset:offset + nbytes]).hexdigest() == sha256


@dataclass
class Adoption:
    """What a start found of a dead daemon's host tier."""
    source: str = ""                              # the directory it came from; "" when none was found
    adopted: list = field(default_factory=list)   # model keys now resident again
    rejected: dict = field(default_factory=dict)  # model key -> why it was not (its files are deleted)
    verified_bytes: int = 0
    seconds: float = 0.0


def adopt_host_tier(tier: HostTier, manifests: dict, variants_needed: dict) -> Adoption:
    """Claim this socket's dead host tier, if there is one, and restore into `tier` the models whose
    bytes match: manifests and variants_needed are by model key (what the repository holds now).
    Runs before tier.start(); the tier's tables must be empty.

    A warm restart only saves promotions: when the files will not let it happen (a claim or a write that
    fails), it is logged in one line and the daemon starts cold (tier.start clears what was claimed)."""
    t0 = time.perf_counter()
    found = Adoption()
    try:
        source = _claim(tier)
    except OSError as e:
        log.warning("warm restart: could not claim the old host tier (%s: %s); starting with an empty one",
                    e.filename, e.strerror)
        return found
    if source is None:
        return found
    found.source = str(source)
    try:
        _readopt(tier, manifests, variants_needed, found)
    except OSError as e:
        log.warning("warm restart: re-adopting %s failed (%s: %s); starting with an empty host tier", source,
                    e.filename, e.strerror)
        tier.forget_all()
        return Adoption(source=str(source))
    found.seconds = time.perf_counter() - t0
    for key, why in found.rejected.items():
        log.warning("warm restart: %s not re-adopted from the old host tier: %s", key, why)
    log.info("warm restart: re-adopted %d models (%.1f MiB checked in %.3f s) from %s", len(found.adopted),
             found.verified_bytes / 2**20, found.seconds, found.source)
    return found


def _readopt(tier: HostTier, manifests: dict, variants_needed: dict, found: Adoption) -> None:
    """The claimed tier's files: junk removed, each recorded model checked and restored or deleted."""
    root = tier.root
    for junk in [*root.glob("*.loading"), *root.glob("*.tmp"), *root.glob("fake-gpu-*")]:
        remove_quietly(junk)
    segment_bytes = {}
    for seg in root.glob("seg-*.bin"):
        segment_bytes[seg.name] = seg.stat().st_size
    views = _SegmentViews(root)
    try:
        for record in sorted(root.glob(f"*{WHERE_SUFFIX}")):
            key = record.name[:-len(WHERE_SUFFIX)]
            try:
                locations = _read_locations(record, key)
                why = _check_model(key, manifests.get(key), locations, variants_needed.get(key, ("cpu",)),
                                   segment_bytes, views, tier)
            except (OSError, ValueError, KeyError, TypeError) as e:
                why = f"unreadable record: {e}"
            if why is None:
                tier.restore(key, manifests[key], locations, segment_bytes)
                found.adopted.append(key)
            else:
                found.rejected[key] = why
                remove_quietly(record)
        found.verified_bytes = views.verified_bytes
    finally:
        views.close()
    _remove_unadopted(tier)
    tier.trim()
    tier.write_owner()


def _claim(tier: HostTier) -> Path | None:
    """Rename the newest dead tier of our socket to our own directory; None when there is none."""
    if not tier.owner:
        return None
    if tier.root.exists():   # before start it cannot be ours: a dead daemon that had our pid
        return tier.root if read_owner(tier.root) == tier.owner else None
    mine = [d for d, owner in dead_tiers(tier.root.parent) if owner == tier.owner]
    for d in sorted(mine, key=lambda d: d.stat().st_mtime, reverse=True):
        try:
            os.rename(d, tier.root)
            return d
        except FileNotFoundError:
            continue     # another daemon took it first
    return None


def _read_locations(record: Path, key: str) -> dict:
    data = json.loads(record.read_text())
    if data.get("key") != key or not isinstance(data.get("locations"), dict):
        raise ValueError(f"{record.name} does not describe {key}")
    return {variant: {name: (seg, int(off)) for name, (seg, off) in where.items()}
            for variant, where in data["locations"].items()}


def _check_model(key: str, manifest: Manifest | None, locations: dict, needed: tuple, segment_bytes: dict,
                 views: "_SegmentViews", tier: HostTier) -> str | None:
    """Why this model cannot be re-adopted, or None when every tensor is where it says, intact."""
    if manifest is None:
        return "no such model in the repository any more"
    for variant in needed:
        if variant not in locations:
            return f"its {variant} weights were not resident"
        if not tier.skeleton_path(key, variant).exists():
            return f"its {variant} skeleton is missing"
    for variant, where in locations.items():
        for t in variant_tensors(manifest, variant):
            if t.name not in where:
                return f"tensor {t.name} has no place (the manifest changed)"
            seg, offset = where[t.name]
            segment_number(seg)
            if seg not in segment_bytes or offset < 0 or offset + t.nbytes > segment_bytes[seg]:
                return f"tensor {t.name} lies outside segment {seg}"
            if not views.intact(seg, offset, t.nbytes, t.sha256, t.xxh3):
                return f"tensor {t.name} in {seg} does not match the manifest's checksum"
    return None


class _SegmentViews:
    """Each segment mapped once, each (segment, offset, hash) checked once: models share tensors."""

    def __init__(self, root: Path):
        self.root = root
        self.maps: dict = {}
        self.checked: dict = {}
        self.verified_bytes = 0

    def intact(self, seg: str, offset: int, nbytes: int, sha256: str, xxh3: str = "") -> bool:
        if (seg, offset, sha256) not in self.checked:
            if seg not in self.maps:
                with open(self.root / seg, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    self.maps[seg] = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) if size else b""
            self.checked[(seg, offset, sha256)] = tensor_intact(memoryview(self.maps[seg]), offset, nbytes, sha256,
                                                                xxh3)
            self.verified_bytes += nbytes
        return self.checked[(seg, offset, sha256)]

    def close(self) -> None:
        for m in self.maps.values():
            if isinstance(m, mmap.mmap):
                m.close()


def _remove_unadopted(tier: HostTier) -> None:
    """Delete every file no adopted model uses: other segments, other models' skeletons."""
    keep = {OWNER_FILE, *tier.segments}
    for key in tier.models:
        keep |= {tier.where_path(key).name, tier.skeleton_path(key).name, tier.skeleton_path(key, "gpu").name,
                 tier.skeleton_path(key, "gpu").with_suffix(".stub").name}
    for path in tier.root.iterdir():
        if path.name not in keep:
            remove_quietly(path)
