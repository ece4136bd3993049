"""benchmarks/repoload/run.py on tiny-cnn, one round: the real daemon (and Triton where its peer is built)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.systems.triton import peer_paths

RUN = Path(__file__).resolve().parents[1] / "repoload" / "run.py"


def test_every_load_answers_on_every_system(tmp_path):
    r = subprocess.run([sys.executable, str(RUN), "--model", "tiny-cnn", "--rounds", "1", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())
    systems = {"modelcache"} | ({"triton"} if peer_paths() else set())
    assert {(row["system"], row["step"]) for row in rows} == \
        {(s, step) for s in systems for step in ("new", "unchanged", "reload", "override", "files")}
    for row in rows:
        assert row["load_s"] > 0 and row["first_ms"] > 0, row
    report = (tmp_path / "report.txt").read_text()
    assert report.startswith("$ python benchmarks/repoload/run.py --model tiny-cnn") and "first request ms" in report


TRAFFIC = Path(__file__).resolve().parents[1] / "repoload" / "traffic.py"


def test_a_model_reloaded_under_traffic_loses_no_request(tmp_path):
    r = subprocess.run([sys.executable, str(TRAFFIC), "--rounds", "1", "--configs", "serial", "--clients", "2",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((tmp_path / "traffic.json").read_text())
    assert {row["system"] for row in rows} == {"modelcache"} | ({"triton"} if peer_paths() else set())
    for row in rows:
        assert row["failed"] == 0 and row["load_error"] is None and row["new"] > 0, row
    assert (tmp_path / "traffic.txt").read_text().startswith("$ python benchmarks/repoload/traffic.py --rounds 1")


WARM_PACKER = Path(__file__).resolve().parents[1] / "repoload" / "warm_packer.py"


def test_the_warm_packer_comparison_packs_every_way(tmp_path):
    r = subprocess.run([sys.executable, str(WARM_PACKER), "--models", "tiny-cnn", "--rounds", "1", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = json.loads((tmp_path / "warm_packer.json").read_text())
    assert {(p["model"], p["way"]) for p in results["packs"]} == {("tiny-cnn", w) for w in ("exec", "warm", "first")}
    assert all(p["s"] > 0 for p in results["packs"]) and results["server_memory"]["uss_mib"] > 1
    assert (tmp_path / "warm_packer.txt").read_text().startswith("$ python benchmarks/repoload/warm_packer.py --models")
