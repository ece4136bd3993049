"""Prometheus text exposition: rendered by the owner loop from plain data, served by a thread.

The HTTP thread never reads the daemon's tables: the owner loop renders a snapshot
(`render`) every sweep and swaps it in; the thread serves whatever is current.
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ..histogram import Histogram

log = logging.getLogger("modelcache.metrics")


def esc(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _tier_labels(t: dict) -> str:
    return f'tier="{t["tier"]}"' + (f',device="{esc(t["device"])}"' if t.get("device") else "")


class Exposition:
    """Metric families in Prometheus text format 0.0.4, each its HELP and TYPE lines, then its samples.
    omit_empty: a family without samples is left out (as prometheus-cpp, hence Triton, prints its families)."""

    def __init__(self, omit_empty: bool = False):
        self.lines: list[str] = []
        self.omit_empty = omit_empty

    def metric(self, name: str, kind: str, help_: str, samples) -> None:
        samples = list(samples)
        if self.omit_empty and not samples:
            return
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} {kind}")
        self.lines.extend(samples)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render(counters: dict, tiers: list[dict], models: list[dict], clients: int, uptime_s: float,
           open_latency: Histogram, states: list[str], executor: dict | None = None,
           infer_latency: dict | None = None) -> str:
    """modelcache's own metrics (modelcache_*) as Prometheus text format 0.0.4."""
    out = Exposition()
    metric = out.metric

    metric("modelcache_uptime_seconds", "gauge", "Seconds since the daemon started.", [f"modelcache_uptime_seconds {uptime_s:.1f}"])
    metric("modelcache_clients", "gauge", "Connected clients.", [f"modelcache_clients {clients}"])
    metric("modelcache_tier_used_bytes", "gauge", "Bytes resident per tier (GPU tiers: per device).",
           [f'modelcache_tier_used_bytes{{{_tier_labels(t)}}} {t["used_bytes"]}' for t in tiers])
    metric("modelcache_tier_capacity_bytes", "gauge", "Capacity per tier (0: unbounded).",
           [f'modelcache_tier_capacity_bytes{{{_tier_labels(t)}}} {t["capacity_bytes"]}' for t in tiers])
    for t in tiers:
        if "memory_limit_bytes" in t:   # the host tier's: the memory limit it lives under (daemon/memory.py)
            for key, name, help_ in (
                    ("memory_limit_bytes", "modelcache_memory_limit_bytes",
                     "The memory limit the host tier lives under: RAM, or the cgroup's limit when smaller."),
                    ("memory_reserve_bytes", "modelcache_memory_reserve_bytes",
                     "Headroom kept free under the memory limit (memory_reserve): idle models are given back below it."),
                    ("headroom_bytes", "modelcache_memory_headroom_bytes",
                     "Memory free under the memory limit now (the limit less the cgroup's working set, or the "
                     "machine's MemAvailable).")):
                metric(name, "gauge", help_, [f"{name} {t[key]}"])
    metric("modelcache_tier_waiting_requests", "gauge", "Requests waiting for room in a tier full of models in use.",
           [f'modelcache_tier_waiting_requests{{{_tier_labels(t)}}} {t["waiting"]["requests"]}'
            for t in tiers if "waiting" in t])
    by_state = {s: 0 for s in states}
    for m in models:
        by_state[m["state"]] = by_state.get(m["state"], 0) + 1
    metric("modelcache_models", "gauge", "Models per lifecycle state.",
           [f'modelcache_models{{state="{s}"}} {n}' for s, n in by_state.items()])
    metric("modelcache_model_corrupt", "gauge", "Versions whose stored files failed their checksums (1 each).",
           [f'modelcache_model_corrupt{{model="{esc(m["name"])}",version="{m["version"]}"}} 1'
            for m in models if m.get("corrupt")])
    metric("modelcache_model_refcount", "gauge", "Open leases per model.",
           [f'modelcache_model_refcount{{model="{esc(m["name"])}",version="{m["version"]}"}} {m["refcount"]}'
            for m in models])
    metric("modelcache_model_resident_bytes", "gauge", "Bytes the host tier holds for each model (its own accounting).",
           [f'modelcache_model_resident_bytes{{model="{esc(m["name"])}",version="{m["version"]}"}} '
            f'{m["host_bytes"] if m["tier"] != "disk" else 0}' for m in models])
    metric("modelcache_model_gpu_leases", "gauge", "GPU leases per model and device (0: resident, unleased).",
           [f'modelcache_model_gpu_leases{{model="{esc(m["name"])}",version="{m["version"]}",'
            f'device="{esc(g["device"])}"}} {g["leases"]}' for m in models for g in m.get("gpu", ())
            if g["state"] == "resident"])
    for key, help_ in (("keep_alive_until", "When each model's keep-alive ends (Unix time; keepalive and hybrid "
                                            "policies): idle past it, it is unloaded."),
                       ("next_call", "When each model's next call is expected (Unix time; the hybrid policy, once "
                                     "the model's calls show a pattern).")):
        metric(f"modelcache_model_{key}_timestamp_seconds", "gauge", help_,
               [f'modelcache_model_{key}_timestamp_seconds{{model="{esc(m["name"])}",version="{m["version"]}"}} '
                f'{m[key]:.3f}' for m in models if m.get(key)])
    for key, help_ in (("opens", "Open requests."), ("hits", "Opens served from the host tier."),
                       ("misses", "Opens that had to promote from disk."), ("evictions", "Models evicted."),
                       ("gpu_promotions", "Copies of models onto a GPU."),
                       ("gpu_evictions", "Models demoted from a GPU to the host tier."),
                       ("closes", "Leases closed by clients."), ("clients_lost", "Clients dropped for silence or death."),
                       ("adds", "Models added."), ("bad_messages", "Malformed requests refused."),
                       ("opens_from_disk", "Opens answered from the repository's files: the host tier could not "
                                           "take the model then (open_when_full = disk)."),
                       ("corrupt_detected", "Promotions or opens refused because a stored file failed its checksum."),
                       ("refetched", "Damaged versions fetched again from the remote store."),
                       ("fetched", "Versions fetched from the remote store on a miss."),
                       ("unloads", "Idle models unloaded from the host tier when their keep-alive ended."),
                       ("prewarms", "Models pre-warmed disk -> host before their expected call."),
                       ("gpu_unloads", "Idle GPU copies demoted when their keep-alive ended."),
                       ("gpu_prewarms", "Models pre-warmed host -> GPU before their expected call."),
                       ("wasted_prewarms", "Pre-warmed host copies freed before any call used them."),
                       ("gpu_wasted_prewarms", "Pre-warmed GPU copies freed before any call used them."),
                       ("pressure_evictions", "Idle models given back because memory under the limit ran short."),
                       ("pressure_reliefs", "Times memory under the limit ran short and idle models were given back."),
                       ("outputs_lent", "Serve-mode outputs over 256 KiB written into a memory file the request lent."),
                       ("outputs_large_inline", "Serve-mode outputs over 256 KiB sent in the reply: the request lent "
                                                "no file (ZeroMQ, an older client, a model's first answer), or one "
                                                "without room for it.")):
        metric(f"modelcache_{key}_total", "counter", help_, [f"modelcache_{key}_total {counters.get(key, 0)}"])
    metric("modelcache_open_latency_seconds", "histogram", "Time from an open request to its reply.",
           open_latency.lines("modelcache_open_latency_seconds"))
    if executor is not None:
        metric("modelcache_worker_queue_length", "gauge", "Serve-mode stage tasks queued or running per worker.",
               [f'modelcache_worker_queue_length{{worker="{w["id"]}",kind="{w["kind"]}"}} {w["queued"]}'
                for w in executor["workers"]])
        metric("modelcache_inference_requests_total", "counter", "Serve-mode requests by result.",
               [f'modelcache_inference_requests_total{{result="ok"}} {executor["served"]}',
                f'modelcache_inference_requests_total{{result="error"}} {executor["failed"]}'])
        metric("modelcache_inference_refused_total", "counter",
               "Serve-mode requests refused by their model's queue: full (max_queue), or waited past queue_timeout_ms.",
               [f'modelcache_inference_refused_total{{reason="{why}"}} {n}' for why, n in executor["refused"].items()])
        metric("modelcache_inference_in_flight", "gauge", "Serve-mode requests in flight.",
               [f"modelcache_inference_in_flight {executor['in_flight']}"])
        metric("modelcache_inference_queued", "gauge",
               "Serve-mode requests waiting in a model's queue, by priority level (0: a model without levels).",
               [f'modelcache_inference_queued{{model="{esc(key.rpartition("@")[0])}",'
                f'version="{key.rpartition("@")[2]}",level="{level}"}} {n}'
                for key, depths in executor.get("queued_by_model", {}).items() for level, n in depths.items()])
        cache = executor.get("response_cache")
        if cache is not None:   # (executor/response_cache.py: models whose serving asks for it)
            for key, kind, help_ in (
                    ("hits", "counter", "Serve-mode requests answered from a response cache (the daemon's or a "
                                        "front's), without a run."),
                    ("misses", "counter", "Serve-mode requests of response-cached models no cache had."),
                    ("evicted", "counter", "Answers dropped from the daemon's response cache: least recently used, "
                                           "or memory pressure."),
                    ("bytes", "gauge", "Bytes of answers the daemon's response cache holds."),
                    ("entries", "gauge", "Answers the daemon's response cache holds."),
                    ("capacity_bytes", "gauge", "The response cache's size (response_cache_size).")):
                name = f"modelcache_response_cache_{key}" + ("_total" if kind == "counter" else "")
                metric(name, kind, help_, [f"{name} {cache[key]}"])
    lines = []
    for key, hist in sorted((infer_latency or {}).items()):   # key: "name@version", labelled as elsewhere
        name, _, version = key.rpartition("@")
        lines += hist.lines("modelcache_inference_latency_seconds", f'model="{esc(name)}",version="{version}"')
    metric("modelcache_inference_latency_seconds", "histogram", "Serve-mode request latency per model.", lines)
    return out.text()


class MetricsServer:
    """GET /metrics on host:port; serves the latest rendered text."""

    def __init__(self, host: str, port: int):
        self.text = b"# no snapshot yet\n"
        server_self = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's naming)
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404, "only /metrics here")
                    return
                body = server_self.text
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # scrapes are not events worth a log line
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="metrics", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def publish(self, text: str) -> None:
        self.text = text.encode()  # one reference swap: the thread sees the old or the new, never half

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
