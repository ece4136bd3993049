"""Triton's metrics (daemon/triton_metrics.py): the families Triton 2.51 prints, with its HELP, types and labels,
read by Prometheus's own parser (prometheus_client); their values from the engine's counters; and a real daemon's
page agreeing with the statistics extension its HTTP front serves, through tritonclient.
"""

from __future__ import annotations

import urllib.request
from collections import namedtuple
from pathlib import Path

import numpy as np
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from modelcache import zoo
from modelcache.daemon.triton_metrics import CpuUtilization, render_triton

from conftest import stop_cleanly, wait_until
from test_triton_repo import free_port, put_model, start_importing

TRITON = Path(__file__).parent / "data" / "triton_2.51_metrics.txt"


def families(text: str) -> dict:
    """name -> (type, help, [(labels, value)]), as a Prometheus server reads the page."""
    return {f.name: (f.type, f.documentation, [(s.labels, s.value) for s in f.samples])
            for f in text_string_to_metric_families(text)}


def sample(fams: dict, name: str, **labels) -> float | None:
    """The value of the family's sample with exactly these labels; None when the page has none."""
    found = [v for got, v in fams.get(name, (None, None, []))[2] if got == {k: str(v) for k, v in labels.items()}]
    assert len(found) <= 1, (name, labels)
    return found[0] if found else None


def listing(name: str, version: int, **more) -> dict:
    return {"name": name, "version": version, "unloaded": False, "corrupt": "", **more}


def test_the_families_are_tritons_with_its_help_types_and_labels():
    triton = families(TRITON.read_text())
    ours = families(render_triton([listing("tiny", 1)], {}, {}, set(), 0.25, (1 << 30, 1 << 29)))
    # Triton's pinned-memory pool: modelcache keeps none, so it says nothing of one
    assert set(triton) - set(ours) == {"nv_pinned_memory_pool_total_bytes", "nv_pinned_memory_pool_used_bytes"}
    assert set(ours) <= set(triton)
    for name, (kind, help_, samples) in ours.items():
        assert (kind, help_) == triton[name][:2], name
        assert sorted(sorted(labels) for labels, _ in samples) == \
            sorted(sorted(labels) for labels, _ in triton[name][2]), name
    # a version with no request yet is listed with every counter at 0, as Triton lists one it loaded
    assert sample(ours, "nv_inference_request_success", model="tiny", version=1) == 0
    assert sample(ours, "nv_inference_request_failure", model="tiny", reason="CANCELED", version=1) == 0


def test_the_values_are_the_engines_counters_in_tritons_units():
    served = {"a@2": {"success": 5, "success_s": 0.0123456, "samples": 9, "executions": 4, "queue_s": 0.002,
                      "run_s": 0.0075, "input_s": 0.00025, "output_s": 0.0003, "failed": 3, "rejected": 2, "cache_hits": 1, "cache_hit_s": 0.0000125,
                      "cache_misses": 4, "cache_miss_s": 0.001}}
    models = [listing("a", 2), listing("b", 1), listing("gone", 1, unloaded=True), listing("bad", 1, corrupt="sum")]
    cache = {"capacity_bytes": 1000, "bytes": 250, "entries": 3, "hits": 7, "misses": 5, "evicted": 2}
    fams = families(render_triton(models, served, {"a@2": {"0": 2, "1": 3}}, {"a@2"}, 0.5, (8 << 30, 3 << 30),
                                  cache))
    a = {"model": "a", "version": 2}
    assert sample(fams, "nv_inference_request_success", **a) == 5
    assert sample(fams, "nv_inference_count", **a) == 9
    assert sample(fams, "nv_inference_exec_count", **a) == 4
    assert sample(fams, "nv_inference_request_duration_us", **a) == 12345
    assert sample(fams, "nv_inference_queue_duration_us", **a) == 2000
    assert sample(fams, "nv_inference_compute_infer_duration_us", **a) == 7500
    assert sample(fams, "nv_inference_compute_input_duration_us", **a) == 250
    assert sample(fams, "nv_inference_compute_output_duration_us", **a) == 300
    assert [sample(fams, "nv_inference_request_failure", reason=r, **a)
            for r in ("REJECTED", "BACKEND", "CANCELED", "OTHER")] == [2, 1, 0, 0]
    assert sample(fams, "nv_inference_pending_request_count", **a) == 5       # (every priority level's)
    assert sample(fams, "nv_cache_num_hits_per_model", **a) == 1
    assert sample(fams, "nv_cache_hit_duration_per_model", **a) == 12
    assert sample(fams, "nv_cache_miss_duration_per_model", **a) == 1000
    # the cache's families only for a model whose answers are cached; nothing for one unloaded or damaged
    assert [labels["model"] for labels, _ in fams["nv_cache_num_misses_per_model"][2]] == ["a"]
    assert sorted(labels["model"] for labels, _ in fams["nv_inference_count"][2]) == ["a", "b"]
    assert sample(fams, "nv_cpu_utilization") == 0.5
    assert [sample(fams, f"nv_cache_{k}") for k in ("util", "num_entries", "num_hits", "num_misses", "num_lookups",
                                                    "num_evictions")] == [0.25, 3, 7, 5, 12, 2]
    assert "nv_cache_util" not in families(render_triton(models, served, {}, set(), 0.5, (1, 1),
                                                         {**cache, "capacity_bytes": 0}))   # (a cache off: none)
    assert (sample(fams, "nv_cpu_memory_total_bytes"), sample(fams, "nv_cpu_memory_used_bytes")) == (8 << 30, 3 << 30)


def test_cpu_utilization_is_busy_over_busy_and_idle_time_since_the_last_sample():
    Times = namedtuple("Times", "user nice system idle iowait irq softirq steal")
    reads = iter([Times(10, 0, 5, 100, 1, 0, 0, 0), Times(13, 0, 6, 103, 2, 0, 0, 0),   # 4 busy, 4 idle
                  Times(13, 0, 6, 103, 2, 0, 0, 0),                                      # nothing passed
                  Times(12, 0, 6, 104, 2, 0, 0, 0)])                                     # a counter went back
    cpu = CpuUtilization(read=lambda: next(reads))
    assert cpu.sample() == 0.5
    assert cpu.sample() == 0.0
    assert cpu.sample() == 0.0      # (counted 0, as Triton's wrap_sub: 0 busy, 1 idle)


CONFIG = """
backend: "onnxruntime"
max_batch_size: 4
input [ { name: "input" data_type: TYPE_FP32 dims: [ 3, 32, 32 ] } ]
output [ { name: "logits" data_type: TYPE_FP32 dims: [ 10 ] } ]
"""


def test_a_daemons_triton_metrics_agree_with_its_statistics_extension(tmp_path):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException
    repo = tmp_path / "models"
    put_model(repo, "plain", zoo.build("tiny-cnn", seed=1), CONFIG)
    put_model(repo, "cached", zoo.build("tiny-cnn", seed=2), CONFIG + "response_cache { enable: true }\n")
    port = free_port()
    d, _, http_at = start_importing(tmp_path, repo, {"MODELCACHE_METRICS_PORT": str(port)})
    h = httpclient.InferenceServerClient(http_at)
    try:
        def infer(name, x):
            i = httpclient.InferInput("input", list(x.shape), "FP32")
            i.set_data_from_numpy(x)
            return h.infer(name, [i]).as_numpy("logits")

        x = np.random.default_rng(3).standard_normal((2, 3, 32, 32)).astype(np.float32)
        for rows in (1, 2, 2):
            infer("plain", x[:rows])
        infer("cached", x)
        infer("cached", x)   # the response cache's answer
        with pytest.raises(InferenceServerException):   # a wrong shape: refused before the model, not a failure
            infer("plain", np.zeros((1, 3, 32, 31), np.float32))

        def scrape():
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                return families(r.read().decode())

        def settled():
            fams = scrape()
            done = sample(fams, "nv_inference_request_success", model="plain", version=1) == 3 and \
                sample(fams, "nv_inference_request_success", model="cached", version=1) == 2
            return fams if done else None

        fams = wait_until(settled, what="a page with every request counted")
        stats = {s["name"]: s for s in h.get_inference_statistics()["model_stats"]}
        for name in ("plain", "cached"):
            s, m = stats[name], {"model": name, "version": 1}
            assert sample(fams, "nv_inference_count", **m) == s["inference_count"]
            assert sample(fams, "nv_inference_exec_count", **m) == s["execution_count"]
            for family, stat in (("request_duration", "success"), ("queue_duration", "queue"),
                                 ("compute_infer_duration", "compute_infer"),
                                 ("compute_input_duration", "compute_input"),
                                 ("compute_output_duration", "compute_output")):
                assert sample(fams, f"nv_inference_{family}_us", **m) == int(s["inference_stats"][stat]["ns"]) // 1000
            assert sum(sample(fams, "nv_inference_request_failure", reason=r, **m)
                       for r in ("REJECTED", "BACKEND", "CANCELED", "OTHER")) == 0
        assert sample(fams, "nv_inference_count", model="plain", version=1) == 5            # rows
        # the daemon ran them (batched: not a front's): their tensors' decoding and encoding timed
        assert int(stats["plain"]["inference_stats"]["compute_input"]["ns"]) > 0
        assert int(stats["plain"]["inference_stats"]["compute_output"]["ns"]) > 0
        assert sample(fams, "nv_cache_num_hits_per_model", model="cached", version=1) == 1
        assert sample(fams, "nv_cache_num_misses_per_model", model="cached", version=1) == 1
        assert "plain" not in [labels["model"] for labels, _ in fams["nv_cache_num_hits_per_model"][2]]
        assert 0.0 <= sample(fams, "nv_cpu_utilization") <= 1.0
        assert sample(fams, "nv_cpu_memory_total_bytes") == psutil.virtual_memory().total
        # modelcache's own families are on the same page
        assert sample(fams, "modelcache_inference_requests", result="ok") == 5   # (the parser drops _total)
        # an unloaded model is gone from Triton's families, as Triton drops an unloaded model's
        h.unload_model("plain")
        wait_until(lambda: "plain" not in [labels["model"] for labels, _ in scrape()["nv_inference_count"][2]],
                   what="the unloaded model off the page")
    finally:
        h.close()
        stop_cleanly(d)
