"""What is resident in one memory tier, and everything that changes it: one type, instantiated per tier.

A `Residency` runs on the owner loop over one `Tier` (tiers/base.py): the host tier's, and one per GPU
above it (`below`: the tier a copy here is promoted from; a GPU copy holds the host copy it came from,
and goes first when the host copy is freed). It alone owns, for its tier: the models' copies there
(copy.py) and every hold on them (holds.py: leases, with the lease table every tier shares; requests in
flight; profile runs; serve-mode GPU workers), the requests waiting for room (room.py), the one promotion
however many ask, refusals that name what holds the tier, victims chosen through its eviction policy
(which only chooses), the policy's keep-alive and pre-warm timers, and every notification the policy
hears; adoption after a restart, capacity changes, an operator's evict and remove. `evict` is the one
method that frees memory in any tier, and it frees nothing a holder maps.

The same object runs the FaaS replay (benchmarks/faas/simulate.py) over a sizes-only tier, virtual
loaders and a virtual clock: the replay's states are these.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ...errors import CapacityError, DaemonUnavailable, IntegrityError, ModelCacheError
from .room import RoomQueue
from ..wording import plural
from .copy import ModelState, TierCopy
from .holds import PROFILE, REQUEST, SESSION, WORKER, Hold, Lease, LeaseTable
from .victims import capacity_refusal, choose_victims

if TYPE_CHECKING:   # (the registry's records hold their copies: copy.py, which this package owns)
    from ..registry import ModelRecord, Registry

log = logging.getLogger("modelcache.daemon")


class Residency:
    def __init__(self, *, tier, policy, registry: Registry, loaders, counters: dict, jobs: dict, clock,
                 settings, below: "Residency | None" = None, source=None, memory=None):
        self.tier = tier                  # tiers.host.HostTier or tiers.gpu.DeviceTier (the Tier contract)
        self.id = tier.id                 # its copies' key in each model's record
        self.policy = policy              # eviction: it chooses, this frees
        self.registry = registry
        self.loaders = loaders            # run(work, done): work on a loader thread, done on the owner loop
        self.counters = counters
        self.jobs = jobs                  # loads in flight, for stats
        self.clock = clock
        self.settings = settings          # request_timeout_s: a waiter's deadline when its request set none
        self.below = below                # the tier a copy here is promoted from; None: the repository
        self.above: list = []             # the tiers promoted from this one
        if below is not None:
            below.above.append(self)
        # The bottom tier's: the repository side (fetch.py), which fetches a damaged version again.
        self.source = source
        # The host tier's: the memory limit's headroom (memory.py), which a promotion must leave free.
        self.memory = memory
        self.room = RoomQueue()
        # The daemon's leases, in whichever tier: one table, the bottom tier's, which the tiers above share.
        self.leases: LeaseTable = below.leases if below is not None else LeaseTable()
        self.workers: dict = {}           # (serve-mode GPU worker id, model key) -> its Hold on the copy here
        self.resident: dict = {}          # key -> ModelRecord of each copy resident here: what room is made from
        self.needs: dict = {}             # key -> bytes its last promotion that found no room would have placed
        # key -> the OutOfMemoryError of a serve request's promotion that waits for memory (requests in flight
        # hold it, and let go in milliseconds): said, with how long it waited, if its deadline passes first
        self.short_of_memory: dict = {}
        # Called with (model key, tier id) when a copy here is freed or replaced: what was built over it goes.
        self.forget: list = []
        self._prefix = "" if tier.name == "host" else "gpu_"   # its counters: promotions, gpu_promotions, ...

    def count(self, name: str) -> None:
        key = self._prefix + name
        self.counters[key] = self.counters.get(key, 0) + 1

    def copy(self, model: ModelRecord) -> TierCopy:
        """The model's copy here: its record makes one (ON_DISK) the first time a tier asks."""
        return model.tier_copies.get(self.id) or model.copy_in(self.id)

    def is_resident(self, model: ModelRecord) -> bool:
        return model.copy_in(self.id).state is ModelState.RESIDENT

    # -- bringing a model in ----------------------------------------------------------------------
    def when_resident(self, model: ModelRecord, then, deadline: float | None = None, wait: bool = True,
                      memory_wait: bool = False, overflow=None) -> bool:
        """Call then(error, hit) once `model` is resident here: now on a hit (returns True), else after the
        one promotion (from the tier below first, where it is not there either). With a tier full of models
        in use the request waits for room, in each tier, until `deadline` (clock time; None:
        request_timeout_s from now); `wait=False`: here it is refused at once instead (a serve request, which
        the CPU serves). `memory_wait` (a serve request): where the memory limit cannot take it while other
        models are held, it waits for their holds to end as for room, rather than fail at once (a lease may be
        held for hours: an open fails at once). A model that can never be here, or is larger than the whole
        tier, raises ModelCacheError at once when its tier is the first one missing it. `overflow` (an attach
        open, disk_opens.py): called instead where the request would wait for room, or be refused for room or
        memory, in this tier (the bottom one: it maps the repository's files instead)."""
        copy = self.copy(model)
        if copy.state is ModelState.RESIDENT:
            then(None, True)
            return True
        self.tier.check_model(model.key, model.manifest)
        if self.below is None:
            refusal = self.source.refusal(model) if self.source is not None else None
            if refusal is not None:   # (through `then`: a serve request's hold is released there)
                then(refusal, False)
                return False
            self._join(model, copy, then, deadline, wait, memory_wait, overflow)
            return False

        def on_below(error, _hit):
            if error is not None:
                then(error, False)
                return
            try:
                self._join(model, copy, then, deadline, wait)
            except ModelCacheError as e:
                then(e, False)

        self.below.when_resident(model, on_below, deadline)
        return False

    def _join(self, model: ModelRecord, copy: TierCopy, then, deadline: float | None, wait: bool,
              memory_wait: bool = False, overflow=None) -> None:
        """Wait on the load in flight, or start it, or wait for room for it."""
        def wake(err):
            then(err, False)
        if copy.state is ModelState.RESIDENT:   # (it arrived while the tier below was loading)
            then(None, False)
        elif copy.state is ModelState.LOADING:
            copy.wait_for_load(wake)
        elif self.source is not None and model.damage:   # a fetch of a damaged version that failed before
            copy.wait_for_load(wake)
            self._refetch(model, copy)
        else:
            self._promote_or_wait(model, copy, wake, deadline, wait, memory_wait, overflow)

    def _promote_or_wait(self, model: ModelRecord, copy: TierCopy, wake, deadline: float | None, wait: bool,
                         memory_wait: bool = False, overflow=None) -> None:
        """Start the copy's promotion if there is room and no request waits for room before it; else queue
        `wake` for room (room.py), in arrival order; or, given `overflow`, call it instead of waiting or
        refusing."""
        queued = bool(self.room)
        if copy.state is ModelState.ON_DISK:
            try:
                if not queued and self._start(model, copy, memory_wait=memory_wait):
                    copy.wait_for_load(wake)
                    return
            except CapacityError:   # (the memory limit; or the model alone exceeds the tier)
                if overflow is None:
                    raise
        if overflow is not None:    # no room now (or queued for it already, for other requests): not waited for
            overflow()
            return
        if copy.state is ModelState.ON_DISK:
            needs = self._needs(model)
            if needs > self.tier.capacity_bytes or not wait:   # it would wait for nothing; or told not to wait
                raise self._refusal(model, needs)
            copy.queue_for_room()
        elif not wait:
            raise self._refusal(model, self._needs(model))
        copy.wait_for_room(wake, memory_wait)
        now = self.clock()
        self.room.add(copy, wake, now + self.settings.request_timeout_s if deadline is None else deadline, now)
        log.debug("%s waits for room in %s (%d models queued)", model.key, self.tier.where, len(self.room.models))
        if queued:
            self.admit()

    def _needs(self, model: ModelRecord) -> int:
        """What the model's copy would place here: as its last promotion that found no room planned it, else
        planned now (less what it shares here) and given back."""
        needs = self.needs.get(model.key)
        if needs:
            return needs
        plan = self.tier.plan(model.key, model.manifest)
        self.tier.abort(plan)
        return plan.bytes

    def _start(self, model: ModelRecord, copy: TierCopy, prewarm: bool = False, memory_wait: bool = False) -> bool:
        """Plan the model's place here, make room if needed, and copy it on a loader thread. False: no room
        now (nothing reserved; the caller queues the request, or drops the pre-warm, whose room comes only from
        its policy's prewarm_victims); CapacityError: the model alone exceeds the tier."""
        tier = self.tier
        plan = tier.plan(model.key, model.manifest)   # reserves
        over = tier.used_bytes - tier.capacity_bytes
        if over > 0 and not self._make_room(over, loading=model.key, prewarm=prewarm):
            tier.abort(plan)
            if plan.bytes > tier.capacity_bytes:
                raise self._refusal(model, plan.bytes)
            self.needs[model.key] = plan.bytes   # (for the refusal, should its request's deadline pass)
            return False
        self.needs.pop(model.key, None)
        if self.memory is not None:
            try:
                self._fit_memory(model, plan, prewarm)
            except CapacityError as e:   # (OutOfMemoryError; the plan is given back)
                if not (memory_wait and self._memory_may_come_back(model)):
                    self.short_of_memory.pop(model.key, None)
                    raise
                self.short_of_memory[model.key] = e
                self.needs[model.key] = plan.bytes
                return False
            self.short_of_memory.pop(model.key, None)
            self.memory.started(plan.bytes)
        copy.start_load(prewarm)
        job = f"load:{model.key}:{self.id}"
        self.jobs[job] = {"kind": f"{self._prefix}load".replace("_", "-"), "model": model.key, "tier": self.id,
                          "bytes_total": plan.bytes}

        def done(seconds, error):
            self.jobs.pop(job, None)
            if self.memory is not None:
                self.memory.settled(plan.bytes)
            if error is not None:
                tier.abort(plan)
                waiters = copy.finish_load(ok=False)
                log.error("promotion of %s to %s failed: %s", model.key, tier.where, error)
                if isinstance(error, IntegrityError) and self.source is not None:
                    error = self._damaged(model, copy, error, waiters)
                    if error is None:    # its waiters now wait on the fetch, then on the promotion after it
                        self.admit()     # (its reservation is free again)
                        return
            else:
                tier.commit(plan)
                waiters = copy.finish_load(ok=True)
                self.resident[model.key] = model
                if self.source is not None:
                    model.promoted()
                self.policy.created(model.key, tier.model_bytes(model.key))
                self.count("promotions")
                rate = f" ({plan.bytes / seconds / 1e9:.1f} GB/s)" if seconds else ""
                log.info("model promoted: %s to %s, %.1f MiB copied in %.3f s%s", model.key, tier.where,
                         plan.bytes / 2**20, seconds, rate)
            for wake in waiters:
                wake(error)
            # Room may have appeared: a failed copy's reservation, a copy loaded for no request (a `load`, a
            # pre-warm: no victim while it was copied), the copy below that this one was made from.
            (self.below or self).admit()

        self.loaders.run(lambda: tier.write(plan), done)
        return True

    # -- a damaged version (the bottom tier: its source is the repository) -------------------------
    def _damaged(self, model: ModelRecord, copy: TierCopy, error: IntegrityError, waiters: list):
        """A stored file failed its checksum while promoting: the version is marked, and fetched again from
        the remote store (once) for `waiters`, who then get None back here; else the error they get."""
        self.counters["corrupt_detected"] = self.counters.get("corrupt_detected", 0) + 1
        model.mark_corrupt(str(error))
        if self.source.can_refetch(model):
            for wake in waiters:
                copy.wait_for_load(wake)
            self._refetch(model, copy)
            return None
        return self.source.refusal(model) or error

    def _refetch(self, model: ModelRecord, copy: TierCopy) -> None:
        """Replace a damaged version with the remote store's copy, then promote it for its waiters.
        LOADING meanwhile: no second fetch or promotion starts, and remove and evict leave it alone."""
        copy.start_load()

        def fetched(error):
            if error is None:
                for forget in self.forget:
                    forget(model.key, self.id)
                try:   # (its waiters' own deadlines are not kept across a fetch: request_timeout_s from now)
                    if not self._start(model, copy):
                        copy.queue_for_room()
                        now = self.clock()
                        for wake in copy.waiters:
                            self.room.add(copy, wake, now + self.settings.request_timeout_s, now)
                    return
                except ModelCacheError as e:
                    error = e
                copy.start_load()   # (a load that could not start: its waiters are told, as a failed fetch's)
            for wake in copy.finish_load(ok=False):
                wake(error)

        self.source.fetch_again(model, fetched)

    # -- room -----------------------------------------------------------------------------------------
    def admit(self) -> None:
        """Room may have appeared (a release, an eviction, more capacity, an unpin): start the promotions
        waiting for it, the oldest first (room.py); then the tiers above, as freeing here frees there too."""
        self.room.admit(lambda copy: self._start(copy.model, copy, memory_wait=copy.memory_wait))
        for tier in self.above:
            tier.admit()

    def stop_waiting(self) -> None:
        """The daemon is stopping: answer every request still waiting for room, rather than leave it to time out."""
        self.room.stop(lambda copy: DaemonUnavailable(
            f"the modelcache daemon stopped while {copy.model.key} waited for room in {self.tier.where}; ask again "
            "once it is back"))

    def _refusal(self, model: ModelRecord, needs: int) -> CapacityError:
        """No room here for the model: what holds the tier and why (or: it alone exceeds the tier)."""
        kept = {m.key: c.why_kept() for m in self.registry.models.values()
                if m is not model and (c := m.tier_copies.get(self.id)) is not None
                and c.state in (ModelState.LOADING, ModelState.RESIDENT)}
        return capacity_refusal(model.key, needs, self.tier.where, self.tier.capacity_bytes, self.tier.used_bytes,
                                kept, self.tier.capacity_setting)

    def _room_refusal(self, model: ModelRecord, waited_s: float) -> CapacityError:
        """A request's deadline passed while it waited for room: how long, and what held the tier then (or the
        memory, for a serve request that waited for memory)."""
        short = self.short_of_memory.pop(model.key, None)
        if short is not None:
            return type(short)(f"waited {waited_s:.1f} s for memory, until the request's deadline: {short}")
        return CapacityError(f"waited {waited_s:.1f} s for room, until the request's deadline: "
                             f"{self._refusal(model, self._needs(model))}")

    # -- holding and letting go: leases, requests, profile runs, serve-mode GPU workers ------------------------
    def grant(self, client, model: ModelRecord, now: float) -> Lease:
        """A client's lease on the copy here (resident): held until close, drop_client or end; the open is a
        call of the model in every tier it holds, and its last use (wall time `now`)."""
        lease = self.leases.new(client.client_id, model)
        self._take(lease)
        tier = self
        while tier is not None:
            tier.policy.accessed(model.key)
            tier = tier.below
        model.used(now)
        return lease

    def grant_unheld(self, client, model: ModelRecord, now: float) -> Lease:
        """A client's lease on no copy: an open answered from the repository's files (disk_opens.py). It holds
        nothing a tier frees; it is a lease so that close, goodbye and the client's end treat it as any other."""
        lease = self.leases.new(client.client_id, model)
        model.used(now)
        return lease

    def leases_over_files(self, model: ModelRecord) -> int:
        """The model's leases that hold no copy (grant_unheld): sessions over the repository's files."""
        return sum(1 for lease in self.leases.by_id.values() if lease.model is model and not lease.tiers)

    def close(self, lease_id: str, client_id: str | None = None) -> Lease:
        """A client closed its lease (LeaseError: no such lease of that client's): its copy is let go."""
        lease = self.leases.take(lease_id, client_id)
        self.end(lease)
        return lease

    def drop_client(self, client_id: str) -> list:
        """A client left (goodbye, death, silence, its connection closed): each lease it held ends."""
        leases = [self.leases.take(lease_id) for lease_id in self.leases.of_client(client_id)]
        for lease in leases:
            self.end(lease)
        return leases

    def unclaimed(self, model: ModelRecord) -> None:
        """An open's copy came in for a client that left meanwhile, or may not map it: no lease is granted,
        but its policies hear the call and its copy is idle, as if a lease had come and gone."""
        self.end(self._take(Hold(SESSION, model)))

    def hold_request(self, model: ModelRecord, profile: bool = False) -> Hold:
        """A serve request (or a profile run) in flight on the model: its copy here is not freed until `end`."""
        return self._take(Hold(PROFILE if profile else REQUEST, model))

    def also(self, hold: Hold) -> None:
        """`hold` holds the model's copy here too (a request whose stages may run on this GPU), until its end."""
        self._take(hold)
        self.policy.accessed(hold.model.key)   # (a serve request is a call, as an open is)

    def hold_for_worker(self, model: ModelRecord, worker_id: int) -> None:
        """A serve-mode GPU worker may have sessions over the copy here: held (once per worker) until
        worker_done. The engine asks as it places each stage there."""
        if (worker_id, model.key) not in self.workers:
            self.workers[(worker_id, model.key)] = self._take(Hold(WORKER, model))

    def worker_done(self, model_key: str, worker_id: int):
        """The worker drops its sessions over the copy: returns a callable that ends its hold, to run once they
        are gone (a stage placed there meanwhile takes a new hold); None when it held none."""
        hold = self.workers.pop((worker_id, model_key), None)
        return None if hold is None else (lambda: self.end(hold))

    def end(self, hold: Hold) -> None:
        """The holder let go: each copy it held (here and in the tiers below each) is released; the policies
        hear of each copy left idle, and free it if they say so now; a request waiting for room may take
        its place."""
        if isinstance(hold, Lease):
            self.leases.discard(hold)     # (ended by its manager, not its client: off the table too)
        tiers, hold.tiers = hold.tiers, []
        for tier in reversed(tiers):     # (a GPU copy first: the host copy's release may evict it)
            tier._release(hold.model, hold)

    def _take(self, hold: Hold) -> Hold:
        self._hold(hold.model, hold)
        hold.tiers.append(self)
        return hold

    def _hold(self, model: ModelRecord, hold: Hold) -> None:
        """Not freed under `hold`, here nor in the tiers below."""
        self.copy(model).hold(hold)
        if self.below is not None:
            self.below._hold(model, hold)

    def accessed(self, model: ModelRecord) -> None:
        """A call of the model used its copy here (a serve request run): the policy hears it."""
        self.policy.accessed(model.key)

    def _release(self, model: ModelRecord, hold: Hold) -> None:
        copy = self.copy(model)
        copy.let_go(hold)
        if copy.idle:
            self.policy.released(model.key)
            if self.policy.evict_on_release and copy.evictable:
                self.evict(model)
        if self.room:
            self.admit()
        if self.below is not None:
            self.below._release(model, hold)

    def check_unheld(self, model: ModelRecord, doing: str, ignoring=None) -> None:
        """Raise unless nothing but holders of kind `ignoring` holds the model's copy here and it is not loading:
        what re-partitioning it needs (its serve-mode GPU workers' sessions are dropped with the old stages)."""
        copy = self.copy(model)
        if copy.state is ModelState.LOADING:
            raise CapacityError(f"{model.key} is in use (it is loading); {doing} it when no session or request "
                                "holds it")
        held = copy.holders_text(ignoring=ignoring)
        if held:
            raise CapacityError(f"{model.key} is in use ({held} hold it); {doing} it when no session or request "
                                "holds it")

    # -- freeing ----------------------------------------------------------------------------------------
    def evict(self, model: ModelRecord, counter: str = "evictions") -> int:
        """Free the model's copy here, and first its copies in the tiers above (the tiers are inclusive; a
        client's old host mapping stays valid). Returns the bytes freed, in every tier. `counter`: "evictions"
        (room was needed, or asked for) or "unloads" (its keep-alive ended).

        The one place memory leaves a tier: the copy's record says first whether anything holds it
        (check_freeable), and a copy a live lease maps is never freed, in any tier."""
        copy = self.copy(model)
        copy.check_freeable()         # (raises, freeing nothing)
        freed = sum(tier.evict(model) for tier in self.above if tier.is_resident(model))
        if copy.freed():
            self.count("wasted_prewarms")
        del self.resident[model.key]
        tier_freed = self.tier.free_model(model.key)
        self.policy.removed(model.key)
        for forget in self.forget:
            forget(model.key, self.id)
        self.count(counter)
        log.info("model %s: %s from %s, %.1f MiB freed%s", "unloaded" if counter == "unloads" else "evicted",
                 model.key, self.tier.where, tier_freed / 2**20,
                 ", idle past its keep-alive" if counter == "unloads" else "")
        return freed + tier_freed

    def _make_room(self, bytes_over: int, loading: str, prewarm: bool = False) -> bool:
        """Evict unheld, unpinned copies, as the policy chooses, until `bytes_over` is freed (for a pre-warm,
        only those its policy's prewarm_victims offers). Nothing is evicted unless the whole need can be met."""
        by_key = {k: m for k, m in self.resident.items() if m.tier_copies[self.id].evictable and k != loading}
        victims = choose_victims(self.policy, by_key, self.tier.bytes_freed_by, bytes_over,
                                 prewarm_of=loading if prewarm else None)
        if victims is None:
            return False
        for key in victims:
            self.evict(by_key[key])
        return True

    def _fit_memory(self, model: ModelRecord, plan, prewarm: bool) -> None:
        """The memory limit's headroom must take the plan and still leave memory_reserve free: idle models are
        given back for it (not for a pre-warm, which is dropped instead), else OutOfMemoryError (plan aborted)."""
        short = self.memory.shortfall(plan.bytes)
        if short > 0 and not prewarm:
            self.give_back(short, counter="pressure_evictions", loading=model.key)
            short = self.memory.shortfall(plan.bytes)
        if short > 0:
            self.tier.abort(plan)
            held = sorted(f"{m.key} ({', '.join(why for why, _ in m.tier_copies[self.id].why_kept())})"
                          for k, m in self.resident.items() if k != model.key and not m.tier_copies[self.id].evictable)
            raise self.memory.refusal(model.key, plan.bytes, held)

    def _memory_may_come_back(self, model: ModelRecord) -> bool:
        """Whether memory here may come back: another model's copy held (a request in flight, a lease), a
        promotion under way (its bytes reserved; its requests hold it, then let go), or serve sessions being
        dropped (a copy given back stays charged while they map it; admit() runs once they are gone)."""
        return (self.memory is not None and (self.memory.in_flight > 0 or self.memory.dropping > 0)) or any(
            m is not model and m.tier_copies[self.id].holds for m in self.resident.values())

    def give_back(self, bytes_wanted: int, counter: str = "evictions", loading: str | None = None) -> tuple[list, int]:
        """Free idle copies (unheld, unpinned, not `loading`) in the policy's order until `bytes_wanted` is freed
        or none is left: the memory limit's pressure, not the tier's capacity, asks (memory.py). Unlike
        _make_room it frees what it can even when that falls short. Returns (keys evicted, bytes freed)."""
        by_key = {k: m for k, m in self.resident.items() if m.tier_copies[self.id].evictable and k != loading}
        evicted, freed = [], 0
        for key in self.policy.order(list(by_key)):
            if freed >= bytes_wanted:
                break
            if self.tier.bytes_freed_by([key]) == 0:   # (shares all it holds with a model in use)
                continue
            before = self.tier.used_bytes
            self.evict(by_key[key], counter=counter)
            freed += before - self.tier.used_bytes
            evicted.append(key)
        return evicted, freed

    def demote(self, model: ModelRecord) -> int:
        """An operator's evict: free the model's copy here (and above) if there is one, or say what holds it
        (CapacityError, freeing nothing); then admit what waits for the room. Returns the bytes freed."""
        copy = self.copy(model)
        if self.below is not None and copy.state in (ModelState.ON_DISK, ModelState.WAITING):
            return 0      # (no copy on this GPU yet)
        copy.check_freeable()
        freed = self.evict(model) if copy.state is ModelState.RESIDENT else 0
        self.admit()
        return freed

    def remove(self, model: ModelRecord, from_disk, doing: str = "removed") -> None:
        """An operator's remove (the bottom tier's), or a replacement's swap (daemon/swaps.py, `doing`
        "replaced"): refused while anything holds or loads the model; else `from_disk()` (a failure there,
        StorageError, leaves the version as it was, served), then its copies are freed, room admitted, and the
        record forgotten."""
        in_use = self.leases_over_files(model) > 0   # (sessions map its files in the repository)
        try:
            self.copy(model).check_freeable()
        except CapacityError:
            in_use = True
        if in_use:
            raise CapacityError(f"{model.key} is in use or loading; it cannot be {doing} now")
        from_disk()
        if self.is_resident(model):
            self.evict(model)
            self.admit()
        self.registry.remove_model(model)

    def set_capacity(self, capacity_bytes: int) -> None:
        """A reload's new capacity. Lowered below what the tier holds, nothing is freed now: the next promotion
        evicts, as ever. Raised: the requests waiting for room are admitted."""
        self.tier.capacity_bytes = capacity_bytes
        self.admit()

    def adopt(self, model: ModelRecord) -> str:
        """A dead daemon's copy, found whole here after a restart (daemon/restart.py): resident again, or, where
        it lacks a variant this daemon's promotions copy, freed; then returns why ("" when adopted)."""
        missing = set(self.tier.variants(model.manifest)) - set(self.tier.models[model.key])
        if missing:
            self.tier.free_model(model.key)
            return f"its {', '.join(sorted(missing))} weights were not resident"
        copy = self.copy(model)
        copy.start_load()                 # (its load is the dead daemon's)
        copy.finish_load(ok=True)
        self.resident[model.key] = model
        self.policy.created(model.key, self.tier.model_bytes(model.key))
        self.counters["adopted"] = self.counters.get("adopted", 0) + 1
        return ""

    # -- timers: the policy's keep-alive and pre-warm deadlines, and those of requests waiting for room --------
    def next_timer(self) -> float | None:
        """When on_timer next has something to do (clock time); None: nothing pending."""
        return min((t for t in (self.policy.next_deadline(), self.room.next_deadline()) if t is not None),
                   default=None)

    def on_timer(self, now: float) -> None:
        """Run what is due by `now` (the owner loop calls this every turn; nothing due costs a heap peek)."""
        gave_up = False
        for copy, wake, waited_s in self.room.expired(now):
            wake(self._room_refusal(copy.model, waited_s))
            gave_up = True
        if gave_up and self.below is not None:
            self.below.admit()   # a copy none waits for here any more: the one below is evictable again
        for action in self.policy.due():
            model = self.registry.by_key(action.key)
            if model is None:
                continue
            if action.kind == "unload":
                if self.copy(model).evictable:   # (in use: the policy asks again after its release; pinned: never)
                    self.evict(model, counter="unloads")
                    self.admit()
            elif action.kind == "prewarm":
                self._prewarm(model)

    def _prewarm(self, model: ModelRecord) -> None:
        """Promote `model` before its expected call, if its source is ready, no request waits for room here, and
        it fits; room only from what the policy's prewarm_victims offers. Otherwise the pre-warm is dropped."""
        copy = self.copy(model)
        ready = not model.damage if self.below is None else self.below.is_resident(model)
        if copy.state is not ModelState.ON_DISK or not ready or self.room:
            return
        try:
            self.tier.check_model(model.key, model.manifest)
            if self._start(model, copy, prewarm=True):
                self.count("prewarms")
                log.info("pre-warming %s into %s: its next call is expected soon", model.key, self.tier.where)
        except ModelCacheError as e:
            log.info("pre-warm of %s into %s dropped: %s", model.key, self.tier.where, e)

    # -- what operators see ---------------------------------------------------------------------------------
    def describe(self) -> dict:
        """The tier as `status` lists it: its own description, its accounting, the copies there, who waits."""
        held = [m for m in self.registry.models.values()
                if (c := m.tier_copies.get(self.id)) is not None and c.state in (ModelState.LOADING, ModelState.RESIDENT)]
        return {**self.tier.describe(), "used_bytes": self.tier.used_bytes, "capacity_bytes": self.tier.capacity_bytes,
                "models": [m.key for m in held],
                "leased": {m.key: m.tier_copies[self.id].holds for m in held if m.tier_copies[self.id].holds},
                "waiting": self.room.waiting()}

    def waiting_text(self, model: ModelRecord) -> str:
        """For `ls` (WHY) of a tier above the host's: requests waiting for room here for the model, or ""."""
        copy = model.tier_copies.get(self.id)
        if copy is None or copy.state is not ModelState.WAITING:
            return ""
        return f"waiting for room on {self.tier.where.removeprefix('the GPU tier of ')} " \
               f"({plural(len(copy.waiters), 'request')})"
