"""The model requests of the wire — load, evict, pin, remove, add, verify — and how a model is listed.

`Models` runs on the owner loop. Its handlers translate a message into calls of the tiers' residency
managers (daemon/residency/: the host tier's, and the GPUs' in `gpus`) and their outcomes into
replies; the managers decide. Add packs on a loader thread and verify scrubs on one.
"""

from __future__ import annotations

import logging
import time

from ..errors import InputError, IntegrityError, ModelCacheError, ModelNotFound, PackError
from ..executor.sequences import SequenceSpec
from ..store.format import load_manifest
from ..store.packing import pack_in_subprocess
from ..store.reservations import staged_path
from ..store.scrub import DAMAGED, nothing_to_verify, verify_version
from ..store.sources import check_regular_files, check_source_names, close_all
from ..store.warm_packer import WarmPacker
from ..wire import protocol as P
from .registry import ModelRecord, Registry
from .residency import ModelState
from .wording import plural

log = logging.getLogger("modelcache.daemon")


class Models:
    def __init__(self, *, registry: Registry, host, gpus, fetcher, repository, loaders, settings, admins,
                 counters: dict, jobs: dict, clock, wall, reply):
        self.registry = registry
        self.host = host                  # the host tier's Residency
        self.gpus = gpus                  # daemon/gpus.py: the GPU tiers' (by UUID), `named`
        self.fetcher = fetcher            # daemon/fetch.py: models only the remote store has
        self.repository = repository
        self.loaders = loaders
        self.settings = settings
        self.admins = admins
        self.counters = counters
        self.jobs = jobs                  # in-flight packs, for stats
        self.clock = clock
        self.wall = wall                  # wall time: when a keep-alive ends, as `ls` and `status` show it
        self.reply = reply                # (ident, message): answer a request later
        self.reserved_versions: set = set()     # versions being packed, not yet in the registry
        # Packing subprocesses, so an immediate stop can kill them. Loader threads add and remove
        # entries (single set operations, atomic under the GIL); only the signal handler reads it.
        self.packers: set = set()
        # Packs fork from a server with their imports done, kept while adds come (store/warm_packer.py).
        self.warm_packer = WarmPacker(clock=clock)
        # Serving.warm_up: a model with warm-up samples runs them when added or loaded
        self.warm_up = lambda model, **how: None
        self.swaps = None                   # daemon/swaps.py: replacements waiting to be swapped in (the server's)

    def handlers(self) -> dict:
        return {P.Load: self.on_Load, P.Remove: self.on_Remove, P.Pin: self.on_Pin, P.Evict: self.on_Evict,
                P.Add: self.on_Add, P.Verify: self.on_Verify}

    def tier_named(self, spec: str):
        """The residency a load or evict names: 'host', 'gpu' or 'gpu:<UUID or index>'."""
        if spec == "host":
            return self.host
        if spec.partition(":")[0] != "gpu":
            raise ModelCacheError(f"unknown tier {spec!r}: use 'host', 'gpu' or 'gpu:<UUID or index>'")
        return self.gpus.named(spec)

    # -- handlers ----------------------------------------------------------------------------------
    def on_Load(self, ident, msg: P.Load):
        residency = self.tier_named(msg.tier)
        model = self.fetcher.resolve_or_fetch(ident, msg)
        if model is None:
            return None
        self.admins.check_model_owner(ident, model, "load")
        before = model.copies

        def answer(error, hit):
            self.reply(ident, outcome(msg, model, before) if error is None else
                       P.ErrorReply(req_id=msg.req_id, code=error.code, message=str(error)))
            if error is None and not hit:   # (brought into memory now; one that was there was warmed already)
                self.warm_up(model)

        residency.when_resident(model, answer)
        return None

    def on_Evict(self, ident, msg: P.Evict):
        model = self.fetcher.resolve(msg.name, msg.version)
        self.admins.check_model_owner(ident, model, "evict")
        before = model.copies
        # The host tier, the GPU named, or every GPU (a daemon without one says so): each refuses a copy in use.
        named = self.tier_named(msg.tier)
        freed = sum(r.demote(model) for r in (self.gpus if msg.tier in ("gpu", "cuda") else [named]))
        return outcome(msg, model, before, freed_bytes=freed)

    def on_Pin(self, ident, msg: P.Pin):
        model = self.fetcher.resolve(msg.name, msg.version)
        self.admins.check_model_owner(ident, model, "pin" if msg.pinned else "unpin")
        was_pinned = model.pin(msg.pinned)
        log.info("model %s: %s", "pinned" if msg.pinned else "unpinned", model.key)
        if was_pinned and not msg.pinned:
            self.host.admit()    # it may make room for a request waiting, in any tier
        return outcome(msg, model, model.copies, was_pinned=was_pinned)

    def on_Remove(self, ident, msg: P.Remove):
        if msg.version is not None and (msg.name, msg.version) in self.repository.unreadable:
            self.repository.remove(msg.name, msg.version)  # a version whose manifest is damaged: never registered
            del self.repository.unreadable[(msg.name, msg.version)]
            log.info("damaged model removed: %s@%d", msg.name, msg.version)
            return P.Ack(req_id=msg.req_id)
        model = self.fetcher.resolve(msg.name, msg.version)
        self.admins.check_model_owner(ident, model, "remove")
        # From disk first: a removal that fails there (StorageError) leaves the version as it was, served.
        self.host.remove(model, lambda: self.repository.remove(model.name, model.version))
        log.info("model removed: %s", model.key)
        return P.Ack(req_id=msg.req_id)

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

    def on_Add(self, ident, msg: P.Add):
        """Pack the files whose descriptors came with the request (daemon/lane_server.py): the daemon reads what
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
        if msg.serving.get("sequence") is not None:   # a stateful model's controls and states, checked before packing
            try:
                SequenceSpec.from_wire(msg.serving["sequence"])
            except ValueError as e:
                raise InputError(f"add {msg.name}: {e}") from None
        opt_level = msg.opt_level or self.settings.opt_level
        with_prepacked = self.settings.prepack if msg.prepack is None else msg.prepack
        version = msg.version if msg.version is not None else self.registry.next_version(msg.name, self.reserved_versions)
        key = (msg.name, version)
        if key in self.reserved_versions:
            raise PackError(f"model {msg.name} version {version} is being added or replaced now; wait for it")
        # A replace of a version there: packed beside it while it serves, then swapped in (daemon/swaps.py).
        old = self.registry.models.get(key)
        replacing = old is not None and msg.replace
        if old is not None and not replacing:
            raise PackError(f"model {msg.name} version {version} already exists")
        if replacing:
            self.admins.check_model_owner(ident, old, "replace")
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
                                              declared={"serving": msg.serving, "model_config": msg.model_config,
                                                        "labels": msg.labels}, replacing=replacing,
                                              spawn=self.warm_packer.spawn)
            finally:
                close_all(fds)
                for p in started:
                    self.packers.discard(p)
            return manifest, time.perf_counter() - t0

        def done(result, error):
            if error is not None or not replacing:   # (a replacement keeps its version reserved until its swap)
                self.reserved_versions.discard(key)
            self.jobs.pop(f"add:{msg.name}@{version}", None)
            if error is not None:
                log.warning("add %s from %s failed: %s", job["model"], msg.path, error)
                self.reply(ident, P.ErrorReply(req_id=msg.req_id, code=error.code, message=str(error)))
                return
            manifest, pack_s = result
            if replacing:
                self.swaps.start(old, staged_path(self.repository.root, *key), manifest,
                                 lambda error, model: swapped(error, model, manifest, pack_s))
                return
            added(self.registry.add_model(self.repository.model_dir(msg.name, version), manifest), manifest, pack_s)

        def swapped(error, model, manifest, pack_s):
            self.reserved_versions.discard(key)
            if error is not None:
                log.warning("replacing %s from %s failed: %s", job["model"], msg.path, error)
                self.reply(ident, P.ErrorReply(req_id=msg.req_id, code=error.code, message=str(error)))
                return
            added(model, manifest, pack_s, "replaced")

        def added(model, manifest, pack_s, how="added"):
            self.counters["adds"] += 1
            log.info("model %s: %s@%d, %d tensors, %.1f MiB, packed in %.2f s", how, msg.name, version,
                     len(manifest.tensors), manifest.weights_bytes / 2**20, pack_s)
            self.reply(ident, P.AddReply(req_id=msg.req_id, name=msg.name, version=version,
                                          weights_bytes=manifest.weights_bytes, tensors=len(manifest.tensors),
                                          pack_s=pack_s))
            self.warm_up(model, ready_meanwhile=how == "replaced")   # (the version it replaced was ready)

        self.loaders.run(work, done)
        return None

    # -- what operators see -------------------------------------------------------------------------
    def describe(self, model: ModelRecord) -> dict:
        """A model as listings show it, with each tier's charge for it from that tier's own accounting, and
        the timed policies' view (eviction/timed.py) in wall time: until when an idle copy is kept, and when
        its next call is expected (None: no timer, or no prediction)."""
        host = self.host.tier
        host_bytes = host.model_bytes(model.key) if model.state is ModelState.RESIDENT else \
            host.estimate_bytes(model.manifest)
        gpu_bytes = sum(r.tier.model_bytes(model.key) for r in self.gpus if r.is_resident(model))
        now, wall = self.clock(), self.wall()

        def as_wall(t):
            return None if t is None else wall + (t - now)
        kept = self.host.policy.keep_alive_until(model.key)
        call = self.host.policy.predicted_next_call(model.key)
        over_files = self.host.leases_over_files(model)
        why = ", ".join(filter(None, [model.why_resident(kept is not None and kept > now),
                                      *(r.waiting_text(model) for r in self.gpus),
                                      over_files and f"{plural(over_files, 'session')} over its files"]))
        out = model.describe(host_bytes, gpu_bytes, why=why, keep_alive_until=as_wall(kept), next_call=as_wall(call))
        # What evicting it alone would free in the host tier now (its tensors no other resident model uses).
        out["file_leases"] = over_files   # (open_when_full = disk: daemon/disk_opens.py)
        out["frees_bytes"] = host.bytes_freed_by([model.key]) if model.state is ModelState.RESIDENT else 0
        for copy in out["gpu"]:   # (only under a timed policy: the copy's record is otherwise as it was)
            until = self.gpus.by_uuid[copy["device"]].policy.keep_alive_until(model.key)
            if until is not None:
                copy["keep_alive_until"] = as_wall(until)
        return out


def outcome(msg, model: ModelRecord, before: list, **fields):
    """The answer to a load, pin or evict: Ack, or what was done when the request asks (older clients do not)."""
    if not msg.outcome:
        return P.Ack(req_id=msg.req_id)
    return P.ModelOutcome(req_id=msg.req_id, name=model.name, version=model.version, before=before,
                          after=model.copies, pinned=model.pinned, **fields)
