"""The host tier: model weights in POSIX shared memory (files on the /dev/shm tmpfs).

Layout, one flat directory per daemon instance, `<shm_dir>/modelcache.<uid>.<pid>/`:
  seg-<n>.bin       a segment: tensors at page-aligned offsets, written once, then read-only
  <model>.onnx      a resident model's skeleton, its external data pointing into segments
  <model>.gpu.onnx  its GPU skeleton (when the daemon has GPUs): every shared weight a stub ...
  <model>.gpu.stub  ... over this sparse file of zeros, never read (clients override the stubs)
  <model>.where.json  where each tensor of a resident model lives: what a restarted daemon re-adopts
  owner             the socket of the daemon that made the tier (tiers/adopt.py: only it re-adopts)

A model has up to two variants of its weights: "cpu" (the skeleton ORT optimized for the CPU
at add time) and "gpu" (the provider-independent one the GPU tier copies to devices from
here). Both live here when the daemon has GPUs; tensors they share are stored once.

Tensors are content-addressed (sha256 from the manifest): a tensor already resident —
in another model, another version, or twice in one model — is not stored again; the
new model's skeleton points at the existing copy. A segment lives while any resident
model uses it. Files are 0440 in a 0750 directory: the daemon's group may map them.
An unlinked segment stays valid for the clients that still map it, so freeing never
pulls memory from under a running session.

Threads: `plan`, `commit`, `abort` and `free_model` run on the owner loop and alone
touch the tables; `write` runs on a loader thread and only does the I/O of one plan.

Integrity: `write` checks the version's files against the checksums written at add time
before it uses them (skeletons whole, the weights' size) and hashes each tensor as it copies
it (integrity.py); a mismatch raises IntegrityError naming the model, version and file.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from .files import copy_hashed, copy_range, punch_holes
from .. import integrity, prepack
from ..format import ALIGN, GPU_SKELETON_FILE, PREPACKED_FILE, SKELETON_FILE, WEIGHTS_FILE, Manifest
from ..storage import remove_tree, storage_errors, write_atomic

log = logging.getLogger("modelcache.host")
PREFIX = "modelcache."
OWNER_FILE = "owner"
WHERE_SUFFIX = ".where.json"


def segment_number(name: str) -> int:
    """seg-<n>.bin -> n; ValueError for any other name."""
    if not (name.startswith("seg-") and name.endswith(".bin")):
        raise ValueError(f"not a segment name: {name!r}")
    return int(name[4:-4])


def write_json_atomic(path: Path, data) -> None:
    write_atomic(path, json.dumps(data), mode=0o440)


def remove_quietly(path: Path) -> None:
    """Remove a file or directory of the tier, never raising: freeing memory must not fail half way through
    the tables (a transient failure is tried again; what still stays is logged, and goes with the tier)."""
    error = remove_tree(path)
    if error is not None:
        log.error("could not remove %s from the host tier: %s", path, error)


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


@dataclass
class Segment:
    """One segment file and what lives in it: each tensor (or a weight with its pre-packed blobs) a range with
    the models that use it. A range no model uses any more is punched out of the file (FALLOC_FL_PUNCH_HOLE:
    tmpfs gives its pages back at once), so a model that shares one tensor with another keeps that tensor's
    pages, not the whole segment (issue 42: a 9.5 MiB model kept a 528 MiB segment)."""
    name: str
    size: int                                   # the file's length
    ranges: dict = field(default_factory=dict)  # offset -> [end, set of model keys using it (or loading it)]
    held: int | None = None                     # resident_bytes() while no range changes (used_bytes is asked often)

    @property
    def users(self) -> set:
        return set().union(*(users for _, users in self.ranges.values()))

    def changed(self) -> None:
        self.held = None

    def use(self, offset: int, end: int | None, key: str) -> None:
        self.changed()
        entry = self.ranges.setdefault(offset, [end, set()])
        entry[1].add(key)
        if end is not None and (entry[0] is None or end > entry[0]):
            entry[0] = end

    def resident_bytes(self, without=frozenset()) -> int:
        """Bytes of the pages that ranges used by any model but those `without` lie in (what the file holds once
        the rest is punched; all of it while every range is used)."""
        if not without and self.held is not None:
            return self.held
        held = self._resident(without)
        if not without:
            self.held = held
        return held

    def _resident(self, without) -> int:
        return self.span_bytes(_page_spans((off, end) for off, (end, users) in self.ranges.items()
                                           if users - without))

    def span_bytes(self, spans) -> int:
        """Bytes of the file the page spans cover (the last page only up to the file's end)."""
        return sum(min(end, self.size) - start for start, end in spans)

    def holes(self) -> list:
        """The page-aligned spans of the file no used range lies in: what punching gives back."""
        holes, at = [], 0
        for start, end in _page_spans((off, end) for off, (end, users) in self.ranges.items() if users):
            if start > at:
                holes.append((at, start))
            at = end
        if at < self.size:
            holes.append((at, _page_up(self.size)))
        return holes


def _page_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _page_spans(ranges) -> list:
    """Byte ranges -> the sorted, merged spans of whole pages they touch."""
    spans = []
    for start, end in sorted((off // ALIGN * ALIGN, _page_up(end)) for off, end in ranges):
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], end))
        else:
            spans.append((start, end))
    return spans


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


class HostTier:
    name = "host"
    id = "host"                         # its copies' key in a model's record (registry.HOST)
    where = "the host tier"
    capacity_setting = "host_capacity"

    def __init__(self, shm_dir: str | Path, capacity_bytes: int, owner: str = "", verify: bool = True,
                 source=None):
        self.source = source              # tiers.disk.Repository: where promotions read a version's files
        # Whether promotions copy a model's GPU variant too (a daemon with a GPU tier promotes from here).
        self.gpu_variant = False
        self.capacity_bytes = capacity_bytes
        self.owner = owner                              # the daemon's socket: names the tier's instance
        self.verify = verify      # check checksums while promoting (off only to measure what checking costs)
        self.root = Path(shm_dir) / f"{PREFIX}{os.getuid()}.{os.getpid()}"
        self.segments: dict[str, Segment] = {}
        self.index: dict[str, tuple[str, int]] = {}     # sha256 -> (segment, offset)
        self.models: dict[str, dict] = {}               # resident key -> variant -> tensor name -> (segment, offset)
        self.units: dict[str, tuple] = {}               # prepack.unit_key -> (segment, weight offset, packs placed)
        self.prepacked: dict[str, dict] = {}            # resident key -> tensor name -> packs placed (cpu variant)
        self._next_segment = 0

    # -- accounting ----------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        """Bytes the segments hold, including those being written (reserved by their plan)."""
        return sum(s.resident_bytes() for s in self.segments.values())

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def bytes_freed_by(self, keys) -> int:
        """What evicting all of `keys` together would free: the ranges (page-rounded) no other model uses."""
        keys = frozenset(keys)
        return sum(s.resident_bytes() - s.resident_bytes(keys) for s in self.segments.values()
                   if not keys.isdisjoint(s.users))

    def model_bytes(self, key: str) -> int:
        """Bytes of the ranges a model uses (page-rounded; shared ones counted in full)."""
        return sum(s.span_bytes(_page_spans((off, end) for off, (end, users) in s.ranges.items() if key in users))
                   for s in self.segments.values())

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Create the tier's directory, or keep the one tiers/adopt.py re-adopted (run that first)."""
        remove_stale(self.root.parent, self.owner)
        if self.root.exists() and not self.models:  # a dead daemon's that had our pid, not re-adopted
            error = remove_tree(self.root)
            if error is not None:
                raise error
        self.root.mkdir(mode=0o750, exist_ok=bool(self.models))
        self.write_owner()

    def write_owner(self) -> None:
        if self.owner:   # a tier with no owner (tests, tools) is never re-adopted
            write_atomic(self.root / OWNER_FILE, self.owner)

    def stop(self, keep: bool = False) -> None:
        """Free the tier; keep=True leaves it whole for the next daemon on this socket to re-adopt."""
        if not keep:
            error = remove_tree(self.root)
            if error is not None:
                log.error("could not remove the host tier %s: %s; remove it by hand", self.root, error)

    def skeleton_path(self, key: str, variant: str = "cpu") -> Path:
        return self.root / (f"{key}.gpu.onnx" if variant == "gpu" else f"{key}.onnx")

    def has_variant(self, key: str, variant: str) -> bool:
        return variant in self.models.get(key, ())

    def segment_path(self, name: str) -> Path:
        return self.root / name

    def where_path(self, key: str) -> Path:
        return self.root / f"{key}{WHERE_SUFFIX}"

    def forget_all(self) -> None:
        """Empty the tables (a re-adoption that failed part way: `start` then clears the directory)."""
        self.segments, self.index, self.models, self.units, self.prepacked = {}, {}, {}, {}, {}
        self._next_segment = 0

    def restore(self, key: str, manifest: Manifest, locations: dict, segment_bytes: dict) -> None:
        """Take back a model a dead daemon left resident here (tiers/adopt.py has checked its bytes)."""
        with_blobs = {r["tensor"] for r in manifest.prepacked}   # a weight stored with its pre-packed blobs
        for variant, where in locations.items():
            for t in variant_tensors(manifest, variant):
                seg_name, offset = where[t.name]
                seg = self.segments.setdefault(seg_name, Segment(seg_name, segment_bytes[seg_name]))
                # (a weight's blobs follow it up to the next range: trim finds where that is)
                seg.use(offset, None if variant == "cpu" and t.name in with_blobs else offset + t.nbytes, key)
                self.index.setdefault(t.sha256, (seg_name, offset))
                self._next_segment = max(self._next_segment, segment_number(seg_name) + 1)
        self.models[key] = locations

    def trim(self) -> None:
        """After re-adopting: give back every span of a segment no model uses (what the dead daemon died before
        punching). A weight's pre-packed blobs stay with it (its range runs to the next one)."""
        for seg in self.segments.values():
            starts = sorted(seg.ranges) + [seg.size]
            for i, start in enumerate(starts[:-1]):
                if seg.ranges[start][0] is None:
                    seg.ranges[start][0] = starts[i + 1]
            seg.changed()
            try:
                punch_holes(self.segment_path(seg.name), seg.holes())
            except OSError as e:
                log.error("could not give back unused ranges of %s: %s", seg.name, e.strerror or e)

    def variants(self, manifest: Manifest) -> tuple:
        """What a promotion copies: the CPU weights, and the GPU ones when there is a GPU tier."""
        return ("cpu", "gpu") if self.gpu_variant and manifest.gpu_tensors else ("cpu",)

    def estimate_bytes(self, manifest: Manifest) -> int:
        """About what a promotion would place, before planning it: its distinct tensors of the variants copied,
        and pre-packed blobs (less what it shares with resident models, more the tensors' alignment)."""
        distinct = {t.sha256: t.nbytes for v in self.variants(manifest) for t in variant_tensors(manifest, v)}
        return sum(distinct.values()) + manifest.files.get(PREPACKED_FILE, {}).get("bytes", 0)

    def tensors_of(self, manifest: Manifest) -> list:
        """The tensors of a model a lease here maps: its CPU variant's."""
        return manifest.tensors

    def check_model(self, key: str, manifest: Manifest) -> None:
        """Every packed model can be in the host tier."""

    def describe(self) -> dict:
        return {"tier": "host", "path": str(self.root)}

    # -- promotion: plan (owner) -> write (loader) -> commit or abort (owner) -------------
    def plan(self, key: str, manifest: Manifest) -> Plan:
        """Decide where each tensor of each variant will live and reserve the new segment's bytes; the
        files are the repository's copy of the version (`source`)."""
        return self.plan_from(key, self.source.model_dir(manifest.name, manifest.version), manifest,
                              self.variants(manifest))

    def plan_from(self, key: str, disk_dir: Path, manifest: Manifest, variants: tuple = ("cpu",)) -> Plan:
        """`plan` of the version in `disk_dir`, of the `variants` given."""
        locations, copies, offset = {}, [], 0
        fresh: dict[str, int] = {}                  # sha -> offset in the new segment
        new_ranges: dict[int, int] = {}             # the new segment's ranges: start -> end
        segment = f"seg-{self._next_segment}.bin"
        records = _prepacked_records(disk_dir, manifest) if "cpu" in variants else {}
        blob_copies, prepacked, units = [], {}, {}
        for variant in variants:
            where = locations[variant] = {}
            for t in variant_tensors(manifest, variant):
                record = records.get(t.name) if variant == "cpu" else None
                if record is not None:              # the weight and its blobs, stored together, once
                    ukey = prepack.unit_key(t.sha256, record)
                    unit = self.units.get(ukey) or units.get(ukey)
                    if unit is None:
                        offset = -(-offset // ALIGN) * ALIGN
                        weight_offset = offset
                        copies.append((t.offset, offset, t.nbytes, t.sha256))
                        fresh.setdefault(t.sha256, offset)
                        offset += t.nbytes
                        packs = []
                        for pack_key, blobs in record["packs"]:
                            placed = []
                            for src_off, nbytes, xxh3 in blobs:
                                offset = -(-offset // ALIGN) * ALIGN
                                blob_copies.append((src_off, offset, nbytes, xxh3, t.name))
                                placed.append([offset, nbytes])
                                offset += nbytes
                            packs.append([pack_key, placed])
                        unit = units[ukey] = (segment, weight_offset, packs)
                        new_ranges[weight_offset] = offset   # the weight and its blobs: one range
                    where[t.name] = (unit[0], unit[1])
                    prepacked[t.name] = unit[2]
                elif t.sha256 in self.index:
                    where[t.name] = self.index[t.sha256]
                elif t.sha256 in fresh:             # the same tensor twice in one model, or in both variants
                    where[t.name] = (segment, fresh[t.sha256])
                else:
                    offset = -(-offset // ALIGN) * ALIGN
                    fresh[t.sha256] = offset
                    copies.append((t.offset, offset, t.nbytes, t.sha256))
                    where[t.name] = (segment, offset)
                    new_ranges[offset] = offset + t.nbytes
                    offset += t.nbytes
        if copies:
            self._next_segment += 1
            seg = self.segments[segment] = Segment(segment, offset)   # reserved from now on
            for start, end in new_ranges.items():
                seg.use(start, end, key)
        else:
            segment = None
        for where in locations.values():            # keep the reused ranges alive while we load
            for seg_name, at in where.values():
                if seg_name != segment:
                    seg = self.segments[seg_name]
                    seg.use(at, seg.ranges[at][0], key)
        return Plan(key, disk_dir, manifest, locations, copies, segment, offset, blob_copies, prepacked, units)

    def write(self, plan: Plan) -> float:
        """Copy the plan's new tensors from disk into shared memory and write the skeleton. Loader thread;
        a full or read-only /dev/shm raises StorageError saying so."""
        with storage_errors(f"promoting {plan.key} to the host tier", self.root):
            return self._write(plan)

    def _write(self, plan: Plan) -> float:
        t0 = time.perf_counter()
        verify = self.verify and bool(plan.manifest.checksum)
        if not plan.manifest.checksum:
            log.warning("%s: unverified (packed before file checksums); add it again to have it checked", plan.key)
        self._check_files(plan, verify)
        if plan.segment is not None:
            path = self.segment_path(plan.segment)
            tmp = path.with_suffix(".loading")
            src_fd = os.open(plan.disk_dir / WEIGHTS_FILE, os.O_RDONLY)
            dst_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
            try:
                os.ftruncate(dst_fd, plan.segment_bytes)
                if verify:
                    self._copy_verified(plan, src_fd, dst_fd)
                else:
                    for src_off, dst_off, nbytes, _ in _coalesce(plan.copies):
                        copy_range(src_fd, dst_fd, src_off, dst_off, nbytes)
                if plan.blob_copies:
                    self._copy_blobs(plan, dst_fd, verify)
            finally:
                os.close(src_fd)
                os.close(dst_fd)
            os.chmod(tmp, 0o440)
            os.rename(tmp, path)
        _write_skeleton(plan.disk_dir / SKELETON_FILE, self.skeleton_path(plan.key), plan.locations["cpu"], plan.key,
                        plan.prepacked)
        if "gpu" in plan.locations:
            _write_gpu_skeleton(plan.disk_dir / GPU_SKELETON_FILE, self.skeleton_path(plan.key, "gpu"),
                                plan.manifest, plan.key)
        # Last, once every file it names is in place: a daemon that dies later leaves a record to re-adopt.
        write_json_atomic(self.where_path(plan.key), {"key": plan.key, "locations": plan.locations})
        return time.perf_counter() - t0

    @staticmethod
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

    @staticmethod
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

    @staticmethod
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

    def commit(self, plan: Plan) -> None:
        if plan.segment is not None:
            for _, dst_off, _, sha in plan.copies:
                self.index.setdefault(sha, (plan.segment, dst_off))   # an older copy stays the one reused
        self.units.update(plan.units)
        self.models[plan.key] = plan.locations
        if plan.prepacked:
            self.prepacked[plan.key] = plan.prepacked

    def abort(self, plan: Plan) -> None:
        """A failed or refused load: release what the plan reserved."""
        self._remove_skeletons(plan.key)
        self._drop_user(plan.key)

    def free_model(self, key: str) -> int:
        """Forget a resident model; free the segments nobody else uses. Returns bytes freed."""
        self.models.pop(key, None)
        self.prepacked.pop(key, None)
        self._remove_skeletons(key)
        return self._drop_user(key)

    def _remove_skeletons(self, key: str) -> None:
        for path in (self.where_path(key), self.skeleton_path(key), self.skeleton_path(key, "gpu"),
                     self.skeleton_path(key, "gpu").with_suffix(".stub")):
            remove_quietly(path)

    def _drop_user(self, key: str) -> int:
        """`key` uses nothing here any more: segments no model uses are removed, ranges punched. Bytes freed."""
        freed = 0
        for seg in list(self.segments.values()):
            if key not in seg.users:
                continue
            before = seg.resident_bytes()
            for _, users in seg.ranges.values():
                users.discard(key)
            seg.changed()
            if not seg.users:
                freed += before
                remove_quietly(self.segment_path(seg.name))
                remove_quietly(self.segment_path(seg.name).with_suffix(".loading"))
                del self.segments[seg.name]
                self.index = {sha: loc for sha, loc in self.index.items() if loc[0] != seg.name}
                self.units = {u: loc for u, loc in self.units.items() if loc[0] != seg.name}
            else:
                self._punch(seg)
                freed += before - seg.resident_bytes()
        return freed

    def _punch(self, seg: Segment) -> None:
        """Forget the segment's ranges no model uses (a new promotion must not reuse them) and give their pages
        back. Clients map only what their leases name, and a range goes only with its last model's copy."""
        dead = {off for off, (_, users) in seg.ranges.items() if not users}
        if not dead:
            return
        for off in dead:
            del seg.ranges[off]
        seg.changed()
        self.index = {sha: loc for sha, loc in self.index.items() if not (loc[0] == seg.name and loc[1] in dead)}
        self.units = {u: loc for u, loc in self.units.items() if not (loc[0] == seg.name and loc[1] in dead)}
        path = self.segment_path(seg.name)
        try:
            punch_holes(path, seg.holes())
        except OSError as e:   # (a filesystem without hole punching: the pages stay until the segment goes)
            log.error("could not give back unused ranges of %s: %s", path, e.strerror or e)

    # -- what clients get ------------------------------------------------------------------
    def export(self, key: str, manifest: Manifest) -> dict:
        """What a lease on the host copy maps, as OpenReply's fields: the skeleton, the segments, each tensor's
        place, and the tensors whose pre-packed blobs ORT maps from the skeleton."""
        skeleton, segments, tensors = self.layout(key, manifest)
        return {"skeleton_path": skeleton, "segments": segments, "tensors": tensors,
                "prepacked": sorted(self.prepacked_tensors(key))}

    def lease_fds(self, key: str) -> list[int]:
        """No descriptors travel with a host lease: the client opens the segments by path."""
        return []

    def layout(self, key: str, manifest: Manifest, variant: str = "cpu") -> tuple[str, list[str], list[list]]:
        """(skeleton path, segment paths, [name, dtype, shape, segment index, offset, nbytes] per tensor)."""
        locations = self.models[key][variant]
        segments = sorted({seg for seg, _ in locations.values()})
        slot = {seg: i for i, seg in enumerate(segments)}
        tensors = [[t.name, t.dtype, t.shape, slot[locations[t.name][0]], locations[t.name][1], t.nbytes]
                   for t in variant_tensors(manifest, variant)]
        return str(self.skeleton_path(key, variant)), [str(self.segment_path(s)) for s in segments], tensors

    def prepacked_tensors(self, key: str) -> set:
        """The cpu tensors a client must let ORT map from the skeleton, with prepacking on, to share their
        pre-packed blobs (add_initializer would hide the blobs); empty for a model without them."""
        return set(self.prepacked.get(key, ()))

    def file_locations(self, key: str, variant: str) -> dict:
        """Tensor name -> (segment file path, offset): where a device promotion reads each tensor."""
        return {name: (str(self.segment_path(seg)), off) for name, (seg, off) in self.models[key][variant].items()}


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


def _load_skeleton(src: Path, key: str):
    """The packed skeleton's graph; a file that does not parse is a damaged file of `key`, not a decode error."""
    import onnx
    try:
        return onnx.load(str(src), load_external_data=False)
    except FileNotFoundError:
        raise integrity.damaged(key, src.name, "the file is missing") from None
    except Exception as e:  # protobuf's DecodeError, UnicodeDecodeError on a damaged string...
        raise integrity.damaged(key, src.name, f"not an ONNX graph: {type(e).__name__}: {str(e)[:200]}") from None


def _prepacked_records(disk_dir: Path, manifest: Manifest) -> dict:
    """tensor name -> prepack record, when this machine can use the model's blobs and has the file."""
    if not prepack.usable(manifest) or not (Path(disk_dir) / PREPACKED_FILE).exists():
        return {}
    return {r["tensor"]: r for r in manifest.prepacked}


def _write_skeleton(src: Path, dst: Path, locations: dict, key: str, prepacked: dict | None = None) -> None:
    """The packed skeleton with each external tensor pointing at its segment and offset.

    Clients hand ORT most weights with add_initializer, but ORT still checks that the
    external data a skeleton names exists; pointing it at the real bytes keeps the
    skeleton correct on its own as well. A weight in `prepacked` also names its blobs
    (ORT's `prepacked_<i>` entries, offsets in the same segment): clients let ORT map it.
    """
    import onnx
    from ..format import iter_graphs

    model = _load_skeleton(src, key)
    for graph in iter_graphs(model.graph):
        for t in graph.initializer:
            if t.name in locations and t.data_location == onnx.TensorProto.EXTERNAL:
                seg, offset = locations[t.name]
                for entry in t.external_data:
                    if entry.key == "location":
                        entry.value = seg
                    elif entry.key == "offset":
                        entry.value = str(offset)
                for name, value in prepack.external_entries((prepacked or {}).get(t.name, [])):
                    t.external_data.add(key=name, value=value)
    _save_graph(model, dst)


def _save_graph(model, dst: Path) -> None:
    """Save an ONNX graph to `dst` whole (0440): written beside it and renamed; a failure leaves no temp file."""
    write_atomic(dst, model.SerializeToString(), mode=0o440)


def _write_gpu_skeleton(src: Path, dst: Path, manifest: Manifest, key: str) -> None:
    """The GPU skeleton, its stubs pointing at `<dst>.stub`: a sparse file of zeros as large as the
    largest stub (ORT checks the external data a graph names exists; it never reads it, because
    every stub is overridden by add_initializer). Sparse on tmpfs: it costs no memory."""
    import onnx
    from ..format import iter_graphs

    stub = dst.with_suffix(".stub")
    model = _load_skeleton(src, key)
    for graph in iter_graphs(model.graph):
        for t in graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                for entry in t.external_data:
                    if entry.key == "location":
                        entry.value = stub.name
    with open(stub, "wb") as f:
        f.truncate(max((t.nbytes for t in manifest.gpu_tensors), default=0))
    os.chmod(stub, 0o440)
    _save_graph(model, dst)


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
