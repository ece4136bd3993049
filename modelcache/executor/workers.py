"""Worker groups: threads in the daemon, each pinned to its cores, each with its own ORT thread pool.

A worker only runs what the owner loop queued for it and posts the result back; it
owns its sessions (built on first use, over the daemon's read-only mappings of the
host tier, so stages share weights with every client) and nothing else.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field

from .scheduler import WorkerState

log = logging.getLogger("modelcache.executor")


def parse_groups(spec: str, cpus: list[int] | None = None) -> list[list[int]]:
    """'1,1' -> [[0], [1]]; '2' -> [[0, 1]]: consecutive cores of this process's CPU set per group."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    sizes = [int(x) for x in str(spec).split(",") if x.strip()]
    if not sizes or any(n < 1 for n in sizes):
        raise ValueError(f"workers={spec!r}: give thread counts per group, e.g. '1,1' or '2'")
    groups, at = [], 0
    for n in sizes:
        # More groups than cores: wrap around (groups share cores; still correct, just slower).
        groups.append([cpus[(at + i) % len(cpus)] for i in range(n)])
        at += n
    return groups


@dataclass
class StageJob:
    batch_id: int
    model_key: str
    stage: int
    skeleton: str              # stage skeleton (its external data names files that exist; ORT checks)
    segments: list             # host-tier segment paths
    tensors: list              # [name, dtype, shape, segment index, offset, nbytes] the stage needs
    inputs: dict               # name -> array
    outputs: list
    predicted_s: float | None
    queued_at: float = 0.0
    worker_id: int = -1            # set by the worker that runs it
    result: dict = field(default_factory=dict)


class Worker:
    def __init__(self, worker_id: int, cores: list[int], post):
        self.state = WorkerState(worker_id, kind=f"cpu{len(cores)}")
        self.cores = cores
        self.queue: queue.Queue = queue.Queue()
        self.post = post                        # post(job, error): hands the finished job to the owner loop
        self.sessions: dict = {}                # (model key, stage) -> (session, mappings, values)
        self.queued_predictions: list = []      # owner-side: predicted seconds of jobs not yet finished
        self.thread = threading.Thread(target=self._loop, name=f"worker-{worker_id}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=30)

    def drop_model(self, model_key: str) -> None:
        """Forget sessions of an evicted model (they map segments that are being freed)."""
        self.queue.put(("drop", model_key))

    def _loop(self) -> None:
        try:
            os.sched_setaffinity(0, self.cores)  # this thread; ORT's pool threads, created here, inherit it
        except OSError as e:
            log.warning("worker %d: cannot pin to cores %s: %s", self.state.worker_id, self.cores, e)
        while True:
            job = self.queue.get()
            if job is None:
                self.sessions.clear()
                return
            if isinstance(job, tuple):
                for key in [k for k in self.sessions if k[0] == job[1]]:
                    del self.sessions[key]
                continue
            self.post(job, self.run(job))

    def run(self, job: StageJob) -> Exception | None:
        """Run one stage job; its outputs and time go into job.result. Returns the error, if any:
        a bad input or an ORT failure costs that request, never the worker."""
        job.worker_id = self.state.worker_id
        try:
            sess = self._session(job)
            t0 = time.perf_counter()
            values = sess.run(job.outputs, job.inputs)
            job.result = {"outputs": dict(zip(job.outputs, values)), "run_s": time.perf_counter() - t0}
            return None
        except Exception as e:
            return e

    def can_run_inline(self, job: StageJob) -> bool:
        """Whether the owner loop may run this job itself (see Engine._run_inline): only once this
        worker built the stage's session, since building one takes far too long for the loop."""
        return (job.model_key, job.stage) in self.sessions

    def _session(self, job: StageJob):
        key = (job.model_key, job.stage)
        if key not in self.sessions:
            import onnxruntime as ort
            from ..session_options import attach_session_options, bind_weights

            so = attach_session_options(spinning=False)
            so.intra_op_num_threads = len(self.cores)
            maps, values = bind_weights(so, job.segments, job.tensors)
            sess = ort.InferenceSession(job.skeleton, so, providers=["CPUExecutionProvider"])
            self.sessions[key] = (sess, maps, values)
        return self.sessions[key][0]
