"""Where each ready stage runs: eager, round-robin, and dmda (StarPU's deque-model-data-aware).

Pure: workers, tasks and predictions come in as plain data, placements go out; no
clocks, threads or ORT. The executor keeps the real queues and applies the answers.

dmda places each task on the worker where it is expected to *finish* first:
    max(now, worker free at) + transfer of its input to that worker's memory + predicted compute.
A (stage, worker kind) pair with no measurement yet is explored first, as StarPU
calibrates: a model it has never timed cannot be compared.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WorkerState:
    worker_id: int
    kind: str                 # performance-model class, e.g. "cpu1" (1 thread), "cpu2", "gpu"
    memory_node: str = "cpu"  # where its inputs must live: "cpu" or a GPU's UUID
    free_at: float = 0.0      # when its queue is expected to drain


@dataclass
class Task:
    request_id: int
    model: str
    stage: int
    batch: int = 1
    input_bytes: int = 0
    data_node: str = "cpu"    # where the stage's input currently is
    arrival: float = 0.0


@dataclass
class Placement:
    task: Task
    worker_id: int
    start: float
    end: float
    predicted_s: float | None


@dataclass
class TransferModel:
    """Seconds to move bytes between memory nodes: latency + bytes / bandwidth; free within a node."""
    bandwidth_bytes_s: float = 10e9
    latency_s: float = 10e-6
    overrides: dict = field(default_factory=dict)   # (src, dst) -> (latency_s, bandwidth_bytes_s)

    def seconds(self, nbytes: int, src: str, dst: str) -> float:
        if src == dst:
            return 0.0
        latency, bandwidth = self.overrides.get((src, dst), (self.latency_s, self.bandwidth_bytes_s))
        return latency + nbytes / bandwidth


_SAME_NODE = TransferModel()   # the default: CPU workers only, nothing to move


class Scheduler:
    name = "base"

    def place(self, tasks: list[Task], workers: list[WorkerState], now: float, predict,
              transfer: TransferModel | None = None) -> list[Placement]:
        """Placements for `tasks`, in order; `workers[i].free_at` is advanced as each is placed.

        predict(model, stage, kind, batch) -> seconds or None (never measured).
        """
        transfer = transfer or _SAME_NODE
        out = []
        for task in tasks:
            if len(workers) == 1:   # (one worker group, the default: nothing to choose, only its clock to keep)
                w, predicted = workers[0], predict(task.model, task.stage, workers[0].kind, task.batch)
            else:
                w, predicted = self.choose(task, workers, now, predict, transfer)
            start = max(now, w.free_at) + transfer.seconds(task.input_bytes, task.data_node, w.memory_node)
            end = start + (predicted or 0.0)
            w.free_at = end
            out.append(Placement(task, w.worker_id, start, end, predicted))
        return out

    def choose(self, task, workers, now, predict, transfer) -> tuple[WorkerState, float | None]:
        raise NotImplementedError


class Eager(Scheduler):
    """The worker that frees first (an idle one if any), ignoring speed: StarPU's eager."""
    name = "eager"

    def choose(self, task, workers, now, predict, transfer):
        w = min(workers, key=lambda w: (max(now, w.free_at), w.worker_id))
        return w, predict(task.model, task.stage, w.kind, task.batch)


class RoundRobin(Scheduler):
    name = "round-robin"

    def __init__(self):
        self._next = 0

    def choose(self, task, workers, now, predict, transfer):
        w = workers[self._next % len(workers)]
        self._next += 1
        return w, predict(task.model, task.stage, w.kind, task.batch)


class DMDA(Scheduler):
    """Minimum expected completion time, counting queue, transfer and predicted compute."""
    name = "dmda"

    def choose(self, task, workers, now, predict, transfer):
        best, best_end, best_pred = None, None, None
        for w in workers:
            predicted = predict(task.model, task.stage, w.kind, task.batch)
            if predicted is None:  # uncalibrated here: measure it (explore) before comparing
                return w, None
            end = max(now, w.free_at) + transfer.seconds(task.input_bytes, task.data_node, w.memory_node) + predicted
            if best_end is None or end < best_end - 1e-12:
                best, best_end, best_pred = w, end, predicted
        return best, best_pred


SCHEDULERS = {cls.name: cls for cls in (Eager, RoundRobin, DMDA)}


def make_scheduler(name: str) -> Scheduler:
    try:
        return SCHEDULERS[name]()
    except KeyError:
        raise ValueError(f"unknown scheduler {name!r}; choose one of {', '.join(SCHEDULERS)}") from None
