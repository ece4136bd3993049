"""`modelcache place` end to end on a packed zoo model: describe, search, plan file, pictures, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modelcache.cli import main
from modelcache.store.packing import pack

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "systems"


@pytest.fixture
def repo(tmp_path, zoo_file):
    pack(zoo_file("tiny-cnn"), tmp_path / "repo", "cnn", 1)
    return tmp_path / "repo"


def test_describe_writes_a_system_that_place_reads(tmp_path, repo, capsys):
    assert main(["place", "--describe", "--workers", "1,1", "-o", str(tmp_path / "here.toml")]) == 0
    text = (tmp_path / "here.toml").read_text()
    assert "[kinds.cpu1]" in text and 'name = "cpu-1"' in text
    plan = tmp_path / "cnn.plan.json"
    assert main(["place", "cnn", "--repository", str(repo), "--system", str(tmp_path / "here.toml"),
                 "--time-budget", "5", "-o", str(plan)]) == 0
    data = json.loads(plan.read_text())
    assert data["model"] == "cnn@1" and data["stages"][0]["start"] == 0
    assert all(name in ("cpu-0", "cpu-1") for s in data["stages"] for name in s["worker_names"])
    assert "measured" in data["cost_source"]["cpu1"]


@pytest.mark.parametrize("system", sorted(p.name for p in EXAMPLES.glob("*.toml")))
def test_example_systems_give_a_plan_no_worse_than_any_baseline(system, tmp_path, repo, capsys):
    out = tmp_path / "plan.json"
    assert main(["place", "cnn", "--repository", str(repo), "--system", str(EXAMPLES / system), "--batch", "4",
                 "--time-budget", "10", "-o", str(out), "--plots", str(tmp_path / "plots")]) == 0
    rows = json.loads(out.read_text())["report"]["rows"]
    plan, baselines = rows[0], rows[1:]
    assert {b["method"].split()[0] for b in baselines} == {"half-split", "tail", "fastest", "greedy"}
    assert all(plan["latency_s"] <= b["latency_s"] * (1 + 1e-9) for b in baselines)
    assert "modelled" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["cnn-gantt.png", "cnn-vs-baselines.png"]


def test_bad_input_is_a_clear_error(tmp_path, repo, capsys):
    (tmp_path / "bad.toml").write_text("[kinds.x]\nconv_gflop_s = 1\n")
    assert main(["place", "cnn", "--repository", str(repo), "--system", str(tmp_path / "bad.toml")]) == 1
    assert "kinds.x: missing matmul_gflop_s" in capsys.readouterr().err
    assert main(["place", "nope", "--repository", str(repo), "--system", str(EXAMPLES / "mars-8acc.toml")]) == 1
    assert "no nope in the repository" in capsys.readouterr().err
