"""Each protocol operation as daemon messages over the link, for both fronts; and every daemon error as the
protocol's status (HTTP and gRPC).

Health, server and model metadata, model readiness, infer, and Triton's extensions its clients call: model
repository (index; load = the model's directory imported again (triton_repo/load.py), then prefetched into the
host tier; unload = evicted from memory), model configuration and statistics. A model in the repository is ready
(the daemon promotes it on its first request) unless a front unloaded it (the daemon keeps that, P.SetUnloaded):
then it is not ready and refuses requests until it is loaded again, as Triton's explicit model control. Answers
are plain dicts shaped as v2's JSON, whose names are also the gRPC messages' fields.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass

import numpy as np

from .. import __version__
from ..wire import protocol as P
from ..errors import CapacityError, InputError, ModelCacheError, ModelNotFound, NotAllowed
from ..executor.response_cache import ResponseCache, model_identity, request_key
from ..daemon.log_settings import LogSettings
from ..triton_repo.load import is_repository_load, load_failed, repository_load
from . import types
from .link import DaemonLink
from .classification import classify
from .front_runs import FrontRunner
from .inputs import RequiredInputs
from .reshape import Reshape
from .shared_memory import RegionInput, Regions
from .types import raw_view

EXTENSIONS = ["classification", "binary_tensor_data", "model_repository", "model_configuration", "statistics",
              "logging"]
# The daemon's error codes (modelcache/errors.py) -> (HTTP status, gRPC status code name); any other code (a
# RunError's "run") is a failure of the model or the daemon: 500, INTERNAL.
STATUS_BY_CODE = {"not_found": (404, "NOT_FOUND"), "input": (400, "INVALID_ARGUMENT"),
                  "protocol": (400, "INVALID_ARGUMENT"), "permission": (403, "PERMISSION_DENIED"),
                  "capacity": (503, "UNAVAILABLE"), "not_allowed": (503, "UNAVAILABLE"),
                  "out_of_memory": (503, "RESOURCE_EXHAUSTED"), "daemon_unavailable": (503, "UNAVAILABLE"),
                  "timeout": (504, "DEADLINE_EXCEEDED"), "run": (500, "INTERNAL")}
INTERNAL = (500, "INTERNAL")


@dataclass(frozen=True)
class Interface:
    """What serving a model at a front needs of its description (interface_of)."""
    reshape: Reshape | None         # its Triton reshape (oip/reshape.py)
    labels: dict                    # its outputs' class labels
    batches: bool                   # its configuration's max_batch_size > 0
    required: RequiredInputs | None   # the inputs its configuration requires (oip/inputs.py)
    front_runs: tuple | None        # (the version, what running it here needs) when the daemon lets this front run it
    cached_as: tuple | None         # (the version, its answers' identity) when its answers may be cached
    unloaded: bool                  # a front unloaded it (Triton's explicit model control): its requests refused


def _model_dirs(root: str) -> list[str]:
    """The Triton repository's model directories, by name (none when it cannot be read)."""
    try:
        return sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    except OSError:
        return []


def unloaded_text(name: str) -> str:
    return f"{name} is unloaded: load it first (repository load of {name})"


log = logging.getLogger("modelcache.front")
INTERFACE_TTL_S = 2.0


def unknown_model(e: ModelNotFound, name: str, version: int | None) -> ModelNotFound:
    """An unknown model or version said as Triton says it (its clients match the words: Triton's example
    clients check them), then the daemon's own words."""
    what = f"'{name}'" + (f" version {version}" if version is not None else "")
    return ModelNotFound(f"Request for unknown model: {what} is not found; {e}")


def status_of(e: ModelCacheError) -> tuple[int, str]:
    return STATUS_BY_CODE.get(e.code, INTERNAL)


def _configured(entries: list[dict], configured: list | None) -> list[dict]:
    """The model's tensors a configuration lists, in its order; all of them where it lists none."""
    if not configured:
        return entries
    by_name = {e["name"]: e for e in entries}
    return [by_name[t["name"]] for t in configured if t.get("name") in by_name]


def parse_version(text: str | None) -> int | None:
    """A version as the protocol gives it (a string; "" or None: the latest) -> an int >= 1."""
    if text is None or text == "":
        return None
    try:
        version = int(text)
    except ValueError:
        raise InputError(f"model version {text[:40]!r} is not a number") from None
    if version < 1:
        raise InputError(f"model version {version}: versions start at 1")
    return version


class Operations:
    """One front's operations over its link; `unloaded` is this front's explicit model control."""

    def __init__(self, link: DaemonLink, settings):
        self.link = link
        self.settings = settings
        # Answers of models that ask for a response cache, kept here too: a hit costs this front's hashing, not a
        # round trip to the daemon, whose own cache every front and client shares. Bounded by the same setting.
        self.answers = ResponseCache(settings.response_cache_bytes())
        # short models, run here, and what this front answered itself reported to the daemon (front_runs.py)
        self.runner = FrontRunner(link, settings, link.client_name, answers=self.answers)
        self.loading: dict = {}            # name -> the asyncio.Lock its repository loads here take in turn (kept)
        # Triton's system shared memory, registered with this front; refused unless the operator allows it
        self.regions = Regions(allowed=settings.client_shared_memory)
        # Big inputs go through /dev/shm files as client.infer sends them; the daemon's group may read them.
        self.group_of = settings.socket[len("ipc://"):]
        # (name, version) -> (when read, interface_of's answer): a describe per request would cost a round trip;
        # a model imported again with another reshape or labels is seen within INTERFACE_TTL_S.
        self.interfaces: dict = {}
        self.own_log = LogSettings()       # this front's log, set as the daemon's when a request changes them

    async def ready(self) -> str | None:
        """None when the daemon answers; else why the server is not ready."""
        try:
            await self.link.call(P.ListModels(req_id=0), (P.ModelList,), timeout_s=5.0)
        except ModelCacheError as e:
            return f"not ready: {e}"
        return None

    async def log_settings(self, update: dict) -> dict:
        """Triton's logging extension: the daemon's log settings, updated first where `update` names some (an admin's
        request: the daemon's user, as the daemon's own fronts are); this front's own log follows them."""
        reply = await self.link.call(P.LogSettings(req_id=0, update=update), (P.LogSettingsReply,))
        if update:
            self.own_log.apply({k: v for k, v in reply.settings.items() if k != "log_file"})
        return reply.settings

    def server_metadata(self) -> dict:
        extensions = EXTENSIONS + (["system_shared_memory"] if self.regions.allowed else [])
        return {"name": "modelcache", "version": __version__, "extensions": extensions}

    async def describe(self, name: str, version: int | None) -> P.DescribeReply:
        """The model's description; ModelNotFound (404, NOT_FOUND) for an unknown model or version."""
        try:
            d = await self.link.call(P.Describe(req_id=0, name=name, version=version), (P.DescribeReply,))
        except ModelNotFound as e:
            raise unknown_model(e, name, version) from None
        kept = self.interfaces.get((name, version))
        if kept is not None and kept[1].unloaded != bool(getattr(d, "unloaded", False)):
            self.forget_interface(name)   # (another front loaded or unloaded it: seen here from now on)
        return d

    async def model_metadata(self, name: str, version: int | None) -> dict:
        d = await self.describe(name, version)
        listing = await self.link.call(P.ListModels(req_id=0), (P.ModelList,))
        versions = sorted({m["version"] for m in listing.models if m["name"] == name} | {d.version})
        config = getattr(d, "model_config", None) or {}
        # A configured model lists what its configuration does, as Triton: its overridable initializers served as
        # inputs, never a stateful model's control and state tensors, which the server fills.
        inputs = types.tensor_metadata(_configured(d.inputs + (getattr(d, "overridable", None) or []),
                                                   config.get("input")))
        outputs = types.tensor_metadata(_configured(d.outputs, config.get("output")))
        reshape = Reshape.of(config)
        if reshape is not None:   # what clients send and get: the configuration's dims
            inputs, outputs = reshape.metadata(inputs, "input"), reshape.metadata(outputs, "output")
        return {"name": d.name, "versions": [str(v) for v in versions],
                "platform": config.get("platform") or "onnxruntime_onnx",
                "inputs": inputs, "outputs": outputs}

    async def interface_of(self, name: str, version: int | None) -> "Interface":
        """What serving the model here needs of its description (Interface), read at most every INTERFACE_TTL_S."""
        now = time.monotonic()
        cached = self.interfaces.get((name, version))
        if cached is None or now - cached[0] > INTERFACE_TTL_S:
            d = await self.describe(name, version)
            config = getattr(d, "model_config", None) or {}
            cached = self.interfaces[(name, version)] = (now, Interface(
                Reshape.of(config), getattr(d, "labels", None) or {}, int(config.get("max_batch_size", 0)) > 0,
                RequiredInputs.of(config), (d.version, d.front_runs) if d.front_runs else None,
                (d.version, model_identity(f"{d.name}@{d.version}", d.source_sha256))
                if getattr(d, "response_cache", False) and self.answers.enabled else None,
                bool(getattr(d, "unloaded", False))))
            if cached[1].cached_as is None:   # (no longer cached: the daemon's cache turned off, say; its answers go)
                self.answers.forget(name)
        return cached[1]

    def forget_interface(self, name: str) -> None:
        """This front changed the model (a load, an unload): its next request reads its description again; the
        other front's within INTERFACE_TTL_S."""
        self.interfaces = {k: v for k, v in self.interfaces.items() if k[0] != name}

    async def model_ready(self, name: str, version: int | None) -> str | None:
        """None when the model is ready; else why not. ModelNotFound for an unknown model."""
        d = await self.describe(name, version)
        if getattr(d, "unloaded", False):
            return unloaded_text(name)
        if getattr(d, "warming", False):   # (Triton's model is not ready until its warm-up ends)
            return f"{name}@{d.version} is warming up (its model_warmup)"
        listing = await self.link.call(P.ListModels(req_id=0), (P.ModelList,))
        for m in listing.models:
            if m["name"] == name and (version is None or m["version"] == version) and m.get("corrupt"):
                return f"{name}@{m['version']} is damaged: {m['corrupt']}"
        return None

    async def infer(self, name: str, version: int | None, feeds: dict, output_names: list | None,
                    timeout_us: float | None, classes: dict | None = None, sequence: dict | None = None,
                    order: tuple | None = None, priority: int | None = None, body=None) -> tuple[dict, int | None]:
        """(outputs by name, the version that ran) through the daemon's engine, as every client's request.
        `classes`: output -> how many top classes to answer with instead of its values (classification.py);
        `sequence`: a stateful model's {id, start, end} (inputs.sequence_of); `priority`: its priority level
        (Triton's request priority, executor/queues.py). `order`: (the future set once the
        request before this one was sent, or None; this one's, set here once it is sent, and by the caller if
        it never is): a stream's requests reach the daemon in the order they were read, whatever each waits for
        on the way (a sequence's order is its state's). `body`: the memory file the request's body was received
        into (client/input_buffers.Received), whose tensors pass to the daemon where they lie."""
        after, sent = order or (None, None)
        started = time.monotonic()
        interface = await self.interface_of(name, version)
        if interface.unloaded:
            raise InputError(unloaded_text(name))
        if any(isinstance(v, RegionInput) for v in feeds.values()):
            feeds = self.regions.read_inputs(feeds)
        reshape, labels, batch, required, here, cached_as = (
            interface.reshape, interface.labels, interface.batches, interface.required, interface.front_runs,
            interface.cached_as)
        if required is not None:
            required.check(name, feeds)
        if reshape is not None:
            feeds = reshape.to_model(feeds)
        key, lookup_s = None, 0.0
        if cached_as is not None and sequence is None and after is None:   # (a stream's order is the daemon's)
            t0 = time.monotonic()
            key = request_key(cached_as[1], feeds, output_names)
            outputs = self.answers.get(key)
            lookup_s = time.monotonic() - t0
            if outputs is not None:   # answered before, here: nothing crosses to the daemon
                self.runner.cache_hit(name, cached_as[0], started, lookup_s)
                return self._answer(outputs, reshape, classes, labels, batch), cached_as[0]
        outputs, ran, ran_here = await self._run(name, version, feeds, output_names, timeout_us, sequence, after,
                                                 sent, here, started, priority, body)
        if key is not None:   # kept before the answer is shaped for this client (its reshape, its classes)
            t0 = time.monotonic()
            if ran == cached_as[0] and self.answers.put(key, name, outputs):
                self.runner.keep_reporting()
            if ran_here:      # (the daemon counted those it served: a hit of its own cache, or a miss)
                self.runner.cache_missed(name, cached_as[0], lookup_s + time.monotonic() - t0)
        return self._answer(outputs, reshape, classes, labels, batch), ran

    async def _run(self, name: str, version: int | None, feeds: dict, output_names: list | None,
                   timeout_us: float | None, sequence: dict | None, after, sent, here,
                   started: float, priority: int | None = None, body=None) -> tuple[dict, int | None, bool]:
        """(the model's outputs, the version that ran, whether it ran here): here, where the daemon said this front
        may run it, else through the daemon's engine (whose response cache is shared by every front and client)."""
        held = None if here is None or sequence is not None or after is not None else self.runner.session(name, here[0])
        if held is not None:   # a short model this front runs itself, over the daemon's weights
            deadline = started + timeout_us / 1e6 if timeout_us else None
            return self.runner.run(name, here[0], held, feeds, output_names, here[1].get("max_batch", 0),
                                   deadline, started), here[0], True
        passing = self.link.buffers.request()   # large inputs in memory files passed with the request
        if body is not None:
            passing.adopt(body)
        wire = passing.encode(feeds, self.group_of, name)
        passing.lend(name)   # a memory file for the answer's large outputs, which the daemon writes into
        error = None
        try:
            deadline_ms = timeout_us / 1000 if timeout_us else None
            if after is not None:
                await after
            reply = await self.link.call(
                P.Infer(req_id=0, client_id="", name=name, inputs=wire, version=version, output_names=output_names,
                        deadline_ms=deadline_ms, sequence=sequence, priority=priority, ipc_fds=len(passing.fds),
                        lent_fds=passing.lent_fds),
                (P.InferReply,),
                on_sent=None if sent is None else (lambda: sent.done() or sent.set_result(None)), fds=passing.fds)
            outputs = passing.decode(reply.outputs, name)
        except BaseException as e:
            error = e
            if isinstance(e, ModelNotFound):
                raise unknown_model(e, name, version) from None
            raise
        finally:
            passing.settle_after(error)
        return outputs, reply.version if reply.version is not None else version, False   # (older daemon: None)

    def write_outputs(self, outputs: dict, output_regions: dict) -> set:
        """Write each output the request asked for in shared memory to its region; the names written, which the
        reply gives with their datatype and shape only (as Triton's: no parameters, no data)."""
        written = output_regions.keys() & outputs.keys()
        for name in written:
            self.regions.write_output(name, output_regions[name], raw_view(np.asarray(outputs[name])))
        return written

    @staticmethod
    def _answer(outputs: dict, reshape, classes: dict | None, labels: dict, batch: bool) -> dict:
        """The model's outputs as the client asked for them: its configuration's dims, top classes."""
        if reshape is not None:
            outputs = reshape.to_client(outputs)
        for output, count in (classes or {}).items():
            if output in outputs:
                outputs[output] = classify(outputs[output], count, labels.get(output), batch, output)
        return outputs

    async def close(self) -> None:
        """The front stops: the models it ran go back to the daemon, with the counts it has not reported."""
        await self.runner.close()
        await self.link.close()
        self.regions.close()

    async def repository_index(self, only_ready: bool) -> list[dict]:
        listing = await self.link.call(P.ListModels(req_id=0), (P.ModelList,))
        index = []
        for m in listing.models:
            if m.get("corrupt"):
                state, reason = "UNAVAILABLE", f"damaged: {m['corrupt']}"
            elif m.get("unloaded"):
                state, reason = "UNAVAILABLE", "unloaded"
            elif m.get("warming"):
                state, reason = "LOADING", "warming up (model_warmup)"
            else:   # every stored version serves; the tier says how soon
                state, reason = "READY", {"disk": "on disk: promoted on first request",
                                          "ensemble": m.get("why") or "an ensemble"}.get(m["tier"], "in memory")
            if not only_ready or state == "READY":
                index.append({"name": m["name"], "version": str(m["version"]), "state": state, "reason": reason})
        if self.settings.triton_repository and not only_ready:   # (as Triton lists a model it has not loaded: its name)
            listed = {m["name"] for m in listing.models}
            index += [{"name": n} for n in await asyncio.to_thread(_model_dirs, self.settings.triton_repository)
                      if n not in listed]
        return index

    async def load(self, name: str, parameters: dict) -> None:
        """Triton's repository load: the model read again from its directory (the request's files, or the
        Triton repository's) and imported, changed versions replaced (triton_repo/load.py); then, as for a
        model added another way, brought into memory."""
        self._check_model_control()
        if is_repository_load(name, parameters, self.settings.triton_repository):
            # One load of a model at a time here, as Triton does (two would race to replace the same versions)
            async with self.loading.setdefault(name, asyncio.Lock()):
                await self.runner.let_go(name)   # (its sessions here would hold a version being replaced)
                lines = await asyncio.to_thread(repository_load, name, parameters, self.settings,
                                                self.settings.triton_repository)
            log.info("load %s: %s", name, "; ".join(lines))
        listing = await self.link.call(P.ListModels(req_id=0), (P.ModelList,))
        if not any(m["name"] == name and m["tier"] == "ensemble" for m in listing.models):   # (no weights to load)
            try:
                await self.link.call(P.Load(req_id=0, name=name), (P.Ack,), timeout_s=self.settings.add_timeout_s)
            except ModelNotFound as e:
                where = f"; and no directory {name!r} in the Triton repository {self.settings.triton_repository}" \
                    if self.settings.triton_repository else ""
                raise ModelNotFound(f"{load_failed(name)}: {e}{where}") from None
        await self.link.call(P.SetUnloaded(req_id=0, name=name, unloaded=False), (P.Ack,))
        self.forget_interface(name)

    def _check_model_control(self) -> None:
        """Loads and unloads are served under explicit model control only (the model_control setting), as Triton's."""
        if self.settings.model_control != "explicit":
            raise NotAllowed("explicit model load / unload is not allowed if polling is enabled"   # (Triton's words,
                             f" (model_control is {self.settings.model_control})")                 # in none mode too)

    async def unload(self, name: str) -> None:
        """Triton's unload: the model not ready, its requests refused, over every front (the daemon keeps the state:
        P.SetUnloaded), until a load; then every version of it in memory evicted, but one still in use (another
        front running it, a session), which stays until the host tier's policy evicts it."""
        self._check_model_control()
        await self.link.call(P.SetUnloaded(req_id=0, name=name), (P.Ack,))   # (NOT_FOUND for an unknown name)
        self.forget_interface(name)
        await self.runner.let_go(name)   # (its sessions here would hold it in memory)
        listing = await self.link.call(P.ListModels(req_id=0), (P.ModelList,))
        # Every version in memory: an Evict without a version names only the latest
        for version in [m["version"] for m in listing.models if m["name"] == name and m["tier"] not in ("disk", "ensemble")]:
            try:
                await self.link.call(P.Evict(req_id=0, name=name, version=version), (P.Ack,))
            except CapacityError as e:
                log.info("unload %s: version %d stays in memory while in use: %s", name, version, e)

    async def model_config(self, name: str, version: int | None) -> dict:
        """Triton's model configuration extension: what the model was imported with from a Triton repository
        (`modelcache import-triton`), else the model's inputs and outputs with their whole shapes and
        max_batch_size 0 (no batching dimension claimed)."""
        d = await self.describe(name, version)
        stored = getattr(d, "model_config", None)
        if stored:
            return {**stored, "name": d.name}
        return types.model_config(d.name, d.inputs, d.outputs)

    async def model_stats(self, name: str | None, version: int | None) -> list[dict]:
        """Triton's statistics extension: every model, every version of one, or one version."""
        if name:   # NOT_FOUND for an unknown model or version
            await self.describe(name, version)
        listing = await self.link.call(P.ListModels(req_id=0), (P.ModelList,))
        stats = await self.link.call(P.Stats(req_id=0), (P.StatsReply,))
        served = stats.executor.get("models") or {}
        return [types.model_stat(m["name"], m["version"], served.get(f"{m['name']}@{m['version']}"))
                for m in listing.models
                if (not name or m["name"] == name) and (version is None or m["version"] == version)]
