"""Per-model serve-mode counters the engine keeps as requests finish: what `stats` reports per model and
the HTTP front's statistics extension serves (counts, summed seconds, the latency histogram)."""

from __future__ import annotations

import time

from ..histogram import Histogram

INFER_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def add_batch(batches: dict, rows: int, count: int, run_s: float) -> None:
    """Count `count` executions of `rows` rows taking `run_s` in all, in a {str(rows): [count, seconds]} map."""
    held = batches.get(str(rows))
    if held is None:
        batches[str(rows)] = [count, run_s]
    else:
        held[0] += count
        held[1] += run_s


def add_batches(batches: dict, more: dict) -> None:
    """Count another {str(rows): [count, seconds]} map's executions into `batches`."""
    for rows, (count, run_s) in more.items():
        add_batch(batches, int(rows), count, run_s)


class ModelServeStats:
    """One model version's requests since the daemon started. Times are the engine's (`timings`): a
    request's total, its queue wait (summed over stages) and its stages' run time."""

    __slots__ = ("latency", "samples", "queue_s", "run_s", "input_s", "output_s", "failed", "failed_s", "rejected",
                 "executions", "batches", "last_at", "last_unix_ms", "cache_hits", "cache_hit_s", "cache_misses", "cache_miss_s")

    def __init__(self):
        self.latency = Histogram(INFER_BUCKETS_S)   # successful requests: their count, summed seconds, buckets
        self.samples = 0          # rows of successful requests (Triton's inference_count)
        self.queue_s = 0.0        # successful requests' waits for a worker
        self.run_s = 0.0          # successful requests' stage runs (a batch's run counts for each member)
        self.input_s = 0.0        # their tensors decoded from the request (Triton's compute_input), and their
        self.output_s = 0.0       # outputs encoded into the answer (compute_output): the daemon's own serve path's
        self.failed = 0
        self.failed_s = 0.0
        self.rejected = 0         # of the failed, those its queue refused (full, timed out, past their deadline):
                                  # Triton's failure reason REJECTED; the others failed in a run (BACKEND)
        self.executions = 0       # batches that ran to the end (one per request without batching)
        self.batches: dict = {}   # str(batch size) -> [executions of that many rows, their runs' seconds]
                                  # (Triton's batch_stats; str: msgpack's maps take no int keys by default)
        self.last_at = None       # engine clock of the last answer, success or failure
        self.last_unix_ms = None  # the same moment on the wall clock: Triton's last_inference, the same
                                  # however often and from wherever it is asked (not now less idle_s)
        # The response cache (executor/response_cache.py), as Triton counts it: a hit is a success that never ran
        # (no samples, no execution), timed by its lookup; a miss's time is its lookup and the answer's insertion.
        self.cache_hits = 0
        self.cache_hit_s = 0.0
        self.cache_misses = 0
        self.cache_miss_s = 0.0

    def finished(self, now: float, samples: int, timings: dict, ok: bool, rejected: bool = False) -> None:
        """A request answered: `ok`, or failed; `rejected`: its model's queue refused it, it never ran."""
        self.last_at = now
        self.last_unix_ms = int(time.time() * 1e3)
        total_s = timings["total_ms"] / 1e3
        if not ok:
            self.failed += 1
            self.failed_s += total_s
            self.rejected += rejected
            return
        self.latency.observe(total_s)
        self.samples += samples
        self.queue_s += timings["queue_ms"] / 1e3
        self.run_s += sum(s["run_ms"] for s in timings["stages"]) / 1e3
        self.input_s += timings.get("input_ms", 0.0) / 1e3
        self.output_s += timings.get("output_ms", 0.0) / 1e3

    def executed(self, rows: int, run_s: float) -> None:
        """A batch of `rows` ran to the end, its stages taking `run_s`."""
        self.executions += 1
        add_batch(self.batches, rows, 1, run_s)

    def cache_hit(self, now: float, total_s: float, lookup_s: float) -> None:
        """A request answered from the response cache: a success, with no run and no queue."""
        self.last_at = now
        self.last_unix_ms = int(time.time() * 1e3)
        self.latency.observe(total_s)
        self.cache_hits += 1
        self.cache_hit_s += lookup_s

    def cache_missed(self, seconds: float) -> None:
        """A request the response cache did not have: its lookup and (once it ran) its insertion took `seconds`."""
        self.cache_misses += 1
        self.cache_miss_s += seconds

    def absorb(self, now: float, report: dict) -> None:
        """Requests a front ran itself (oip/front_runs.py; FrontServed checked them): counted as the engine's own,
        each its own execution, none queued; and those its response cache answered or missed."""
        ok = sum(report["counts"])
        self.latency.merge(report["counts"], report["success_s"])
        self.samples += report["samples"]
        self.run_s += report["run_s"]
        self.failed += report["failed"]
        self.failed_s += report["failed_s"]
        hits = report.get("cache_hits", 0)   # (answered from the front's response cache: they never ran)
        self.executions += ok - hits
        add_batches(self.batches, report.get("batches", {}))   # (FrontServed checked its shape)
        self.cache_hits += hits
        self.cache_hit_s += report.get("cache_hit_s", 0.0)
        self.cache_misses += report.get("cache_misses", 0)
        self.cache_miss_s += report.get("cache_miss_s", 0.0)
        if ok or report["failed"]:
            self.last_at = now
            self.last_unix_ms = max(self.last_unix_ms or 0, report["last_unix_ms"])

    def describe(self, now: float) -> dict:
        return {"success": self.latency.n, "success_s": self.latency.total, "samples": self.samples,
                "queue_s": self.queue_s, "run_s": self.run_s, "input_s": self.input_s, "output_s": self.output_s,
                "failed": self.failed, "failed_s": self.failed_s,
                "rejected": self.rejected, "executions": self.executions, "batches": self.batches,
                "cache_hits": self.cache_hits, "cache_hit_s": self.cache_hit_s,
                "cache_misses": self.cache_misses, "cache_miss_s": self.cache_miss_s,
                "idle_s": None if self.last_at is None else max(0.0, now - self.last_at),
                "last_unix_ms": self.last_unix_ms}
