"""Serve-mode requests in the daemon: describe, partition, infer.

`Serving` runs on the owner loop; the stage work runs on the executor's workers (`engine`), and a
request in flight holds its model. It is handed the tiers' residency managers that bring a model in
(the host tier's, and the GPUs').

With GPU workers, a request first brings its model to their devices' GPU tier (one promotion,
however many requests and stage sessions), and holds each device copy while in flight; each GPU
worker that may have sessions over a copy holds it too (`worker_hold`, which the engine calls).
Stage sessions there run over the tier's arena in this process: nothing is copied per session.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from ..wire import protocol as P, tensors
from ..errors import InputError, ModelCacheError, ProtocolError
from ..executor.engine import ServeRequest
from ..executor.response_cache import ResponseCache, model_identity, request_key
from ..executor.sequences import SequenceSpec, SequenceTable
from ..executor.stats import INFER_BUCKETS_S
from ..memlimit import release_freed_heap
from ..storage import storage_errors
from ..executor.workers import select_gpus
from .registry import HOST, ModelRecord, Registry
from .residency import WORKER
from .residency.room import deadline_of
from .warmup import sample_requests
from .wording import plural

log = logging.getLogger("modelcache.daemon")


class Serving:
    def __init__(self, *, registry: Registry, host, gpus, fetcher, engine, loaders, admins, clock, reply, touch,
                 ensembles, responses: ResponseCache, counters: dict):
        self.registry = registry
        # The daemon's counters; serving counts its large outputs, in a lent file ("outputs_lent") or in the reply
        # ("outputs_large_inline": no file lent, or no room in it).
        self.counters = counters
        self.host = host                  # the host tier's Residency
        self.gpus = gpus                  # daemon/gpus.py: the GPU tiers' Residency, by UUID
        self.fetcher = fetcher            # daemon/fetch.py: a model only the remote store has
        self.engine = engine              # executor.engine.Engine
        self.loaders = loaders
        self.admins = admins
        self.clock = clock
        self.reply = reply                # (ident, message): answer a request later
        self.touch = touch                # (client_id, ident) -> the caller's client record, kept alive
        self.ensembles = ensembles        # daemon/ensembles.py: pipelines of models served here
        ensembles.serve = self.serve
        self.responses = responses        # answers of models that ask for it (response_cache.py; capacity 0: off)
        self.answers_dropped = 0          # times memory pressure dropped them (FrontServedReply tells the fronts)
        self.swaps = None                 # daemon/swaps.py (the server's): FrontServedReply names what they replace
        self.serve_specs: dict = {}             # model key -> (segments, stage specs), see _serve_specs
        self.serve_device_specs: dict = {}      # (model key, device UUID) -> its GPU stage specs
        self.sequence_specs: dict = {}          # model key -> (its manifest's serving["sequence"], SequenceSpec)
        self.sequence_tables: dict = {}         # model key -> its sequences (executor/sequences.py)
        self.warming: dict = {}                 # model key -> its warm-ups running (warm_up): not ready at the fronts
        host.forget.append(self.forget_copy)   # (every tier's managers share the host's list: daemon/gpus.py)

    def handlers(self) -> dict:
        return {P.Describe: self.on_Describe, P.Partition: self.on_Partition, P.SetBatching: self.on_SetBatching,
                P.Configure: self.on_Configure, P.Profile: self.on_Profile, P.Infer: self.on_Infer,
                P.AddEnsemble: self.ensembles.on_AddEnsemble, P.FrontServed: self.on_FrontServed}

    def forget_model(self, key: str) -> None:
        """The model's host copy is gone or stale: its stage sessions and specs go with it. Until the workers
        have dropped the sessions, what they map and allocate still counts against the memory limit: a serve
        request short of memory waits for that (memory.dropping), and is admitted again once they are gone."""
        memory = self.host.memory
        if memory is None:
            self.engine.drop_model(key)
        else:
            memory.dropping += 1

            def dropped():
                memory.dropping -= 1
                self.host.admit()

            self.engine.drop_model(key, then=dropped)
        self.serve_specs.pop(key, None)

    def drop_answers(self, name: str | None = None) -> int:
        """The response cache's answers of model `name` (every version: it was removed), or all of them (memory
        pressure: then the heap they leave goes back to the OS too); the bytes freed."""
        if name is not None:
            return self.responses.forget(name)
        self.answers_dropped += 1   # (the fronts drop theirs when their next report's reply says so)
        freed = self.responses.clear()
        if freed:
            release_freed_heap()
        return freed

    def forget_copy(self, key: str, tier: str) -> None:
        """A copy of the model was freed or replaced: what was built over it goes."""
        if tier == HOST:
            self.forget_model(key)
        else:
            self.serve_device_specs.pop((key, tier), None)

    def on_Describe(self, ident, msg: P.Describe):
        ensemble = self.ensembles.find(msg.name, msg.version)
        if ensemble is not None:
            reply = self.ensembles.describe(ensemble, msg.req_id)
            reply.unloaded = msg.name in self.registry.unloaded
            return reply
        model = self.fetcher.resolve_or_fetch(ident, msg)   # (as infer does: a serve session describes first)
        if model is None:
            return None
        io = model.manifest.io_summary()
        return P.DescribeReply(req_id=msg.req_id, name=model.name, version=model.version, inputs=io["inputs"],
                               outputs=io["outputs"], weights_bytes=model.manifest.weights_bytes,
                               stages=[{k: e[k] for k in ("file", "inputs", "outputs", "cost_share", "workers")
                                        if k in e} for e in model.manifest.stages],
                               model_config=model.manifest.model_config, source_sha256=model.manifest.source_sha256,
                               labels=model.manifest.labels, overridable=io["overridable"],
                               front_runs=self._front_runs(model), response_cache=self.caches(model),
                               unloaded=model.name in self.registry.unloaded, warming=model.key in self.warming)

    def caches(self, model: ModelRecord) -> bool:
        """Whether the model's answers are cached: it asks (never a stateful one: check_serving) and the cache is on."""
        return bool(model.manifest.serving.get("response_cache")) and self.responses.enabled

    def _front_runs(self, model: ModelRecord) -> dict:
        """What a front needs to run the model itself ({max_batch}), when the engine says it may; else {}. Not a
        stateful model (its state is the engine's), nor one whose initializers a request may override."""
        if self._sequence_spec(model) is not None or model.manifest.overridable:
            return {}
        if not self.engine.front_may_run(model.key, model.manifest.serving or None, len(model.manifest.stages)):
            return {}
        return {"max_batch": model.manifest.serving.get("max_batch") or 0}

    def on_FrontServed(self, ident, msg: P.FrontServed):
        """A front's requests it ran itself: counted as the engine's, and a call of each model for its policy (the
        keep-alive runs from the report, at most a second after the call). A model gone meanwhile is skipped."""
        reports = {key: _front_report(key, report) for key, report in _items(msg.models, "models")}
        for key, report in reports.items():
            model = self.registry.by_key(key)
            if model is None:
                continue
            self.engine.absorb_front(key, report)
            if sum(report["counts"]) - report["cache_hits"] or report["failed"]:   # (a hit is no call of the model)
                self.host.accessed(model)
        return P.FrontServedReply(req_id=msg.req_id, answers_dropped=self.answers_dropped,
                                  replacing=self.swaps.replacing() if self.swaps is not None else [])

    def on_Partition(self, ident, msg: P.Partition):
        from ..executor.partition import check_request, partition
        model = self.fetcher.resolve(msg.name, msg.version)
        self.admins.check_model_owner(ident, model, "partition")   # it changes what every user's requests run
        if msg.plan is None:
            check_request(msg.stages, msg.tail_fraction)   # here, not on a loader: no job for what cannot be met
        else:
            self.engine.check_plan_workers(msg.plan)
        # A serve-mode GPU worker's hold does not count: its sessions are dropped with the old stages (below),
        # and the device copy they run over is the same for any partition.
        self.host.check_unheld(model, "partition", ignoring=WORKER)

        def done(result, error):
            if error is None:
                model.repartitioned(result)
                self.forget_model(model.key)  # old stage sessions are stale
                log.info("model partitioned: %s into %s", model.key, plural(max(1, len(result["stages"])), "stage"))
                self.reply(ident, P.DescribeReply(req_id=msg.req_id, name=model.name, version=model.version,
                                                   stages=result["stages"]))
            else:
                self.reply(ident, P.ErrorReply(req_id=msg.req_id, code=error.code, message=str(error)))

        gpu = any(getattr(w, "device", None) is not None for w in self.engine.workers)   # GPU stages too

        def work():
            with storage_errors(f"partitioning {model.key}", model.disk_dir):
                return partition(model.disk_dir, msg.stages, msg.tail_fraction, gpu=gpu, plan=msg.plan)
        self.loaders.run(work, done)
        return None

    def on_SetBatching(self, ident, msg: P.SetBatching):
        from ..store.format import write_manifest
        model = self.fetcher.resolve(msg.name, msg.version)
        self.admins.check_model_owner(ident, model, "set the batching profile of")
        stages = max(1, len(model.manifest.stages))
        if msg.profile.stages != stages:   # (the rest of the profile was checked as it was decoded)
            raise InputError(f"{model.key}: the profile times {msg.profile.stages} stages; the model has {stages}: "
                             "calibrate again after partitioning")
        # Stored first, then used: a manifest that cannot be written (StorageError) leaves the old profile in force.
        stored = dataclasses.replace(model.manifest, batching=dict(msg.profile))
        write_manifest(model.disk_dir, stored, f"storing the batching profile of {model.key}")
        model.calibrated(stored.batching, stored.checksum)
        self.forget_model(model.key)  # its batching policy is rebuilt with the new profile
        log.info("batching profile stored: %s, N_opt %s at t_opt %.0f ms", model.key, msg.profile.get("n_opt"),
                 msg.profile.get("t_opt_ms", 0))
        return P.Ack(req_id=msg.req_id)

    def on_Configure(self, ident, msg: P.Configure):
        """A version's declared configuration replaced in place (a repository load that changed only the config):
        stored first, then used, as a batching profile is. Requests already queued keep the policy they were queued
        under; the next ones, and the model's sessions made from now on, take the new one. Its warm-up runs again."""
        from ..store.format import write_manifest
        model = self.fetcher.resolve(msg.name, msg.version)
        self.admins.check_model_owner(ident, model, "configure")
        old = model.manifest.serving or {}
        serving = dict(msg.serving)
        if serving.get("sequence") is not None:
            try:
                SequenceSpec.from_wire(serving["sequence"])
            except ValueError as e:
                raise InputError(f"configure {model.key}: {e}") from None
            if serving["sequence"] == old.get("sequence"):
                serving["sequence"] = old["sequence"]   # (the same object: its live sequences go on, not restarted)
        stored = dataclasses.replace(model.manifest, serving=serving, model_config=dict(msg.model_config),
                                     labels=dict(msg.labels))
        write_manifest(model.disk_dir, stored, f"storing the configuration of {model.key}")
        model.reconfigured(stored)
        self.forget_model(model.key)   # (its sessions and stage specs: a thread count may have changed)
        log.info("model %s: configuration replaced in place (its weights unchanged)", model.key)
        self.warm_up(model)
        return P.Ack(req_id=msg.req_id)

    def on_Profile(self, ident, msg: P.Profile):
        from ..executor.profile import WAKE_GAP_S
        from ..store.format import SKELETON_FILE
        from ..wire.protocol import MAX_PROFILE_RUNS, MAX_PROFILE_S

        model = self.fetcher.resolve(msg.name, msg.version)
        # It takes a worker for seconds, from every user's requests: the model's owner or an admin only.
        self.admins.check_model_owner(ident, model, "profile")
        if not 1 <= msg.runs <= MAX_PROFILE_RUNS or not 0 <= msg.min_s <= MAX_PROFILE_S:   # (NaN fails too)
            raise InputError(f"profile runs={msg.runs}, min_s={msg.min_s}: give 1-{MAX_PROFILE_RUNS} runs spanning "
                             f"0-{MAX_PROFILE_S:g} s")
        worker = self.engine.cpu_worker(msg.worker)
        feeds, maps = tensors.decode(msg.inputs)
        model.feed_check.check(feeds)
        held = self.host.hold_request(model, profile=True)   # not evicted under the worker's session
        answered = []

        def finish(result, error):
            if answered:             # (a failure after the answer: the hold is released once)
                return
            answered.append(True)
            try:
                if error is not None:
                    if not isinstance(error, ModelCacheError):
                        error = ModelCacheError(f"{model.key}: profiling on {worker.name} failed: {str(error)[:500]}")
                    self.reply(ident, P.ErrorReply(req_id=msg.req_id, code=error.code, message=str(error)))
                else:
                    times, args, wake = result
                    self.reply(ident, P.ProfileReply(req_id=msg.req_id, name=model.name, version=model.version,
                                                      worker=worker.name, threads=len(worker.cores), times=times,
                                                      args=args, wake_s=wake))
            finally:
                maps.clear()
                self.host.end(held)

        def start(error, hit):
            # Called by the load's waiters too: whatever fails here is this request's answer, never the loop's.
            try:
                if error is not None:
                    raise error
                _, segments, all_tensors = self.host.tier.layout(model.key, model.manifest)
                skeleton = str(model.disk_dir / SKELETON_FILE)
                # How long the worker is out: dmda places nothing there meanwhile it need not.
                run_s = self.engine.predicted_run_s(model.key, len(model.manifest.stages), worker.state.kind) or 0.0
                expected_s = min(MAX_PROFILE_S, max(msg.min_s, msg.runs * (2 * run_s + WAKE_GAP_S)))
                self.engine.run_on_worker(worker, lambda w: w.profile(skeleton, segments, all_tensors, dict(feeds),
                                                                      msg.runs, msg.min_s),
                                          finish, expected_s=expected_s)
            except Exception as e:
                finish(None, e)

        try:
            self.host.when_resident(model, start)
        except Exception as e:       # no room to load it, say: the answer, and the hold released
            finish(None, e)
        return None

    def on_Infer(self, ident, msg: P.Infer):
        self.touch(msg.client_id, ident, msg.client_name)
        deadline_of(0.0, msg.deadline_ms)   # checked before anything is fetched
        ensemble = self.ensembles.find(msg.name, msg.version)
        model = None if ensemble is not None else self.fetcher.resolve_or_fetch(ident, msg)
        if model is None and ensemble is None:
            return None
        arrival = self.clock()
        deadline = deadline_of(arrival, msg.deadline_ms)
        feeds, maps = tensors.decode(msg.inputs, getattr(msg, "passed", ()))   # (server._take_passed's mappings)
        lent = getattr(msg, "lent", None)   # files lent for the outputs (wire/lent_outputs.py), or None
        input_s = self.clock() - arrival   # (Triton's compute_input: the request's tensors made ready to run)

        def answer(result, timings, error):
            try:
                if error is None:
                    try:
                        encoding = self.clock()
                        wire, _ = tensors.encode(result, inline_only=True, lent=lent)
                        self._count_large_outputs(wire)
                        # (Triton's compute_output; the engine's statistics read the timings once this returns)
                        timings["output_ms"] = (self.clock() - encoding) * 1e3
                    except Exception as e:  # an output serve mode cannot carry (a sequence): say so, never hang
                        error = e if isinstance(e, ModelCacheError) else \
                            ModelCacheError(f"{msg.name}: cannot send its outputs: {type(e).__name__}: {e}")
                if error is not None:
                    self.reply(ident, P.ErrorReply(req_id=msg.req_id, code=error.code, message=str(error)))
                else:
                    self.reply(ident, P.InferReply(req_id=msg.req_id, outputs=wire, timings=timings,
                                                   version=(model or ensemble).version))
            finally:
                maps.clear()  # the input mappings go with the request, and the lent files (written before the reply)
                if lent is not None:
                    lent.close()

        if ensemble is not None:   # its steps, each a request of its model (daemon/ensembles.py)
            self.ensembles.run(ensemble, feeds, msg.output_names, arrival, deadline, answer, msg.priority)
            return None
        self.serve(model, feeds, msg.output_names, arrival, deadline, msg.sequence, answer, msg.priority,
                   input_s=input_s)
        return None

    def _count_large_outputs(self, wire: list) -> None:
        for entry in wire:
            if "lent_at" in entry:
                self.counters["outputs_lent"] += 1
            elif len(entry.get("data", b"")) > tensors.INLINE_MAX_BYTES:
                self.counters["outputs_large_inline"] += 1

    def serve(self, model: ModelRecord, feeds: dict, output_names: list | None, arrival: float,
              deadline: float | None, sequence: dict | None, answer, priority: int | None = None,
              warmup: bool = False, input_s: float = 0.0) -> None:
        """Run one request of `model` on the engine: `answer(outputs, timings, error)` once, when it is done;
        `priority` its level in a model with priority levels (executor/queues.py). A `warmup` request (warm_up) is
        neither cached nor counted: in the model's statistics, or as a call by the keep-alive policies.
        InputError (and the like), raised here, for a request refused before anything is held."""
        spec = self._sequence_spec(model)
        if spec is not None:   # a stateful model: the server fills its controls and states (executor/sequences.py)
            served = spec.hidden_inputs & feeds.keys()
            if served:
                raise InputError(f"{model.key}: input {sorted(served)[0]!r} is a sequence control or state, which "
                                 "the server fills: do not send it")
            model.feed_check.check({**feeds, **spec.example_feeds})   # (the id is the table's to check)
        else:
            model.feed_check.check(feeds)
        if model.manifest.stages and model.manifest.overridable:
            fed = sorted({o.name for o in model.manifest.overridable} & feeds.keys())
            if fed:
                raise InputError(f"{model.key}: {fed[0]!r} overrides an initializer, which a model split into "
                                 f"stages cannot take; partition it back into one stage to feed it")
        samples = tensors.request_rows(feeds)
        limit = model.manifest.serving.get("max_batch")
        outputs = [o.name for o in model.manifest.outputs]
        tensors.check_request(model.key, model.name, samples, limit, output_names, outputs)
        if spec is not None and limit and samples != 1:   # (Triton's words)
            raise InputError(f"inference request to model '{model.name}' must specify batch-size 1 due to "
                             "requirements of sequence batcher")
        wanted = output_names
        if spec is not None:   # the state outputs always run; a client gets them only when it asks
            wanted = output_names or [o for o in outputs if o not in spec.state_outputs
                                      or any(s.returned for s in spec.states if s.output == o)]
            output_names = None if not output_names else list(dict.fromkeys(output_names + sorted(spec.state_outputs)))
        cache_key, lookup_s = None, 0.0
        if self.caches(model) and not warmup:
            # (a front that missed its own cache has hashed these inputs already, but sends no key: any lane client
            # may send an Infer, and a key taken on trust could name another client's answer)
            started = self.clock()
            cache_key = request_key(model_identity(model.key, model.manifest.source_sha256), feeds, output_names)
            cached = self.responses.get(cache_key)
            lookup_s = self.clock() - started
            if cached is not None:   # answered as it was before: nothing held, promoted or run
                self.engine.cache_hit(model.key, arrival, lookup_s)
                answer(cached, {"total_ms": (self.clock() - arrival) * 1e3, "queue_ms": 0.0, "stages": [],
                                "cached": True}, None)
                return
        held = self.host.hold_request(model)   # not evicted under it (nor its GPU copies, submit: held.also)
        sequence_done: list = []  # the sequence's done(states), once the request runs
        fed = [feeds]             # what the engine runs: the client's feeds (a sequence's: with its controls, state)

        def finish(result, timings, error):
            states = None
            try:  # the answer first: releasing the request's hold is bookkeeping the client need not wait for
                if error is None and spec is not None:
                    states = {o: result[o] for o in spec.state_outputs if o in result}
                    result = {k: result[k] for k in wanted if k in result}
                answer(result, timings, error)
            finally:
                self.host.end(held)
                if sequence_done:   # the sequence's next request may go now, with this one's state
                    sequence_done[0](states)
            if cache_key is not None:   # (after the answer: the client need not wait for the copy kept)
                started = self.clock()
                if error is None:
                    self.responses.put(cache_key, model.name, result)
                self.engine.cache_missed(model.key, lookup_s + self.clock() - started)

        def submit():
            segments, specs, batchable = self._serve_specs(model)
            devices = {}
            for residency in self._serve_tiers(model):
                if residency.is_resident(model):
                    stages = self._serve_device_specs(model, residency, specs)
                    if stages is not None:
                        residency.also(held)     # (a call there too, as an open is: the timed policies count it)
                        devices[residency.id] = stages
            if not warmup:
                self.host.accessed(model)
            self.engine.submit(ServeRequest(model.key, specs, segments, dict(fed[0]), output_names, arrival,
                                            deadline, finish, samples=samples, batchable=batchable,
                                            profile=model.manifest.batching or None, devices=devices,
                                            serving=model.manifest.serving or None, priority=priority,
                                            warmup=warmup, timings={"stages": [], "input_ms": input_s * 1e3}))

        def start(error, hit):
            if error is not None:
                finish(None, {}, error)
                return
            waiting = [r for r in self._serve_tiers(model) if not r.is_resident(model)]
            if not waiting:
                submit()
                return
            left = [len(waiting)]

            def on_device(error, uuid):   # a device that cannot take the model does not serve it: the CPU does
                if error is not None:
                    log.info("%s: served without GPU %s: %s", model.key, uuid, error)
                left[0] -= 1
                if left[0] == 0:
                    submit()

            for residency in waiting:
                uuid = residency.id
                try:
                    # (wait=False: with the device full of models in use, the CPU serves it now, not later)
                    residency.when_resident(model, lambda error, _hit, uuid=uuid: on_device(error, uuid), deadline,
                                            wait=False)
                except ModelCacheError as e:
                    on_device(e, uuid)

        def run():
            try:
                # (memory_wait: where the memory limit cannot take it beside the requests in flight, it waits for them)
                self.host.when_resident(model, start, deadline, memory_wait=True)
            except ModelCacheError as e:   # no room to load it, say: the answer, and the request's hold released
                finish(None, {}, e)

        if spec is None:
            run()
            return

        def go(extra, done):   # the sequence's turn: its controls and state join the client's feeds
            sequence_done.append(done)
            fed[0] = {**feeds, **extra}
            run()

        sequence = sequence or {}
        try:
            self._sequence_table(model, spec).submit(sequence.get("id"), bool(sequence.get("start")),
                                                     bool(sequence.get("end")), deadline, go,
                                                     lambda error: finish(None, {}, error))
        except ModelCacheError as e:   # refused (no id, no START): answered, the hold released
            finish(None, {}, e)

    def warm_up(self, model: ModelRecord, ready_meanwhile: bool = False) -> None:
        """Run the model's warm-up samples (its Triton config's model_warmup, daemon/warmup.py), one run after
        another, each sample `count` times, as requests of its own queue: the model is promoted, its sessions
        made and run once before the requests that come after them. A failure is logged, and ends the warm-up.
        Meanwhile the model is not ready (`warming`), as Triton's, unless `ready_meanwhile`: a version swapped in
        for one that was ready (daemon/swaps.py), whose requests queue behind the warm-up runs anyway."""
        samples = (model.manifest.serving or {}).get("warmup")
        if not samples or self._sequence_spec(model) is not None:
            return
        max_batch = model.manifest.serving.get("max_batch", 0)
        runs = [(s["name"], feeds) for s in samples for _ in range(s["count"])
                for feeds in sample_requests(s, max_batch)]
        started = self.clock()
        if not ready_meanwhile:
            self.warming[model.key] = self.warming.get(model.key, 0) + 1

        def ended() -> None:
            if ready_meanwhile:
                return
            left = self.warming.pop(model.key) - 1
            if left:
                self.warming[model.key] = left

        def run(i: int) -> None:
            if i == len(runs):
                log.info("%s: warmed up: %d runs in %.2f s", model.key, len(runs), self.clock() - started)
                ended()
                return
            name, feeds = runs[i]

            def answered(outputs, timings, error):
                if error is not None:
                    log.warning("%s: warm-up sample %r failed: %s", model.key, name, error)
                    ended()
                else:
                    run(i + 1)
            try:
                self.serve(model, feeds, None, self.clock(), None, None, answered, warmup=True)
            except ModelCacheError as e:   # (refused before it was held: a sample the model cannot take)
                log.warning("%s: warm-up sample %r refused: %s", model.key, name, e)
                ended()

        run(0)

    def _sequence_spec(self, model: ModelRecord):
        """The model's sequence batching (a SequenceSpec), or None for a stateless model."""
        wire = model.manifest.serving.get("sequence") if model.manifest.serving else None
        if wire is None:
            return None
        cached = self.sequence_specs.get(model.key)
        if cached is None or cached[0] is not wire:
            try:
                spec = SequenceSpec.from_wire(wire)
            except ValueError as e:   # (a manifest edited by hand: said, never a trace)
                raise ModelCacheError(f"{model.key}: its stored sequence batching cannot be used: {e}") from None
            cached = self.sequence_specs[model.key] = (wire, spec)
        return cached[1]

    def _sequence_table(self, model: ModelRecord, spec) -> SequenceTable:
        table = self.sequence_tables.get(model.key)
        if table is None or table.spec is not spec:
            if table is not None:   # imported again with another configuration: its sequences start over
                table.close(InputError(f"{model.key}: its sequence batching changed; start the sequence again"))
            table = self.sequence_tables[model.key] = SequenceTable(model.key, spec, self.clock)
        return table

    def next_timer(self) -> float | None:
        """When a sequence may have idled out."""
        times = [t for table in self.sequence_tables.values() if (t := table.next_timer()) is not None]
        return min(times) if times else None

    def on_timer(self, now: float) -> None:
        for key, table in list(self.sequence_tables.items()):
            table.on_timer(now)
            if not table.sequences:   # (a model's table comes back with its next sequence)
                del self.sequence_tables[key]

    def _serve_tiers(self, model: ModelRecord) -> list:
        """The GPU tiers whose device has a serve-mode GPU worker, when the model has GPU weights."""
        if not self.gpus or not model.manifest.gpu_tensors or model.manifest.serving.get("device") == "cpu":
            return []   # (device "cpu": its Triton instance_group asked for CPU instances only)
        return [self.gpus.by_uuid[w.device.uuid] for w in self.engine.workers
                if getattr(w, "device", None) is not None and w.device.uuid in self.gpus.by_uuid]

    def _serve_device_specs(self, model: ModelRecord, residency, specs: list) -> list | None:
        """Per stage {uuid, skeleton, tensors at this process's addresses} of the model's copy on `uuid`, or
        None per stage that has no GPU skeleton (None in all: GPU workers cannot run this model). Cached with
        the copy: a demotion forgets it (evict_from_device), a new partition rebuilds `specs`."""
        uuid, tier = residency.id, residency.tier
        cached = self.serve_device_specs.get((model.key, uuid))
        if cached is not None and cached[0] is specs:
            return cached[1]
        if not model.manifest.stages:
            stages = [{"uuid": uuid, "skeleton": str(self.host.tier.skeleton_path(model.key, "gpu")),
                       "tensors": tier.local_tensors(model.key)}]
        else:
            stages = [{"uuid": uuid, "skeleton": str(model.disk_dir / e["gpu_file"]),
                       "tensors": tier.local_tensors(model.key, set(e["gpu_tensors"]))} if e.get("gpu_file") else None
                      for e in model.manifest.stages]
        if all(s is None for s in stages):
            stages = None
        self.serve_device_specs[(model.key, uuid)] = (specs, stages)
        return stages

    def worker_hold(self, key: str, uuid: str, worker_id: int, holds: bool):
        """The engine, on the owner loop: GPU worker `worker_id` may have sessions over the model's copy on
        device `uuid` (holds), held once per worker like a client's GPU lease; or it drops them (not holds):
        returns what ends its hold once they are gone, or None when it held none."""
        residency = self.gpus.by_uuid[uuid]
        if not holds:
            return residency.worker_done(key, worker_id)
        model = self.registry.by_key(key)
        if model is not None:   # (a request in flight holds its model: it cannot have been removed)
            residency.hold_for_worker(model, worker_id)
        return None

    def _serve_specs(self, model: ModelRecord) -> tuple[list, list, bool]:
        """(segments, per-stage {skeleton, inputs, outputs, tensors}, batchable) of a resident model; cached
        until it is evicted or re-partitioned, since every request of a model needs the same.

        Batchable: every input and output has a free first dimension, so requests can be stacked
        along it and the outputs split back."""
        cached = self.serve_specs.get(model.key)
        if cached is None:
            _, segments, all_tensors = self.host.tier.layout(model.key, model.manifest)
            # (a whole model's stage also takes the overridable initializers a request feeds: the engine passes
            # on those of its inputs a request has)
            whole_inputs = [i.name for i in model.manifest.inputs + model.manifest.overridable]
            stages = model.manifest.stages or [{"file": "model.onnx", "inputs": whole_inputs,
                                                "outputs": [o.name for o in model.manifest.outputs],
                                                "tensors": [t[0] for t in all_tensors]}]
            specs = []
            for e in stages:
                wanted = set(e["tensors"])
                specs.append({"skeleton": str(model.disk_dir / e["file"]), "inputs": e["inputs"],
                              "outputs": e["outputs"], "tensors": [t for t in all_tensors if t[0] in wanted],
                              "worker_ids": self.engine.worker_ids(e.get("workers"), model.key)})
            io = model.manifest.inputs + model.manifest.outputs
            # (an overridable initializer fed by one request is no row of a batch: such models run requests alone)
            batchable = all(e.shape and not isinstance(e.shape[0], int) for e in io) and not model.manifest.overridable
            self._check_stored_profile(model)
            cached = self.serve_specs[model.key] = (segments, specs, batchable)
        return cached

    @staticmethod
    def _check_stored_profile(model: ModelRecord) -> None:
        """A profile stored before set_batching checked profiles in full (or edited by hand) may be one
        every serve request would fail on: serve without it, and say so, rather than fail forever."""
        from ..calibration import check_profile
        if model.manifest.batching:
            try:
                check_profile(model.manifest.batching, stages=max(1, len(model.manifest.stages)))
            except ValueError as e:
                log.warning("%s: ignoring its stored batching profile: %s", model.key, e)
                model.calibrated({})


def serve_gpu_devices(settings) -> list | None:
    """The devices that get a serve-mode GPU worker: the simulated ones of `fake_gpus` (as `gpus` selects),
    or None: those `discover_gpus` finds (CUDA devices, with onnxruntime's CUDA provider)."""
    if not settings.fake_gpus:
        return None
    from ..tiers.gpu import fake_devices
    return select_gpus(settings.gpus, fake_devices(settings.fake_gpus), cuda_provider=True)


def _items(value, what: str):
    if not isinstance(value, dict):
        raise ProtocolError(f"front_served: {what} must be a map, not {type(value).__name__}")
    return value.items()


def _front_report(key, report) -> dict:
    """One model's entry of a FrontServed, checked: ProtocolError names what is wrong."""
    if not isinstance(key, str):
        raise ProtocolError(f"front_served: a model key must be text, not {type(key).__name__}")
    fields = dict(_items(report, f"{key[:80]}'s report"))
    counts = fields.get("counts")
    if not isinstance(counts, list) or len(counts) != len(INFER_BUCKETS_S) + 1 \
            or not all(type(c) is int and c >= 0 for c in counts):
        raise ProtocolError(f"front_served: {key[:80]}'s counts must be {len(INFER_BUCKETS_S) + 1} counts >= 0")
    out = {"counts": counts}
    for name, kind in (("success_s", float), ("samples", int), ("run_s", float), ("failed", int),
                       ("failed_s", float), ("last_unix_ms", int), ("cache_hits", int), ("cache_hit_s", float),
                       ("cache_misses", int), ("cache_miss_s", float)):
        value = fields.get(name, 0)
        if type(value) not in ((int,) if kind is int else (int, float)) or not math.isfinite(value) or value < 0:
            raise ProtocolError(f"front_served: {key[:80]}'s {name} must be a finite number >= 0")
        out[name] = value
    out["batches"] = {}   # {rows: [runs, seconds]} (executor/stats.add_batch; a front before it sent none)
    for rows, pair in _items(fields.get("batches", {}), f"{key[:80]}'s batches"):
        if not (isinstance(rows, str) and rows.isdigit() and 0 < int(rows) <= 1 << 31) or not isinstance(pair, list) \
                or len(pair) != 2 or type(pair[0]) is not int or pair[0] < 0 or type(pair[1]) not in (int, float) \
                or not math.isfinite(pair[1]) or pair[1] < 0:
            raise ProtocolError(f"front_served: {key[:80]}'s batches must map a row count to [runs, seconds]")
        out["batches"][rows] = pair
    return out
