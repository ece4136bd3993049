"""Serve-mode engine: requests move stage by stage over worker groups, placed by the scheduler.

Runs on the daemon's owner loop (it is called from handlers and from posted worker
results); workers only execute. Each stage of each request is one task: when it is
ready (request arrival, or the previous stage done) the scheduler places it, the
worker runs it, and its measured time calibrates the performance model.
"""

from __future__ import annotations

import itertools
import os
import logging
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ModelCacheError, RequestTimeout
from ..daemon.metrics import Histogram
from .perfmodel import PerfModels

INFER_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
from .scheduler import Task, make_scheduler
from .workers import StageJob, Worker, parse_groups

log = logging.getLogger("modelcache.executor")


@dataclass
class ServeRequest:
    model_key: str
    stages: list                 # [{skeleton, inputs, outputs, tensors}] in order
    segments: list
    data: dict                   # tensors by name: the feeds, then each stage's outputs
    output_names: list
    arrival: float
    deadline: float | None
    finish: object               # finish(outputs: dict | None, timings: dict, error) on the owner loop
    batch: int = 1
    stage: int = 0
    request_id: int = 0
    timings: dict = field(default_factory=lambda: {"stages": []})


class Engine:
    def __init__(self, workers_spec: str, scheduler: str, perf_path: Path | None, post, clock):
        # "auto": one group of every core this process may use.
        self.groups = parse_groups(str(len(os.sched_getaffinity(0))) if workers_spec == "auto" else workers_spec)
        self.scheduler = make_scheduler(scheduler)
        self.perf_path = perf_path
        self.perf = PerfModels.load(perf_path) if perf_path else PerfModels()
        self.clock = clock
        self.workers = [Worker(i, cores, lambda job, err: post(lambda *_: self._stage_done(job, err), None, None))
                        for i, cores in enumerate(self.groups)]
        self.outstanding = [0] * len(self.workers)
        self.requests: dict[int, ServeRequest] = {}
        self._ids = itertools.count(1)
        self.served = 0
        self.failed = 0
        self.latencies_ms: deque = deque(maxlen=1000)
        self.last_used: dict[str, float] = {}   # model key -> when a request last touched it
        self.latency_by_model: dict = {}          # model key -> Histogram of request latency (s), for metrics

    def start(self) -> None:
        for w in self.workers:
            w.start()

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
        if self.perf_path:
            self.perf.save(self.perf_path)

    def drop_model(self, model_key: str) -> None:
        self.last_used.pop(model_key, None)
        for w in self.workers:
            w.drop_model(model_key)

    def drop_idle(self, now: float, idle_s: float) -> list[str]:
        """Drop the stage sessions of models no request used for `idle_s`: they hold activation
        buffers and keep weights mapped, which a model nobody serves should not cost."""
        busy = {r.model_key for r in self.requests.values()}
        idle = [k for k, t in self.last_used.items() if now - t > idle_s and k not in busy]
        for key in idle:
            self.drop_model(key)
        return idle

    # -- requests ------------------------------------------------------------------------
    def submit(self, req: ServeRequest) -> None:
        req.request_id = next(self._ids)
        self.requests[req.request_id] = req
        self.last_used[req.model_key] = req.arrival
        self._schedule(req)

    def _predict(self, model, stage, kind, batch):
        return self.perf.predict(model, stage, kind, batch)

    def _schedule(self, req: ServeRequest) -> None:
        now = self.clock()
        if req.deadline is not None and now > req.deadline:
            self._finish(req, RequestTimeout(f"deadline passed before stage {req.stage} could start"))
            return
        spec = req.stages[req.stage]
        inputs = {k: req.data[k] for k in spec["inputs"]}
        for i, w in enumerate(self.workers):  # an idle worker's estimate is "free now"
            if self.outstanding[i] == 0:
                w.state.free_at = now
        task = Task(req.request_id, req.model_key, req.stage, req.batch,
                    sum(getattr(v, "nbytes", 0) for v in inputs.values()), arrival=now)
        [placement] = self.scheduler.place([task], [w.state for w in self.workers], now, self._predict)
        worker = self.workers[placement.worker_id]
        self.outstanding[placement.worker_id] += 1
        worker.queue.put(StageJob(req.request_id, req.model_key, req.stage, spec["skeleton"], req.segments,
                                  spec["tensors"], inputs, spec["outputs"], placement.predicted_s, queued_at=now))

    def _stage_done(self, job: StageJob, error) -> None:
        req = self.requests.get(job.request_id)
        worker = self.workers[job.worker_id]
        self.outstanding[job.worker_id] -= 1
        if req is None:
            return
        if error is not None:
            self._finish(req, error if isinstance(error, ModelCacheError) else
                         ModelCacheError(f"stage {job.stage} failed: {str(error)[:500]}"))
            return
        run_s = job.result["run_s"]
        self.perf.record(job.model_key, job.stage, worker.state.kind, req.batch, run_s, job.predicted_s)
        done_at = self.clock()
        req.timings["stages"].append({"stage": job.stage, "worker": worker.state.worker_id, "kind": worker.state.kind,
                                      "wait_ms": max(0.0, (done_at - job.queued_at - run_s) * 1e3),
                                      "run_ms": run_s * 1e3,
                                      "predicted_ms": None if job.predicted_s is None else job.predicted_s * 1e3})
        req.data.update(job.result["outputs"])
        req.stage += 1
        if req.stage < len(req.stages):
            self._schedule(req)
        else:
            self._finish(req, None)

    def _finish(self, req: ServeRequest, error) -> None:
        self.requests.pop(req.request_id, None)
        total_ms = (self.clock() - req.arrival) * 1e3
        req.timings["total_ms"] = total_ms
        req.timings["queue_ms"] = sum(s["wait_ms"] for s in req.timings["stages"])
        if error is None:
            self.served += 1
            self.latencies_ms.append(total_ms)
            self.latency_by_model.setdefault(req.model_key, Histogram(INFER_BUCKETS_S)).observe(total_ms / 1e3)
            names = req.output_names or req.stages[-1]["outputs"]
            req.finish({n: req.data[n] for n in names}, req.timings, None)
        else:
            self.failed += 1
            req.finish(None, req.timings, error)

    def describe(self) -> dict:
        lat = sorted(self.latencies_ms)
        return {"scheduler": self.scheduler.name,
                "workers": [{"id": w.state.worker_id, "kind": w.state.kind, "cores": w.cores,
                             "queued": self.outstanding[i]} for i, w in enumerate(self.workers)],
                "served": self.served, "failed": self.failed, "in_flight": len(self.requests),
                "latency_ms_p50": statistics.median(lat) if lat else None,
                "latency_ms_p99": lat[int(0.99 * (len(lat) - 1))] if lat else None,
                "perf_models": self.perf.summary()}
