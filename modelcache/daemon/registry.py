"""The daemon's tables: models with their lifecycle, clients, and leases. Owned by the owner loop alone.

A model's record owns its transitions (as sllm-store's `Model` and plasma's lifecycle manager do), and
so does its copy in each memory tier (`TierCopy`: the host tier's, and one per GPU): holding and letting
go (leases, requests in flight), waiting for room, starting and finishing the one load every waiter
shares, marking damage, being freed. Their fields change only through these methods
(tests/test_layers.py checks every module). The rule that matters most on a GPU — memory a lease maps
is never freed — is `TierCopy.check_freeable`, which each tier's residency manager asks in its one
method that frees (daemon/residency.py).
"""

from __future__ import annotations

import bisect
import enum
import itertools
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CapacityError, LeaseError, ModelNotFound
from ..format import Manifest

HOST = "host"   # the host tier's copy; a GPU's is keyed by the device's UUID


def plural(n: int, noun: str, nouns: str = "") -> str:
    """'1 session', '2 sessions': a count that reads right in a message."""
    return f"{n} {noun}" if n == 1 else f"{n} {nouns or noun + 's'}"


# What to do about each reason a copy is kept in its tier: capacity errors end with these.
CLOSE_SESSIONS, UNPIN, WAIT = "close sessions", "unpin", "wait for the load to finish"


class ModelState(enum.Enum):
    ON_DISK = "on_disk"      # not in the tier (the host tier's: only in the repository)
    WAITING = "waiting"      # requests want it in a tier full of models in use: queued for room (room.py)
    LOADING = "loading"      # a loader thread is copying it into the tier
    RESIDENT = "resident"    # in the tier; clients may map it


@dataclass(eq=False)   # a record with an identity (queues find it by `is`), not a value
class TierCopy:
    """A model's copy in one memory tier: the host tier's (HOST), or one GPU's (its UUID).

    The tiers are inclusive: a GPU copy is promoted from the host copy, and holds it (a GPU lease
    holds both; the host copy is not freed while a GPU copy waits for room or is being made from it).
    `holds` counts leases and requests in flight on this copy: memory they map is not reclaimed by
    freeing it (on a GPU, measured: shared/GPU.md), so a held copy is never freed.
    """
    model: "ModelRecord" = field(repr=False)
    tier: str                                     # HOST, or the GPU's UUID
    state: ModelState = ModelState.ON_DISK
    holds: int = 0
    waiters: list = field(default_factory=list)   # callbacks(error) waiting for room, then on the one load
    prewarmed: bool = False   # loaded by its policy's pre-warm, and nothing has held it since

    # -- holding -----------------------------------------------------------------------------
    def hold(self) -> None:
        """A lease or a request in flight: the copy is not freed under it."""
        self.holds += 1
        self.prewarmed = False

    def let_go(self) -> None:
        if self.holds <= 0:
            raise AssertionError(f"{self.where}: released more often than it was held")
        self.holds -= 1

    @property
    def idle(self) -> bool:
        """Resident with nothing holding it: the moment its tier's policy hears it was released."""
        return self.holds == 0 and self.state is ModelState.RESIDENT

    @property
    def busy_above(self) -> bool:
        """A copy in a tier above is waiting for room or being made from this one: this one must stay."""
        copies = self.model.tier_copies
        return self.tier == HOST and len(copies) > 1 and \
            any(c.state in (ModelState.WAITING, ModelState.LOADING) for t, c in copies.items() if t != HOST)

    @property
    def freeable(self) -> bool:
        return self.idle and not self.busy_above

    @property
    def evictable(self) -> bool:
        """A candidate its policy may choose: resident, unheld, unpinned, nothing above busy with it."""
        return self.freeable and not self.model.pinned

    # -- the one load ------------------------------------------------------------------------
    def wait_for_load(self, wake) -> None:
        """`wake(error)` runs once the load in flight (or the room it waits for, then that load) ends."""
        self.waiters.append(wake)

    def queue_for_room(self) -> None:
        """ON_DISK -> WAITING: its waiters wait for room in the tier (its residency's room queue)."""
        if self.state is not ModelState.ON_DISK:
            raise AssertionError(f"{self.where}: queued for room while {self.state.value}")
        self.state = ModelState.WAITING

    def give_up(self, wake) -> None:
        """One waiter's deadline passed: it no longer waits; the last one to go takes the copy out of the
        queue (leave_room_queue)."""
        self.waiters.remove(wake)
        if not self.waiters:
            self.leave_room_queue()

    def leave_room_queue(self) -> list:
        """WAITING -> ON_DISK: no request waits for room for it any more (the last one gave up, or it was
        refused); returns the waiters to wake, no longer waiting."""
        if self.state is not ModelState.WAITING:
            raise AssertionError(f"{self.where}: left the room queue while {self.state.value}")
        self.state = ModelState.ON_DISK
        waiters, self.waiters = self.waiters, []
        return waiters

    def start_load(self, prewarm: bool = False) -> None:
        """ON_DISK or WAITING -> LOADING: a promotion (or the host copy's fetch of a damaged version) is on its
        way; `prewarm`: its policy's, which no request asked for (yet)."""
        if self.state not in (ModelState.ON_DISK, ModelState.WAITING):
            raise AssertionError(f"{self.where}: a load started while {self.state.value}")
        self.state = ModelState.LOADING
        self.prewarmed = prewarm and not self.waiters

    def finish_load(self, ok: bool) -> list:
        """LOADING -> RESIDENT (ok) or ON_DISK; returns the waiters to wake, no longer waiting."""
        if self.state is not ModelState.LOADING:
            raise AssertionError(f"{self.where}: a load finished while {self.state.value}")
        self.state = ModelState.RESIDENT if ok else ModelState.ON_DISK
        if not ok:
            self.prewarmed = False
        waiters, self.waiters = self.waiters, []
        return waiters

    def refetched(self) -> None:
        """The host copy's fetch of a fresh version ended (LOADING -> ON_DISK): its promotion comes next."""
        if self.state is not ModelState.LOADING:
            raise AssertionError(f"{self.where}: fetched again while {self.state.value}")
        self.state = ModelState.ON_DISK

    # -- freeing -----------------------------------------------------------------------------
    def check_freeable(self) -> None:
        """Raise unless this copy may be freed now (an explicit evict; pins do not count): never memory a
        lease maps, nor a copy that is waiting, loading, or that a copy above is being made from."""
        host = self.tier == HOST
        on = "" if host else f" on {self.tier}"
        if self.holds:
            raise CapacityError(f"{self.model.key} is in use by {plural(self.holds, self.session)}{on}; it cannot "
                                f"be evicted{'' if host else ' from that GPU'}")
        if self.state is ModelState.WAITING:
            raise CapacityError(f"{self.model.key} is waiting for room in {self.where} (requests wait for it); "
                                + ("evict it once it is resident" if host else "there is no copy there to evict yet"))
        if any(c.state is ModelState.WAITING for c in self.model.gpu_copies()) and host:
            raise CapacityError(f"{self.model.key} is waiting for room on a GPU (requests wait for it there); "
                                "evict it once they are served")
        if self.state is ModelState.LOADING or self.busy_above:
            raise CapacityError(f"{self.model.key} is loading; evict it once it is resident" if host else
                                f"{self.model.key} is being copied to GPU {self.tier}; evict it once it is there")

    def freed(self) -> bool:
        """RESIDENT -> ON_DISK, raising (so that nothing is freed) while anything holds it; returns whether it
        had been pre-warmed and no call used it."""
        self.check_freeable()
        if self.state is not ModelState.RESIDENT:
            raise AssertionError(f"{self.where}: freed while {self.state.value}")
        wasted, self.prewarmed = self.prewarmed, False
        self.state = ModelState.ON_DISK
        return wasted

    # -- what it says --------------------------------------------------------------------------
    @property
    def session(self) -> str:
        return "session" if self.tier == HOST else "GPU session"

    @property
    def where(self) -> str:
        return "the host tier" if self.tier == HOST else f"GPU {self.tier}"

    def why_kept(self) -> list:
        """[(reason, what to do)] that keep this copy in its tier when room is needed; [] when none does."""
        if self.state is ModelState.WAITING:
            return []                 # (no copy: it holds no room)
        if self.state is ModelState.LOADING:
            return [("loading" if self.tier == HOST else "being copied there", WAIT)]
        reasons = [(f"in use by {plural(self.holds, self.session)}", CLOSE_SESSIONS)] if self.holds else []
        if self.busy_above and not self.holds:     # (a GPU lease holds the host copy too)
            waiting = any(c.state is ModelState.WAITING for c in self.model.gpu_copies())
            reasons.append(("waiting for room on a GPU" if waiting else "being copied to a GPU", WAIT))
        return reasons + ([("pinned", UNPIN)] if self.model.pinned else [])


@dataclass(eq=False)
class ModelRecord:
    name: str
    version: int
    disk_dir: Path
    manifest: Manifest
    pinned: bool = False
    hits: int = 0
    misses: int = 0
    last_use: float = 0.0
    # Why a stored file of this version failed its checksum ("" while none has): it is not served.
    damage: str = ""
    refetched: bool = False  # fetched again after damage, not yet promoted: damage now is the store's own
    tier_copies: dict = field(default_factory=dict)   # HOST or GPU UUID -> TierCopy (the host's always there)
    key: str = field(init=False)  # "name@version": asked several times per request, so made once

    def __post_init__(self):
        self.key = f"{self.name}@{self.version}"
        self.tier_copies[HOST] = TierCopy(self, HOST)

    @property
    def feed_check(self):
        """The check every serve-mode request's feeds go through, compiled once per model."""
        check = self.__dict__.get("_feed_check")
        if check is None:
            from ..tensors import FeedCheck
            io = self.manifest.io_summary()
            check = self.__dict__["_feed_check"] = FeedCheck(self.name, io["inputs"], io["overridable"])
        return check

    # -- its copies ------------------------------------------------------------------------------
    def copy_in(self, tier: str) -> TierCopy:
        """The model's copy in `tier` (HOST or a GPU's UUID): a record in state ON_DISK while not there."""
        copy = self.tier_copies.get(tier)
        if copy is None:
            copy = self.tier_copies[tier] = TierCopy(self, tier)
        return copy

    @property
    def host(self) -> TierCopy:
        return self.tier_copies[HOST]

    def gpu_copies(self) -> list:
        """Its copies on GPUs that are there or on their way (WAITING, LOADING, RESIDENT)."""
        return [c for t, c in self.tier_copies.items() if t != HOST and c.state is not ModelState.ON_DISK]

    @property
    def devices(self) -> dict:
        """GPU UUID -> its copy there, for the GPUs where it is (or is on its way)."""
        return {c.tier: c for c in self.gpu_copies()}

    @property
    def state(self) -> ModelState:
        """The host copy's state: what `ls` shows as the model's."""
        return self.host.state

    @property
    def refcount(self) -> int:
        """What holds the host copy: leases (GPU leases too) and requests in flight."""
        return self.host.holds

    @property
    def tier(self) -> str:
        """The fastest tier that holds it."""
        if any(c.state is ModelState.RESIDENT for c in self.gpu_copies()):
            return "gpu"
        return "host" if self.host.state is ModelState.RESIDENT else "disk"

    @property
    def copies(self) -> list:
        """The memory tiers holding a resident copy: "host", then "gpu:<UUID>" each ([]: on disk only)."""
        return (["host"] if self.host.state is ModelState.RESIDENT else []) + \
            [f"gpu:{c.tier}" for c in self.gpu_copies() if c.state is ModelState.RESIDENT]

    # -- the rest of its lifecycle: the only code that changes these fields ---------------------------
    def pin(self, pinned: bool) -> bool:
        """Pin or unpin (a pinned model is never a victim); returns whether it was pinned."""
        was, self.pinned = self.pinned, pinned
        return was

    def opened(self, hit: bool) -> None:
        """An open found the model resident (a hit) or had to load it."""
        self.hits += hit
        self.misses += not hit

    def used(self, now: float) -> None:
        """A lease was granted at wall time `now`."""
        self.last_use = now

    def mark_corrupt(self, why: str) -> None:
        """A stored file failed its checksum: not served until a fresh copy replaces it."""
        self.damage = why

    def found_intact(self) -> bool:
        """A scrub of its stored files found them intact (repaired, or put back): served again.
        Returns whether it had been marked corrupt."""
        was_marked, self.damage = bool(self.damage), ""
        return was_marked

    def replaced(self, disk_dir: Path, manifest: Manifest) -> None:
        """The remote store's fresh copy replaced a damaged one; its host copy's promotion comes next."""
        self.disk_dir, self.manifest = disk_dir, manifest
        self.__dict__.pop("_feed_check", None)          # built from the old manifest
        self.host.refetched()
        self.damage, self.refetched = "", True

    def promoted(self) -> None:
        """Its host copy is resident: damage found from now on is the store's own copy's."""
        self.refetched = False

    def why_resident(self, kept_alive: bool) -> str:
        """Why the host copy is there, for `ls`: in use, pinned, pre-warmed, kept alive (its policy's window
        is open: `kept_alive`), or just cached (it stays until room is needed); "" when not resident."""
        host = self.host
        if host.state is ModelState.LOADING:
            return "loading"
        if host.state is ModelState.WAITING:
            return f"waiting for room ({plural(len(host.waiters), 'request')})"
        if host.state is not ModelState.RESIDENT:
            return ""
        reasons = (["in use"] if host.holds else []) + (["pinned"] if self.pinned else []) + \
            (["pre-warmed"] if host.prewarmed else []) + (["kept alive"] if kept_alive and not host.holds else [])
        return ", ".join(reasons) or "cached"

    def describe(self, host_bytes: int = 0, gpu_bytes: int = 0, **policy_view) -> dict:
        """For listings. bytes: the stored weights (every variant); host_bytes, gpu_bytes: each tier's own
        charge for it (the host tier's: what a promotion places when it is not resident; GPU: 0 when on none).
        policy_view: why, keep_alive_until, next_call (daemon/listing.py), added at the end."""
        return {"name": self.name, "version": self.version, "bytes": self.manifest.weights_bytes,
                "host_bytes": host_bytes, "gpu_bytes": gpu_bytes,
                "tier": self.tier, "state": "corrupt" if self.damage else self.state.value, "refcount": self.refcount,
                "hits": self.hits, "misses": self.misses, "last_use": self.last_use, "pinned": self.pinned,
                "tensors": len(self.manifest.tensors), "opt_level": self.manifest.opt_level,
                "gpu": [{"device": c.tier, "state": c.state.value, "leases": c.holds} for c in self.gpu_copies()],
                "corrupt": self.damage, **policy_view}


def blank_listing(name: str, version: int, **fields) -> dict:
    """An entry of a listing shaped like ModelRecord.describe, for what holds no copy anywhere: `fields` say it."""
    return {"name": name, "version": version, "bytes": 0, "host_bytes": 0, "gpu_bytes": 0, "tier": "disk",
            "state": "", "refcount": 0, "hits": 0, "misses": 0, "last_use": 0.0, "pinned": False, "tensors": 0,
            "opt_level": "", "gpu": [], "why": "", "keep_alive_until": None, "next_call": None, **fields}


def describe_unreadable(name: str, version: int, why: str) -> dict:
    """A version on disk whose manifest cannot be used."""
    return blank_listing(name, version, state="corrupt", corrupt=why)


@dataclass
class ClientRecord:
    client_id: str
    pid: int
    name: str
    last_seen: float
    leases: set = field(default_factory=set)
    uid: int | None = None           # the kernel's, with pid (see daemon/identity.py); None: a tcp:// client
    gid: int | None = None
    connection: object = None        # a lane connection that is this client: it lives as long as that does


@dataclass
class Lease:
    lease_id: str
    client_id: str
    model: ModelRecord
    tier: str = HOST                 # whose copy it maps: HOST, or a GPU's UUID


class Registry:
    def __init__(self):
        self.models: dict[tuple[str, int], ModelRecord] = {}
        self._versions: dict[str, list[int]] = {}   # name -> its versions, ascending: resolve runs per request
        self.clients: dict[str, ClientRecord] = {}
        self.leases: dict[str, Lease] = {}
        self._ids = itertools.count(1)

    # -- models ----------------------------------------------------------------------
    def add_model(self, disk_dir: Path, manifest: Manifest) -> ModelRecord:
        rec = ModelRecord(manifest.name, manifest.version, disk_dir, manifest)
        if (rec.name, rec.version) not in self.models:
            bisect.insort(self._versions.setdefault(rec.name, []), rec.version)
        self.models[(rec.name, rec.version)] = rec
        return rec

    def remove_model(self, rec: ModelRecord) -> None:
        del self.models[(rec.name, rec.version)]
        versions = self._versions[rec.name]
        versions.remove(rec.version)
        if not versions:
            del self._versions[rec.name]

    def by_key(self, key: str) -> ModelRecord | None:
        """The model whose key ("name@version") a policy or the engine names; None if it is gone."""
        name, _, version = key.rpartition("@")
        return self.models.get((name, int(version))) if version.isdigit() else None

    def versions(self, name: str) -> list[int]:
        return list(self._versions.get(name, ()))

    def resolve(self, name: str, version: int | None) -> ModelRecord:
        if version is not None:
            rec = self.models.get((name, version))
            if rec is not None:
                return rec
        versions = self._versions.get(name)
        if not versions:
            known = sorted({n for n, _ in self.models})
            hint = f"known models: {', '.join(known)}" if known else "the repository is empty; add one with `modelcache add`"
            raise ModelNotFound(f"no model named {name!r}; {hint}")
        if version is None:
            version = versions[-1]
        if version not in versions:
            raise ModelNotFound(f"model {name!r} has no version {version}; it has {versions}")
        return self.models[(name, version)]

    def next_version(self, name: str, reserved: set) -> int:
        taken = set(self.versions(name)) | {v for (n, v) in reserved if n == name}
        return max(taken, default=0) + 1

    # -- clients and leases ----------------------------------------------------------
    def new_client(self, pid: int, name: str, now: float, uid: int | None = None,
                   gid: int | None = None, connection=None) -> ClientRecord:
        cid = f"c{next(self._ids)}-{secrets.token_hex(4)}"
        rec = ClientRecord(cid, pid, name, now, uid=uid, gid=gid, connection=connection)
        self.clients[cid] = rec
        return rec

    def client(self, client_id: str) -> ClientRecord:
        rec = self.clients.get(client_id)
        if rec is None:
            raise LeaseError(f"unknown client {client_id!r}: its lease expired or the daemon restarted; reconnect")
        return rec

    def grant(self, client: ClientRecord, model: ModelRecord, now: float, tier: str = HOST) -> Lease:
        """A lease on the model's copy in `tier` (HOST, or a GPU's UUID), for the table; its residency
        manager holds the copy (Residency.lease)."""
        lease = Lease(f"l{next(self._ids)}-{secrets.token_hex(4)}", client.client_id, model, tier)
        self.leases[lease.lease_id] = lease
        client.leases.add(lease.lease_id)
        model.used(now)
        return lease

    def release(self, lease_id: str, client_id: str | None = None) -> Lease:
        """Take a lease off the table; the caller lets its copy go (Residency.release)."""
        lease = self.leases.get(lease_id)
        if lease is None or (client_id is not None and lease.client_id != client_id):
            raise LeaseError(f"unknown lease {lease_id!r}")
        del self.leases[lease_id]
        client = self.clients.get(lease.client_id)
        if client is not None:  # a dropped client is already gone from the table
            client.leases.discard(lease_id)
        return lease

    def drop_client(self, client_id: str) -> list[Lease]:
        """Forget a client and take every lease it held off the table; returns them (to be let go)."""
        rec = self.clients.pop(client_id, None)
        if rec is None:
            return []
        return [self.release(lease_id) for lease_id in list(rec.leases)]
