"""Batching decisions for serve mode: pure, driven by `now` and predictions passed in.

Policies (LBCI, Zhao et al. 2023, and Triton's dynamic batching):
  Serial          one request at a time
  BatchWindow(m)  wait until m requests queue or the oldest has waited `window_s`: LBCI's Batchsize(m)
  Dynamic         when a worker frees up, take up to max_batch samples; wait at most max_queue_delay_s
  LayerToLayer    an in-flight batch absorbs queued requests at a stage boundary if every member's
                  predicted finish still meets its deadline (arrival + t_opt)

Requests with several samples are kept whole: a request is taken entirely or not at all.
Not yet wired into the engine (the batching issue): these are its decision rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Pending:
    request_id: int
    samples: int
    arrival: float
    deadline: float = float("inf")


@dataclass
class Decision:
    take: list = field(default_factory=list)   # request ids to run now, as one batch
    wait_until: float | None = None            # nothing to run: ask again at this time (None: on arrival)


def _whole_requests(queue: list[Pending], max_samples: int) -> list[int]:
    """FIFO prefix of whole requests within max_samples (the first is taken even if larger alone)."""
    take, total = [], 0
    for p in queue:
        if take and total + p.samples > max_samples:
            break
        take.append(p.request_id)
        total += p.samples
    return take


class Serial:
    name = "serial"

    def decide(self, now: float, queue: list[Pending]) -> Decision:
        return Decision(take=[queue[0].request_id]) if queue else Decision()


class BatchWindow:
    """LBCI's Batchsize(m): a batch of m requests, or what came within the window."""
    name = "batch"

    def __init__(self, m: int = 10, window_s: float = 0.05):
        self.m, self.window_s = m, window_s

    def decide(self, now, queue):
        if not queue:
            return Decision()
        if len(queue) >= self.m or now - queue[0].arrival >= self.window_s:
            return Decision(take=[p.request_id for p in queue[: self.m]])
        return Decision(wait_until=queue[0].arrival + self.window_s)


class Dynamic:
    """Triton-style: full batch now, or whatever is queued once the oldest waited max_queue_delay_s."""
    name = "dynamic"

    def __init__(self, max_batch: int = 8, max_queue_delay_s: float = 0.0):
        self.max_batch, self.max_queue_delay_s = max_batch, max_queue_delay_s

    def decide(self, now, queue):
        if not queue:
            return Decision()
        if sum(p.samples for p in queue) >= self.max_batch or now - queue[0].arrival >= self.max_queue_delay_s:
            return Decision(take=_whole_requests(queue, self.max_batch))
        return Decision(wait_until=queue[0].arrival + self.max_queue_delay_s)


class LayerToLayer:
    """LBCI: new requests join an in-flight batch at a stage boundary when deadlines allow.

    predict(stage, batch) -> seconds. The batch is at boundary k (stages < k done). A newcomer
    of n samples first runs stages 0..k-1 alone, then the merged batch runs stages k..x-1:
        finish = now + sum_{s<k} predict(s, n) + sum_{s>=k} predict(s, b + n)
    It joins only if that finish meets the deadline of every member and of itself.
    """
    name = "layer"

    def __init__(self, predict, stages: int, max_batch: int = 16):
        self.predict, self.stages, self.max_batch = predict, stages, max_batch

    def finish_if_joined(self, now: float, k: int, batch_samples: int, newcomer_samples: int) -> float:
        catch_up = sum(self.predict(s, newcomer_samples) for s in range(k))
        rest = sum(self.predict(s, batch_samples + newcomer_samples) for s in range(k, self.stages))
        return now + catch_up + rest

    def admit(self, now: float, k: int, batch: list[Pending], queue: list[Pending]) -> list[int]:
        """Queued requests (FIFO, whole) that join the batch at boundary k; stops at the first refusal."""
        members = list(batch)
        joined = []
        for p in queue:
            b = sum(m.samples for m in members)
            if b + p.samples > self.max_batch:
                break
            finish = self.finish_if_joined(now, k, b, p.samples)
            if any(finish > m.deadline for m in members + [p]):
                break
            members.append(p)
            joined.append(p.request_id)
        return joined


# -- LBCI's per-sample cost model and optimal batch size ------------------------------------

def g(b, z1: float, z2: float, z3: float, z4: float):
    """Time of a batch of b samples: b * ((z1 - z2) / (1 + (b / z3) ** z4) + z2).

    Per-sample time falls from ~z1 (small batches) to z2 (large) around b = z3, steepness z4.
    """
    b = np.asarray(b, dtype=float)
    return b * ((z1 - z2) / (1.0 + (b / z3) ** z4) + z2)


def fit_g(batches, seconds) -> tuple[float, float, float, float]:
    """Least-squares fit of g to measured batch times: a grid over (z3, z4), z1 and z2 in closed form."""
    b = np.asarray(batches, dtype=float)
    t = np.asarray(seconds, dtype=float)
    best, best_err = None, float("inf")
    for z3 in np.geomspace(max(b.min(), 0.5), b.max() * 2, 40):
        for z4 in np.linspace(0.5, 4.0, 15):
            s = 1.0 / (1.0 + (b / z3) ** z4)
            # t = z1 * b*s + z2 * b*(1 - s): linear in (z1, z2)
            a = np.stack([b * s, b * (1 - s)], axis=1)
            (z1, z2), *_ = np.linalg.lstsq(a, t, rcond=None)
            err = float(np.sum((a @ np.array([z1, z2]) - t) ** 2))
            if err < best_err and z1 > 0 and z2 > 0:
                best, best_err = (float(z1), float(z2), float(z3), float(z4)), err
    if best is None:
        raise ValueError("cannot fit g(b) to these measurements")
    return best


def n_opt(z: tuple, t_opt: float, max_batch: int = 256) -> int:
    """The largest batch whose predicted time stays within t_opt (at least 1)."""
    best = 1
    for b in range(1, max_batch + 1):
        if float(g(b, *z)) <= t_opt:
            best = b
    return best
