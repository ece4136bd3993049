"""benchmarks/inputs: the ways a large input could be handed over, and serve calls by memory files against files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1] / "inputs"
ROOT = HERE.parents[1]


def test_every_way_hands_over_the_same_tensor(tmp_path):
    r = subprocess.run([sys.executable, str(HERE / "ways.py"), "--rounds", "1", "--calls", "3", "--sizes-mb", "0.3",
                        "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    results = json.loads((tmp_path / "ways.json").read_text())
    assert set(results) == {"0.3", "2.0"}
    assert all(set(by_way) == {"file", "memfd-map", "memfd-copy", "memfd-reused", "memfd-mapped", "inline"} and
               all(t[0] > 0 for t in by_way.values()) for by_way in results.values())
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("modelcache-io.ways.")]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare(1)")
def test_the_serve_comparison_reports_each_case_and_the_contained_client(tmp_path):
    """On this checkout against itself (the lab has no older one at hand): every case (inputs over 256 KiB, and a
    large output: `neg`) timed on both, through a session, `modelcache http`, `modelcache grpc` and its stream, each answer
    checked; and a client with an empty /dev/shm of its own answered by both."""
    r = subprocess.run([sys.executable, str(HERE / "run.py"), "--baseline", str(ROOT), "--rounds", "1", "--sum-mb",
                        "0.6", "4.8", "--neg-mb", "4.8", "--resnet-batches", "--fronts", "http", "grpc", "grpc-stream",
                        "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert {(r["checkout"], r["path"], r["case"]) for r in results["rows"]} == {
        (c, p, s) for c in ("this", "baseline") for p in ("session", "http", "grpc", "grpc-stream")
        for s in ("sum 0.6 MB", "sum 4.8 MB", "neg 4.8 MB")}
    assert all(r["front_cpu_us"] > 0 and r["cpu_us"] > 0 for r in results["rows"] if r["path"] != "session")
    report = (tmp_path / "report.txt").read_text()
    assert "through `modelcache http`" in report and "through `modelcache grpc`" in report
    assert "through `modelcache grpc`'s ModelStreamInfer" in report
    assert all(v.startswith("answered 150000") for v in results["contained"].values()), results["contained"]


def test_fresh_pages_times_each_way_and_says_what_a_limit_did():
    r = subprocess.run([sys.executable, str(HERE / "fresh_pages.py"), "--mb", "2", "--runs", "1", "--limit-mb", "96"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for way in ("mapping", "fallocate+mapping", "populate+mapping", "pwrite"):
        assert any(line.split()[:1] == [way] and float(line.split()[1]) > 0 for line in r.stdout.splitlines()), r.stdout
    limited = r.stdout.split("MiB:", 1)[1].splitlines()[1:]
    assert len(limited) == 5 and all(any(w in line for w in ("killed by", "filled", "error", "not run"))
                                     for line in limited), r.stdout


def test_output_ways_times_each_way_to_write_and_read_a_lent_file():
    r = subprocess.run([sys.executable, str(HERE / "output_ways.py"), "--mb", "0.5", "--runs", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    timed = {line.rsplit(None, 2)[0].strip(): float(line.split()[-2]) for line in r.stdout.splitlines()
             if line.startswith("  ")}
    assert set(timed) == {"daemon: pwrite", "daemon: mapping", "daemon: populated", "client: mapping + sum",
                          "client: pread + sum", "client: inline (one copy) + sum", "client: sum only"}, r.stdout
    assert all(t > 0 for t in timed.values()), r.stdout


def test_stream_answer_writes_the_same_message_both_ways_and_times_them():
    r = subprocess.run([sys.executable, str(HERE / "stream_answer.py"), "--mb", "0.5", "--runs", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    line = r.stdout.splitlines()[-1].split()
    assert line[:2] == ["0.5", "MB:"] and line[2] == "whole" and line[5] == "written", r.stdout
    assert float(line[3]) > 0 and float(line[6]) > 0, r.stdout
