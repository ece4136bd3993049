"""The daemon's tables: models with their lifecycle, and clients. Owned by the owner loop alone.

A model's record owns its transitions (as sllm-store's `Model` and plasma's lifecycle manager do): pins,
hits, damage, its manifest's changes (a new partition, calibrated batching). Its copies in each memory
tier, and the leases and other holds on them, are the residency managers' (daemon/residency/). Their
fields change only through their own methods (tests/test_layers.py checks every module).
"""

from __future__ import annotations

import bisect
import itertools
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LeaseError, ModelNotFound
from ..store.format import Manifest
from .residency.copy import HOST, ModelState, TierCopy
from .wording import plural

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
            from ..wire.tensors import FeedCheck
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

    def reconfigured(self, manifest: Manifest) -> None:
        """Its declared configuration was replaced in place (serve's on_Configure): the same weights and files."""
        self.manifest = manifest

    def repartitioned(self, result: dict) -> None:
        """A partition was stored (executor/partition.py's result): its stages, their cuts and files' checksums;
        a batching profile calibrated for the old stages no longer holds."""
        self.manifest.stages, self.manifest.stage_cuts = result["stages"], result.get("cuts", [])
        self.manifest.batching = {}
        self.manifest.files = result.get("files", self.manifest.files)

    def calibrated(self, batching: dict, checksum: str | None = None) -> None:
        """A batching profile was stored (`checksum`: the manifest's as written), or ({}) one found unusable is
        set aside for this run."""
        self.manifest.batching = batching
        if checksum is not None:
            self.manifest.checksum = checksum

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
    uid: int | None = None           # the kernel's, with pid (see daemon/identity.py); None: a tcp:// client
    gid: int | None = None
    connection: object = None        # a lane connection that is this client: it lives as long as that does


class Registry:
    def __init__(self):
        self.models: dict[tuple[str, int], ModelRecord] = {}
        self._versions: dict[str, list[int]] = {}   # name -> its versions, ascending: resolve runs per request
        self.clients: dict[str, ClientRecord] = {}
        self._ids = itertools.count(1)
        # Names a protocol front unloaded (Triton's explicit model control, P.SetUnloaded): every front says them not
        # ready and refuses their requests until one loads them; kept until the daemon stops, as Triton's unloads.
        self.unloaded: set[str] = set()

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

    # -- clients ---------------------------------------------------------------------
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

    def forget_client(self, client_id: str) -> ClientRecord | None:
        """Take a client off the table (its leases are its residency managers' to end: Residency.drop_client)."""
        return self.clients.pop(client_id, None)
