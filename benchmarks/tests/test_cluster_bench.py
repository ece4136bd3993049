"""benchmarks/cluster/run.py: the trace generator (pure), and the benchmark end to end at tiny scale."""

import json
from collections import Counter

import numpy as np
import pytest

from benchmarks.cluster.run import trace, zipf_weights

MODELS = [f"m{i}" for i in range(12)]


def test_zipf_weights_follow_ranks():
    w = zipf_weights(12, 1.0)
    assert w.sum() == pytest.approx(1.0)
    assert w[0] / w[1] == pytest.approx(2.0) and w[0] / w[3] == pytest.approx(4.0)


def test_trace_counts_follow_the_ranks():
    t = trace(MODELS, 20000, 1.0, 10.0, seed=1)
    counts = Counter(m for _, m in t)
    assert [counts[m] for m in MODELS[:4]] == sorted((counts[m] for m in MODELS[:4]), reverse=True)
    expected = zipf_weights(12, 1.0) * 20000
    for m, e in zip(MODELS, expected):
        assert abs(counts[m] - e) < 5 * np.sqrt(e) + 5        # within a few standard deviations
    assert counts[MODELS[0]] / counts[MODELS[-1]] == pytest.approx(12, rel=0.3)


def test_trace_poisson_gaps():
    t = trace(MODELS, 20000, 1.0, 8.0, seed=2)
    times = np.array([a for a, _ in t])
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)
    assert gaps.std() == pytest.approx(1 / 8.0, rel=0.1)        # exponential: std = mean


def test_trace_same_seed_same_trace():
    assert trace(MODELS, 300, 1.0, 5.0, seed=7) == trace(MODELS, 300, 1.0, 5.0, seed=7)
    assert trace(MODELS, 300, 1.0, 5.0, seed=7) != trace(MODELS, 300, 1.0, 5.0, seed=8)


def test_zipf_zero_is_uniform():
    counts = Counter(m for _, m in trace(MODELS, 12000, 0.0, 5.0, seed=3))
    assert all(abs(counts[m] - 1000) < 150 for m in MODELS)


@pytest.mark.slow
def test_bench_cluster_end_to_end(tmp_path):
    pytest.importorskip("ray.serve")
    from benchmarks.cluster import run as cluster
    out = tmp_path / "out"
    assert cluster.main(["--models", "12", "--requests", "60", "--rate", "6", "--repeats", "1",
                         "--modes", "locality", "default", "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    modes = data["summary"]["modes"]
    assert set(modes) == {"locality", "default"}
    for s in modes.values():
        assert s["errors"] == [0]
        assert s["requests"] == [48]
        assert 0.0 <= s["warm_fraction"][0] <= 1.0
        assert 0 < s["p50_ms"][0] <= s["p99_ms"][0] < 60000
        assert s["remote_fetches"][0] >= 1
    assert "warm_locality_over_default" in data["summary"]["ratios"]
    assert (out / "report.txt").read_text().startswith("$ python benchmarks/cluster/run.py")
