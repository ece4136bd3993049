"""The remote store, as the daemon's owner loop uses it: fetch a model only the remote store has (one fetch
however many ask, the requests run again once it lands), and fetch again a version whose stored files are
damaged (for the host tier's residency manager, whose source the repository is)."""

from __future__ import annotations

import logging

from ..errors import IntegrityError, ModelNotFound, RemoteError
from .registry import ModelRecord, Registry

log = logging.getLogger("modelcache.daemon")


class Fetcher:
    def __init__(self, *, registry: Registry, repository, remote, loaders, counters: dict, jobs: dict, reply,
                 redispatch):
        self.registry = registry
        self.repository = repository      # tiers.disk.Repository
        self.remote = remote              # tiers.remote.RemoteStore, or None
        self.loaders = loaders
        self.counters = counters
        self.jobs = jobs                  # fetches in flight, for stats
        self.reply = reply                # (ident, message): answer a request later
        self.redispatch = redispatch      # (ident, request): run a request again (after its fetch)
        self.fetches: dict = {}           # (name, version) -> [(retry, fail)] waiting on one fetch
        # (ident, request, model) -> whether the request waits for its version's swap (daemon/swaps.py)
        self.hold_back = lambda ident, msg, model: False

    def resolve(self, name: str, version: int | None) -> ModelRecord:
        """The model a request names. A version whose manifest is damaged is refused as what it is
        (IntegrityError), by every request alike: attach, serve, describe, remove..."""
        try:
            return self.registry.resolve(name, version)
        except ModelNotFound:
            unreadable = self.unreadable_version(name, version)
            if not unreadable:
                raise
        fix = f"open it to fetch it again from {self.remote.url}" if self.remote is not None else \
            "no remote store is configured to fetch it again"
        raise IntegrityError(f"{unreadable}; {fix}")

    def resolve_or_fetch(self, ident, msg) -> ModelRecord | None:
        """The model a request names; if only the remote store has it (or has a good copy of a version whose
        manifest is damaged here), start one fetch and return None: the request runs again when it lands (or
        is answered with the fetch's error). None too for a version being swapped for its replacement: the
        request runs again once it is (swaps.py)."""
        from ..wire import protocol as P
        try:
            model = self.registry.resolve(msg.name, msg.version)
            return None if self.hold_back(ident, msg, model) else model
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

    def unreadable_version(self, name: str, version: int | None) -> str:
        """Why the repository could not register `name` at `version` (any version when None), or ""."""
        for (n, v), why in self.repository.unreadable.items():
            if n == name and version in (None, v):
                return why
        return ""

    # -- a damaged version: the host tier's residency manager asks ---------------------------------
    def refusal(self, model: ModelRecord) -> IntegrityError | None:
        """Why a version marked corrupt is not served, and the way back, when no remote store can replace it;
        None when it is not marked, or can be fetched again."""
        if not model.damage or self.remote is not None:
            return None
        return IntegrityError(f"{model.damage}; no remote store is configured to fetch it again: repair or replace "
                              f"the file, then run `modelcache verify {model.name}` to re-check it")

    def can_refetch(self, model: ModelRecord) -> bool:
        """A copy damaged again right after its fetch is not fetched a third time (`refetched`)."""
        return self.remote is not None and not model.refetched

    def fetch_again(self, model: ModelRecord, then) -> None:
        """Replace a damaged version with the remote store's copy (on a loader thread); then(error) after."""
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
            if error is not None:
                then(IntegrityError(f"{model.damage}; fetching it again from {self.remote.url} failed: {error}"))
                return
            disk_dir, manifest, seconds = result
            model.replaced(disk_dir, manifest)
            self.counters["refetched"] += 1
            log.info("model fetched again: %s from %s in %.2f s", model.key, self.remote.url, seconds)
            then(None)

        self.loaders.run(work, done)
