"""The batching calibration profile stored with a model (its manifest's `batching`): LBCI's per-sample
cost model g(b) and N_opt, and how a profile is made (`modelcache calibrate`), checked and read.

Pure numbers with no executor in them, so the client that measures a profile, the daemon that
stores it and the executor that serves by it all import it from here.
"""

from __future__ import annotations

import math


# -- LBCI's per-sample cost model and optimal batch size ------------------------------------

def g(b, z1: float, z2: float, z3: float, z4: float):
    """Time of a batch of b samples: b * ((z1 - z2) / (1 + (b / z3) ** z4) + z2).

    Per-sample time falls from ~z1 (small batches) to z2 (large) around b = z3, steepness z4.
    """
    import numpy as np  # here, not at the top: the client imports this module to calibrate
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
    try:
        z = fit_g(batches, totals) if len(batches) >= 2 else (totals[0], totals[0], 1.0, 1.0)
    except ValueError:
        # No g(b) with positive per-sample times fits (noise on a busy machine: a larger batch measured
        # faster than a smaller one in all). Batching shows no gain then: a flat per-sample time, N_opt 1.
        per_sample = sorted(t / b for b, t in zip(batches, totals))[len(batches) // 2]
        z = (per_sample, per_sample, 1.0, 1.0)
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
PROFILE_MAX_STAGES = 64      # as many as a partition may have (executor/partition.py's MAX_STAGES)
_PROFILE_FIELDS = {"kind", "batches", "stage_s", "ratios", "g", "t_opt_ms", "n_opt", "request_s"}


def _number(x) -> bool:
    """A finite int or float, not a bool (which is an int to Python)."""
    return type(x) in (int, float) and math.isfinite(x)


def check_profile(profile: dict, stages: int | None = None) -> None:
    """Refuse anything but a profile such as calibration_profile makes, for these stages (None: as many as
    its rows time): every field's type, shape and range (ValueError says which). A profile is stored with
    the model and read for every serve request, so one that passes here must never fail there."""
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
    if stages is None:
        stages = len(rows[0])
        if not 1 <= stages <= PROFILE_MAX_STAGES or any(len(r) != stages for r in rows):
            raise ValueError(f"the profile's stage_s rows must each time the same 1 to {PROFILE_MAX_STAGES} stages")
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


# -- a model's own batching policy, as its source declared it (a Triton config.pbtxt) ------------

SERVING_POLICIES = ("serial", "dynamic")   # what a model's own configuration can ask for
SERVING_MAX_BATCH = 1 << 16
_SERVING_FIELDS = {"policy", "max_batch", "max_queue_delay_ms", "preferred_batch_sizes", "device", "sequence",
                   "max_queue", "queue_timeout_ms", "queue_delay", "priority_levels", "default_priority",
                   "priority_queues", "response_cache", "warmup", "intra_op_threads"}
_QUEUE_FIELDS = {"max_queue", "queue_timeout_ms", "queue_delay"}   # a queue policy's (executor/queues.QueuePolicy)
PRIORITY_LEVELS_MAX = 1 << 16


def _check_queue_policy(policy: dict, where: str) -> None:
    max_queue = policy.get("max_queue", 0)
    if type(max_queue) is not int or not 0 <= max_queue <= 1 << 31:
        raise ValueError(f"{where}max_queue must be a whole number of requests from 0 (the daemon's setting) to 2^31")
    timeout = policy.get("queue_timeout_ms", 0.0)
    if not _number(timeout) or not 0 <= timeout <= 3.6e6:
        raise ValueError(f"{where}queue_timeout_ms must be a number of milliseconds from 0 (no limit) to an hour")
    if type(policy.get("queue_delay", False)) is not bool:
        raise ValueError(f"{where}queue_delay must be true or false")


# Bytes an element of each type a warm-up input may have ("object": a string's reference, as numpy holds it)
WARMUP_ITEM_BYTES = {"bool": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "int8": 1, "int16": 2, "int32": 4,
                     "int64": 8, "float16": 2, "float32": 4, "float64": 8, "object": 8}
WARMUP_SAMPLE_BYTES_MAX = 256 << 20   # one sample's inputs, all its rows: what a model's declared serving may ask
WARMUP_COUNT_MAX = 1000               # runs of one sample


def warmup_sample_bytes(sample: dict) -> int:
    """What a warm-up sample's inputs hold, all its rows."""
    return sample["batch_size"] * sum(math.prod(spec["dims"]) * WARMUP_ITEM_BYTES[spec["dtype"]]
                                      for spec in sample["inputs"].values())


def _check_warmup(samples) -> None:
    """A model's warm-up samples as triton_repo/warmup.samples writes them (daemon/warmup.py makes their requests);
    within bounds a daemon can afford."""
    if not isinstance(samples, list) or len(samples) > 64:
        raise ValueError("warmup must be a list of at most 64 samples")
    for s in samples:
        if not isinstance(s, dict) or set(s) != {"name", "batch_size", "count", "inputs"} \
                or not isinstance(s["name"], str) or not isinstance(s["inputs"], dict):
            raise ValueError("a warmup sample is a map of name, batch_size, count and inputs")
        if type(s["batch_size"]) is not int or not 1 <= s["batch_size"] <= SERVING_MAX_BATCH \
                or type(s["count"]) is not int or not 1 <= s["count"] <= WARMUP_COUNT_MAX:
            raise ValueError(f"warmup sample {s['name'][:80]!r}: batch_size must be 1 to {SERVING_MAX_BATCH}, "
                             f"count 1 to {WARMUP_COUNT_MAX}")
        for name, spec in s["inputs"].items():
            if not isinstance(spec, dict) or spec.get("dtype") not in WARMUP_ITEM_BYTES \
                    or not isinstance(spec.get("dims"), list) or len(spec["dims"]) > 16 \
                    or not all(type(d) is int and d >= 0 for d in spec["dims"]) \
                    or not (spec.get("fill") in ("zero", "random") or isinstance(spec.get("data"), str)
                            or isinstance(spec.get("strings"), list) and len(spec["strings"]) == math.prod(spec["dims"])
                            and all(isinstance(x, str) for x in spec["strings"])) \
                    or not (spec.get("reshape") is None or isinstance(spec["reshape"], list)
                            and all(type(d) is int and d >= -1 for d in spec["reshape"])):
                raise ValueError(f"warmup sample {s['name'][:80]!r}: input {str(name)[:80]!r} must give its dtype, "
                                 "dims (>= 0) and a fill (zero, random), data or its strings")
        if warmup_sample_bytes(s) > WARMUP_SAMPLE_BYTES_MAX:
            raise ValueError(f"warmup sample {s['name'][:80]!r}: its inputs would hold more than "
                             f"{WARMUP_SAMPLE_BYTES_MAX >> 20} MiB")


def check_serving(serving: dict) -> None:
    """Refuse anything but a model's batching policy as `modelcache import-triton` stores it (its manifest's
    `serving`): {"policy": "serial" or "dynamic", "max_batch": the largest request and batch (0: no limit),
    "max_queue_delay_ms", "preferred_batch_sizes", "device": "cpu" to keep it off GPU workers, "sequence": a
    stateful model's controls and states (executor/sequences.SequenceSpec), "max_queue": requests its queue holds
    (0: the `max_queue` setting's), "queue_timeout_ms": how long a request may wait in it (0: no limit),
    "queue_delay": true to move a request past that time behind the others rather than refuse it (Triton's DELAY),
    "priority_levels": how many priority levels its queue has (0: none), "default_priority": the level of a request
    that names none, "priority_queues": {level: its own max_queue, queue_timeout_ms, queue_delay} (executor/queues.py),
    "response_cache": true to answer inputs it has answered before from the daemon's response cache, "warmup": the
    samples it runs when added or loaded (triton_repo/warmup.py), "intra_op_threads": at most this many threads
    run it on a worker (its Triton config's intra_op_thread_count)}, each field optional. ValueError says which
    field is wrong."""
    if not isinstance(serving, dict):
        raise ValueError("a model's serving policy is a map of its fields")
    unknown = sorted(set(serving) - _SERVING_FIELDS)
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r} in a model's serving policy; known: "
                         f"{', '.join(sorted(_SERVING_FIELDS))}")
    if serving.get("policy", "serial") not in SERVING_POLICIES:
        raise ValueError(f"a model's serving policy must be one of {', '.join(SERVING_POLICIES)}")
    max_batch = serving.get("max_batch", 0)
    if type(max_batch) is not int or not 0 <= max_batch <= SERVING_MAX_BATCH:
        raise ValueError(f"max_batch must be a whole number from 0 (no limit) to {SERVING_MAX_BATCH}")
    delay = serving.get("max_queue_delay_ms", 0.0)
    if not _number(delay) or not 0 <= delay <= 3.6e6:
        raise ValueError("max_queue_delay_ms must be a number of milliseconds from 0 to an hour")
    _check_queue_policy(serving, "")
    levels = serving.get("priority_levels", 0)
    if type(levels) is not int or not 0 <= levels <= PRIORITY_LEVELS_MAX:
        raise ValueError(f"priority_levels must be a whole number from 0 (none) to {PRIORITY_LEVELS_MAX}")
    default = serving.get("default_priority", 1 if levels else 0)
    if levels and (type(default) is not int or not 1 <= default <= levels):   # (Triton's words)
        raise ValueError(f"default priority level must be in range [1, {levels}]")
    if not levels and ("default_priority" in serving or serving.get("priority_queues")):
        raise ValueError("default_priority and priority_queues need priority_levels")
    queues = serving.get("priority_queues", {})
    if not isinstance(queues, dict):
        raise ValueError("priority_queues must be a map from a priority level to its queue policy")
    for level, policy in queues.items():
        if not (isinstance(level, str) and level.isdigit() and 1 <= int(level) <= levels):
            raise ValueError(f"priority queue policy must have priority level in range [1, {levels}]: not {level!r}")
        if not isinstance(policy, dict) or set(policy) - _QUEUE_FIELDS:
            raise ValueError(f"priority_queues[{level}] must be a map of {', '.join(sorted(_QUEUE_FIELDS))}")
        _check_queue_policy(policy, f"priority_queues[{level}].")
    sizes = serving.get("preferred_batch_sizes", [])
    if not isinstance(sizes, list) or len(sizes) > 64 or not all(type(b) is int and 1 <= b <= SERVING_MAX_BATCH
                                                                 for b in sizes):
        raise ValueError("preferred_batch_sizes must be a list of at most 64 batch sizes >= 1")
    _check_warmup(serving.get("warmup", []))
    threads = serving.get("intra_op_threads", 0)
    if type(threads) is not int or not 0 <= threads <= 1024:
        raise ValueError("intra_op_threads must be a whole number of threads from 0 (the worker's cores) to 1024")
    if type(serving.get("response_cache", False)) is not bool:
        raise ValueError("response_cache must be true or false")
    if serving.get("response_cache") and serving.get("sequence") is not None:   # (Triton refuses it too)
        raise ValueError("a stateful model (sequence batching) cannot have a response cache: its answers depend "
                         "on its state, not only its inputs")
    if serving.get("device", "cpu") != "cpu":
        raise ValueError("a model's serving device may only be \"cpu\" (its Triton instance_group KIND_CPU)")
    if serving.get("sequence") is not None and not isinstance(serving["sequence"], dict):
        # (its fields are the executor's to check: executor/sequences.SequenceSpec.from_wire, when a model is added)
        raise ValueError("a model's sequence batching is a map of its fields")
