"""The daemon's tables: models with their lifecycle, clients, and leases. Owned by the owner loop alone.

A model's record owns its transitions (as sllm-store's `Model` and plasma's lifecycle manager do):
holding and letting go (leases, requests in flight), starting and finishing the one load that every
waiter shares, marking damage, and being freed from a tier. The rule that matters most on a GPU —
memory is never freed while a lease maps it — is checked here, in `check_freeable` and
`DeviceResidency.check_freeable`, which the caches call before they free anything.
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


def plural(n: int, noun: str, nouns: str = "") -> str:
    """'1 session', '2 sessions': a count that reads right in a message."""
    return f"{n} {noun}" if n == 1 else f"{n} {nouns or noun + 's'}"


# What to do about each reason a copy is kept in its tier: capacity errors end with these.
CLOSE_SESSIONS, UNPIN, WAIT = "close sessions", "unpin", "wait for the load to finish"


class ModelState(enum.Enum):
    ON_DISK = "on_disk"      # only in the repository
    WAITING = "waiting"      # requests want it in a tier full of models in use: queued for room (room.py)
    LOADING = "loading"      # a loader thread is copying it into the host tier
    RESIDENT = "resident"    # in shared memory; clients may map it


@dataclass(eq=False)   # a record with an identity (queues find it by `is`), not a value
class DeviceResidency:
    """A model's copy on one GPU (the device tier is inclusive: the host tier holds it too).

    `leases` counts GPU leases: clients that map this copy by IPC. Memory they map is not
    reclaimed by freeing it (measured, shared/GPU.md), so only a copy with no leases is evicted.
    WAITING: no copy yet; requests wait for room on the device (its RoomQueue), and its host copy stays.
    """
    device: str                      # the device's UUID
    state: "ModelState"              # WAITING, LOADING or RESIDENT
    leases: int = 0
    waiters: list = field(default_factory=list)   # callbacks(error) waiting for room, then on the one promotion
    model: "ModelRecord" = field(default=None, repr=False)   # whose copy (its `devices` holds this)

    def leave_room_queue(self) -> list:
        """WAITING -> gone: no request waits for room on this GPU for the model any more (the last one gave up,
        or it was refused); returns the waiters to wake, no longer waiting."""
        if self.state is not ModelState.WAITING:
            raise AssertionError(f"{self.model.key}: left the room queue of {self.device} while {self.state.value}")
        self.state = ModelState.ON_DISK   # (not on this device: a deadline still queued for it sees it left)
        del self.model.devices[self.device]
        waiters, self.waiters = self.waiters, []
        return waiters

    def acquire(self) -> None:
        self.leases += 1

    def release(self) -> None:
        if self.leases <= 0:
            raise AssertionError(f"a GPU lease on {self.device} released more often than it was taken")
        self.leases -= 1

    @property
    def freeable(self) -> bool:
        return self.state is ModelState.RESIDENT and self.leases == 0

    def why_kept(self, pinned: bool) -> list:
        """[(reason, what to do)] that keep this copy on its GPU when room is needed; [] when none does."""
        if self.state is ModelState.WAITING:
            return []                 # (no copy: it holds no room)
        if self.state is ModelState.LOADING:
            return [("being copied there", WAIT)]
        return ([(f"in use by {plural(self.leases, 'GPU session')}", CLOSE_SESSIONS)] if self.leases else []) + \
            ([("pinned", UNPIN)] if pinned else [])

    def check_freeable(self, key: str) -> None:
        """Raise unless this copy may be freed now: device memory a lease maps is never freed."""
        if self.state is ModelState.WAITING:
            raise CapacityError(f"{key} is waiting for room on GPU {self.device} (requests wait for it); "
                                "there is no copy there to evict yet")
        if self.state is ModelState.LOADING:
            raise CapacityError(f"{key} is being copied to GPU {self.device}; evict it once it is there")
        if self.leases:
            raise CapacityError(f"{key} is in use by {plural(self.leases, 'GPU session')} on {self.device}; "
                                f"it cannot be evicted from that GPU")


@dataclass
class ModelRecord:
    name: str
    version: int
    disk_dir: Path
    manifest: Manifest
    state: ModelState = ModelState.ON_DISK
    refcount: int = 0
    pinned: bool = False
    hits: int = 0
    misses: int = 0
    last_use: float = 0.0
    # Opens waiting for the in-flight load: (reply callback) each. One load, many waiters.
    waiters: list = field(default_factory=list)
    devices: dict = field(default_factory=dict)   # device UUID -> DeviceResidency
    # Why a stored file of this version failed its checksum ("" while none has): it is not served.
    damage: str = ""
    refetched: bool = False  # fetched again after damage, not yet promoted: damage now is the store's own
    prewarmed: bool = False  # loaded by its policy's pre-warm, and no request has held it since
    key: str = field(init=False)  # "name@version": asked several times per request, so made once

    def __post_init__(self):
        self.key = f"{self.name}@{self.version}"

    @property
    def feed_check(self):
        """The check every serve-mode request's feeds go through, compiled once per model."""
        check = self.__dict__.get("_feed_check")
        if check is None:
            from ..tensors import FeedCheck
            check = self.__dict__["_feed_check"] = FeedCheck(self.name, self.manifest.io_summary()["inputs"])
        return check

    @property
    def tier(self) -> str:
        """The fastest tier that holds it."""
        if any(r.state is ModelState.RESIDENT for r in self.devices.values()):
            return "gpu"
        return "host" if self.state is ModelState.RESIDENT else "disk"

    @property
    def copies(self) -> list:
        """The memory tiers holding a resident copy: "host", then "gpu:<UUID>" each ([]: on disk only)."""
        return (["host"] if self.state is ModelState.RESIDENT else []) + \
            [f"gpu:{r.device}" for r in self.devices.values() if r.state is ModelState.RESIDENT]

    @property
    def busy_on_device(self) -> bool:
        """A device copy is loading (it reads the host copy), waiting for room (it will) or leased: the host
        copy must stay."""
        return any(r.state is not ModelState.RESIDENT or r.leases for r in self.devices.values())

    # -- lifecycle: the only code that changes state, refcount, waiters and damage ---------
    def hold(self, device: str | None = None) -> None:
        """A lease or a request in flight: the model (and its copy on `device`) is not freed under it."""
        if device is not None:
            self.devices[device].acquire()
        self.refcount += 1
        self.prewarmed = False

    def let_go(self, device: str | None = None) -> None:
        if self.refcount <= 0:
            raise AssertionError(f"{self.key} released more often than it was held")
        if device is not None:
            self.devices[device].release()
        self.refcount -= 1

    @property
    def idle(self) -> bool:
        """Resident with nothing holding it: the moment its eviction policy hears it was released."""
        return self.refcount == 0 and self.state is ModelState.RESIDENT

    def wait_for_load(self, wake) -> None:
        """`wake(error)` runs once the load in flight ends: one load, however many wait."""
        self.waiters.append(wake)

    def start_load(self, prewarm: bool = False) -> None:
        """ON_DISK or WAITING -> LOADING: a promotion (or a fetch of a damaged version) is on its way;
        `prewarm`: its policy's, which no request asked for (yet)."""
        if self.state not in (ModelState.ON_DISK, ModelState.WAITING):
            raise AssertionError(f"{self.key}: a load started while {self.state.value}")
        self.state = ModelState.LOADING
        self.prewarmed = prewarm and not self.waiters

    def queue_for_room(self) -> None:
        """ON_DISK -> WAITING: its waiters wait for room in the host tier (HostCache's room queue)."""
        if self.state is not ModelState.ON_DISK:
            raise AssertionError(f"{self.key}: queued for room while {self.state.value}")
        self.state = ModelState.WAITING

    def leave_room_queue(self) -> list:
        """WAITING -> ON_DISK: no request waits for room for it any more (the last one gave up, or it was
        refused); returns the waiters to wake, no longer waiting."""
        if self.state is not ModelState.WAITING:
            raise AssertionError(f"{self.key}: left the room queue while {self.state.value}")
        self.state = ModelState.ON_DISK
        waiters, self.waiters = self.waiters, []
        return waiters

    def finish_load(self, ok: bool) -> list:
        """LOADING -> RESIDENT (ok) or ON_DISK; returns the waiters to wake, no longer waiting."""
        self.state = ModelState.RESIDENT if ok else ModelState.ON_DISK
        if ok:
            self.refetched = False
        else:
            self.prewarmed = False
        waiters, self.waiters = self.waiters, []
        return waiters

    def mark_corrupt(self, why: str) -> None:
        """A stored file failed its checksum: not served until a fresh copy replaces it."""
        self.damage = why

    def found_intact(self) -> bool:
        """A scrub of its stored files found them intact (repaired, or put back): served again.
        Returns whether it had been marked corrupt."""
        was_marked, self.damage = bool(self.damage), ""
        return was_marked

    def replaced(self, disk_dir: Path, manifest: Manifest) -> None:
        """The remote store's fresh copy replaced a damaged one (LOADING -> ON_DISK, to be promoted)."""
        self.disk_dir, self.manifest = disk_dir, manifest
        self.__dict__.pop("_feed_check", None)          # built from the old manifest
        self.state = ModelState.ON_DISK
        self.damage, self.refetched = "", True

    @property
    def evictable(self) -> bool:
        """A candidate the eviction policy may choose: resident, unused, unpinned, no device copy busy."""
        return self.state is ModelState.RESIDENT and self.refcount == 0 and not self.pinned \
            and not self.busy_on_device

    def why_kept(self) -> list:
        """[(reason, what to do)] that keep the host copy when room is needed; [] when it may be evicted."""
        if self.state is ModelState.LOADING:
            return [("loading", WAIT)]
        reasons = [(f"in use by {plural(self.refcount, 'session')}", CLOSE_SESSIONS)] if self.refcount else []
        if self.busy_on_device and not self.refcount:     # (a GPU lease counts in refcount too)
            waiting = any(r.state is ModelState.WAITING for r in self.devices.values())
            reasons.append(("waiting for room on a GPU" if waiting else "being copied to a GPU", WAIT))
        return reasons + ([("pinned", UNPIN)] if self.pinned else [])

    def check_freeable(self) -> None:
        """Raise unless the host copy may be freed now (an explicit evict or remove; pins do not count)."""
        if self.refcount > 0:
            raise CapacityError(f"{self.key} is in use by {plural(self.refcount, 'session')}; it cannot be evicted")
        if self.state is ModelState.WAITING:
            raise CapacityError(f"{self.key} is waiting for room in the host tier (requests wait for it); "
                                "evict it once it is resident")
        if any(r.state is ModelState.WAITING for r in self.devices.values()):
            raise CapacityError(f"{self.key} is waiting for room on a GPU (requests wait for it there); "
                                "evict it once they are served")
        if self.state is ModelState.LOADING or self.busy_on_device:
            raise CapacityError(f"{self.key} is loading; evict it once it is resident")

    def evicted(self) -> None:
        """RESIDENT -> ON_DISK once its GPU copies are gone; raises if anything still holds it."""
        self.check_freeable()
        if self.state is not ModelState.RESIDENT or self.devices:
            raise AssertionError(f"{self.key} freed while {self.state.value} with GPU copies {list(self.devices)}")
        self.state = ModelState.ON_DISK
        self.prewarmed = False

    def why_resident(self, kept_alive: bool) -> str:
        """Why the host copy is there, for `ls`: in use, pinned, pre-warmed, kept alive (its policy's window
        is open: `kept_alive`), or just cached (it stays until room is needed); "" when not resident."""
        if self.state is ModelState.LOADING:
            return "loading"
        if self.state is ModelState.WAITING:
            return f"waiting for room ({plural(len(self.waiters), 'request')})"
        if self.state is not ModelState.RESIDENT:
            return ""
        reasons = (["in use"] if self.refcount else []) + (["pinned"] if self.pinned else []) + \
            (["pre-warmed"] if self.prewarmed else []) + (["kept alive"] if kept_alive and not self.refcount else [])
        return ", ".join(reasons) or "cached"

    def queue_for_device_room(self, device: str) -> DeviceResidency:
        """Not on `device` -> WAITING there: requests wait for room on it (that GPU's room queue)."""
        if device in self.devices or self.state is not ModelState.RESIDENT:
            raise AssertionError(f"{self.key}: queued for room on {device} while there or without a host copy")
        res = self.devices[device] = DeviceResidency(device, ModelState.WAITING, model=self)
        return res

    def start_device_load(self, device: str) -> DeviceResidency:
        """Not on `device`, or WAITING there (its waiters then wait on this load) -> LOADING."""
        res = self.devices.get(device)
        if (res is not None and res.state is not ModelState.WAITING) or self.state is not ModelState.RESIDENT:
            raise AssertionError(f"{self.key}: a GPU promotion to {device} started twice or without a host copy")
        if res is None:
            res = self.devices[device] = DeviceResidency(device, ModelState.LOADING, model=self)
        res.state = ModelState.LOADING
        return res

    def finish_device_load(self, device: str, ok: bool) -> list:
        """The copy on `device` is RESIDENT (ok) or gone; returns its waiters to wake."""
        res = self.devices[device]
        if ok:
            res.state = ModelState.RESIDENT
        else:
            del self.devices[device]
        waiters, res.waiters = res.waiters, []
        return waiters

    def device_evicted(self, device: str) -> None:
        """Forget the copy on `device`; raises (and frees nothing) while a lease maps it."""
        self.devices[device].check_freeable(self.key)
        del self.devices[device]

    def describe(self, host_bytes: int = 0, gpu_bytes: int = 0, **policy_view) -> dict:
        """For listings. bytes: the stored weights (every variant); host_bytes, gpu_bytes: each tier's own
        charge for it (the host tier's: what a promotion places when it is not resident; GPU: 0 when on none).
        policy_view: why, keep_alive_until, next_call (HostCache.describe), added at the end."""
        return {"name": self.name, "version": self.version, "bytes": self.manifest.weights_bytes,
                "host_bytes": host_bytes, "gpu_bytes": gpu_bytes,
                "tier": self.tier, "state": "corrupt" if self.damage else self.state.value, "refcount": self.refcount,
                "hits": self.hits, "misses": self.misses, "last_use": self.last_use, "pinned": self.pinned,
                "tensors": len(self.manifest.tensors), "opt_level": self.manifest.opt_level,
                "gpu": [{"device": r.device, "state": r.state.value, "leases": r.leases}
                        for r in self.devices.values()], "corrupt": self.damage, **policy_view}


def describe_unreadable(name: str, version: int, why: str) -> dict:
    """A version on disk whose manifest cannot be used, shaped like ModelRecord.describe for listings."""
    return {"name": name, "version": version, "bytes": 0, "host_bytes": 0, "gpu_bytes": 0, "tier": "disk",
            "state": "corrupt", "refcount": 0,
            "hits": 0, "misses": 0, "last_use": 0.0, "pinned": False, "tensors": 0, "opt_level": "",
            "gpu": [], "corrupt": why, "why": "", "keep_alive_until": None, "next_call": None}


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
    device: str | None = None        # the GPU whose copy it maps; None: the host tier's


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

    def grant(self, client: ClientRecord, model: ModelRecord, now: float, device: str | None = None) -> Lease:
        """A lease on the model's host copy, or on its copy on `device` (which holds the host copy too)."""
        lease = Lease(f"l{next(self._ids)}-{secrets.token_hex(4)}", client.client_id, model, device)
        model.hold(device)
        self.leases[lease.lease_id] = lease
        client.leases.add(lease.lease_id)
        model.last_use = now
        return lease

    def release(self, lease_id: str, client_id: str | None = None) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None or (client_id is not None and lease.client_id != client_id):
            raise LeaseError(f"unknown lease {lease_id!r}")
        del self.leases[lease_id]
        client = self.clients.get(lease.client_id)
        if client is not None:  # a dropped client is already gone from the table
            client.leases.discard(lease_id)
        lease.model.let_go(lease.device)
        return lease

    def drop_client(self, client_id: str) -> list[Lease]:
        """Forget a client and release every lease it held; returns the leases released."""
        rec = self.clients.pop(client_id, None)
        if rec is None:
            return []
        return [self.release(lease_id) for lease_id in list(rec.leases)]
