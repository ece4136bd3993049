"""The placement check's bookkeeping (benchmarks/placement/check): other processes' load per phase, rows
measured again when disturbed."""

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.placement.check import cpuload
from benchmarks.placement.check.run import quietest, report

COMMITTED = Path(__file__).resolve().parents[1] / "placement/check/results.json"


def test_cpu_load_is_split_into_own_other_and_steal():
    got = cpuload.load(2.0, busy_s=3.0, own_s=2.0, steal_s=0.2, children_s=1.5)
    assert got == pytest.approx({"seconds": 2.0, "busy": 1.5, "own": 1.0, "daemon": 0.75, "other": 0.5, "steal": 0.1})
    assert cpuload.load(1.0, busy_s=1.0, own_s=1.01, steal_s=0.0)["other"] == 0.0   # counters tick apart
    assert cpuload.load(0.0, 1.0, 1.0, 1.0)["busy"] == 0.0


def test_meter_reads_this_process():
    with cpuload.Meter() as m:
        sum(i * i for i in range(200000))
    assert m.result["seconds"] > 0 and m.result["own"] > 0


def row(other, n):
    return {"model": "m", "workers": ["cpu-0"], "kind": "cpu2", "stages": 2, "n": n, "other_cores": other,
            "latency_ms": {"measured": 10.0, "simulated_profile": 10.0, "simulated_solo": 10.0},
            "throughput_per_s": {"measured": 1.0, "simulated_profile": 1.0, "simulated_solo": 1.0,
                                 "simulated_loaded": 1.0},
            "latency_error_profile": 0.0, "latency_error_solo": 0.0, "throughput_error_profile": 0.0,
            "throughput_error_solo": 0.0, "throughput_error_loaded": 0.0, "load_average": (1.0, 1.0, 1.0),
            "cpu": {p: {"other": other, "steal": 0.0} for p in ("profile", "solo", "load")}}


def test_a_disturbed_row_is_measured_again_and_the_quietest_kept(capsys):
    others = iter([0.5, 0.3, 0.05])
    args = SimpleNamespace(max_other=0.1, retries=1)
    got = quietest(lambda: row(next(others), 0), args)
    assert got["other_cores"] == 0.3 and got["attempts"] == 2 and got["chosen"] == 2
    assert [r["other_cores"] for r in got["other_attempts"]] == [0.5]
    quiet = quietest(lambda: row(0.02, 0), args)
    assert quiet["attempts"] == 1 and "other_attempts" not in quiet
    printed = capsys.readouterr().out
    assert printed.count("again: ") == 1 and printed.count("other cores: profile 0.50") == 1
    assert "attempt 2 of 2" in report_of(got)


def report_of(r):
    out = io.StringIO()
    report({"rows": [r]}, out)
    return out.getvalue()


def test_report_reads_rows_with_and_without_cpu_figures():
    out = io.StringIO()
    report({"rows": [row(0.02, 0)], "load_average_at_start": 0.4, "max_other": 0.1, "retries": 1}, out)
    text = out.getvalue()
    assert "load average 0.40 at start" in text and "other cores: profile 0.02" in text
    assert "within 10 %: 2 of 2" in text
    if COMMITTED.exists():           # a report written before the figures existed
        out = io.StringIO()
        report(json.loads(COMMITTED.read_text()), out)
        assert "within 10 %" in out.getvalue()


def test_speed_drift_is_the_daemons_stage_runs_against_the_profiles():
    from benchmarks.placement.check.run import line, speed_drift
    r = row(0.0, 0)
    assert speed_drift(r) is None
    r["stage_s"] = {"profiled": [0.020, 0.030], "served_solo": [0.025, 0.030], "served_loaded": [0.020, 0.025]}
    assert speed_drift(r) == pytest.approx((0.1, -0.1))
    assert "stage runs vs the profile: solo +10.0 %, load -10.0 %" in line(r)
    r["stage_s"]["served_loaded"] = [None, 0.03]
    assert speed_drift(r) is None


def test_a_row_interleaves_profile_solo_and_load_and_reports_every_source(tmp_path, capsys):
    """The whole check on a tiny model (a real daemon, real profiles): every row carries the figures of
    each source the report names, its phases merged over the rounds."""
    from benchmarks.placement.check.run import main

    out = tmp_path / "check"
    assert main(["--models", "tiny-vit", "--workers", "1,1", "--stages", "2", "--requests", "4", "--seconds", "1",
                 "--profile-s", "0.2", "--rounds", "2", "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    rows = data.get("data", data)["rows"]
    assert len(rows) >= 1
    r = rows[0]
    assert r["rounds"] == 2 and len(r["latency_ms"]["samples_ms"]) == 4
    assert r["throughput_per_s"]["answered"] == r["throughput_per_s"]["requests"] > 0
    for key in ("profile", "profile_here", "solo", "loaded"):
        assert r["throughput_per_s"][f"simulated_{key}"] > 0
    assert all(r["cpu"][phase]["seconds"] > 0 for phase in ("profile", "solo", "load"))
    assert set(r["wake_ms"]) == {"profile", "profile_here"}     # the cold runs of both profiles
    text = (out / "report.txt").read_text()
    assert "the profile on the daemon's workers" in text and "the profile in this process" in text


def test_phases_merge_weighted_by_their_seconds():
    from benchmarks.placement.check.run import merged
    m = merged([{"seconds": 1.0, "other": 0.3, "steal": 0.0}, {"seconds": 3.0, "other": 0.1, "steal": 0.4}])
    assert m == pytest.approx({"seconds": 4.0, "other": 0.15, "steal": 0.3})
