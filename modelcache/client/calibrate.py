"""Batching calibration: time each stage of a model at several batch sizes, through the daemon.

LBCI predicts the time of a batch from a table of run-time ratios per (batch size, stages
done) and a fitted per-sample cost g(b), and derives N_opt, the largest batch that meets the
latency bound t_opt. We measure those on the daemon's own workers — requests go through
serve mode one at a time, and the per-stage times come back in each request's timings — and
store the result with the model, where the layer-to-layer batcher and N_opt defaults read it.
"""

from __future__ import annotations

import statistics
import time

from ..calibration import calibration_profile
from ..wire.tensors import random_feeds

DEFAULT_BATCHES = (1, 2, 4, 8, 16)
DEFAULT_T_OPT_FACTOR = 5.0   # without a t_opt: five times a batch-1 request's round trip


def calibrate(client, name: str, batches=DEFAULT_BATCHES, runs: int = 5, t_opt_ms: float | None = None,
              version: int | None = None, progress=None) -> dict:
    """Measure, fit, store with the model; returns the stored profile."""
    described = client.describe(name, version)
    stages = max(1, len(described.stages))
    sizes = sorted(set(int(x) for x in batches))
    feeds = {b: random_feeds(described.inputs, batch=b) for b in sizes}
    per_stage = {b: [[] for _ in range(stages)] for b in sizes}
    round_trips = {b: [] for b in sizes}
    kind = None
    for b in sizes:
        client.infer(name, feeds[b], version=version)  # warm-up: session build, first-run allocations
    # Rounds over all sizes, not one size after another: a noisy spell on a shared machine then
    # touches every size a little instead of skewing one of them (and so g(b) and N_opt).
    for _ in range(runs):
        for b in sizes:
            t0 = time.perf_counter()
            _, timings = client.infer(name, feeds[b], version=version)
            round_trips[b].append(time.perf_counter() - t0)
            for st in timings["stages"]:
                per_stage[b][st["stage"]].append(st["run_ms"] / 1e3)
                kind = st["kind"]
    stage_s = {b: [statistics.median(x) for x in per_stage[b]] for b in sizes}
    request_s = {b: statistics.median(round_trips[b]) for b in sizes}
    if progress:
        for b in sizes:
            progress(f"batch {b:3d}: stages " + " + ".join(f"{t * 1e3:.1f}" for t in stage_s[b])
                     + f" = {sum(stage_s[b]) * 1e3:.1f} ms; request {request_s[b] * 1e3:.1f} ms")
    # The default bound is on what a client sees, so it counts the request's way in and out too.
    t_opt_s = t_opt_ms / 1e3 if t_opt_ms else DEFAULT_T_OPT_FACTOR * request_s[min(request_s)]
    profile = calibration_profile(kind, stage_s, t_opt_s, request_s)
    client.set_batching(name, profile, version)
    return profile
