"""A placement plan and what it costs: stages (contiguous node ranges) × worker sets × batch splits.

A request is a batch of `batch` samples. Stage k runs nodes [start, end) on its workers, worker w
taking split[w] samples (rows in order: the first worker the first rows). Between stages the
boundary's tensors move row by row from the worker that holds them to the one that needs them;
bytes that share a link queue on it (each direction of a link is one resource), links work in
parallel. The model's inputs start in host memory and its outputs end there.

    latency     = sum over stages (transfer in + hand-off + slowest worker of the stage) + transfer out
                  + the request's own overhead (System.handoff_s, System.request_s: serving's costs)
    throughput  = batch / the busiest resource's time per batch (a worker or a link), the
                  rate a pipeline of many requests sustains

The costs are analytical (no queueing between requests); simulate.py replays a plan with queues.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import InputError
from .costs import CostTable
from .system import HOST, System

PLAN_FORMAT = 1
STAGE_PENALTY = 0.01


@dataclass(frozen=True)
class Stage:
    start: int
    end: int
    workers: tuple       # indices into system.workers
    split: tuple         # samples per worker, summing to the plan's batch

    def active(self) -> tuple:
        """(worker, rows) of the workers with rows; computed once (stages are immutable and asked often)."""
        try:
            return self._active
        except AttributeError:
            object.__setattr__(self, "_active", tuple((w, b) for w, b in zip(self.workers, self.split) if b > 0))
            return self._active


@dataclass
class Plan:
    stages: list
    batch: int
    model: str = ""
    system: str = ""
    objective: str = "latency"
    method: str = ""
    latency_s: float | None = None
    throughput_per_s: float | None = None

    def describe(self, system: System, table: CostTable | None = None) -> list[str]:
        lines = []
        for k, s in enumerate(self.stages):
            names = ", ".join(f"{system.workers[w].name}×{b}" for w, b in s.active())
            span = f"{table.nodes[s.start]}..{table.nodes[s.end - 1]}" if table else ""
            lines.append(f"stage {k}: nodes [{s.start}, {s.end}) {span} on {names}")
        return lines

    def to_json(self, system: System, table: CostTable) -> dict:
        return {"format": PLAN_FORMAT, "model": self.model, "system": self.system, "objective": self.objective,
                "method": self.method, "batch": self.batch, "latency_s": self.latency_s,
                "throughput_per_s": self.throughput_per_s, "nodes": len(table.nodes),
                "stages": [{**asdict(s), "workers": list(s.workers), "split": list(s.split),
                            "worker_names": [system.workers[w].name for w in s.workers],
                            "worker_kinds": [system.workers[w].kind for w in s.workers],
                            "first_node": table.nodes[s.start], "last_node": table.nodes[s.end - 1]}
                           for s in self.stages],
                "cost_source": table.source}


def load_plan(path: str | Path) -> dict:
    """A plan file as written by `modelcache place`; InputError when it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise InputError(f"plan {path} does not exist") from None
    except ValueError as e:
        raise InputError(f"plan {path} is not JSON: {e}") from None
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT or not isinstance(data.get("stages"), list):
        raise InputError(f"{path} is not a placement plan (format {PLAN_FORMAT}) written by `modelcache place`")
    return data


def even_split(batch: int, k: int) -> tuple:
    return tuple(batch // k + (1 if i < batch % k else 0) for i in range(k))


def rows_moved(src: list, dst: list) -> list:
    """(src worker, dst worker, rows) for rows laid out in order over src's and dst's splits."""
    moves, i, j, left_s, left_d = [], 0, 0, 0, 0
    src = [(w, b) for w, b in src if b > 0]
    dst = [(w, b) for w, b in dst if b > 0]
    if src:
        left_s = src[0][1]
    if dst:
        left_d = dst[0][1]
    while i < len(src) and j < len(dst):
        n = min(left_s, left_d)
        moves.append((src[i][0], dst[j][0], n))
        left_s -= n
        left_d -= n
        if left_s == 0:
            i += 1
            left_s = src[i][1] if i < len(src) else 0
        if left_d == 0:
            j += 1
            left_d = dst[j][1] if j < len(dst) else 0
    return moves


class PlanCost:
    """Costs of plans for one (model table, system, batch); pieces are cached, since a search asks
    for the same stages, splits and transfers many times."""

    HOST_WORKER = -1     # where the model's inputs come from and its outputs go

    def __init__(self, table: CostTable, system: System, batch: int):
        if batch > table.batch:
            raise ValueError(f"batch {batch}: the cost table goes up to {table.batch}")
        self.table, self.system, self.batch = table, system, batch
        self.kinds = [w.kind for w in system.workers]
        self.nodes_of = [w.memory_node for w in system.workers]
        self.capacity = [w.memory_gbyte * 1e9 for w in system.workers]
        self.bounded = any(math.isfinite(c) for c in self.capacity)
        self._xfer: dict = {}
        self._stage_s: dict = {}

    def node_of(self, worker: int) -> str:
        return HOST if worker == self.HOST_WORKER else self.nodes_of[worker]

    def worker_s(self, w: int, i: int, j: int, b: int) -> float:
        return self.table.seconds(self.kinds[w], i, j, b) if b else 0.0

    def stage_s(self, s: Stage) -> float:
        t = self._stage_s.get(s)
        if t is None:
            t = self._stage_s[s] = max((self.worker_s(w, s.start, s.end, b) for w, b in s.active()), default=0.0)
        return t

    # -- transfers ---------------------------------------------------------------------------
    def link_loads(self, boundary: int, src: list, dst: list) -> dict:
        """(link) -> bytes it carries at this boundary, for row layouts src and dst [(worker, rows)]."""
        per_row = self.table.cut_bytes[boundary]
        loads: dict = {}
        for a, b, rows in rows_moved(src, dst):
            for hop in self.system.route(self.node_of(a), self.node_of(b)):
                loads[hop] = loads.get(hop, 0.0) + rows * per_row
        return loads

    def transfer_s(self, boundary: int, src: tuple, dst: tuple) -> float:
        """Seconds to move a boundary's tensors: links in parallel, bytes on one link one after another."""
        key = (boundary, src, dst)
        t = self._xfer.get(key)
        if t is None:
            links = self.system.links
            t = max((links[l].latency_s + nbytes / links[l].bytes_per_s
                     for l, nbytes in self.link_loads(boundary, list(src), list(dst)).items() if nbytes > 0),
                    default=0.0)
            self._xfer[key] = t
        return t

    def _layout(self, s: Stage | None) -> tuple:
        return ((self.HOST_WORKER, self.batch),) if s is None else s.active()

    # -- whole plans -------------------------------------------------------------------------
    def feasible(self, plan: Plan) -> bool:
        if not self.bounded:
            return True
        held = [0.0] * len(self.kinds)
        for s in plan.stages:
            for w, b in s.active():
                held[w] += self.table.weights(s.start, s.end)
        return all(h <= c for h, c in zip(held, self.capacity))

    def latency_s(self, plan: Plan) -> float:
        if not self.feasible(plan):
            return math.inf
        total, prev = self.system.request_s, None
        for s in plan.stages:
            total += self.transfer_s(s.start, self._layout(prev), self._layout(s)) + self.system.handoff_s + self.stage_s(s)
            prev = s
        return total + self.transfer_s(self.table.n, self._layout(prev), self._layout(None))

    def bottleneck_s(self, plan: Plan) -> float:
        """The busiest resource's seconds per batch: what bounds a pipeline's rate."""
        if not self.feasible(plan):
            return math.inf
        busy: dict = {}
        prev = None
        links = self.system.links
        for s in [*plan.stages, None]:
            boundary = self.table.n if s is None else s.start
            for l, nbytes in self.link_loads(boundary, list(self._layout(prev)), list(self._layout(s))).items():
                if nbytes > 0:
                    busy[l] = busy.get(l, 0.0) + links[l].latency_s + nbytes / links[l].bytes_per_s
            if s is not None:
                for w, b in s.active():
                    busy[w] = busy.get(w, 0.0) + self.worker_s(w, s.start, s.end, b)
            prev = s
        bound = max(busy.values(), default=0.0)
        hosts = [i for i, w in enumerate(self.system.workers) if w.memory_node == HOST]
        if self.system.serving_on_worker_cores and hosts:
            # the request's serving work takes host workers' idle time (the OS runs the client's and the
            # daemon's threads where a core is free): it binds once it exceeds all their slack
            bound = max(bound, (sum(busy.get(w, 0.0) for w in hosts) + self.system.request_s) / len(hosts))
        return bound

    def score(self, plan: Plan, objective: str) -> tuple:
        """What a search minimizes: latency, or the bottleneck (then latency, to break ties).

        For throughput each stage past the first costs STAGE_PENALTY of the bottleneck: the bound takes
        a pipeline as perfect, but one worker's stages of different requests queue behind each other
        (the simulator shows 8 interleaved stages on two workers sustaining 17 % less than the bound), and
        every stage is one more hand-off in the engine."""
        if objective == "throughput":
            return (self.bottleneck_s(plan) * (1 + STAGE_PENALTY * (len(plan.stages) - 1)), self.latency_s(plan))
        return (self.latency_s(plan),)

    def annotate(self, plan: Plan) -> Plan:
        plan.latency_s = self.latency_s(plan)
        b = self.bottleneck_s(plan)
        plan.throughput_per_s = plan.batch / b if b and math.isfinite(b) else 0.0
        return plan

    def check(self, plan: Plan) -> None:
        """InputError when a plan does not fit this model, system and batch."""
        n, at = self.table.n, 0
        for k, s in enumerate(plan.stages):
            if s.start != at or not s.start < s.end <= n:
                raise InputError(f"plan stage {k}: nodes [{s.start}, {s.end}) do not follow on from {at} "
                                 f"(the model has {n} nodes)")
            if not s.workers or len(s.workers) != len(s.split) or sum(s.split) != plan.batch:
                raise InputError(f"plan stage {k}: split {s.split} over workers {s.workers} is not the batch "
                                 f"of {plan.batch}")
            if any(not 0 <= w < len(self.kinds) for w in s.workers):
                raise InputError(f"plan stage {k}: worker index out of range (the system has {len(self.kinds)})")
            at = s.end
        if at != n:
            raise InputError(f"plan covers nodes [0, {at}); the model has {n}")
