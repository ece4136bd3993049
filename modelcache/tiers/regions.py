"""The content-addressed region store both memory tiers keep: the host tier's segment files, a GPU's arenas.

A region is what a tier allocates at once for one promotion (a segment file, one device allocation): the
tensors that promotion brought, at offsets, each tensor a range with the models that use it. The index
names, by sha256, the copy of each tensor a new model reuses, so a tensor resident in any model is stored
once. Dropping a model (freed, or a plan aborted) takes it off every range it used.

The tiers differ only in what they can give back before a region's last user goes, and that is the
store's one parameter, `page`. The host tier punches the pages of a segment no model uses any more out
of the file, so its store counts and frees in pages of `page` bytes, and forgets a range once nobody uses
it (its bytes are gone: no new model may reuse them). A device allocation is freed whole, so a GPU's
store (page None) counts a region whole while any model uses it and keeps its unused ranges reusable
until the last user goes. The store keeps only the tables: what freeing does (unlink a file, punch its
holes, free an allocation) is the tier's, told by what `drop_user` returns.

Threads: the owner loop's alone, as the tiers' tables are.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Region:
    """One region and what lives in it: each tensor (or a host weight with its pre-packed blobs) a range with
    the models that use it (or are loading it)."""
    name: str
    seq: int                                    # creation order (a GPU's export lists its handles in it)
    size: int                                   # the file's length, the allocation's bytes
    page: int | None = None                     # the store's: what unused ranges are given back in; None: whole
    ranges: dict = field(default_factory=dict)  # offset -> [end, set of model keys using it (or loading it)]
    allocation: object = None                   # a device region's allocation, set at commit (None for a file)
    held: int | None = None                     # resident_bytes() while no range changes (used_bytes is asked often)

    @property
    def users(self) -> set:
        return set().union(*(users for _, users in self.ranges.values()))

    def changed(self) -> None:
        self.held = None

    def use(self, offset: int, end: int | None, key: str) -> None:
        """`key` uses the range at `offset`; end None: not known yet (a re-adopted weight's blobs: the host
        tier's trim sets it). A range used again with a larger end grows."""
        self.changed()
        entry = self.ranges.setdefault(offset, [end, set()])
        entry[1].add(key)
        if end is not None and (entry[0] is None or end > entry[0]):
            entry[0] = end

    def resident_bytes(self, without=frozenset()) -> int:
        """Bytes it holds while the models but those `without` keep it: the pages their ranges lie in (all of
        it while every range is used), or, with no page, the whole region while any of them uses it."""
        if not without and self.held is not None:
            return self.held
        held = self._held(lambda users: users - without)
        if not without:
            self.held = held
        return held

    def bytes_of(self, key: str) -> int:
        """Bytes of it that `key` keeps: the pages of its ranges, or the whole region (shared ones in full)."""
        return self._held(lambda users: key in users)

    def _held(self, keeps) -> int:
        spans = [(off, end) for off, (end, users) in self.ranges.items() if keeps(users)]
        if self.page is None:
            return self.size if spans else 0
        return sum(min(end, self.size) - start for start, end in page_spans(spans, self.page))

    def holes(self) -> list:
        """The page-aligned spans no used range lies in: what punching gives back (page stores only)."""
        holes, at = [], 0
        used = ((off, end) for off, (end, users) in self.ranges.items() if users)
        for start, end in page_spans(used, self.page):
            if start > at:
                holes.append((at, start))
            at = end
        if at < self.size:
            holes.append((at, page_up(self.size, self.page)))
        return holes


def page_up(n: int, page: int) -> int:
    return -(-n // page) * page


def page_spans(ranges, page: int) -> list:
    """Byte ranges -> the sorted, merged spans of whole pages they touch."""
    spans = []
    for start, end in sorted((off // page * page, page_up(end, page)) for off, end in ranges):
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], end))
        else:
            spans.append((start, end))
    return spans


@dataclass
class Freed:
    """What dropping a model freed, for the tier to act on: regions to release whole (gone from the store),
    and ranges forgotten in regions that stay (page stores: the tier gives back the region's `holes()`)."""
    bytes: int = 0
    regions: list = field(default_factory=list)   # Region, each no model uses any more
    ranges: dict = field(default_factory=dict)    # region name -> offsets of its ranges no model uses any more

    def covers(self, location) -> bool:
        """Whether a (region, offset, ...) place is gone: its region released, or its range forgotten."""
        name, offset = location[0], location[1]
        return any(r.name == name for r in self.regions) or offset in self.ranges.get(name, ())


class RegionStore:
    """The regions of one tier, the sha256 index over them, and the bytes they hold."""

    def __init__(self, name_of, page: int | None = None):
        self.name_of = name_of            # creation number -> region name: "seg-3.bin", "arena-3"
        self.page = page                  # see the module: the host's pages, or None (a GPU's: whole regions)
        self.regions: dict[str, Region] = {}
        self.index: dict[str, tuple[str, int]] = {}     # sha256 -> (region, offset) of the copy a new model reuses
        self.next_seq = 0

    def placement(self, align: int) -> "Placement":
        """Where a new plan puts a model's tensors, its new tensors `align`-aligned in the region it reserves."""
        return Placement(self, self.name_of(self.next_seq), align)

    def reserve(self, size: int, ranges: dict, key: str) -> Region:
        """A new region of `size` bytes, its ranges (start -> end) used by `key`: counted from now on, as a
        plan's reservation is, before a byte is written."""
        name = self.name_of(self.next_seq)
        region = self.regions[name] = Region(name, self.next_seq, size, self.page)
        self.next_seq += 1
        for start, end in ranges.items():
            region.use(start, end, key)
        return region

    def restore(self, name: str, seq: int, size: int) -> Region:
        """The region `name` as a dead daemon left it (the host tier's re-adoption): its ranges are used again
        one by one; later regions are numbered after it."""
        self.next_seq = max(self.next_seq, seq + 1)
        return self.regions.setdefault(name, Region(name, seq, size, self.page))

    def keep(self, locations, key: str, but: str | None = None) -> None:
        """`key` uses the ranges at these (region, offset) places too, those in region `but` aside."""
        for name, offset in locations:
            if name != but:
                region = self.regions[name]
                region.use(offset, region.ranges[offset][0], key)

    def publish(self, name: str, placed) -> None:
        """Offer the (sha256, offset) tensors of region `name` for reuse; an older copy stays the one reused."""
        for sha, offset in placed:
            self.index.setdefault(sha, (name, offset))

    def drop_user(self, key: str) -> Freed:
        """`key` uses nothing here any more. Regions nobody uses leave the store; in a page store, so do the
        ranges nobody uses (and the index's entries for both: a new model must not reuse them)."""
        freed = Freed()
        for region in list(self.regions.values()):
            if key not in region.users:
                continue
            before = region.resident_bytes()
            for _, users in region.ranges.values():
                users.discard(key)
            region.changed()
            if not region.users:
                del self.regions[region.name]
                freed.regions.append(region)
                freed.bytes += before
                continue
            dead = {off for off, (_, users) in region.ranges.items() if not users} if self.page else set()
            if dead:
                for off in dead:
                    del region.ranges[off]
                region.changed()
                freed.ranges[region.name] = dead
            freed.bytes += before - region.resident_bytes()
        if freed.regions or freed.ranges:
            self.index = {sha: loc for sha, loc in self.index.items() if not freed.covers(loc)}
        return freed

    def clear(self) -> None:
        self.regions, self.index, self.next_seq = {}, {}, 0

    # -- accounting --------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return sum(r.resident_bytes() for r in self.regions.values())

    def bytes_freed_by(self, keys) -> int:
        keys = frozenset(keys)
        return sum(r.resident_bytes() - r.resident_bytes(keys) for r in self.regions.values()
                   if not keys.isdisjoint(r.users))

    def model_bytes(self, key: str) -> int:
        return sum(r.bytes_of(key) for r in self.regions.values())


class Placement:
    """Where one plan puts a model's tensors: a copy already resident (the index), one the plan placed already
    (the same tensor twice in a model, or in both its variants), or new room in the region the plan reserves,
    named before the plan knows whether it needs one."""

    def __init__(self, store: RegionStore, region: str, align: int):
        self.store, self.region, self.align = store, region, align
        self.fresh: dict[str, int] = {}       # sha256 -> offset in the new region
        self.ranges: dict[int, int] = {}      # the new region's ranges: start -> end
        self.end = 0                          # the bytes they take

    def find(self, sha: str) -> tuple | None:
        """(region, offset) of a copy of the tensor to reuse; None when it needs room of its own."""
        if sha in self.store.index:
            return self.store.index[sha]
        if sha in self.fresh:
            return self.region, self.fresh[sha]
        return None

    def new(self, nbytes: int, sha: str | None = None) -> int:
        """Room for `nbytes` in the new region, a range of its own: its offset. `sha`: later finds reuse it."""
        offset = page_up(self.end, self.align)
        self.ranges[offset] = self.end = offset + nbytes
        if sha is not None:
            self.fresh.setdefault(sha, offset)
        return offset

    def grow(self, start: int, nbytes: int) -> int:
        """Room for `nbytes` more in the range at `start` (a host weight's pre-packed blobs follow it): its offset."""
        offset = page_up(self.end, self.align)
        self.ranges[start] = self.end = offset + nbytes
        return offset

    def reserve(self, key: str, locations, size: int | None = None) -> str | None:
        """Reserve the new region for `key` (`size` bytes; what was placed by default) if anything was placed
        in it, and keep the other (region, offset) `locations` it reuses alive while it loads. The new
        region's name, or None when every tensor was there already."""
        name = None
        if self.ranges:
            name = self.store.reserve(self.end if size is None else size, self.ranges, key).name
        self.store.keep(locations, key, but=name)
        return name


class StoredTier:
    """The Tier contract's accounting (tiers/base.py) of a tier whose regions are a `RegionStore`, `store`."""
    store: RegionStore
    capacity_bytes: int

    @property
    def used_bytes(self) -> int:
        """Bytes the regions hold, those reserved by a plan in flight included."""
        return self.store.used_bytes

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def bytes_freed_by(self, keys) -> int:
        """What evicting all of `keys` together would free: what of each region no other model keeps."""
        return self.store.bytes_freed_by(keys)

    def model_bytes(self, key: str) -> int:
        """Bytes of the regions a model uses (page-rounded in the host tier; shared ones counted in full)."""
        return self.store.model_bytes(key)

    @property
    def index(self) -> dict:
        """sha256 -> (region, offset): the copy of each tensor a new model reuses."""
        return self.store.index
