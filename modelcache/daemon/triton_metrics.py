"""Triton's own metrics (`nv_inference_*`, `nv_cache_*`, `nv_cpu_*`), rendered from the engine's per-model counters,
so that a Triton user's scrape configuration, Grafana dashboards and autoscaling rules read modelcache unchanged.

The families, their HELP text, types and labels are Triton 2.51's (core's src/metrics.cc and
metric_model_reporter.cc, and what its native server printed here: tests/data/triton_2.51_metrics.txt). A model
version is listed as Triton lists a loaded one: every version the daemon serves, counters at 0 until its first
request; not one unloaded over a protocol front, nor one whose stored files failed their checksums.

What differs, each for want of the measurement rather than by choice of name:
- compute_input and compute_output are the daemon's decoding of a request's tensors and encoding of its answer
  (as the statistics extension's, oip/types.py model_stat): a request a front ran itself converts nothing there;
- a failure is REJECTED when its model's queue refused it (full, timed out, past its deadline), else BACKEND
  (it failed in a run); nothing is counted CANCELED or OTHER. Requests refused before they reach the engine (a
  wrong shape, an unknown input) are not failures, as in Triton, where they never reach the model;
- no GPU families (nv_gpu_*: Triton reads them from NVML) and no pinned-memory pool (modelcache keeps none);
- of the response cache's own gauges, no lookup and insertion durations: a model's misses are timed lookup and
  insertion together (nv_cache_miss_duration_per_model). Its hits and misses are every cache's (the daemon's and
  the fronts'), its entries, bytes and evictions the daemon's.
"""

from __future__ import annotations

import psutil

from .metrics import Exposition, esc

# (family, key of ModelServeStats.describe, HELP): Triton's counters of successful requests, in its order.
_COUNTS = (
    ("nv_inference_request_success", "success", "Number of successful inference requests, all batch sizes"),
    ("nv_inference_count", "samples", "Number of inferences performed (does not include cached requests)"),
    ("nv_inference_exec_count", "executions",
     "Number of model executions performed (does not include cached requests)"),
)
# (family, key of the seconds summed, HELP): cumulative durations, in microseconds.
_DURATIONS = (
    ("nv_inference_request_duration_us", "success_s",
     "Cumulative inference request duration in microseconds (includes cached requests)"),
    ("nv_inference_queue_duration_us", "queue_s",
     "Cumulative inference queuing duration in microseconds (includes cached requests)"),
    ("nv_inference_compute_input_duration_us", "input_s",
     "Cumulative compute input duration in microseconds (does not include cached requests)"),
    ("nv_inference_compute_infer_duration_us", "run_s",
     "Cumulative compute inference duration in microseconds (does not include cached requests)"),
    ("nv_inference_compute_output_duration_us", "output_s",
     "Cumulative inference compute output duration in microseconds (does not include cached requests)"),
)
_CACHE = (
    ("nv_cache_num_hits_per_model", "counter", "cache_hits", "Number of cache hits per model"),
    ("nv_cache_hit_duration_per_model", "us", "cache_hit_s", "Total cache hit duration per model, in microseconds"),
    ("nv_cache_num_misses_per_model", "counter", "cache_misses", "Number of cache misses per model"),
    ("nv_cache_miss_duration_per_model", "us", "cache_miss_s",
     "Total cache miss (insert+lookup) duration per model, in microseconds"),
)
# The response cache's own gauges (Triton's local cache prints them with --cache-config): (family, HELP, value).
_CACHE_WIDE = (
    ("nv_cache_util", "Cache utilization [0.0 - 1.0]", lambda c: c["bytes"] / c["capacity_bytes"]),
    ("nv_cache_num_entries", "Number of responses stored in response cache", lambda c: c["entries"]),
    ("nv_cache_num_hits", "Number of cache hits in response cache", lambda c: c["hits"]),
    ("nv_cache_num_misses", "Number of cache misses in response cache", lambda c: c["misses"]),
    ("nv_cache_num_lookups", "Number of cache lookups in response cache", lambda c: c["hits"] + c["misses"]),
    ("nv_cache_num_evictions", "Number of cache evictions in response cache", lambda c: c["evicted"]),
)
FAILURE_REASONS = ("OTHER", "BACKEND", "CANCELED", "REJECTED")


class CpuUtilization:
    """The machine's CPU utilization between two samples, as Triton computes it from /proc/stat: busy time
    (user, nice, system, irq, softirq, steal) over busy and idle (idle, iowait) time, in [0, 1]."""

    BUSY = ("user", "nice", "system", "irq", "softirq", "steal")
    IDLE = ("idle", "iowait")

    def __init__(self, read=psutil.cpu_times):
        self.read = read
        self.last = read()

    def sample(self) -> float:
        now, last = self.read(), self.last
        self.last = now

        def spent(fields):   # (a counter that went back, as after a CPU went offline, counts 0: Triton's wrap_sub)
            return sum(max(0.0, getattr(now, f, 0.0) - getattr(last, f, 0.0)) for f in fields)

        busy, idle = spent(self.BUSY), spent(self.IDLE)
        return busy / (busy + idle) if busy + idle > 0 else 0.0


def served_versions(models: list[dict]) -> list[dict]:
    """The listing's entries Triton would have a loaded model for (models and ensembles): not unloaded, not
    damaged."""
    return [m for m in models if not m.get("unloaded") and not m.get("corrupt")]


def render_triton(models: list[dict], served: dict, queued_by_model: dict, cached: set, cpu_utilization: float,
                  memory: tuple[int, int], cache: dict | None = None) -> str:
    """Triton's metric families as Prometheus text. models: the daemon's listing (served_versions picks);
    served: model key -> ModelServeStats.describe (none: no request yet); queued_by_model: key -> {level: waiting};
    cached: keys whose answers the response cache keeps; memory: (total, used) bytes of the machine's RAM;
    cache: the response cache's describe, with every cache's hits and misses (None, or no capacity: off)."""
    out = Exposition(omit_empty=True)
    listed = [(m["name"], m["version"], f"{m['name']}@{m['version']}") for m in served_versions(models)]

    def labels(name: str, version: int, **more) -> str:   # in Triton's order: sorted by label name
        pairs = sorted({"model": name, "version": str(version), **more}.items())
        return ",".join(f'{k}="{esc(v)}"' for k, v in pairs)

    def per_model(family: str, value, keys=None, **more) -> list[str]:
        return [f"{family}{{{labels(n, v, **more)}}} {value(served.get(k) or {})}"
                for n, v, k in listed if keys is None or k in keys]

    success, *counts = _COUNTS
    out.metric(success[0], "counter", success[2], per_model(success[0], lambda s: s.get("success", 0)))
    out.metric("nv_inference_request_failure", "counter", "Number of failed inference requests, all batch sizes",
               [line for reason in FAILURE_REASONS
                for line in per_model("nv_inference_request_failure",
                                      lambda s, r=reason: _failures(s, r), reason=reason)])
    for family, key, help_ in counts:
        out.metric(family, "counter", help_, per_model(family, lambda s, k=key: s.get(k, 0)))
    for family, key, help_ in _DURATIONS:
        out.metric(family, "counter", help_, per_model(family, lambda s, k=key: _us(s.get(k, 0.0))))
    out.metric("nv_inference_pending_request_count", "gauge",
               "Instantaneous number of pending requests awaiting execution per-model.",
               [f"nv_inference_pending_request_count{{{labels(n, v)}}} "
                f"{sum((queued_by_model.get(k) or {}).values())}" for n, v, k in listed])
    for family, kind, key, help_ in _CACHE:   # (only for models whose answers are cached, as Triton)
        out.metric(family, "counter", help_,
                   per_model(family, lambda s, k=key, us=kind == "us": _us(s.get(k, 0.0)) if us else s.get(k, 0),
                             keys=cached))
    if cache and cache.get("capacity_bytes"):
        for family, help_, value in _CACHE_WIDE:
            out.metric(family, "gauge", help_, [f"{family} {value(cache)!r}"])
    total, used = memory
    out.metric("nv_cpu_utilization", "gauge", "CPU utilization rate [0.0 - 1.0]",
               [f"nv_cpu_utilization {cpu_utilization!r}"])
    out.metric("nv_cpu_memory_total_bytes", "gauge", "CPU total memory (RAM), in bytes",
               [f"nv_cpu_memory_total_bytes {total}"])
    out.metric("nv_cpu_memory_used_bytes", "gauge", "CPU used memory (RAM), in bytes",
               [f"nv_cpu_memory_used_bytes {used}"])
    return out.text()


def machine_memory() -> tuple[int, int]:
    """The machine's RAM and what is used of it, as Triton reads /proc/meminfo: MemTotal, MemTotal - MemAvailable
    (the machine's, not a memory cgroup's: modelcache_memory_limit_bytes says that one)."""
    vm = psutil.virtual_memory()
    return vm.total, max(0, vm.total - vm.available)


def _failures(stats: dict, reason: str) -> int:
    rejected = stats.get("rejected", 0)
    return {"REJECTED": rejected, "BACKEND": stats.get("failed", 0) - rejected}.get(reason, 0)


def _us(seconds: float) -> int:
    return int(seconds * 1e6)
