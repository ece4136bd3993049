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

The tables are a region store (regions.py) that gives back pages: a range of a segment no model
uses any more is punched out of the file. Writing a plan is host_plan.py's, the skeletons are
skeletons.py's, the tiers dead daemons left are stale.py's, and re-adopting one is adopt.py's.

Integrity: `write` checks the version's files against the checksums written at add time
before it uses them (skeletons whole, the weights' size) and hashes each tensor as it copies
it (integrity.py); a mismatch raises IntegrityError naming the model, version and file.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .files import punch_holes, remove_quietly
from .host_plan import Plan, variant_tensors, write_plan
from .regions import RegionStore, StoredTier
from .stale import OWNER_FILE, PREFIX, remove_stale
from ..store import prepack
from ..store.format import ALIGN, PREPACKED_FILE, Manifest
from ..storage import remove_tree, storage_errors, write_atomic

log = logging.getLogger("modelcache.host")
WHERE_SUFFIX = ".where.json"


def segment_name(n: int) -> str:
    return f"seg-{n}.bin"


def segment_number(name: str) -> int:
    """seg-<n>.bin -> n; ValueError for any other name."""
    if not (name.startswith("seg-") and name.endswith(".bin")):
        raise ValueError(f"not a segment name: {name!r}")
    return int(name[4:-4])


class HostTier(StoredTier):
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
        # Segments give back the pages of ranges no model uses (issue 42: a 9.5 MiB model that shared one
        # tensor with a 528 MiB one kept the whole segment): the store counts and frees in pages.
        self.store = RegionStore(segment_name, page=ALIGN)
        self.models: dict[str, dict] = {}               # resident key -> variant -> tensor name -> (segment, offset)
        self.units: dict[str, tuple] = {}               # prepack.unit_key -> (segment, weight offset, packs placed)
        self.prepacked: dict[str, dict] = {}            # resident key -> tensor name -> packs placed (cpu variant)

    @property
    def segments(self) -> dict:
        """Segment name -> its Region (regions.py)."""
        return self.store.regions

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
        self.store.clear()
        self.models, self.units, self.prepacked = {}, {}, {}

    def restore(self, key: str, manifest: Manifest, locations: dict, segment_bytes: dict) -> None:
        """Take back a model a dead daemon left resident here (tiers/adopt.py has checked its bytes)."""
        with_blobs = {r["tensor"] for r in manifest.prepacked}   # a weight stored with its pre-packed blobs
        for variant, where in locations.items():
            for t in variant_tensors(manifest, variant):
                seg_name, offset = where[t.name]
                seg = self.store.restore(seg_name, segment_number(seg_name), segment_bytes[seg_name])
                # (a weight's blobs follow it up to the next range: trim finds where that is)
                seg.use(offset, None if variant == "cpu" and t.name in with_blobs else offset + t.nbytes, key)
                self.store.publish(seg_name, [(t.sha256, offset)])
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
            self._give_back(seg)

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
        locations, copies = {}, []
        placing = self.store.placement(ALIGN)
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
                        weight_offset = placing.new(t.nbytes, t.sha256)
                        copies.append((t.offset, weight_offset, t.nbytes, t.sha256))
                        packs = []
                        for pack_key, blobs in record["packs"]:
                            placed = []
                            for src_off, nbytes, xxh3 in blobs:    # (in the weight's range: they go with it)
                                offset = placing.grow(weight_offset, nbytes)
                                blob_copies.append((src_off, offset, nbytes, xxh3, t.name))
                                placed.append([offset, nbytes])
                            packs.append([pack_key, placed])
                        unit = units[ukey] = (placing.region, weight_offset, packs)
                    where[t.name] = (unit[0], unit[1])
                    prepacked[t.name] = unit[2]
                elif (reused := placing.find(t.sha256)) is not None:
                    where[t.name] = reused
                else:
                    where[t.name] = (placing.region, placing.new(t.nbytes, t.sha256))
                    copies.append((t.offset, where[t.name][1], t.nbytes, t.sha256))
        segment = placing.reserve(key, (at for where in locations.values() for at in where.values()))
        return Plan(key, disk_dir, manifest, locations, copies, segment, placing.end,
                    blob_copies, prepacked, units)

    def write(self, plan: Plan) -> float:
        """Copy the plan's new tensors from disk into shared memory and write the skeleton. Loader thread;
        a full or read-only /dev/shm raises StorageError saying so."""
        with storage_errors(f"promoting {plan.key} to the host tier", self.root):
            return write_plan(plan, self)

    def commit(self, plan: Plan) -> None:
        if plan.segment is not None:
            self.store.publish(plan.segment, ((sha, dst_off) for _, dst_off, _, sha in plan.copies))
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
        """`key` uses nothing here any more: segments no model uses are removed, the pages of ranges no model
        uses given back. Clients map only what their leases name, and a range goes only with its last model's
        copy; an unlinked segment stays valid for the clients that still map it. Bytes freed."""
        freed = self.store.drop_user(key)
        self.units = {u: loc for u, loc in self.units.items() if not freed.covers(loc)}
        for seg in freed.regions:
            remove_quietly(self.segment_path(seg.name))
            remove_quietly(self.segment_path(seg.name).with_suffix(".loading"))
        for name in freed.ranges:
            self._give_back(self.segments[name])
        return freed.bytes

    def _give_back(self, seg) -> None:
        """Punch the segment's pages no used range lies in."""
        try:
            punch_holes(self.segment_path(seg.name), seg.holes())
        except OSError as e:   # (a filesystem without hole punching: the pages stay until the segment goes)
            log.error("could not give back unused ranges of %s: %s", seg.name, e.strerror or e)

    # -- what clients get ------------------------------------------------------------------
    def export(self, key: str, manifest: Manifest) -> dict:
        """What a lease on the host copy maps, as OpenReply's fields: the skeleton, the segments, each tensor's
        place, and the tensors whose pre-packed blobs ORT maps from the skeleton."""
        skeleton, segments, tensors = self.layout(key, manifest)
        return {"skeleton_path": skeleton, "segments": segments, "tensors": tensors,
                "prepacked": sorted(self.prepacked_tensors(key))}

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



def _prepacked_records(disk_dir: Path, manifest: Manifest) -> dict:
    """tensor name -> prepack record, when this machine can use the model's blobs and has the file."""
    if not prepack.usable(manifest) or not (Path(disk_dir) / PREPACKED_FILE).exists():
        return {}
    return {r["tensor"]: r for r in manifest.prepacked}
