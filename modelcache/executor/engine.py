"""Serve-mode engine: requests are batched, and batches move stage by stage over worker groups.

Runs on the daemon's owner loop; workers only execute. It works in steps, as vLLM v1's EngineCore does:
`submit` only queues a request, and the daemon calls `step()` once a loop turn, after it has read
everything that arrived in that turn (and applied the workers' finished stages):

  schedule  each model's batching policy forms batches from everything queued, for the idle workers;
            stage work already in flight goes first (a finished stage hands its batch on before any
            new batch is formed), and the scheduler places each stage on a worker
  execute   a short stage with nothing else in flight runs right here on the loop (_may_inline);
            others go to their worker's thread, whose result comes back in a later turn
  update    a finished stage calibrates the performance model; after the last stage the outputs
            are split back per request and each is answered

So there is one way in and one way out, whatever the load: requests that arrive together are batched
together (the lane hands the daemon every request a front had ready in one read), and one ORT run serves
them all.

Layer-to-layer batching (LBCI): when a batch reaches a stage boundary k and requests are
queued, the policy may admit some. They run stages 0..k-1 as a catch-up batch while the
main batch waits; then the two merge and run the remaining stages as one batch.

GPU workers run a stage only over its model's copy on their device (ServeRequest.devices,
which the daemon fills once the copy is resident there). The daemon holds that copy for each
(GPU worker, model) from the first stage the engine places there until the worker confirms it
dropped the model's sessions: the daemon's own process really frees device memory, so a copy
is never freed under a session that may still run (`worker_hold`).
A stage's output that a later stage reads stays on the GPU that made it (a DeviceValue);
it comes to host memory only where a CPU worker, a batch merge or the answer needs it.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import os
import statistics
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import CapacityError, InputError, RequestTimeout
from ..calibration import profile_predict, request_overhead
from ..config import parse_policy_spec
from .batching import LayerToLayer, Pending, make_batcher
from ..storage import StateFile
from .perfmodel import PerfModels
from .queues import ModelQueue, Refused
from .scheduler import Task, make_scheduler
from .stats import ModelServeStats
from .workers import (DeviceValue, GpuWorker, StageJob, Worker, WorkerCall, WorkerUnavailable, discover_gpus,
                      parse_groups, stage_error, to_host)

log = logging.getLogger("modelcache.executor")

DEFAULT_MAX_BATCH = 8     # without a setting or a calibrated N_opt
POLICY_LOOKAHEAD = 256    # queued requests a batching policy sees (FIFO head)
PERF_SAVE_INTERVAL_S = 300.0   # a daemon that dies loses at most this much of its performance history


@dataclass(eq=False)  # identity: requests hold arrays, and two are never "equal"
class ServeRequest:
    model_key: str
    stages: list                 # [{skeleton, inputs, outputs, tensors}] in order
    segments: list
    data: dict                   # the feeds by name
    output_names: list
    arrival: float
    deadline: float | None
    finish: object               # finish(outputs: dict | None, timings: dict, error) on the owner loop
    samples: int = 1             # rows along axis 0: a request is batched whole
    batchable: bool = False      # every input and output has a free first (batch) dimension
    profile: dict | None = None  # the model's calibration (manifest "batching"), if any
    request_id: int = 0
    timings: dict = field(default_factory=lambda: {"stages": []})
    # device UUID -> per stage {"uuid", "skeleton", "tensors"} of the model's copy there (see StageJob.device);
    # only GPU workers of these devices may run its stages.
    devices: dict = field(default_factory=dict)
    serving: dict | None = None  # the model's own batching policy (manifest "serving": a Triton config's), if any
    priority: int | None = None  # the client's (Triton's request priority): its level in a model with priority_levels
    warmup: bool = False         # the model's own warm-up (daemon/warmup.py): run as any request, counted in no stats
    # Set by its model's queue (executor/queues.py): its priority level; when it is refused, or with DELAY moved
    # behind its level's others, unless it has run by then (its level's queue timeout; None: no limit); whether moved
    queue_level: int = 0
    queue_deadline: float | None = None
    delayed: bool = False

    def pending(self, t_opt_s: float | None) -> Pending:
        """What the batching policy sees; t_opt bounds the deadline the policy protects."""
        deadline = self.deadline if self.deadline is not None else float("inf")
        if t_opt_s:
            deadline = min(deadline, self.arrival + t_opt_s)
        return Pending(self.request_id, self.samples, self.arrival, deadline)


@dataclass(eq=False)
class Batch:
    batch_id: int
    members: list                # ServeRequests, in row order
    data: dict                   # tensors of all members, concatenated along axis 0
    stage: int = 0
    joins: object = None         # a catch-up batch: merges into this Batch ...
    join_at: int = 0             # ... once it has run stages 0..join_at-1

    @property
    def samples(self) -> int:
        members = self.members
        return members[0].samples if len(members) == 1 else sum(m.samples for m in members)

    @property
    def first(self) -> ServeRequest:
        return self.members[0]


def concat(parts: list[dict]) -> dict:
    """Tensors of several requests as one batch: every name concatenated along axis 0."""
    if len(parts) == 1:
        return dict(parts[0])
    return {name: np.concatenate([to_host(p[name]) for p in parts], axis=0) for name in parts[0]}


def rows_aligned(data: dict, samples: int) -> bool:
    """Whether every tensor has one row per sample, so a batch can be split or merged."""
    return all(getattr(v, "ndim", 0) >= 1 and v.shape[0] == samples for v in data.values())


def same_shape_rows(a: dict, b: dict) -> bool:
    """Whether two requests' feeds can stack: same names, dtypes and dims after the first."""
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape[1:] == b[k].shape[1:] for k in a)


class Engine:
    def __init__(self, settings, perf_path: Path | None, post, clock, worker_factory=None, gpu_devices=None,
                 gpu_worker_factory=None, worker_hold=None, answered=None):
        # "auto": one group of every core this process may use.
        spec = settings.workers
        self.groups = parse_groups(str(len(os.sched_getaffinity(0))) if spec == "auto" else spec)
        # GPU workers follow the CPU groups: one per device settings.gpus selects. Tests that make their
        # own workers get GPUs only when they hand in devices (and, to run nothing, a factory for them).
        if gpu_devices is None:
            gpu_devices = [] if worker_factory is not None else discover_gpus(settings.gpus)
        self.scheduler = make_scheduler(settings.scheduler)
        self.settings = settings      # read live: batching, max_batch, t_opt_ms, batch_window_ms, max_queue_delay_ms
        self.policies = parse_policy_spec(settings.batching)
        self.perf_path = perf_path
        self.perf = PerfModels.load(perf_path) if perf_path else PerfModels()
        # Saved at stop and every PERF_SAVE_INTERVAL_S while runs come in; a save that fails is logged once.
        self.perf_file = StateFile(perf_path, "the performance models") if perf_path else None
        self.perf_saved = (self.perf.recorded, clock())   # (runs recorded, when) at the last save
        self.clock = clock
        # worker_factory(id, cores, post): tests give workers that run nothing, to drive the engine by hand.
        make_worker, make_gpu_worker = worker_factory or Worker, gpu_worker_factory or GpuWorker

        def worker_post(job, err):
            post(lambda *_: self._worker_done(job, err), None, None)

        self.workers = [make_worker(i, cores, worker_post) for i, cores in enumerate(self.groups)]
        self.workers += [make_gpu_worker(i, device, worker_post)
                         for i, device in enumerate(gpu_devices, start=len(self.workers))]
        self.disabled: dict[int, str] = {}      # worker id -> why it takes no more stages (WorkerUnavailable)
        self.placeable = [w.state for w in self.workers]   # what the scheduler may choose from
        self.outstanding = [0] * len(self.workers)
        self.requests: dict[int, ServeRequest] = {}   # every request not yet answered
        self.queues: dict[str, ModelQueue] = {}       # model key -> requests waiting for a batch
        self.batches: dict[int, Batch] = {}           # formed, not finished (running, or waiting for a catch-up)
        self.batchers: dict[str, object] = {}         # model key -> its policy object
        self.wake_at: float | None = None             # a batching window ends: form batches then
        self.inline: deque = deque()                  # (worker, job) the owner loop runs itself, in step()
        self._stepping = False
        self._ids = itertools.count(1)
        self._batch_ids = itertools.count(1)
        self.served = 0
        self.failed = 0
        self.batches_formed = 0
        self.batched_samples = 0
        self.batched_requests = 0     # the mean batch size is requests per batch (a request may carry many samples)
        self.layer_joins = 0
        self.queue_full = 0       # requests refused at once: their model's queue was full
        self.queue_timeouts = 0   # requests refused after waiting their model's queue_timeout_ms
        self.latencies_ms: deque = deque(maxlen=1000)
        self.last_used: dict[str, float] = {}   # model key -> when a request last touched it
        self.model_stats: dict[str, ModelServeStats] = {}   # model key -> its requests' counts and times
        # worker_hold(model key, device UUID, worker id, holds): the daemon's hold on the model's copy on that
        # device for a GPU worker, taken (holds: once, however often asked) as a stage is placed there, for as
        # long as the worker may have sessions over it; not holds: returns what ends it, or None (none held).
        self.worker_hold = worker_hold or (lambda key, uuid, wid, holds: None)
        # answered(): a batch's answers were handed over (its requests' finish callbacks ran): the daemon writes
        # them now, one write a connection, while the loop goes on to the next batch; so the front works on
        # these answers while the daemon runs the next (writing once a turn cost 8% of the requests/s at 4 clients).
        self.answered = answered or (lambda: None)
        self._post = post

    def start(self, import_runtime: bool = False) -> None:
        """Start the workers; `import_runtime`: import ONNX Runtime now, on a thread of its own, where the first
        request's session would (60 ms here with the files cached, 0.2 s cold: that much of the first answer after a
        load, benchmarks/repoload). A daemon serving over a front asks for it; one whose clients attach does not pay
        ORT's 20 MiB before a request."""
        for w in self.workers:
            w.start()
        if import_runtime:
            threading.Thread(target=importlib.import_module, args=("onnxruntime",), name="modelcache-import-ort",
                             daemon=True).start()

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
        self.save_perf_models()

    def save_perf_models(self, now: float | None = None) -> None:
        """Save the performance models if runs came since the last save (`now`: only once
        PERF_SAVE_INTERVAL_S have passed since it, too). Never raises: see storage.StateFile."""
        recorded, saved_at = self.perf_saved
        if self.perf_file is None or self.perf.recorded == recorded or \
                (now is not None and now - saved_at < PERF_SAVE_INTERVAL_S):
            return
        if self.perf_file.save(self.perf.to_json()):
            self.perf_saved = (self.perf.recorded, self.clock())
        else:
            self.perf_saved = (recorded, self.clock())    # (tried again one interval later)

    def worker_names(self) -> dict[str, int]:
        """Worker name (as `modelcache place --describe` names them) -> worker id."""
        return {w.name: w.state.worker_id for w in self.workers}

    def check_plan_workers(self, plan: dict) -> None:
        """InputError unless every worker a placement plan names is one of this daemon's."""
        names = self.worker_names()
        for k, stage in enumerate(plan.get("stages") or []):
            for name in stage.get("worker_names") or []:
                if name not in names:
                    raise InputError(f"the plan puts stage {k} on worker {name!r}, which this daemon does not have "
                                     f"(it has {', '.join(names)}); search the plan on `modelcache place --describe`")

    def worker_ids(self, names: list | None, model_key: str) -> frozenset | None:
        """The ids of a stage's planned workers; None (any worker) when unplanned, or when the daemon's
        workers changed since the plan was made (then say so: the plan no longer applies)."""
        if not names:
            return None
        known = self.worker_names()
        if any(n not in known for n in names):
            log.warning("%s: its placement plan names workers %s; this daemon has %s: serving on any worker",
                        model_key, names, list(known))
            return None
        return frozenset(known[n] for n in names)

    def cpu_worker(self, name: str | None):
        """The CPU worker of that name (None: the first); InputError naming the CPU workers otherwise."""
        cpus = [w for w in self.workers if w.state.memory_node == "cpu" and w.state.worker_id not in self.disabled]
        found = next((w for w in cpus if name is None or w.name == name), None)
        if found is None:
            have = ", ".join(w.name for w in cpus) or "none"
            raise InputError(f"no CPU worker {name!r} in this daemon: it has {have}"
                             + (" (a GPU worker's costs are modelled, not profiled)" if name in self.worker_names()
                                else ""))
        return found

    def predicted_run_s(self, model_key: str, stages: int, kind: str) -> float | None:
        """Seconds one sample takes through every stage of a model on a worker of `kind`; None until measured."""
        each = [self.perf.predict(model_key, s, kind, 1) for s in range(max(1, stages))]
        return None if None in each else sum(each)

    def front_may_run(self, model_key: str, serving: dict | None, stages: int) -> bool:
        """Whether a front may run the model in its own process (docs/serve.md, "Short models at the front"):
        where all the engine would do is run it alone, inline, on the loop. One stage, serial batching (the
        `batching` setting's and the model's own), CPU workers only, and a run it has measured within
        `inline_run_ms` (at the batch size its requests came in). A model the engine has not run yet is not:
        its first requests come here."""
        if self.settings.front_runs != "short" or stages > 1 or self.settings.inline_run_ms <= 0:
            return False
        if any(w.state.memory_node != "cpu" for w in self.workers):   # (the scheduler may place it on a GPU)
            return False
        if self._policy_of(model_key, serving) != "serial":
            return False
        kinds = dict.fromkeys(w.state.kind for w in self.workers)
        predicted = [p for p in (self.perf.shortest(model_key, 0, k) for k in kinds) if p is not None]
        return bool(predicted) and min(predicted) <= self.settings.inline_run_ms / 1e3

    def run_on_worker(self, worker, work, done, expected_s: float) -> None:
        """Run work(worker) on that worker's thread, after the stages queued there; done(result, error) on the
        owner loop. Meanwhile the worker counts as busy, so no new batch waits behind it, and dmda expects
        it free `expected_s` later at the earliest."""
        i = worker.state.worker_id
        self.outstanding[i] += 1
        worker.state.free_at = max(worker.state.free_at, self.clock()) + expected_s

        def finished(result, error):
            self.outstanding[i] -= 1
            done(result, error)   # (the worker is free again: the turn's step schedules it)

        worker.queue.put(WorkerCall(work, lambda result, error: self._post(lambda *_: finished(result, error),
                                                                           None, None)))

    def drop_model(self, model_key: str, then=None) -> None:
        """Forget the model's stage sessions on every worker (each drops them on its thread, after any job
        queued before the drop); `then()` runs on the owner loop once every worker has: what the sessions
        mapped and allocated has been given back by then (the daemon's memory limit waits for it)."""
        self.last_used.pop(model_key, None)
        self.batchers.pop(model_key, None)
        left = len(self.workers)

        def dropped(end) -> None:   # on the owner loop, once per worker
            nonlocal left
            if end is not None:
                end()
            left -= 1
            if left == 0 and then is not None:
                then()

        for w in self.workers:
            uuid = w.state.memory_node
            # A GPU worker's hold on the device copy ends with its sessions; a stage placed there meanwhile
            # takes a new one, as the hold is no longer the worker's.
            end = None if uuid == "cpu" else self.worker_hold(model_key, uuid, w.state.worker_id, False)
            w.drop_model(model_key, then=lambda end=end: self._post(lambda *_: dropped(end), None, None))
        if not self.workers and then is not None:
            then()

    def settings_changed(self) -> None:
        """Batching settings were reloaded: policies are rebuilt on the next batch of each model."""
        self.policies = parse_policy_spec(self.settings.batching)
        self.batchers.clear()

    def drop_idle(self, now: float, idle_s: float) -> list[str]:
        """Drop the stage sessions of models no request used for `idle_s`: they hold activation
        buffers and keep weights mapped, which a model nobody serves should not cost."""
        busy = {r.model_key for r in self.requests.values()}
        idle = [k for k, t in self.last_used.items() if now - t > idle_s and k not in busy]
        for key in idle:
            self.drop_model(key)
        return idle

    # -- batching policy per model -----------------------------------------------------
    def _t_opt_s(self, req: ServeRequest) -> float | None:
        t_opt_ms = self.settings.t_opt_ms or (req.profile or {}).get("t_opt_ms", 0.0)
        return t_opt_ms / 1e3 if t_opt_ms else None

    def _batcher(self, req: ServeRequest):
        batcher = self.batchers.get(req.model_key)
        if batcher is None:
            own = req.serving or {}
            policy = self._policy_of(req.model_key, own) if req.batchable else "serial"
            max_batch = self.settings.max_batch or own.get("max_batch") or (req.profile or {}).get("n_opt") \
                or DEFAULT_MAX_BATCH
            if own.get("max_batch"):
                max_batch = min(max_batch, own["max_batch"])
            delay_ms = own["max_queue_delay_ms"] if "max_queue_delay_ms" in own else self.settings.max_queue_delay_ms
            batcher = self.batchers[req.model_key] = make_batcher(
                policy, max_batch=max_batch, window_s=self.settings.batch_window_ms / 1e3,
                max_queue_delay_s=delay_ms / 1e3, preferred=own.get("preferred_batch_sizes") or (),
                predict=lambda stage, b, key=req.model_key, profile=req.profile: self._predict_batch(key, profile, stage, b),
                stages=len(req.stages), overhead_s=request_overhead(req.profile))
        return batcher

    def _policy_of(self, model_key: str, serving: dict | None) -> str:
        """The model's batching policy: the `batching` setting naming the model wins; then the model's own (its
        Triton config's dynamic_batching); then the setting's default. (The model's max_batch bounds every
        batch: _batcher.)"""
        return self.policies.get(model_key.rsplit("@", 1)[0]) or (serving or {}).get("policy") or self.policies["*"]

    def _predict_batch(self, model_key: str, profile: dict | None, stage: int, samples: int) -> float:
        """Seconds for `stage` of the model at `samples` rows: history, else the calibration
        profile, else the batch-1 history scaled linearly (an upper bound); inf when unknown,
        so layer-to-layer admits nothing it cannot predict."""
        kinds = [w.state.kind for w in self.workers]
        for kind in dict.fromkeys(kinds):
            t = self.perf.predict(model_key, stage, kind, samples)
            if t is not None:
                return t
        t = profile_predict(profile, stage, samples)
        if t is not None:
            return t
        one = self.perf.predict(model_key, stage, kinds[0], 1)
        return one * samples if one is not None else float("inf")

    # -- requests ------------------------------------------------------------------------
    def submit(self, req: ServeRequest) -> None:
        """Queue a request, in its priority level where its model has levels; the next `step()` schedules it. Where
        its level is full (the model's `max_queue`, else the setting's) the request is refused now, as Triton's queue
        policy refuses it: under overload a bounded queue answers at once what it cannot serve soon, and keeps the
        wait of what it takes short."""
        req.request_id = next(self._ids)
        self.requests[req.request_id] = req
        self.last_used[req.model_key] = req.arrival
        queue = self.queues.get(req.model_key)
        if queue is None:
            queue = self.queues[req.model_key] = ModelQueue(req.serving)
        elif queue.serving is not (req.serving or queue.serving):   # (another manifest: removed and added again)
            queue.configure(req.serving)
        try:
            queue.append(req, req.priority, self.clock(), self.settings.max_queue)
        except Refused as e:
            self.queue_full += 1
            self._finish(req, None, CapacityError(f"{req.model_key}: {e}: try again later"), rejected=True)

    def step(self) -> None:
        """Schedule, execute, update, until nothing more can start now: what runs on the loop runs here, and
        what it frees (a worker, a stage boundary, an ensemble's next request) is scheduled in the same step.
        Never nested (a request answered here may submit another): a backlog cannot grow the stack."""
        if self._stepping:
            return
        self._stepping = True
        try:
            while True:
                self._form_batches()                       # schedule
                if not self.inline:
                    return
                while self.inline:                          # execute, and update as each stage finishes
                    worker, job = self.inline.popleft()
                    self._stage_done(job, worker.run(job), inline=True)
                    self.answered()
        finally:
            self._stepping = False

    def next_wakeup(self) -> float | None:
        return self.wake_at

    def on_timer(self, now: float) -> None:
        if self.wake_at is not None and now >= self.wake_at:
            self.step()

    def _form_batches(self) -> None:
        """Give each idle worker a new batch, oldest queue first, as the models' policies decide."""
        self.wake_at = None
        if not self.queues:
            return
        now = self.clock()
        idle = self.outstanding.count(0)
        keys = list(self.queues) if len(self.queues) == 1 else \
            sorted(self.queues, key=lambda k: self.queues[k].head.arrival if self.queues[k] else now)
        for key in keys:
            queue = self.queues[key]
            self._expire_queued(queue, now)
            while queue and idle > 0:
                batcher = self._batcher(queue.head)
                t_opt = self._t_opt_s(queue.head)
                decision = batcher.decide(now, self._head(queue, t_opt))
                if not decision.take:
                    if decision.wait_until is not None:
                        self.wake_at = min(self.wake_at or float("inf"), decision.wait_until)
                    break
                members = self._fit_deadlines(queue, self._take(queue, len(decision.take)), now)
                if self._start(Batch(next(self._batch_ids), members, concat([m.data for m in members]))):
                    idle -= 1   # (a batch whose members all expired took no worker)
        for key in [k for k, q in self.queues.items() if not q]:
            del self.queues[key]
        for queue in self.queues.values():   # a queue timeout answers at its time, not at the next worker's turn
            due = queue.next_due()
            if due is not None:
                self.wake_at = due if self.wake_at is None else min(self.wake_at, due)

    @staticmethod
    def _head(queue: ModelQueue, t_opt: float | None) -> list:
        """What a policy may take from a queue: its head. A batch never holds more than this, and a
        backlog of thousands must not cost thousands of objects per decision."""
        return [r.pending(t_opt) for r in itertools.islice(queue, POLICY_LOOKAHEAD)]

    def _take(self, queue: ModelQueue, n: int) -> list:
        """The first n queued requests, stopping early at one whose feeds cannot stack with the first."""
        members = [queue.popleft()]
        while len(members) < n and queue and same_shape_rows(members[0].data, queue.head.data):
            members.append(queue.popleft())
        return members

    def _batch_time(self, req: ServeRequest, samples: int) -> float:
        """Predicted seconds for `samples` rows of req's model through every stage; 0 when never measured."""
        t = sum(self._predict_batch(req.model_key, req.profile, s, samples) for s in range(len(req.stages)))
        return 0.0 if t == float("inf") else t

    def _fit_deadlines(self, queue: ModelQueue, members: list, now: float) -> list:
        """Shrink a new batch from its end until its predicted run meets every member's deadline.

        A bigger batch is slower: under overload, members started in one that cannot finish in time
        are dropped half-way and their work is wasted (measured: AlexNet's dynamic and layer batching
        fell to 18-24 req/s at 1.5x load, under serial's 35). Those put back run in a later batch, or
        are answered as soon as they cannot make it even alone (_expire_queued)."""
        if len(members) == 1 or all(m.deadline is None for m in members):
            return members
        while len(members) > 1:
            done_at = now + self._batch_time(members[0], sum(m.samples for m in members))
            if all(m.deadline is None or done_at <= m.deadline for m in members):
                break
            queue.appendleft(members.pop())
        return members

    def _expire_queued(self, queue: ModelQueue, now: float) -> None:
        """Answer now the queued requests that cannot finish by their deadline: already past it, or
        nearer to it than the model's predicted run time. Starting those would spend a worker on answers
        nobody can use; under overload that is how goodput collapses (every request started just before
        it expires, and dropped half-way)."""
        for req in queue.expire(now):   # (those with DELAY wait on, behind their level's others)
            self.queue_timeouts += 1
            self._finish(req, None, CapacityError(
                f"{req.model_key}: Request timeout expired: it waited for a worker longer than its model's "
                f"queue timeout ({queue.policy(req.queue_level).timeout_s * 1e3:g} ms)"), rejected=True)
        if not any(r.deadline is not None for r in queue):
            return
        need = self._batch_time(queue.head, 1)   # never measured: 0, so only a passed deadline counts
        for req in [r for r in queue if r.deadline is not None and now + need > r.deadline]:
            queue.remove(req)
            why = ("deadline passed while the request waited for a worker" if now > req.deadline else
                   f"deadline cannot be met: {(req.deadline - now) * 1e3:.1f} ms left, the model needs "
                   f"{need * 1e3:.1f} ms")
            self._finish(req, None, RequestTimeout(why), rejected=True)

    def _start(self, batch: Batch) -> bool:
        self.batches[batch.batch_id] = batch
        self.batches_formed += 1
        self.batched_samples += batch.samples
        self.batched_requests += len(batch.members)
        return self._run_stage(batch)

    def _run_stage(self, batch: Batch) -> bool:
        """Place the batch's next stage on a worker; False when no member is left to run it for."""
        now = self.clock()
        if not self._drop_expired(batch, now):
            return False
        req = batch.first
        spec = req.stages[batch.stage]
        inputs = {k: batch.data[k] for k in spec["inputs"] if k in batch.data}   # (overridables: when fed)
        for i, w in enumerate(self.workers):  # an idle worker's estimate is "free now"
            if self.outstanding[i] == 0:
                w.state.free_at = now
        on_device = next((v.device for v in inputs.values() if isinstance(v, DeviceValue)), "cpu")
        task = Task(batch.batch_id, req.model_key, batch.stage, batch.samples,
                    sum(getattr(v, "nbytes", 0) for v in inputs.values()), data_node=on_device, arrival=now)
        placeable = self._placeable_for(req, batch.stage)
        allowed = spec.get("worker_ids")   # a placement plan's set for this stage: dmda picks within it
        candidates = placeable if allowed is None else [w for w in placeable if w.worker_id in allowed] or placeable
        [placement] = self.scheduler.place([task], candidates, now, self.perf.predict)
        worker = self.workers[placement.worker_id]
        self.outstanding[placement.worker_id] += 1
        job = StageJob(batch.batch_id, req.model_key, batch.stage, spec["skeleton"], req.segments,
                       spec["tensors"], inputs, spec["outputs"], placement.predicted_s, queued_at=now,
                       threads=(req.serving or {}).get("intra_op_threads", 0))
        self._on_device(job, worker, req, batch.stage)
        job.short = job.predicted_s is not None and job.predicted_s <= self.settings.inline_run_ms / 1e3
        if self._may_inline(worker, job):
            self.inline.append((worker, job))
        else:
            worker.queue.put(job)
        return True

    def _placeable_for(self, req: ServeRequest, stage: int) -> list:
        """The workers that may run this stage: CPU groups, and GPU workers whose device holds the model."""
        if len(self.placeable) == len(self.groups) and not self.disabled:   # no GPU worker: the common case
            return self.placeable
        return [s for s in self.placeable if s.memory_node == "cpu" or
                (s.memory_node in req.devices and req.devices[s.memory_node][stage] is not None)]

    def _on_device(self, job: StageJob, worker, req: ServeRequest, stage: int) -> None:
        """A job placed on a GPU worker: give it the device copy's addresses, keep outputs a later stage reads
        on the device, and hold a lease on the copy for as long as the worker may have a session over it."""
        uuid = worker.state.memory_node
        if uuid == "cpu":
            return
        job.device = req.devices[uuid][stage]
        job.keep_on_device = stage + 1 < len(req.stages)
        self.worker_hold(req.model_key, uuid, worker.state.worker_id, True)

    def _may_inline(self, worker, job: StageJob) -> bool:
        """Run this stage on the owner loop (in step()) rather than hand it to its worker's thread?

        Handing a job to a worker thread and its result back costs two thread wake-ups: 0.25 ms a
        request on this 2-core VM by `bench executor` before stages ran inline, more than a tiny
        model's whole run. So a stage runs inline when it is short (predicted <= inline_run_ms),
        nothing else is in flight (blocking the loop then delays no other request, and no worker's
        parallelism is lost), and its worker has built the session (which the loop must never do): for a group
        of several cores, its single-threaded one (Worker._inline_session), which the worker builds after
        running a stage this short on its thread."""
        return job.short and sum(self.outstanding) == 1 and worker.can_run_inline(job)

    def _worker_done(self, job: StageJob, error) -> None:
        """A worker thread's result, posted to the owner loop (the turn's step schedules what it freed)."""
        self._stage_done(job, error)

    def _drop_expired(self, batch: Batch, now: float) -> bool:
        """Answer members whose deadline passed before this stage; False when none is left."""
        late = [m for m in batch.members if m.deadline is not None and now > m.deadline]
        if not late:
            return True
        if len(late) < len(batch.members) and not rows_aligned(batch.data, batch.samples):
            return True  # rows cannot be told apart here: the late ones ride along to the end
        keep = np.concatenate([np.full(m.samples, m not in late) for m in batch.members])
        for m in late:
            self._finish(m, None, RequestTimeout(f"deadline passed before stage {batch.stage} could start"),
                         rejected=True)
        batch.members = [m for m in batch.members if m not in late]
        if not batch.members:
            self._end(batch)
            return False
        batch.data = {k: to_host(v)[keep] for k, v in batch.data.items()}
        return True

    def _stage_done(self, job: StageJob, error, inline: bool = False) -> None:
        self.outstanding[job.worker_id] -= 1
        batch = self.batches.get(job.batch_id)
        if batch is not None:
            if isinstance(error, WorkerUnavailable) and self._disable(job.worker_id, error):
                self._run_stage(batch)      # the same stage again, on a worker that can run it
            elif error is not None:
                self._fail(batch, stage_error(job.model_key, job.stage, error))
            else:
                self._advance(batch, job, inline)

    def _disable(self, worker_id: int, error: Exception) -> bool:
        """Place no more stages on a worker that cannot run any; True while another worker can."""
        if worker_id not in self.disabled:
            self.disabled[worker_id] = str(error)
            self.placeable = [w.state for w in self.workers if w.state.worker_id not in self.disabled]
            log.warning("worker %d takes no more stages: %s", worker_id, error)
        return bool(self.placeable)

    def _record_stage(self, job: StageJob, worker, samples: int) -> None:
        """Calibrate the performance model with a finished stage (and check the prediction it had)."""
        self.perf.record(job.model_key, job.stage, worker.state.kind, samples, job.result["run_s"], job.predicted_s)

    def _stage_entry(self, job: StageJob, worker, samples: int, inline: bool) -> dict:
        """A finished stage's line in its requests' timings."""
        run_s = job.result["run_s"]
        done_at = self.clock()
        return {"stage": job.stage, "worker": worker.state.worker_id, "kind": worker.state.kind,
                "batch": samples, "wait_ms": max(0.0, (done_at - job.queued_at - run_s) * 1e3),
                "run_ms": run_s * 1e3, "inline": inline,
                "predicted_ms": None if job.predicted_s is None else job.predicted_s * 1e3}

    def _advance(self, batch: Batch, job: StageJob, inline: bool) -> None:
        worker = self.workers[job.worker_id]
        self._record_stage(job, worker, batch.samples)
        entry = self._stage_entry(job, worker, batch.samples, inline)
        for m in batch.members:
            m.timings["stages"].append(entry)
        batch.data.update(job.result["outputs"])
        batch.stage += 1
        if batch.stage == len(batch.first.stages):
            self._complete(batch)
            return
        self._prune(batch)
        if batch.joins is not None and batch.stage == batch.join_at:
            main = batch.joins
            self._merge(main, batch)
            self._run_stage(main)
        elif not self._absorb(batch):
            self._run_stage(batch)

    def _prune(self, batch: Batch) -> None:
        """Keep only tensors a later stage or an output needs: less to merge, split and hold."""
        stages = batch.first.stages
        needed = {n for s in stages[batch.stage:] for n in s["inputs"]} | set(stages[-1]["outputs"])
        for m in batch.members:
            needed.update(m.output_names or ())
        batch.data = {k: v for k, v in batch.data.items() if k in needed}

    def _absorb(self, batch: Batch) -> bool:
        """Layer-to-layer at boundary `batch.stage`: start a catch-up batch of admitted requests,
        which this batch waits for. True when one was started."""
        queue = self.queues.get(batch.first.model_key)
        batcher = self._batcher(batch.first)
        if not queue or not isinstance(batcher, LayerToLayer) or batch.joins is not None:
            return False
        if not rows_aligned(batch.data, batch.samples):
            return False  # a tensor at this boundary has no batch axis: merging here is not possible
        t_opt = self._t_opt_s(batch.first)
        admitted = batcher.admit(self.clock(), batch.stage, [m.pending(t_opt) for m in batch.members],
                                 self._head(queue, t_opt))
        if not admitted or not same_shape_rows(batch.first.data, queue.head.data):
            return False
        members = self._take(queue, len(admitted))
        self.layer_joins += len(members)
        catch_up = Batch(next(self._batch_ids), members, concat([m.data for m in members]),
                         joins=batch, join_at=batch.stage)
        self._start(catch_up)
        return True

    def _merge(self, main: Batch, catch_up: Batch) -> None:
        self.batches.pop(catch_up.batch_id, None)
        main.data = concat([main.data, {k: catch_up.data[k] for k in main.data}])
        main.members += catch_up.members
        self.batches_formed -= 1      # counted once: it is part of the main batch now (its requests too)
        self.batched_samples -= catch_up.samples

    def _complete(self, batch: Batch) -> None:
        self._end(batch)
        if not all(m.warmup for m in batch.members):   # (a warm-up alone is not one of the model's executions)
            run_s = sum(s["run_ms"] for s in batch.first.timings["stages"]) / 1e3   # (each member's: the batch's)
            self._stats(batch.first.model_key).executed(batch.samples, run_s)
        at = 0
        for m in batch.members:
            names = m.output_names or m.stages[-1]["outputs"]
            if len(batch.members) == 1:
                outputs = {n: to_host(batch.data[n]) for n in names}
            else:
                outputs = {n: to_host(batch.data[n])[at:at + m.samples] for n in names}
            at += m.samples
            self._finish(m, outputs, None)

    def _fail(self, batch: Batch, error: Exception) -> None:
        self._end(batch)
        for m in batch.members:
            self._finish(m, None, error)

    def _end(self, batch: Batch) -> None:
        """The batch is done or gone; a main batch that waited on it carries on without it."""
        self.batches.pop(batch.batch_id, None)
        if batch.joins is not None and batch.joins.batch_id in self.batches:
            main, batch.joins = batch.joins, None
            self._run_stage(main)

    def _finish(self, req: ServeRequest, outputs: dict | None, error, rejected: bool = False) -> None:
        """Answer the request; `rejected`: its queue refused it (full, timed out, past its deadline) before any run."""
        self.requests.pop(req.request_id, None)
        now = self.clock()
        total_ms = (now - req.arrival) * 1e3
        req.timings["total_ms"] = total_ms
        req.timings["queue_ms"] = sum(s["wait_ms"] for s in req.timings["stages"])
        req.finish(outputs if error is None else None, req.timings, error)   # the answer first: counters can wait
        if req.warmup:
            return
        if error is None:
            self.served += 1
            self.latencies_ms.append(total_ms)
        else:
            self.failed += 1
        self._stats(req.model_key).finished(now, req.samples, req.timings, error is None, rejected)

    def cache_hit(self, model_key: str, arrival: float, lookup_s: float) -> None:
        """A request of the model the daemon answered from its response cache, without submitting it."""
        now = self.clock()
        self.served += 1
        self.latencies_ms.append((now - arrival) * 1e3)
        self._stats(model_key).cache_hit(now, now - arrival, lookup_s)

    def cache_missed(self, model_key: str, seconds: float) -> None:
        self._stats(model_key).cache_missed(seconds)

    def cache_counts(self) -> dict:
        """Response-cache hits and misses of every model, the fronts' own caches' included (their reports)."""
        return {"hits": sum(s.cache_hits for s in self.model_stats.values()),
                "misses": sum(s.cache_misses for s in self.model_stats.values())}

    def absorb_front(self, model_key: str, report: dict) -> None:
        """A front's report of the model's requests it ran itself (Engine.front_may_run): in every count."""
        self._stats(model_key).absorb(self.clock(), report)
        self.served += sum(report["counts"])
        self.failed += report["failed"]

    def _stats(self, model_key: str) -> ModelServeStats:
        stats = self.model_stats.get(model_key)
        if stats is None:
            stats = self.model_stats[model_key] = ModelServeStats()
        return stats

    @property
    def latency_by_model(self) -> dict:
        """model key -> Histogram of its successful requests' latency (s), for metrics."""
        return {key: s.latency for key, s in self.model_stats.items()}

    def describe(self) -> dict:
        lat = sorted(self.latencies_ms)
        return {"scheduler": self.scheduler.name,
                "batching": {"policies": self.policies, "batches": self.batches_formed,
                             "mean_batch": self.batched_requests / self.batches_formed if self.batches_formed else None,
                             "mean_batch_samples": self.batched_samples / self.batches_formed
                             if self.batches_formed else None,
                             "layer_joins": self.layer_joins},
                "workers": [{"id": w.state.worker_id, "name": getattr(w, "name", None), "kind": w.state.kind,
                             "cores": w.cores, "device": w.state.memory_node, "queued": self.outstanding[i],
                             "disabled": self.disabled.get(w.state.worker_id)}
                            for i, w in enumerate(self.workers)],
                "served": self.served, "failed": self.failed, "in_flight": len(self.requests),
                "refused": {"queue_full": self.queue_full, "queue_timeout": self.queue_timeouts},
                "queued": sum(len(q) for q in self.queues.values()),
                # model key -> {str(priority level): requests waiting}: level "0" where the model has no levels
                "queued_by_model": {key: q.depths() for key, q in self.queues.items() if q},
                "latency_ms_p50": statistics.median(lat) if lat else None,
                "latency_ms_p99": lat[int(0.99 * (len(lat) - 1))] if lat else None,
                "perf_models": self.perf.summary(),
                "models": {key: s.describe(self.clock()) for key, s in self.model_stats.items()}}
