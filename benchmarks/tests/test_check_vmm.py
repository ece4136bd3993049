"""benchmarks/gpu/check_vmm.py here, without a GPU: its verdicts, the descriptor passing its children use, its
lease part rehearsed over fake devices (a real daemon under gpu_sharing = "vmm-read-only", a real client
process whose write is killed), and without --rehearse the contract's "could not run". Run from the repository
root: PYTHONPATH=. python -m pytest -q benchmarks/tests/test_check_vmm.py"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from benchmarks.gpu import check_vmm

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "benchmarks" / "gpu" / "check_vmm.py"


def test_summary():
    assert check_vmm.summary([3.0, 1.0, None, 2.0]) == {"n": 3, "median": 2.0, "min": 1.0, "max": 3.0}
    assert check_vmm.summary([None]) == {"n": 0, "median": None, "min": None, "max": None}


def test_a_write_counts_as_refused_only_if_it_failed_or_changed_nothing():
    failed = check_vmm.write_verdict({"call": "cuMemcpyHtoD_v2", "rc": 1}, intact=True)
    assert failed["refused"] and failed["ok"]
    silent = check_vmm.write_verdict({"call": "cuMemcpyHtoD_v2", "rc": 0}, intact=True)   # no error, no change
    assert silent["refused"] and silent["ok"]
    landed = check_vmm.write_verdict({"call": "cupy fill kernel", "error": None}, intact=False)
    assert not landed["refused"] and not landed["ok"]
    errored_but_wrote = check_vmm.write_verdict({"call": "cupy fill kernel", "error": "IllegalAddress"}, intact=False)
    assert errored_but_wrote["refused"] and not errored_but_wrote["ok"]
    died = check_vmm.write_verdict({"died": True, "rc": -11}, intact=None)
    assert died["refused"] and not died["ok"]             # a child that died proves nothing about the bytes


def test_a_killed_child_must_hold_the_memory_then_give_it_back():
    size, slack, start = 64 << 20, 4 << 20, 10 << 30
    good = check_vmm.killed_verdict(start, start - size, start - (1 << 20), size, slack)
    assert good["held_while_child_lives"] and good["reclaimed_after_kill"] and good["free_start_mib"] == 10240.0
    freed_early = check_vmm.killed_verdict(start, start, start, size, slack)
    assert not freed_early["held_while_child_lives"]
    leaked = check_vmm.killed_verdict(start, start - size, start - size, size, slack)
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


def run_check(tmp_path, *args):
    proc = subprocess.run([sys.executable, str(CHECK), "--out", str(tmp_path), *args], capture_output=True,
                          text=True, timeout=240, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    [path] = [p for p in tmp_path.iterdir() if p.suffix == ".json"]
    assert path.name == "check_vmm.json"
    return proc, json.loads(path.read_text())


def test_the_lease_part_rehearses_over_fake_devices(tmp_path):
    proc, result = run_check(tmp_path, "--rehearse")
    assert proc.returncode == 0 and result["status"] == "ok", proc.stdout + proc.stderr + json.dumps(result)
    f = result["figures"]
    assert f["rehearsal"] and f["lease_sharing"] == "vmm-read-only" and f["lease_kind"] == "fake-vmm"
    assert f["lease_bytes_identical"] and f["lease_count"] == 1
    assert f["lease_write"]["died"] and f["lease_write"]["rc"] == -11 and f["lease_write_refused"]   # SIGSEGV
    assert "write_refused" not in f and result["notes"] == ["rehearsal: the raw part needs a GPU and was not run"]


def test_without_a_gpu_it_could_not_run_and_says_why(tmp_path):
    proc, result = run_check(tmp_path)
    assert proc.returncode == 2 and result["status"] == "error", proc.stdout + proc.stderr
    assert result["error"].startswith("CannotRun: no GPU here (cupy and the CUDA driver are both needed)"), result
