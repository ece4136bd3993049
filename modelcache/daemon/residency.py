"""What is resident in one memory tier, and everything that changes it: one type, instantiated per tier.

A `Residency` runs on the owner loop over one `Tier` (tiers/base.py): the host tier's, and one per GPU
above it (`below`: the tier a copy here is promoted from; a GPU copy holds the host copy it came from,
and goes first when the host copy is freed). It alone owns, for its tier: the models' copies there
(registry.TierCopy) and what holds them, the requests waiting for room (room.py), the one promotion
however many ask, refusals that name what holds the tier, victims chosen through its eviction policy
(which only chooses), the policy's keep-alive and pre-warm timers, and every notification the policy
hears. `evict` is the one method that frees memory in any tier, and it frees nothing a lease maps.

The same object runs the FaaS replay (benchmarks/faas/simulate.py) over a sizes-only tier, virtual
loaders and a virtual clock: the replay's states are these.
"""

from __future__ import annotations

import logging

from ..errors import CapacityError, DaemonUnavailable, IntegrityError, ModelCacheError
from .registry import ModelRecord, ModelState, Registry, TierCopy, plural
from .room import RoomQueue

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
        return model.copy_in(self.id)

    def is_resident(self, model: ModelRecord) -> bool:
        return model.copy_in(self.id).state is ModelState.RESIDENT

    # -- bringing a model in ----------------------------------------------------------------------
    def when_resident(self, model: ModelRecord, then, deadline: float | None = None, wait: bool = True,
                      memory_wait: bool = False) -> bool:
        """Call then(error, hit) once `model` is resident here: now on a hit (returns True), else after the
        one promotion (from the tier below first, where it is not there either). With a tier full of models
        in use the request waits for room, in each tier, until `deadline` (clock time; None:
        request_timeout_s from now); `wait=False`: here it is refused at once instead (a serve request, which
        the CPU serves). `memory_wait` (a serve request): where the memory limit cannot take it while other
        models are held, it waits for their holds to end as for room, rather than fail at once (a lease may be
        held for hours: an open fails at once). A model that can never be here, or is larger than the whole
        tier, raises ModelCacheError at once when its tier is the first one missing it."""
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
            self._join(model, copy, then, deadline, wait, memory_wait)
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
              memory_wait: bool = False) -> None:
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
            self._promote_or_wait(model, copy, wake, deadline, wait, memory_wait)

    def _promote_or_wait(self, model: ModelRecord, copy: TierCopy, wake, deadline: float | None, wait: bool,
                         memory_wait: bool = False) -> None:
        """Start the copy's promotion if there is room and no request waits for room before it; else queue
        `wake` for room (room.py), in arrival order."""
        queued = bool(self.room)
        if copy.state is ModelState.ON_DISK:
            if not queued and self._start(model, copy, memory_wait=memory_wait):
                copy.wait_for_load(wake)
                return
            needs = self._needs(model)
            if needs > self.tier.capacity_bytes or not wait:   # it would wait for nothing; or told not to wait
                raise self._refusal(model, needs)
            copy.queue_for_room()
        elif not wait:
            raise self._refusal(model, self._needs(model))
        copy.wait_for_load(wake)
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
        self.room.admit(lambda copy: self._start(copy.model, copy, memory_wait=copy.model.key in self.short_of_memory))
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

    # -- holding and letting go ----------------------------------------------------------------------
    def hold(self, model: ModelRecord) -> None:
        """A lease or a request in flight on the copy here (resident or not yet): not freed under it, nor the
        copies below it."""
        self.copy(model).hold()
        if self.below is not None:
            self.below.hold(model)

    def accessed(self, model: ModelRecord) -> None:
        """A call of the model used its copy here (a lease granted, a serve request run): the policy hears it."""
        self.policy.accessed(model.key)

    def lease(self, model: ModelRecord) -> None:
        """An open's lease on the copy here: held, and a call in every tier it holds."""
        self.hold(model)
        tier = self
        while tier is not None:
            tier.accessed(model)
            tier = tier.below

    def release(self, model: ModelRecord) -> None:
        """A hold on the copy here ended (and on those below it): the policies hear of each copy left idle,
        and free it if they say so now; a request waiting for room may take its place."""
        copy = self.copy(model)
        copy.let_go()
        if copy.idle:
            self.policy.released(model.key)
            if self.policy.evict_on_release and copy.evictable:
                self.evict(model)
        if self.room:
            self.admit()
        if self.below is not None:
            self.below.release(model)

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
        """Whether memory here may come back: another model's copy held (a request in flight, a lease), or a
        promotion under way (its bytes reserved; its requests hold it, then let go)."""
        return (self.memory is not None and self.memory.in_flight > 0) or any(
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

    def adopted(self, model: ModelRecord) -> None:
        """A dead daemon's copy, found whole here after a restart (daemon/restart.py): resident again."""
        copy = self.copy(model)
        copy.start_load()                 # (its load is the dead daemon's)
        copy.finish_load(ok=True)
        self.resident[model.key] = model
        self.policy.created(model.key, self.tier.model_bytes(model.key))

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


def size_text(n: int) -> str:
    """Bytes as a message shows them: MiB, or KiB below one."""
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


def capacity_refusal(key: str, needs: int, where: str, capacity: int, used: int, kept: dict,
                     setting: str) -> CapacityError:
    """The capacity error of every tier, from the tier's own accounting (`used`: its bytes without this
    model's reservation): a model larger than the whole tier only needs the setting raised; otherwise
    it names what holds the tier and why (`kept`: key -> TierCopy.why_kept), and what would free it."""
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
