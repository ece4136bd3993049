"""The host tier's cache: promotion from disk into shared memory, eviction, pinning, prefetch, add, fetch.

`HostCache` runs on the owner loop. It is handed what it works with: the registry (whose model
records own their transitions), the host tier (which plans, writes and frees), the eviction policy
(which only chooses), the repository and remote store, the loader threads for slow work, and
`reply` to answer a request later. The GPU tier (`DeviceCache`, devices.py) builds on it: a model
reaches a GPU through the host tier, and leaves the host tier only after its GPU copies.
"""

from __future__ import annotations

import logging
import time

from .. import protocol as P
from ..errors import (CapacityError, DaemonUnavailable, IntegrityError, ModelCacheError, ModelNotFound, PackError,
                      RemoteError)
from ..eviction import make_policy
from ..format import PREPACKED_FILE, load_manifest
from ..packing import pack_in_subprocess
from ..scrub import DAMAGED, nothing_to_verify, verify_version
from ..storage import storage_errors
from ..sources import check_regular_files, check_source_names, close_all
from ..tiers.host import variant_tensors
from ..tiers.base import Tier
from .loaders import Loaders
from .registry import ModelRecord, ModelState, Registry
from .room import RoomQueue

log = logging.getLogger("modelcache.daemon")


class HostCache:
    def __init__(self, *, registry: Registry, host: Tier, policy, repository, remote, loaders: Loaders, settings,
                 admins, counters: dict, jobs: dict, clock, reply, redispatch, wall=time.time):
        self.registry = registry
        self.host = host                  # tiers.host.HostTier (the Tier contract, and its export)
        self.policy = policy              # eviction: it chooses, this frees
        self.repository = repository
        self.remote = remote              # tiers.remote.RemoteStore, or None
        self.loaders = loaders
        self.settings = settings
        self.admins = admins
        self.counters = counters
        self.jobs = jobs                  # in-flight packs, fetches and loads, for stats
        self.clock = clock
        self.wall = wall                  # wall time: when a keep-alive ends, as `ls` and `status` show it
        self.reply = reply                # (ident, message): answer a request later
        self.redispatch = redispatch      # (ident, request): run a request again (after its fetch)
        # The GPU cache (daemon/devices.py), set by whoever builds this one, with or without devices:
        # a model reaches a GPU through the host tier, and evicting from host demotes its GPU copies first.
        self.gpu = None
        # Called with a model's key when its host copy is freed or replaced: what was built over it goes.
        self.forget: list = []
        self.fetches: dict = {}           # (name, version) -> [(retry, fail)] waiting on one fetch
        self.reserved_versions: set = set()     # versions being packed, not yet in the registry
        # Packing subprocesses, so an immediate stop can kill them. Loader threads add and remove
        # entries (single set operations, atomic under the GIL); only the signal handler reads it.
        self.packers: set = set()
        # Requests waiting for room while the tier is full of models in use (room.py).
        self.room = RoomQueue()
        self.needs: dict = {}   # key -> bytes its last promotion that found no room would have placed

    def handlers(self) -> dict:
        return {P.Load: self.on_Load, P.Remove: self.on_Remove, P.Pin: self.on_Pin, P.Evict: self.on_Evict,
                P.Add: self.on_Add, P.Verify: self.on_Verify}

    def host_variants(self, model: ModelRecord) -> tuple:
        """What a host promotion copies: the CPU weights, and the GPU ones when there is a GPU tier."""
        return ("cpu", "gpu") if self.gpu.tiers and model.manifest.gpu_tensors else ("cpu",)

    def describe(self, model: ModelRecord) -> dict:
        """A model as listings show it, with each tier's charge for it from that tier's own accounting."""
        host_bytes = self.host.model_bytes(model.key) if model.state is ModelState.RESIDENT else \
            self.promotion_bytes(model)
        gpu_bytes = sum(self.gpu.tiers[uuid].model_bytes(model.key) for uuid, r in model.devices.items()
                        if r.state is ModelState.RESIDENT)
        # The timed policies' view (eviction/timed.py), in wall time: until when an idle model is kept, and
        # when its next call is expected (None: no timer, or no prediction).
        now, wall = self.clock(), self.wall()

        def as_wall(t):
            return None if t is None else wall + (t - now)
        kept, call = self.policy.keep_alive_until(model.key), self.policy.predicted_next_call(model.key)
        why = ", ".join(filter(None, (model.why_resident(kept is not None and kept > now),
                                      self.gpu.waiting_text(model))))   # (and each GPU where requests wait for it)
        out = model.describe(host_bytes, gpu_bytes, why=why, keep_alive_until=as_wall(kept), next_call=as_wall(call))
        for copy in out["gpu"]:   # (only under a timed policy: the copy's record is otherwise as it was)
            until = self.gpu.policies[copy["device"]].keep_alive_until(model.key)
            if until is not None:
                copy["keep_alive_until"] = as_wall(until)
        return out

    def promotion_bytes(self, model: ModelRecord) -> int:
        """About what a promotion would place, before planning it: its distinct tensors of the variants copied,
        and pre-packed blobs (less what it shares with resident models, more the tensors' alignment)."""
        distinct = {t.sha256: t.nbytes for v in self.host_variants(model) for t in variant_tensors(model.manifest, v)}
        return sum(distinct.values()) + model.manifest.files.get(PREPACKED_FILE, {}).get("bytes", 0)

    def when_resident(self, model: ModelRecord, then, deadline: float | None = None) -> bool:
        """Call then(error, hit) once `model` is resident: now on a hit (returns True), else after the one load.
        With the tier full of models in use, the request waits for room until `deadline` (clock time; None:
        request_timeout_s from now); a model larger than the whole tier raises CapacityError at once."""
        if model.state is ModelState.RESIDENT:
            then(None, True)
            return True
        if model.damage and self.remote is None:  # (through `then`: a serve request's hold is released there)
            then(corrupt_refusal(model), False)
            return False

        def wake(err):
            then(err, False)
        model.wait_for_load(wake)
        if model.damage and model.state is ModelState.ON_DISK:  # a fetch that failed before: try again
            self._refetch_damaged(model)
        elif model.state in (ModelState.ON_DISK, ModelState.WAITING):  # the first miss starts the load
            try:
                self._promote_or_wait(model, wake, deadline)
            except ModelCacheError:
                model.waiters.clear()   # (this caller gets the error raised; no load is in flight)
                raise
        return False

    def _promote_or_wait(self, model: ModelRecord, wake, deadline: float | None) -> None:
        """Start the model's promotion if there is room and no request waits for room before it; else queue
        `wake` for room (room.py), in arrival order."""
        queued = bool(self.room)
        if model.state is ModelState.ON_DISK:
            if not queued and self.start_promotion(model):
                return
            needs = self.promotion_bytes(model) if queued else 0
            if needs > self.host.capacity_bytes:   # behind a queue: it would wait for nothing
                raise capacity_refusal(model.key, needs, "the host tier", self.host.capacity_bytes, 0, {},
                                       "host_capacity")
            model.queue_for_room()
        now = self.clock()
        self.room.add(model, wake, now + self.settings.request_timeout_s if deadline is None else deadline, now)
        log.debug("%s waits for room in the host tier (%d models queued)", model.key, len(self.room.models))
        if queued:
            self.admit()

    def admit(self) -> None:
        """Room may have appeared (a release, an eviction, more capacity, an unpin): start the promotions waiting
        for it, the oldest first (room.py); then the GPUs' queues, as an eviction or unpin may free room there."""
        self.room.admit(self.start_promotion)
        self.gpu.admit()

    def stop_waiting(self) -> None:
        """The daemon is stopping: answer every request still waiting for room, rather than leave it to time out."""
        self.room.stop(lambda model: DaemonUnavailable(f"the modelcache daemon stopped while {model.key} waited for "
                                                       "room in the host tier; ask again once it is back"))
        self.gpu.stop_waiting()

    def room_refusal(self, model: ModelRecord, waited_s: float) -> CapacityError:
        """A request's deadline passed while it waited for room: how long, and what held the tier then."""
        kept = {m.key: m.why_kept() for m in self.registry.models.values()
                if m is not model and m.state in (ModelState.LOADING, ModelState.RESIDENT)}
        needs = self.needs.get(model.key) or self.promotion_bytes(model)
        error = capacity_refusal(model.key, needs, "the host tier", self.host.capacity_bytes,
                                 self.host.used_bytes, kept, "host_capacity")
        return CapacityError(f"waited {waited_s:.1f} s for room, until the request's deadline: {error}")

    # -- timers: the policy's keep-alive and pre-warm deadlines, and the deadlines of requests waiting for room --
    def next_timer(self) -> float | None:
        """When on_timer next has something to do (clock time); None: nothing pending, in any tier."""
        times = [t for t in (self.policy.next_deadline(), self.room.next_deadline(), self.gpu.next_timer())
                 if t is not None]
        return min(times, default=None)

    def on_timer(self, now: float) -> None:
        """Run what is due by `now` (the owner loop calls this every turn; nothing due costs a heap peek)."""
        for model, wake, waited_s in self.room.expired(now):
            wake(self.room_refusal(model, waited_s))
        for action in self.policy.due(now):
            model = self.registry.by_key(action.key)
            if model is None:
                continue
            if action.kind == "unload":
                if model.evictable:   # (in use: the policy asks again after its release; pinned: never)
                    self.evict(model, counter="unloads")
                    self.admit()
            elif action.kind == "prewarm":
                self._prewarm(model)
        self.gpu.on_timer(now)

    def _prewarm(self, model: ModelRecord) -> None:
        """Promote `model` before its expected call, if it is on disk, no request waits for room, and it fits;
        room only from what the policy's prewarm_victims offers. Otherwise the pre-warm is dropped."""
        if model.state is not ModelState.ON_DISK or model.damage or self.room:
            return
        try:
            if self.start_promotion(model, prewarm=True):
                self.counters["prewarms"] += 1
                log.info("pre-warming %s disk -> host: its next call is expected soon", model.key)
        except ModelCacheError as e:
            log.info("pre-warm of %s dropped: %s", model.key, e)

    def on_Load(self, ident, msg: P.Load):
        device = None
        if msg.tier != "host":
            if msg.tier.partition(":")[0] != "gpu":
                raise ModelCacheError(f"unknown tier {msg.tier!r}: use 'host', 'gpu' or 'gpu:<UUID or index>'")
            device = self.gpu.tier_named(msg.tier)
        model = self.resolve_or_fetch(ident, msg)
        if model is None:
            return None
        self.admins.check_model_owner(ident, model, "load")
        before = model.copies

        def answer(error, hit):
            reply = outcome(msg, model, before) if error is None else \
                P.ErrorReply(req_id=msg.req_id, code=error.code, message=str(error))
            self.reply(ident, reply)

        if device is None:
            self.when_resident(model, answer)
        else:
            self.gpu.when_on_device(model, device, answer)
        return None

    def resolve(self, name: str, version: int | None) -> ModelRecord:
        """The model a request names. A version whose manifest is damaged is refused as what it is
        (IntegrityError), by every request alike: attach, serve, describe, remove..."""
        try:
            return self.registry.resolve(name, version)
        except ModelNotFound:
            unreadable = self._unreadable_version(name, version)
            if not unreadable:
                raise
        fix = f"open it to fetch it again from {self.remote.url}" if self.remote is not None else \
            "no remote store is configured to fetch it again"
        raise IntegrityError(f"{unreadable}; {fix}")

    def resolve_or_fetch(self, ident: bytes, msg) -> ModelRecord | None:
        """The model a request names; if only the remote store has it (or has a good copy of a version whose
        manifest is damaged here), start one fetch and return None: the request runs again when it lands."""
        try:
            return self.registry.resolve(msg.name, msg.version)
        except ModelNotFound:
            if self.remote is None:
                return self.resolve(msg.name, msg.version)   # (raises: unknown, or damaged)
        key = (msg.name, msg.version)

        def fail(error):
            self.reply(ident, P.ErrorReply(req_id=msg.req_id, code=error.code, message=str(error)))

        waiting = self.fetches.get(key)
        self.fetches.setdefault(key, []).append((lambda: self.redispatch(ident, msg), fail))
        if waiting is not None:
            return None  # one fetch per model, however many ask
        job = {"kind": "fetch", "model": f"{msg.name}@{msg.version or 'latest'}", "bytes_done": 0, "bytes_total": 0}
        self.jobs[f"fetch:{key}"] = job

        def progress(done, total):
            job["bytes_done"], job["bytes_total"] = done, total

        def work():
            entry = self.remote.resolve(msg.name, msg.version)
            # (the repository's table, read off the loop: a dict lookup, and only the owner writes it)
            if (entry["name"], entry["version"]) in self.repository.unreadable:
                self.repository.remove(entry["name"], entry["version"])  # its damaged copy is in the way
            return self.remote.fetch(entry, self.repository.root, progress)

        def done(result, error):
            self.jobs.pop(f"fetch:{key}", None)
            waiters = self.fetches.pop(key, [])
            if error is None:
                model_dir, manifest, seconds = result
                if manifest.name != msg.name:
                    error = RemoteError(f"the remote store's {msg.name} holds a manifest for {manifest.name!r}")
                else:
                    self.repository.unreadable.pop((manifest.name, manifest.version), None)
                    if (manifest.name, manifest.version) not in self.registry.models:
                        self.registry.add_model(model_dir, manifest)
                    self.counters["fetched"] += 1
                    log.info("model fetched: %s@%d from %s, %.1f MiB in %.2f s", manifest.name, manifest.version,
                             self.remote.url, manifest.weights_bytes / 2**20, seconds)
            for retry, fail_ in waiters:
                retry() if error is None else fail_(error)

        self.loaders.run(work, done)
        return None

    def on_Remove(self, ident, msg: P.Remove):
        if msg.version is not None and (msg.name, msg.version) in self.repository.unreadable:
            self.repository.remove(msg.name, msg.version)  # a version whose manifest is damaged: never registered
            del self.repository.unreadable[(msg.name, msg.version)]
            log.info("damaged model removed: %s@%d", msg.name, msg.version)
            return P.Ack(req_id=msg.req_id)
        model = self.resolve(msg.name, msg.version)
        self.admins.check_model_owner(ident, model, "remove")
        try:
            model.check_freeable()
        except CapacityError:
            raise CapacityError(f"{model.key} is in use or loading; it cannot be removed now") from None
        # From disk first: a removal that fails there (StorageError) leaves the version as it was, served.
        self.repository.remove(model.name, model.version)
        if model.state is ModelState.RESIDENT:
            self.evict(model)
            self.admit()
        self.registry.remove_model(model)
        log.info("model removed: %s", model.key)
        return P.Ack(req_id=msg.req_id)

    def on_Pin(self, ident, msg: P.Pin):
        model = self.resolve(msg.name, msg.version)
        self.admins.check_model_owner(ident, model, "pin" if msg.pinned else "unpin")
        was_pinned, model.pinned = model.pinned, msg.pinned
        log.info("model %s: %s", "pinned" if msg.pinned else "unpinned", model.key)
        if was_pinned and not msg.pinned:
            self.admit()    # it may make room for a request waiting
        return outcome(msg, model, model.copies, was_pinned=was_pinned)

    def on_Verify(self, ident, msg: P.Verify):
        """Scrub the versions this daemon knows (of `name`, or all) on a loader thread, and serve again
        each one marked corrupt whose files are now intact: the way back after repairing a file."""
        unreadable = [(n, v) for n, v in self.repository.unreadable if msg.name in (None, n)]
        models = [m for m in self.registry.models.values() if msg.name in (None, m.name)]
        if msg.name is not None and not models and not unreadable:
            raise ModelNotFound(nothing_to_verify(self.repository.root, msg.name))
        targets = sorted([(m.key, m.disk_dir) for m in models] +
                         [(f"{n}@{v}", self.repository.model_dir(n, v)) for n, v in unreadable])
        unregistered = {f"{n}@{v}": (n, v) for n, v in unreadable}

        def work():
            reports = [verify_version(disk_dir, key) for key, disk_dir in targets]
            # A version whose manifest was damaged at start and is intact now: its manifest, to register it.
            restored = {}
            for r in reports:
                if r.key in unregistered and r.status != DAMAGED:
                    try:
                        restored[r.key] = load_manifest(self.repository.model_dir(*unregistered[r.key]), r.key)
                    except IntegrityError:   # damaged again since its check: it stays unreadable
                        pass
            return reports, restored

        def done(result, error):
            if error is not None:
                self.reply(ident, P.ErrorReply(req_id=msg.req_id, code=getattr(error, "code", "internal"),
                                               message=f"verify: {error}"))
                return
            reports, restored = result
            by_key = {m.key: m for m in models}
            out = []
            for r in reports:
                model = by_key.get(r.key)
                cleared = model is not None and r.status != DAMAGED and model.found_intact()
                if r.key in restored and self.repository.unreadable.pop(unregistered[r.key], None) is not None \
                        and unregistered[r.key] not in self.registry.models:
                    self.registry.add_model(self.repository.model_dir(*unregistered[r.key]), restored[r.key])
                    cleared = True
                if cleared:
                    log.info("model %s: its files are intact again (verify); served again", r.key)
                out.append(r.to_wire(cleared))
            self.reply(ident, P.VerifyReply(req_id=msg.req_id, root=str(self.repository.root), reports=out))

        self.loaders.run(work, done)
        return None

    def after_release(self, model: ModelRecord, device: str | None = None) -> None:
        """A lease or a request let go of the model: tell the policies, and free it if they say so now."""
        if device is not None:
            self.gpu.after_release(model, device)
        if model.idle:
            self.policy.released(model.key, self.clock())
            if self.policy.evict_on_release and model.evictable:
                self.evict(model)
            if self.room:
                self.admit()

    def on_Evict(self, ident, msg: P.Evict):
        model = self.resolve(msg.name, msg.version)
        self.admins.check_model_owner(ident, model, "evict")
        before, freed = model.copies, 0
        if msg.tier != "host":
            if msg.tier.partition(":")[0] != "gpu":
                raise ModelCacheError(f"unknown tier {msg.tier!r}: use 'host', 'gpu' or 'gpu:<UUID or index>'")
            freed = self.gpu.evict_named(model, msg.tier)
        else:
            model.check_freeable()
            if model.state is ModelState.RESIDENT:
                freed = self.evict(model)
                self.admit()
        return outcome(msg, model, before, freed_bytes=freed)

    def evict(self, model: ModelRecord, counter: str = "evictions") -> int:
        """Free a resident, unreferenced model from memory, its GPU copies first (the tiers are inclusive;
        clients' old host mappings stay valid). Returns the bytes freed, in every tier. `counter`: "evictions"
        (room was needed, or asked for), or "unloads" (its keep-alive ended)."""
        model.check_freeable()
        freed = sum(self.gpu.evict_from_device(model, uuid) for uuid in list(model.devices))
        model.evicted()                 # (raises, freeing nothing, if anything still holds it)
        host_freed = self.host.free_model(model.key)
        self.policy.removed(model.key)
        for forget in self.forget:
            forget(model.key)
        self.counters[counter] += 1
        log.info("model %s: %s from host, %.1f MiB freed%s", "unloaded" if counter == "unloads" else "evicted",
                 model.key, host_freed / 2**20, ", idle past its keep-alive" if counter == "unloads" else "")
        return freed + host_freed

    def make_room(self, bytes_over: int, loading: str, prewarm: bool = False) -> bool:
        """Evict unreferenced, unpinned resident models, as the policy chooses, until `bytes_over` is freed
        (for a pre-warm, only those its policy's prewarm_victims offers).

        Nothing is evicted unless the whole need can be met. Shared segments free only when
        all their users go, so when the policy's per-model choice falls short we walk its
        order and count what a growing prefix frees together.
        """
        by_key = {m.key: m for m in self.registry.models.values() if m.evictable and m.key != loading}
        victims = choose_victims(self.policy, by_key, self.host.bytes_freed_by, bytes_over,
                                 prewarm_of=loading if prewarm else None)
        if victims is None:
            return False
        for key in victims:
            self.evict(by_key[key])
        return True

    def on_Add(self, ident, msg: P.Add):
        """Pack the files whose descriptors came with the request (daemon/lane.py): the daemon reads what
        the client could open, and never opens a path a client names (sources.py says why)."""
        take_fds = getattr(ident, "take_fds", None)
        fds = take_fds() if take_fds is not None else []
        try:
            if take_fds is None:
                raise PackError(f"add {msg.name}: the model's files travel as descriptors over the daemon's local "
                                "socket (ipc://, its .lane), which this request did not come by; upgrade the client")
            check_source_names(msg.files)
            if len(fds) != len(msg.files):
                raise PackError(f"add {msg.name}: {len(msg.files)} files named, {len(fds)} descriptors passed")
            check_regular_files(fds, msg.files, msg.name)
            return self._start_add(ident, msg, fds)
        except BaseException:
            close_all(fds)
            raise

    def _start_add(self, ident, msg: P.Add, fds: list[int]):
        """Pack on a loader thread; the descriptors are closed when it is done."""
        opt_level = msg.opt_level or self.settings.opt_level
        with_prepacked = self.settings.prepack if msg.prepack is None else msg.prepack
        version = msg.version if msg.version is not None else self.registry.next_version(msg.name, self.reserved_versions)
        if (msg.name, version) in self.registry.models or (msg.name, version) in self.reserved_versions:
            raise PackError(f"model {msg.name} version {version} already exists")
        key = (msg.name, version)
        self.reserved_versions.add(key)
        job = {"kind": "add", "model": f"{msg.name}@{version}", "bytes_done": 0, "bytes_total": 0}
        self.jobs[f"add:{msg.name}@{version}"] = job

        def progress(done, total):  # written by the loader thread; only read for stats
            job["bytes_done"], job["bytes_total"] = done, total

        owner_uid = -1 if ident.uid is None else ident.uid

        def work():
            t0 = time.perf_counter()
            started = []
            try:
                manifest = pack_in_subprocess(msg.path, self.repository.root, msg.name, version, opt_level,
                                              progress, on_start=lambda p: (started.append(p), self.packers.add(p)),
                                              sources=(fds, msg.files), owner_uid=owner_uid,
                                              with_prepacked=with_prepacked,
                                              declared={"serving": msg.serving, "model_config": msg.model_config})
            finally:
                close_all(fds)
                for p in started:
                    self.packers.discard(p)
            return manifest, time.perf_counter() - t0

        def done(result, error):
            self.reserved_versions.discard(key)
            self.jobs.pop(f"add:{msg.name}@{version}", None)
            if error is not None:
                log.warning("add %s from %s failed: %s", job["model"], msg.path, error)
                self.reply(ident, P.ErrorReply(req_id=msg.req_id, code=error.code, message=str(error)))
                return
            manifest, pack_s = result
            self.registry.add_model(self.repository.model_dir(msg.name, version), manifest)
            self.counters["adds"] += 1
            log.info("model added: %s@%d, %d tensors, %.1f MiB, packed in %.2f s", msg.name, version,
                     len(manifest.tensors), manifest.weights_bytes / 2**20, pack_s)
            self.reply(ident, P.AddReply(req_id=msg.req_id, name=msg.name, version=version,
                                          weights_bytes=manifest.weights_bytes, tensors=len(manifest.tensors),
                                          pack_s=pack_s))

        self.loaders.run(work, done)
        return None

    def start_promotion(self, model: ModelRecord, prewarm: bool = False) -> bool:
        """Plan the model's place in the host tier, make room if needed, and copy it on a loader thread.
        False: no room now (nothing reserved; the caller queues the request, or drops the pre-warm, whose room
        comes only from `prewarm_victims`); CapacityError: the model alone exceeds the tier."""
        plan = self.host.plan(model.key, model.disk_dir, model.manifest, self.host_variants(model))  # reserves
        over = self.host.used_bytes - self.host.capacity_bytes
        if over > 0 and not self.make_room(over, loading=model.key, prewarm=prewarm):
            self.host.abort(plan)
            if plan.segment_bytes > self.host.capacity_bytes:
                raise capacity_refusal(model.key, plan.segment_bytes, "the host tier", self.host.capacity_bytes, 0,
                                       {}, "host_capacity")
            self.needs[model.key] = plan.segment_bytes   # (for the refusal, should its request's deadline pass)
            return False
        self.needs.pop(model.key, None)
        model.start_load(prewarm)
        self.jobs[f"load:{model.key}"] = {"kind": "load", "model": model.key, "bytes_total": plan.segment_bytes}

        def done(seconds, error):
            self.jobs.pop(f"load:{model.key}", None)
            if error is not None:
                self.host.abort(plan)
                waiters = model.finish_load(ok=False)
                log.error("promotion of %s failed: %s", model.key, error)
                self.admit()    # its reservation is free again
                if isinstance(error, IntegrityError):
                    self.counters["corrupt_detected"] += 1
                    model.mark_corrupt(str(error))
                    if self.remote is not None and not model.refetched:
                        for wake in waiters:  # they wait on the fetch, then on the promotion after it
                            model.wait_for_load(wake)
                        self._refetch_damaged(model)
                        return
                    if self.remote is None:
                        error = corrupt_refusal(model)
            else:
                self.host.commit(plan)
                waiters = model.finish_load(ok=True)
                self.policy.created(model.key, self.host.model_bytes(model.key), self.clock())
                self.counters["promotions"] += 1
                # (the blob also holds the GPU variant's own tensors: count what this promotion placed)
                placed = sum(t.nbytes for v in plan.locations for t in variant_tensors(model.manifest, v))
                shared = placed - plan.segment_bytes
                log.info("model promoted: %s disk -> host, %.1f MiB copied in %.3f s%s", model.key,
                         plan.segment_bytes / 2**20, seconds,
                         f", {shared / 2**20:.1f} MiB shared with resident models" if shared > 0 else "")
            for wake in waiters:
                wake(error)
            if error is None and self.room:
                # A model loaded for no session (a `load`, a pre-warm) was no victim while it was being copied;
                # now it is one, and a request waiting for room may take its place.
                self.admit()

        def write():
            with storage_errors(f"promoting {model.key} to the host tier", self.host.root):
                return self.host.write(plan)

        self.loaders.run(write, done)
        return True

    def _unreadable_version(self, name: str, version: int | None) -> str:
        """Why the repository could not register `name` at `version` (any version when None), or ""."""
        for (n, v), why in self.repository.unreadable.items():
            if n == name and version in (None, v):
                return why
        return ""

    def _refetch_damaged(self, model: ModelRecord) -> None:
        """Replace a damaged version with the remote store's copy, then promote it for the waiters.

        LOADING meanwhile: no second fetch or promotion starts, and remove and evict leave it alone.
        A copy that is damaged again right after its fetch is not fetched a third time (`refetched`)."""
        model.start_load()
        job = self.jobs[f"fetch:{model.key}"] = {"kind": "fetch", "model": model.key, "bytes_done": 0,
                                                 "bytes_total": model.manifest.weights_bytes}
        log.warning("%s: fetching it again from %s", model.damage, self.remote.url)

        def progress(done, total):
            job["bytes_done"], job["bytes_total"] = done, total

        def work():
            entry = self.remote.resolve(model.name, model.version)
            self.repository.remove(model.name, model.version)
            return self.remote.fetch(entry, self.repository.root, progress)

        def done(result, error):
            self.jobs.pop(f"fetch:{model.key}", None)
            if error is None:
                disk_dir, manifest, seconds = result
                model.replaced(disk_dir, manifest)
                for forget in self.forget:
                    forget(model.key)
                self.counters["refetched"] += 1
                log.info("model fetched again: %s from %s in %.2f s", model.key, self.remote.url, seconds)
                try:   # (its waiters' own deadlines are not kept across a fetch: request_timeout_s from now)
                    if not self.start_promotion(model):
                        model.queue_for_room()
                        now = self.clock()
                        for wake in model.waiters:
                            self.room.add(model, wake, now + self.settings.request_timeout_s, now)
                    return
                except ModelCacheError as e:
                    error = e
            else:
                error = IntegrityError(f"{model.damage}; fetching it again from {self.remote.url} failed: {error}")
            for wake in model.finish_load(ok=False):
                wake(error)

        self.loaders.run(work, done)


def policy_for(settings):
    """A tier's eviction policy as the settings name it: `eviction_policy`, and for the timed ones
    (keepalive, hybrid) `keep_alive_s` and `policy_time_scale`."""
    return make_policy(settings.eviction_policy, time_scale=settings.policy_time_scale,
                       keep_alive_s=settings.keep_alive_s)


def outcome(msg, model: ModelRecord, before: list, **fields):
    """The answer to a load, pin or evict: Ack, or what was done when the request asks (older clients do not)."""
    if not msg.outcome:
        return P.Ack(req_id=msg.req_id)
    return P.ModelOutcome(req_id=msg.req_id, name=model.name, version=model.version, before=before,
                          after=model.copies, pinned=model.pinned, **fields)


def corrupt_refusal(model: ModelRecord) -> IntegrityError:
    """Why a version marked corrupt is not served, and the way back (with no remote store to fetch it from)."""
    return IntegrityError(f"{model.damage}; no remote store is configured to fetch it again: repair or replace "
                          f"the file, then run `modelcache verify {model.name}` to re-check it")


def size_text(n: int) -> str:
    """Bytes as a message shows them: MiB, or KiB below one."""
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


def capacity_refusal(key: str, needs: int, where: str, capacity: int, used: int, kept: dict,
                     setting: str) -> CapacityError:
    """The capacity error of every tier, from the tier's own accounting (`used`: its bytes without this
    model's reservation): a model larger than the whole tier only needs the setting raised; otherwise
    it names what holds the tier and why (`kept`: key -> ModelRecord.why_kept), and what would free it."""
    if needs > capacity:
        return CapacityError(f"{key} needs {size_text(needs)} in {where}, more than the whole tier ({setting} = "
                             f"{size_text(capacity)}): the model alone does not fit; raise {setting}")
    held = [(k, reasons) for k, reasons in sorted(kept.items()) if reasons]
    advice = list(dict.fromkeys(todo for _, reasons in held for _, todo in reasons))
    holders = ", ".join(f"{k} ({', '.join(why for why, _ in reasons)})" for k, reasons in held)
    return CapacityError(f"{key} needs {size_text(needs)} in {where} ({size_text(capacity)}, "
                         f"{size_text(used)} used), and "
                         + (f"the models there cannot be evicted now: {holders}" if held else
                            "evicting the unused models there would not free enough (they share memory with "
                            "models in use)")
                         + f"; {', '.join(advice + [f'or raise {setting}'])}")


def choose_victims(policy, candidates: dict, bytes_freed_by, bytes_over: int,
                   prewarm_of: str | None = None) -> list | None:
    """The keys to evict from one tier to free `bytes_over`, or None when all candidates together fall short.
    For a pre-warm of `prewarm_of`, only the victims the policy's prewarm_victims offers (demand comes first).

    Shared segments free only when all their users go, so when the policy's per-model choice
    falls short we walk its order and count what a growing prefix frees together."""
    sizes = {k: bytes_freed_by([k]) for k in candidates}
    if prewarm_of is not None:
        victims = policy.prewarm_victims(prewarm_of, bytes_over, sizes)
    else:
        victims = policy.choose_victims(bytes_over, sizes)
    if not victims and prewarm_of is None:
        prefix = []
        for key in policy.order(list(candidates)):
            prefix.append(key)
            if bytes_freed_by(prefix) >= bytes_over:
                victims = prefix
                break
    if not victims or bytes_freed_by(victims) < bytes_over:
        return None
    return victims
