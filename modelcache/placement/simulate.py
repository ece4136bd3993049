"""A discrete-event simulator that replays a plan under a request trace: per-worker queues, link contention.

Each worker runs one stage task at a time, first come first served; each direction of each link
carries one message at a time, first come first served. A request's stage starts when its previous
stage has finished on every worker (the executor moves a batch stage by stage); then the boundary's
bytes leave, one message per link (a route through host uses two links, streamed through both), and
a worker starts its share once the messages carrying its rows are in. Outputs go back to host.

Two ways to use a stage's worker set:
  "split" - the plan's split: every request is a batch of the plan's size, its rows split as planned;
  "dmda"  - as serve mode runs it: each request's whole stage goes to the worker of the set where it
            would finish first (queue, transfer and compute known exactly here), as the daemon's dmda does;
            and, as the daemon's engine admits work (Engine._form_batches), a request waits in the
            daemon's queue until some worker has nothing assigned, then starts (one per idle worker).
            So a model whose stages all run on one worker takes its requests one at a time, the worker
            idling through each hand-off, instead of queueing every arrival's first stage at once.

Times come from the plan's cost model (PlanCost); the simulator adds what the analytical model leaves
out: queueing between requests, contention on links, and a worker's wake-up: a stage that starts on a
worker idle for WAKE_AFTER_S or more takes its kind's wake_s longer (CostTable.wake_s, measured by
the profile's cold runs: about 2 ms a run on this VM, see placement/profile.py). Serving's own costs
(System.handoff_s per stage, System.request_s per request: the daemon's queue and thread wake-ups, the client's encode and
round trip) are delays that hold no worker: a worker runs the next queued stage meanwhile; except
that where the workers take every core (System.serving_on_worker_cores) a request's serving work
(request_s, from its arrival; then it enters the daemon's queue) needs a core of some host worker.
The client's and the daemon's threads are not pinned: the OS runs them on an idle core, so the work
takes an idle host worker (fewest stages assigned first; a stage ready there meanwhile waits, as a
thread would for the core); only when every host worker is busy does it stretch a running task, of
the worker with the fewest stages assigned (where the OS's balancing puts the woken thread). On one
2-thread worker (group "2") that is every request's cost in the worker's time; on "1,1" with one
worker's stages the lighter, the other worker absorbs it (benchmarks/placement/check: AlexNet in 3
stages on "1,1" served 50.4/s against its busier worker's 19.6 ms of stage runs a request, which
charging the serving work to the first stage's worker, as before, put at 46.4/s). Serving intervals
are recorded with stage -1.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field

from .plan import Plan, PlanCost, rows_moved
from .profile import WAKE_AFTER_S
from .system import HOST


@dataclass
class Interval:
    resource: str        # a worker's name or "link a->b"
    start: float
    end: float
    request: int
    stage: int


@dataclass
class SimResult:
    latencies_s: list
    finished_at: list
    intervals: list = field(default_factory=list)

    @property
    def completed(self) -> int:
        return len(self.latencies_s)

    def span_s(self, arrivals: list) -> float:
        """From the first arrival to the last answer (0 with none answered)."""
        return max(self.finished_at) - min(arrivals) if self.finished_at else 0.0

    def throughput_per_s(self, arrivals: list) -> float:
        span = self.span_s(arrivals)
        return self.completed / span if span > 0 else 0.0

    def percentile_s(self, q: float) -> float:
        lat = sorted(self.latencies_s)
        return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan")


def poisson_arrivals(rate_per_s: float, count: int, seed: int = 0, start: float = 0.0) -> list:
    """Open-loop arrival times: exponential gaps at `rate_per_s`."""
    rng = random.Random(seed)
    t, out = start, []
    for _ in range(count):
        t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


class Simulator:
    def __init__(self, cost: PlanCost, plan: Plan, within_set: str = "split", samples: int | None = None,
                 record: bool = True):
        if within_set not in ("split", "dmda"):
            raise ValueError(f"within_set {within_set!r}: split or dmda")
        self.cost, self.plan, self.mode, self.record = cost, plan, within_set, record
        self.samples = samples or plan.batch          # rows per request (dmda mode: any; split: the plan's)
        self.names = [w.name for w in cost.system.workers]
        self.wake_s = [cost.table.wake_s.get(w.kind, 0.0) for w in cost.system.workers]

    def run(self, arrivals: list) -> SimResult:
        cost, plan = self.cost, self.plan
        links = cost.system.links
        events: list = []
        seq = itertools.count()
        worker_free = [0.0] * len(self.names)
        worker_queue: list = [[] for _ in self.names]     # heap of (ready time, seq, task)
        link_free: dict = {}
        intervals: list = []
        latencies, finished = [], []
        pending: dict = {}                                # (request, stage) -> tasks left

        def push(t, what, *args):
            heapq.heappush(events, (t, next(seq), what, args))

        def send(now, boundary, src, dst, request, stage):
            """Queue the boundary's messages; returns when each destination worker has its rows."""
            loads = cost.link_loads(boundary, src, dst)
            done: dict = {}
            for link, nbytes in sorted(loads.items()):
                if nbytes <= 0:
                    continue
                start = max(now, link_free.get(link, 0.0))
                end = start + links[link].latency_s + nbytes / links[link].bytes_per_s
                link_free[link] = end
                done[link] = end
                if self.record:
                    intervals.append(Interval(f"link {link[0]}->{link[1]}", start, end, request, stage))
            ready: dict = {}
            for a, b, rows in rows_moved(src, dst):
                route = cost.system.route(cost.node_of(a), cost.node_of(b))
                ready[b] = max([ready.get(b, now), *(done.get(h, now) for h in route)])
            return ready

        def layout_in(request, k):
            return self.layouts[request][k - 1] if k > 0 else ((cost.HOST_WORKER, self.samples),)

        def start_stage(now, request, k):
            if k == len(plan.stages):
                ready = send(now, cost.table.n, list(layout_in(request, k)), [(cost.HOST_WORKER, self.samples)],
                             request, k)
                # serving's per-request cost: a delay, unless it took a worker's time (serve())
                end = ready.get(cost.HOST_WORKER, now) + (0.0 if shared else cost.system.request_s)
                push(end, "done", request)
                return
            stage = plan.stages[k]
            if self.mode == "split":
                layout = tuple(stage.active())
            else:
                layout = ((self._dmda_pick(now, stage, request, k, layout_in(request, k), worker_free), self.samples),)
            self.layouts[request].append(layout)
            ready = send(now, stage.start, list(layout_in(request, k)), list(layout), request, k)
            ready = {w: ready.get(w, now) + cost.system.handoff_s for w, _ in layout}   # the job reaching its worker
            pending[(request, k)] = len(layout)
            for w, rows in layout:
                outstanding[w] += 1
                push(ready.get(w, now), "ready", w, request, k, rows)
                # dmda's estimate of when this worker frees: its queue and compute, known exactly here; like the
                # daemon's performance models it leaves a wake-up out
                worker_free[w] = max(worker_free[w], ready.get(w, now)) + self._busy_s(w, k, rows)

        busy = [False] * len(self.names)
        last_run_end = [float("-inf")] * len(self.names)   # a worker idle since WAKE_AFTER_S pays its wake_s
        running: list = [None] * len(self.names)      # [token, Interval, event, args] of the task a worker runs
        tokens = itertools.count()
        hosts = [i for i, w in enumerate(cost.system.workers) if w.memory_node == HOST]
        shared = cost.system.serving_on_worker_cores and cost.system.request_s > 0 and bool(hosts)
        outstanding = [0] * len(self.names)       # stage tasks assigned to a worker, queued or running
        waiting: list = []                        # dmda: requests the daemon holds until a worker is idle
        at = [0]                                  # next of `waiting` to start

        def admit(now):
            idle = outstanding.count(0)
            while at[0] < len(waiting) and idle > 0:
                start_stage(now, waiting[at[0]], 0)
                at[0] += 1
                idle -= 1

        def occupy(now, w, end, request, k, what, *args):
            """Worker w runs a task (a stage, or serving work) until `end`; its event carries a token, so a
            stretched task's first end is ignored."""
            busy[w] = True
            interval = Interval(self.names[w], now, end, request, k)
            if self.record:
                intervals.append(interval)
            running[w] = [next(tokens), interval, what, args]
            push(end, what, *args, running[w][0])

        def current(w, token) -> bool:
            if running[w] is None or running[w][0] != token:
                return False                      # stretched: its later event ends it
            running[w] = None
            busy[w] = False
            return True

        def try_run(now, w):
            if busy[w] or not worker_queue[w]:
                return
            _, _, (request, k, rows) = heapq.heappop(worker_queue[w])
            wake = self.wake_s[w] if now - last_run_end[w] >= WAKE_AFTER_S else 0.0
            occupy(now, w, now + wake + self._busy_s(w, k, rows), request, k, "finish", w, request, k)

        def enter(now, request):
            """The request reaches the daemon's engine (dmda: its queue)."""
            if self.mode == "dmda":
                waiting.append(request)
                admit(now)
            else:
                start_stage(now, request, 0)

        def serve(now, request):
            """A request's serving work on the workers' cores (serving_on_worker_cores); see the module doc."""
            choose = lambda ws: min(ws, key=lambda w: (outstanding[w], w))   # noqa: E731
            idle = [w for w in hosts if not busy[w]]
            if idle:
                w = choose(idle)
                occupy(now, w, now + cost.system.request_s, request, -1, "served", w, request)
                return
            w = choose(hosts)
            token, interval, what, args = running[w]
            interval.end += cost.system.request_s
            running[w][0] = next(tokens)
            push(interval.end, what, *args, running[w][0])
            push(now + cost.system.request_s, "enter", request)

        self.layouts = [[] for _ in arrivals]
        for r, t in enumerate(arrivals):
            push(t, "arrive", r)
        while events:
            now, _, what, args = heapq.heappop(events)
            if what == "arrive":
                if shared:
                    serve(now, args[0])
                else:
                    enter(now, args[0])
            elif what == "enter":
                enter(now, args[0])
            elif what == "served":
                w, request, token = args
                if current(w, token):
                    enter(now, request)
                    try_run(now, w)
            elif what == "ready":
                w, request, k, rows = args
                heapq.heappush(worker_queue[w], (now, next(seq), (request, k, rows)))
                try_run(now, w)
            elif what == "finish":
                w, request, k, token = args
                if not current(w, token):
                    continue
                last_run_end[w] = now       # (serving work on a worker's core is another thread's: not counted)
                outstanding[w] -= 1
                pending[(request, k)] -= 1
                if pending[(request, k)] == 0:
                    start_stage(now, request, k + 1)
                if self.mode == "dmda":
                    admit(now)
                try_run(now, w)
            elif what == "done":
                latencies.append(now - arrivals[args[0]])
                finished.append(now)
        return SimResult(latencies, finished, intervals)

    def _busy_s(self, w: int, k: int, rows: int) -> float:
        """A worker's time on stage k of a request."""
        stage = self.plan.stages[k]
        return self.cost.worker_s(w, stage.start, stage.end, rows)

    def _dmda_pick(self, now, stage, request, k, src, worker_free) -> int:
        """The worker of the stage's set where the whole stage would finish first (ties: lowest index)."""
        def finish(w):
            t = self.cost.transfer_s(stage.start, tuple(src), ((w, self.samples),)) + self.cost.system.handoff_s
            return max(now + t, worker_free[w]) + self._busy_s(w, k, self.samples)
        return min(stage.workers, key=lambda w: (finish(w), w))


def simulate(cost: PlanCost, plan: Plan, arrivals: list, within_set: str = "split", samples: int | None = None,
             record: bool = True) -> SimResult:
    return Simulator(cost, plan, within_set, samples, record).run(arrivals)


def one_at_a_time(cost: PlanCost, plan: Plan, requests: int = 3, within_set: str = "dmda",
                  samples: int | None = None) -> list:
    """Latencies of `requests` sent one at a time, each the moment the previous one is answered (a client
    that waits for its answer). The first meets idle workers and pays their wake-up; the later ones find
    the workers that ran the previous request's stages warm, as a stream of requests does."""
    arrivals, result = [], None
    for _ in range(requests):
        arrivals.append(result.finished_at[-1] if result else 0.0)
        result = simulate(cost, plan, arrivals, within_set, samples=samples, record=False)
    return result.latencies_s
