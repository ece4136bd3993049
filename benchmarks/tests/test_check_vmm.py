"""benchmarks/gpu/check_vmm.py's parts that need no GPU: the verdicts, the descriptor passing its children use,
the result file, and that without a GPU it says so in that file and exits nonzero. Run from the repository root:
PYTHONPATH=. python -m pytest -q benchmarks/tests/test_check_vmm.py"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from benchmarks.gpu import check_vmm

ROOT = Path(__file__).resolve().parents[2]


def test_summary_and_ratio():
    assert check_vmm.summary([3.0, 1.0, None, 2.0]) == {"n": 3, "median": 2.0, "min": 1.0, "max": 3.0}
    assert check_vmm.summary([None]) == {"n": 0, "median": None, "min": None, "max": None}
    assert check_vmm.ratio(3.0, 2.0) == 1.5 and check_vmm.ratio(None, 2.0) is None and check_vmm.ratio(1.0, 0) is None


def test_a_write_counts_as_refused_only_if_it_failed_or_changed_nothing():
    failed = check_vmm.write_verdict({"call": "cuMemcpyHtoD_v2", "rc": 1}, intact=True)
    assert failed["refused"] and failed["ok"]
    silent = check_vmm.write_verdict({"call": "cuMemcpyHtoD_v2", "rc": 0}, intact=True)   # no error, no change
    assert silent["refused"] and silent["ok"]
    landed = check_vmm.write_verdict({"call": "cupy fill kernel", "error": None}, intact=False)
    assert not landed["refused"] and not landed["ok"]
    errored_but_wrote = check_vmm.write_verdict({"call": "cupy fill kernel", "error": "IllegalAddress"}, intact=False)
    assert errored_but_wrote["refused"] and not errored_but_wrote["ok"]
    died = check_vmm.write_verdict({"died": True}, intact=None)
    assert died["refused"] and not died["ok"]             # a child that died proves nothing about the bytes


def test_attach_compares_medians_and_device_memory_within_slack():
    def side(ms, mem):
        return {"attach_ms": check_vmm.summary(ms), "device_bytes": check_vmm.summary(mem)}
    v = check_vmm.attach_verdict(side([2.0, 4.0, 3.0], [600 << 20] * 3), side([1.0, 2.0, 1.5], [590 << 20] * 3),
                                 device_slack_bytes=16 << 20)
    assert v["attach_ms_ratio_vmm_to_ipc"] == 2.0 and v["device_bytes_difference"] == 10 << 20
    assert v["device_memory_equal"]
    v = check_vmm.attach_verdict(side([1.0], [900 << 20]), side([1.0], [600 << 20]), device_slack_bytes=16 << 20)
    assert not v["device_memory_equal"]
    v = check_vmm.attach_verdict(side([1.0], [None]), side([1.0], [600 << 20]), device_slack_bytes=16 << 20)
    assert v["device_bytes_difference"] is None and not v["device_memory_equal"]


def test_a_killed_child_must_hold_the_memory_then_give_it_back():
    size, slack = 256 << 20, 4 << 20
    good = check_vmm.killed_verdict(10 << 30, (10 << 30) - size, (10 << 30) - (1 << 20), size, slack)
    assert good["held_while_child_lives"] and good["reclaimed_after_kill"]
    freed_early = check_vmm.killed_verdict(10 << 30, 10 << 30, 10 << 30, size, slack)
    assert not freed_early["held_while_child_lives"]
    leaked = check_vmm.killed_verdict(10 << 30, (10 << 30) - size, (10 << 30) - size, size, slack)
    assert not leaked["reclaimed_after_kill"]


def test_a_descriptor_passes_to_the_child_as_the_lane_passes_it():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = os.memfd_create("check-vmm-test")
    os.write(fd, b"weights")
    try:
        check_vmm.send_fd(a, fd)
        got = check_vmm.recv_fd(b)
        assert got != fd and os.pread(got, 7, 0) == b"weights"
        os.close(got)
    finally:
        os.close(fd)
        a.close()
        b.close()


def test_without_a_gpu_it_writes_why_and_exits_nonzero(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "check_vmm.py"), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [path] = (tmp_path / "out").iterdir()
    result = json.loads(path.read_text())
    assert path.name == "check_vmm.json" and result["ran"] is False and result["ok"] is False
    assert result["why"].startswith(("no GPU through cupy", "no CUDA driver")), result
    assert "could not run" in proc.stderr


def test_it_needs_an_output_directory():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "check_vmm.py")], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "--out DIR is required" in proc.stderr
