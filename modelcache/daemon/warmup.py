"""A model's warm-up (its Triton config's `model_warmup`, read by triton_repo/warmup.py): the requests each sample
makes, run by Serving.warm_up when the model is added or loaded, before the requests that come after.

Why here and not at a client's first request: that request would pay what a warm-up is for, the model's promotion
into memory, its sessions' creation on the workers and ORT's first run (allocations, thread pools).
"""

from __future__ import annotations

import base64
import math

import numpy as np


def sample_requests(sample: dict, max_batch: int) -> list[dict]:
    """The feeds of one run of `sample` (a serving "warmup" entry): one request of batch_size rows where the model
    batches (max_batch > 0), else batch_size requests of the dims as given (Triton adds no batch dimension then)."""
    rows, inputs = sample["batch_size"], sample["inputs"]
    if max_batch > 0:
        return [{name: np.repeat(_shaped(_one(spec), spec)[np.newaxis], rows, axis=0) for name, spec in inputs.items()}]
    return [{name: _shaped(_one(spec), spec) for name, spec in inputs.items()}] * rows


def _one(spec: dict) -> np.ndarray:
    """One request's worth of the input (its dims, no batch dimension)."""
    dims, dtype = spec["dims"], spec["dtype"]
    if "strings" in spec:   # (a file's strings, decoded at import)
        return np.array(spec["strings"], dtype=object).reshape(dims)
    if "data" in spec:
        return np.frombuffer(base64.b64decode(spec["data"]), dtype=dtype, count=math.prod(dims)).reshape(dims)
    if dtype == "object":   # (zeros for strings, random or not, as Triton's)
        return np.full(dims, "", dtype=object)
    if spec.get("fill") == "zero":
        return np.zeros(dims, dtype=dtype)
    # random bytes, as Triton's (rand() per byte); seeded: the same warm-up every time
    raw = np.random.default_rng(0).integers(0, 256, size=math.prod(dims) * np.dtype(dtype).itemsize, dtype=np.uint8)
    return (raw % 2).astype(bool).reshape(dims) if dtype == "bool" else raw.view(dtype).reshape(dims)


def _shaped(x: np.ndarray, spec: dict) -> np.ndarray:
    """As the model takes it, where the input has a reshape."""
    return x.reshape(spec["reshape"]) if "reshape" in spec else x
