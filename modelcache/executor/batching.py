"""Batching decisions for serve mode: pure, driven by `now` and predictions passed in.

Policies (LBCI, Zhao et al. 2023, and Triton's dynamic batching):
  Serial          one request at a time
  BatchWindow(m)  wait until m requests queue or the oldest has waited `window_s`: LBCI's Batchsize(m)
  Dynamic         when a worker frees up, take up to max_batch samples; wait at most max_queue_delay_s
  LayerToLayer    an in-flight batch absorbs queued requests at a stage boundary if every member's
                  predicted finish still meets its deadline (arrival + t_opt)

Requests with several samples are kept whole: a request is taken entirely or not at all.
The engine (executor/engine.py) asks `decide` when a worker is idle or a window ends, and
`LayerToLayer.admit` at each stage boundary of a running batch; it applies the answers.

Predictions for layer-to-layer come from the performance models, and before those have
seen a batch size, from the model's calibration profile (`profile_predict`): LBCI's table of
stage times per batch size, with the fitted g(b) for sizes between the measured ones.
"""

from __future__ import annotations

import math
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


# -- LBCI's per-sample cost model and optimal batch size ------------------------------------

def g(b, z1: float, z2: float, z3: float, z4: float):
    """Time of a batch of b samples: b * ((z1 - z2) / (1 + (b / z3) ** z4) + z2).

    Per-sample time falls from ~z1 (small batches) to z2 (large) around b = z3, steepness z4.
    """
    import numpy as np  # here, not at the top: settings validation imports this module on client paths
    b = np.asarray(b, dtype=float)
    return b * ((z1 - z2) / (1.0 + (b / z3) ** z4) + z2)


def fit_g(batches, seconds) -> tuple[float, float, float, float]:
    """Least-squares fit of g to measured batch times: a grid over (z3, z4), z1 and z2 in closed form."""
    import numpy as np
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


def n_opt(z: tuple, t_opt: float, max_batch: int = 256, min_gain: float = 0.1) -> int:
    """The largest batch whose predicted time stays within t_opt and that pays: its per-sample time
    at least `min_gain` below a batch of 1's. Where batching gains nothing (ResNet-50 on this CPU
    runs 61 ms a sample at every size) a bigger batch only makes its first request wait, so N_opt is 1."""
    one = float(g(1, *z))
    best = 1
    for b in range(2, max_batch + 1):
        t = float(g(b, *z))
        if t <= t_opt and t / b <= (1 - min_gain) * one:
            best = b
    return best


# -- choosing a policy ----------------------------------------------------------------------

POLICIES = ("serial", "batch", "dynamic", "layer")


def parse_policy_spec(spec: str) -> dict[str, str]:
    """'layer' -> {'*': 'layer'}; 'alexnet=layer,*=serial' -> per model name, '*' for the rest."""
    out = {}
    for part in str(spec).split(","):
        part = part.strip()
        if not part:
            continue
        name, _, policy = part.rpartition("=")
        name = name.strip() or "*"
        policy = policy.strip()
        if policy not in POLICIES:
            raise ValueError(f"batching={spec!r}: unknown policy {policy!r}; choose one of {', '.join(POLICIES)}, "
                             "for all models or per model as 'alexnet=layer,*=serial'")
        out[name] = policy
    out.setdefault("*", "serial")
    return out


def make_batcher(policy: str, *, max_batch: int, window_s: float, max_queue_delay_s: float,
                 predict=None, stages: int = 1, overhead_s: float = 0.0):
    if policy == "serial":
        return Serial()
    if policy == "batch":
        return BatchWindow(m=max_batch, window_s=window_s)
    if policy == "dynamic":
        return Dynamic(max_batch=max_batch, max_queue_delay_s=max_queue_delay_s)
    if policy == "layer":
        return LayerToLayer(predict, stages=stages, max_batch=max_batch, overhead_s=overhead_s)
    raise ValueError(f"unknown batching policy {policy!r}")


# -- calibration profile: LBCI's ratio table and N_opt, stored with the model ---------------

def calibration_profile(kind: str, stage_s: dict[int, list[float]], t_opt_s: float,
                        request_s: dict[int, float] | None = None) -> dict:
    """From measured stage times per batch size ({b: [stage seconds]}) on one worker kind.

    Returns what the manifest stores: the table, the ratio of each stage to the whole per batch
    size (LBCI's run-time ratio table), the fitted g(b) of the whole model, t_opt and N_opt,
    and (when given) the round trip of a request per batch size as a client saw it.
    """
    batches = sorted(stage_s)
    totals = [sum(stage_s[b]) for b in batches]
    z = fit_g(batches, totals) if len(batches) >= 2 else (totals[0], totals[0], 1.0, 1.0)
    return {"kind": kind, "batches": batches, "stage_s": [list(stage_s[b]) for b in batches],
            "ratios": [[t / sum(stage_s[b]) for t in stage_s[b]] for b in batches],
            # N_opt within t_opt / 2, not t_opt: under load a request waits for the batch running when it
            # arrived and then runs in its own, so two batch times must fit in the bound.
            "g": list(z), "t_opt_ms": t_opt_s * 1e3, "n_opt": n_opt(z, t_opt_s / 2, max_batch=max(batches) * 4),
            "request_s": [request_s[b] for b in batches] if request_s else None}


def profile_predict(profile: dict | None, stage: int, batch: int) -> float | None:
    """Seconds for `stage` at `batch` samples from a calibration profile, None without one.

    A measured batch size answers from the table; any other from g(b) times the stage's
    share at the nearest measured size."""
    if not profile or stage >= len(profile["stage_s"][0]):
        return None
    batches = profile["batches"]
    if batch in batches:
        return profile["stage_s"][batches.index(batch)][stage]
    nearest = min(range(len(batches)), key=lambda i: abs(batches[i] - batch))
    return float(g(batch, *profile["g"])) * profile["ratios"][nearest][stage]


PROFILE_MAX_BATCHES = 64     # measured batch sizes in one profile (calibrate measures a handful)
PROFILE_MAX_N_OPT = 4096
_PROFILE_FIELDS = {"kind", "batches", "stage_s", "ratios", "g", "t_opt_ms", "n_opt", "request_s"}


def _number(x) -> bool:
    """A finite int or float, not a bool (which is an int to Python)."""
    return type(x) in (int, float) and math.isfinite(x)


def check_profile(profile: dict, stages: int) -> None:
    """Refuse anything but a profile such as calibration_profile makes, for these stages: every field's
    type, shape and range (ValueError says which). A profile is stored with the model and read for
    every serve request, so one that passes here must never fail there."""
    hint = "make one with `modelcache calibrate`"
    if not isinstance(profile, dict):
        raise ValueError(f"not a batching profile (a map of its fields); {hint}")
    missing = sorted(_PROFILE_FIELDS - {"request_s"} - set(profile))
    unknown = sorted(set(profile) - _PROFILE_FIELDS)
    if missing:
        raise ValueError(f"not a batching profile (no {missing[0]!r}); {hint}")
    if unknown:
        raise ValueError(f"not a batching profile (unknown field {unknown[0]!r}); {hint}")
    kind, batches = profile["kind"], profile["batches"]
    if not isinstance(kind, str) or len(kind) > 64:
        raise ValueError("the profile's kind must be a worker kind such as 'cpu2'")
    if (not isinstance(batches, list) or not 1 <= len(batches) <= PROFILE_MAX_BATCHES
            or not all(type(b) is int and b >= 1 for b in batches) or batches != sorted(set(batches))):
        raise ValueError(f"the profile's batches must be 1 to {PROFILE_MAX_BATCHES} distinct batch sizes >= 1, "
                         "ascending")
    rows = profile["stage_s"]
    if not isinstance(rows, list) or len(rows) != len(batches) or not all(isinstance(r, list) for r in rows):
        raise ValueError("the profile's stage_s must have one row of stage times per batch size")
    if any(len(r) != stages for r in rows):
        raise ValueError(f"the profile times {len(rows[0])} stages; the model has {stages}: "
                         "calibrate again after partitioning")
    for name in ("stage_s", "ratios"):
        table = profile[name]
        if (not isinstance(table, list) or len(table) != len(batches)
                or not all(isinstance(r, list) and len(r) == stages and all(_number(x) and x >= 0 for x in r)
                           for r in table)):
            raise ValueError(f"the profile's {name} must be {len(batches)} rows of {stages} numbers >= 0")
    g = profile["g"]
    if not isinstance(g, list) or len(g) != 4 or not all(_number(z) for z in g) or g[2] <= 0:
        raise ValueError("the profile's g must be 4 numbers (z1, z2, z3 > 0, z4)")
    if not _number(profile["t_opt_ms"]) or profile["t_opt_ms"] <= 0:
        raise ValueError("the profile's t_opt_ms must be a number > 0")
    if type(profile["n_opt"]) is not int or not 1 <= profile["n_opt"] <= PROFILE_MAX_N_OPT:
        raise ValueError(f"the profile's n_opt must be a whole number from 1 to {PROFILE_MAX_N_OPT}")
    request_s = profile.get("request_s")
    if request_s is not None and (not isinstance(request_s, list) or len(request_s) != len(batches)
                                  or not all(_number(x) and x >= 0 for x in request_s)):
        raise ValueError(f"the profile's request_s must be none or {len(batches)} numbers >= 0, one per batch size")


def request_overhead(profile: dict | None) -> float:
    """Seconds a batch-1 request spends outside its stages (the way in and out), from a profile."""
    if not profile or not profile.get("request_s"):
        return 0.0
    return max(0.0, profile["request_s"][0] - sum(profile["stage_s"][0]))
