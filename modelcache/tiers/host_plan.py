"""A host promotion's plan, and the loader thread's half of it: copying the plan's new tensors (and
pre-packed blobs) from the version's files into its new segment, each checked as it is copied, then
writing the model's skeletons and, last, its where-record (what a restarted daemon re-adopts).

The owner loop makes the plan (HostTier.plan_from) and alone touches the tier's tables; this only does
the I/O of one plan, reading the tier's paths.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from .files import copy_hashed, copy_range
from .skeletons import write_gpu_skeleton, write_skeleton
from ..store import integrity
from ..store.format import GPU_SKELETON_FILE, PREPACKED_FILE, SKELETON_FILE, WEIGHTS_FILE, Manifest
from ..storage import write_atomic

log = logging.getLogger("modelcache.host")


def variant_tensors(manifest: Manifest, variant: str) -> list:
    """The tensors of one variant of a packed model: "cpu" or "gpu"."""
    return manifest.gpu_tensors if variant == "gpu" else manifest.tensors


@dataclass
class Plan:
    """How one model becomes resident: which tensors it reuses and which it copies into a new segment."""
    key: str
    disk_dir: Path
    manifest: Manifest
    locations: dict                 # variant -> tensor name -> (segment name, offset)
    copies: list                    # (disk offset, segment offset, nbytes, sha256) for the new segment
    segment: str | None             # the new segment's name, None when every tensor is already resident
    segment_bytes: int
    # Pre-packed MatMul blobs (prepack.py), each in its weight's segment (ORT maps a blob from its weight's file):
    blob_copies: list = field(default_factory=list)   # (PREPACKED_FILE offset, segment offset, nbytes, xxh3, tensor)
    prepacked: dict = field(default_factory=dict)     # tensor name -> [[key, [[segment offset, nbytes], ...]], ...]
    units: dict = field(default_factory=dict)         # new prepack.unit_key -> (segment, weight offset, packs)

    @property
    def bytes(self) -> int:
        """What the plan places in the tier (reserved until commit or abort)."""
        return self.segment_bytes


def write_plan(plan: Plan, tier) -> float:
    """Copy the plan's new tensors from disk into `tier`'s new segment and write the skeletons; seconds taken.
    Checked as it goes unless the tier was told not to (`verify`), or the version predates checksums."""
    t0 = time.perf_counter()
    verify = tier.verify and bool(plan.manifest.checksum)
    if not plan.manifest.checksum:
        log.warning("%s: unverified (packed before file checksums); add it again to have it checked", plan.key)
    _check_files(plan, verify)
    if plan.segment is not None:
        path = tier.segment_path(plan.segment)
        tmp = path.with_suffix(".loading")
        src_fd = os.open(plan.disk_dir / WEIGHTS_FILE, os.O_RDONLY)
        dst_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
        try:
            os.ftruncate(dst_fd, plan.segment_bytes)
            if verify:
                _copy_verified(plan, src_fd, dst_fd)
            else:
                for src_off, dst_off, nbytes, _ in _coalesce(plan.copies):
                    copy_range(src_fd, dst_fd, src_off, dst_off, nbytes)
            if plan.blob_copies:
                _copy_blobs(plan, dst_fd, verify)
        finally:
            os.close(src_fd)
            os.close(dst_fd)
        os.chmod(tmp, 0o440)
        os.rename(tmp, path)
    write_skeleton(plan.disk_dir / SKELETON_FILE, tier.skeleton_path(plan.key), plan.locations["cpu"], plan.key,
                   plan.prepacked)
    if "gpu" in plan.locations:
        write_gpu_skeleton(plan.disk_dir / GPU_SKELETON_FILE, tier.skeleton_path(plan.key, "gpu"),
                           plan.manifest, plan.key)
    # Last, once every file it names is in place: a daemon that dies later leaves a record to re-adopt.
    write_atomic(tier.where_path(plan.key), json.dumps({"key": plan.key, "locations": plan.locations}),
                 mode=0o440)
    return time.perf_counter() - t0


def _check_files(plan: Plan, verify: bool) -> None:
    """The weights have their recorded size; with `verify`, every other recorded file its checksum
    (skeletons are small: checked whole, whichever variants this daemon uses)."""
    integrity.check_size(plan.key, plan.disk_dir / WEIGHTS_FILE, plan.manifest.weights_bytes)
    if plan.blob_copies and PREPACKED_FILE in plan.manifest.files:
        integrity.check_size(plan.key, plan.disk_dir / PREPACKED_FILE, plan.manifest.files[PREPACKED_FILE]["bytes"])
    if verify:
        for fname, record in plan.manifest.files.items():
            if fname not in (WEIGHTS_FILE, PREPACKED_FILE):   # those two: per tensor and blob, as they copy
                integrity.check_file(plan.key, plan.disk_dir, fname, record)


def _copy_verified(plan: Plan, src_fd: int, dst_fd: int) -> None:
    """Copy the plan's tensors, each hashed on the way, against the manifest's per-tensor xxh3."""
    by_sha = {t.sha256: t for variant in plan.locations for t in variant_tensors(plan.manifest, variant)}
    digests = copy_hashed(src_fd, dst_fd, [(src, dst, n) for src, dst, n, _ in plan.copies],
                          integrity.new_hasher)
    for (src_off, _, _, sha), got in zip(plan.copies, digests):
        t = by_sha[sha]
        if got != t.xxh3:
            raise integrity.damaged(plan.key, WEIGHTS_FILE, f"tensor {t.name!r} at offset {src_off}: "
                                    f"{integrity.HASH_NAME} {got[:12]}..., {t.xxh3[:12]}... recorded at add time")


def _copy_blobs(plan: Plan, dst_fd: int, verify: bool) -> None:
    """Copy the plan's pre-packed blobs from PREPACKED_FILE, each checked against its recorded xxh3."""
    src_fd = os.open(plan.disk_dir / PREPACKED_FILE, os.O_RDONLY)
    try:
        if not verify:
            for src_off, dst_off, nbytes, _, _ in plan.blob_copies:
                copy_range(src_fd, dst_fd, src_off, dst_off, nbytes)
            return
        digests = copy_hashed(src_fd, dst_fd, [(src, dst, n) for src, dst, n, _, _ in plan.blob_copies],
                              integrity.new_hasher)
    finally:
        os.close(src_fd)
    for (src_off, _, _, xxh3, name), got in zip(plan.blob_copies, digests):
        if got != xxh3:
            raise integrity.damaged(plan.key, PREPACKED_FILE, f"a blob of tensor {name!r} at offset {src_off}: "
                                    f"{integrity.HASH_NAME} {got[:12]}..., {xxh3[:12]}... recorded at add time")


def _coalesce(copies):
    """Merge copies that are contiguous on both sides (the usual case: a model nothing shares with)."""
    merged = []
    for src, dst, n, sha in sorted(copies, key=lambda c: c[1]):
        if merged and merged[-1][0] + merged[-1][2] <= src and src - merged[-1][0] == dst - merged[-1][1]:
            prev = merged[-1]
            merged[-1] = (prev[0], prev[1], src + n - prev[0], None)
        else:
            merged.append((src, dst, n, sha))
    return merged
