"""The real-daemon replay (benchmarks/faas/real_replay.py) on a tiny trace: the real daemon, a fresh process per call, the counts add up,
and the simulator replays the same calls with the costs measured on the same daemon."""

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.faas.real_replay import daemon_command, daemon_env, fit_line
from modelcache.config import EVICTION_POLICIES

ROOT = Path(__file__).resolve().parents[2]


def replay(*args, timeout):
    """`python -m benchmarks.faas.real_replay ARGS` from the repository root, as benchmarks/README.md says."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "benchmarks.faas.real_replay", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)
from benchmarks.faas.sweep import load_costs
from benchmarks.faas.trace import read_counts


def test_a_tiny_trace_replays_against_the_real_daemon(tmp_path):
    out = tmp_path / "faas"
    r = replay("--functions", "4", "--hours", "0.1", "--compress", "40", "--models", "squeezenet1_1,tiny-cnn",
               "--capacities", "0.4", "--policies", "lru", "--cost-runs", "1", "--max-procs", "1", "--out", str(out),
               timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    calls = sum(sum(f.counts) for f in read_counts(out / "trace.csv"))      # the trace it wrote, read back
    (row,) = data["rows"]
    assert row["calls"] == data["calls"] == calls > 0
    assert row["host_hits"] + row["disk_misses"] + row["remote_misses"] + row["failed"] == calls
    # one call at a time: no call finds the tier full of models in use (the daemon refuses it until it waits for room)
    assert row["failed"] == 0 and row["remote_misses"] == 0                 # every model fits; no remote store
    assert row["disk_misses"] >= 1 and row["promotions"] >= 1               # nothing is resident at the start
    assert row["gib_s"] > 0 and row["open_run_p99_ms"] >= row["open_run_p50_ms"] > 0
    assert row["ttfr_p50_ms"] > row["open_run_p50_ms"]                      # a process starts before it opens
    (sim,) = data["simulated"]
    assert sim["calls"] == calls and sim["policy"] == "lru"
    assert data["agreement"][0]["cold_real"] == row["cold_fraction"] and len(data["agreement_as_started"]) == 1
    assert len(gzip.open(out / "calls.csv.gz", "rt").read().splitlines()) == calls + 1         # a row per call, and the header
    costs = load_costs(out / "costs.json")                                  # what sweep.py --costs reads
    assert costs.open_host_s > 0 and set(costs.run_s) == {"squeezenet1_1", "tiny-cnn"}
    assert "real vs simulated" in r.stdout and "|    lru |" in r.stdout
    assert (out / "pareto.png").stat().st_size > 1000


def test_the_daemon_runs_the_policy_at_the_capacity_asked():
    env = daemon_env("gdsf", 5 << 20)
    assert env["MODELCACHE_EVICTION_POLICY"] == "gdsf" and env["MODELCACHE_HOST_CAPACITY"] == str(5 << 20)
    assert "gdsf" in EVICTION_POLICIES


def test_promotion_costs_fit_a_line_through_the_sizes():
    assert fit_line([(100, 0.002), (300, 0.004)]) == (0.001, 1e-5)
    a, b = fit_line([(100, 0.003)])                      # one size: all of it per byte
    assert (a, b) == (0.0, 3e-5)


def test_a_policy_the_daemon_does_not_run_is_one_line_before_anything_starts():
    r = replay("--policies", "lru,nope", "--functions", "2", "--hours", "0.1", timeout=60)
    assert r.returncode == 2 and "not nope" in r.stderr and "lru" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_the_replays_daemon_keeps_a_model_for_the_compressed_window(tmp_path, monkeypatch):
    """No time scale in the daemon: the replay's launcher (compressed_daemon.py) builds its policies with
    windows as short as the trace's compression makes them; 10 minutes of keep-alive at 60x is 10 s."""
    from modelcache import zoo
    from modelcache.client.connection import connect
    from modelcache.measure import managed_daemon
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("MODELCACHE_SHM_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    zoo.save(zoo.build("tiny-cnn"), str(tmp_path / "m.onnx"))
    with managed_daemon(f"ipc://{tmp_path}/d.sock", str(tmp_path / "repo"), env=daemon_env("keepalive", 64 << 20),
                        command=daemon_command(60)) as socket, connect(socket) as c:
        c.add(str(tmp_path / "m.onnx"), "m")
        c.release(c.open("m").lease_id)
        (m,) = c.list()
        assert 5 < m["keep_alive_until"] - time.time() <= 10.0
