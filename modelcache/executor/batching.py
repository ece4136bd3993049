"""Batching decisions for serve mode: pure, driven by `now` and predictions passed in.

Policies (LBCI, Zhao et al. 2023, and Triton's dynamic batching):
  Serial          one request at a time
  BatchWindow(m)  wait until m requests queue or the oldest has waited `window_s`: LBCI's Batchsize(m)
  Dynamic         when a worker frees up, take up to max_batch samples, or a preferred batch size as soon as
                  one is queued; wait at most max_queue_delay_s
  LayerToLayer    an in-flight batch absorbs queued requests at a stage boundary if every member's
                  predicted finish still meets its deadline (arrival + t_opt)

Requests with several samples are kept whole: a request is taken entirely or not at all.
The engine (executor/engine.py) asks `decide` when a worker is idle or a window ends, and
`LayerToLayer.admit` at each stage boundary of a running batch; it applies the answers.

Predictions for layer-to-layer come from the performance models, and before those have
seen a batch size, from the model's calibration profile (calibration.profile_predict): LBCI's table
of stage times per batch size, with the fitted g(b) for sizes between the measured ones.
The `batching` setting's spec is read by config.parse_policy_spec.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """Triton-style: a full batch now, or the largest preferred batch size the queue fills (whole requests
    adding up to it exactly), else whatever is queued once the oldest waited max_queue_delay_s."""
    name = "dynamic"

    def __init__(self, max_batch: int = 8, max_queue_delay_s: float = 0.0, preferred: tuple = ()):
        self.max_batch, self.max_queue_delay_s = max_batch, max_queue_delay_s
        self.preferred = sorted({b for b in preferred if b <= max_batch}, reverse=True)

    def decide(self, now, queue):
        if not queue:
            return Decision()
        if sum(p.samples for p in queue) >= self.max_batch or now - queue[0].arrival >= self.max_queue_delay_s:
            return Decision(take=_whole_requests(queue, self.max_batch))
        for size in self.preferred:
            take = _whole_requests(queue, size)
            if sum(p.samples for p in queue if p.request_id in take) == size:
                return Decision(take=take)
        return Decision(wait_until=queue[0].arrival + self.max_queue_delay_s)


class LayerToLayer:
    """LBCI: new requests join an in-flight batch at a stage boundary when deadlines allow.

    predict(stage, batch) -> seconds. The batch of b samples is at boundary k (stages < k done).
    Newcomers of n samples in all first run stages 0..k-1 together, then the merged batch runs
    stages k..x-1:
        finish = now + sum_{s<k} predict(s, n) + sum_{s>=k} predict(s, b + n) + overhead_s
    They join only if that finish meets the deadline of every member and newcomer (LBCI's rule;
    overhead_s is what a request costs outside the stages, so the bound holds as the client sees
    it) and if merging saves work: running stages k.. once for b + n samples must cost less than
    for b and n apart, by `min_saving` of the newcomers' share. Measured here, a batch of 2 runs
    AlexNet's later stages barely faster than two of 1; a join that saves nothing only delays the
    batch it joins.
    """
    name = "layer"

    def __init__(self, predict, stages: int, max_batch: int = 16, overhead_s: float = 0.0,
                 min_saving: float = 0.1):
        self.predict, self.stages, self.max_batch = predict, stages, max_batch
        self.overhead_s, self.min_saving = overhead_s, min_saving

    def decide(self, now, queue):
        """A new batch starts at once with what is queued (up to max_batch): later arrivals join it
        at stage boundaries instead of waiting for a window."""
        return Decision(take=_whole_requests(queue, self.max_batch)) if queue else Decision()

    def _rest(self, k: int, samples: int) -> float:
        return sum(self.predict(s, samples) for s in range(k, self.stages))

    def finish_if_joined(self, now: float, k: int, batch_samples: int, newcomer_samples: int) -> float:
        catch_up = sum(self.predict(s, newcomer_samples) for s in range(k))
        return now + catch_up + self._rest(k, batch_samples + newcomer_samples) + self.overhead_s

    def saves_work(self, k: int, batch_samples: int, newcomer_samples: int) -> bool:
        merged = self._rest(k, batch_samples + newcomer_samples)
        apart = self._rest(k, batch_samples) + (1 - self.min_saving) * self._rest(k, newcomer_samples)
        return merged <= apart

    def admit(self, now: float, k: int, batch: list[Pending], queue: list[Pending]) -> list[int]:
        """Queued requests (FIFO, whole) that join the batch at boundary k.

        Candidates are taken in order while max_batch and every deadline hold (a refusal ends the
        scan: FIFO order is kept); the answer is the longest of those prefixes that saves work."""
        b = sum(m.samples for m in batch)
        members, candidates, admitted, n = list(batch), [], [], 0
        for p in queue:
            if b + n + p.samples > self.max_batch:
                break
            finish = self.finish_if_joined(now, k, b, n + p.samples)
            if any(finish > m.deadline for m in members + [p]):
                break
            members.append(p)
            candidates.append(p.request_id)
            n += p.samples
            if self.saves_work(k, b, n):
                admitted = list(candidates)
        return admitted


# -- choosing a policy ----------------------------------------------------------------------

def make_batcher(policy: str, *, max_batch: int, window_s: float, max_queue_delay_s: float,
                 predict=None, stages: int = 1, overhead_s: float = 0.0, preferred: tuple = ()):
    if policy == "serial":
        return Serial()
    if policy == "batch":
        return BatchWindow(m=max_batch, window_s=window_s)
    if policy == "dynamic":
        return Dynamic(max_batch=max_batch, max_queue_delay_s=max_queue_delay_s, preferred=preferred)
    if policy == "layer":
        return LayerToLayer(predict, stages=stages, max_batch=max_batch, overhead_s=overhead_s)
    raise ValueError(f"unknown batching policy {policy!r}")
