"""benchmarks/tritonmetrics/compare.py: Triton's page beside modelcache's, where Triton's peer is built."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.systems.triton import peer_paths

RUN = Path(__file__).resolve().parents[1] / "tritonmetrics" / "compare.py"


@pytest.mark.skipif(peer_paths() is None, reason="the Triton peer is not built (../shared/peers/triton-native)")
def test_both_pages_print_the_same_families_and_counts(tmp_path):
    r = subprocess.run([sys.executable, str(RUN), "--requests", "6", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = (tmp_path / "report.txt").read_text()
    assert "every count agrees" in report and "nv_inference_request_success" in report
    assert "# TYPE nv_inference_count counter" in (tmp_path / "modelcache.txt").read_text()
    assert "# TYPE nv_inference_count counter" in (tmp_path / "triton.txt").read_text()
