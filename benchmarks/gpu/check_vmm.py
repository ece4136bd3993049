"""Read-only GPU sharing (issue #36, step 2) checked on a real GPU, with no onnxruntime: what the fake can't show.

    python3 benchmarks/gpu/check_vmm.py --out DIR [--mib 256] [--runs 5] [--budget-s 240]

Writes DIR/check_vmm.json; exits 0 when it ran (whatever it found: see "ok" and each part's verdict), 2 when
it could not (no GPU, no cupy, no libcuda: the file says why). Needs cupy (the image's cupy-cuda13x) and the
driver; modelcache's own ctypes binding (modelcache/cuda.py, CudaDriver) does the VMM calls, as the daemon
(tiers/gpu.py, CudaVmmAllocator) and the client (client/device.py) do, so this checks the shipped code.

The parent plays the daemon: cuMemCreate (POSIX-fd handles, granularity-rounded), its own read-write mapping,
the bytes copied in, cuMemExportToShareableHandle. Each child is a fresh process that gets the descriptor over a
Unix socket (SCM_RIGHTS, as the lane passes it) and maps it read-only. Parts:
  read_only_map   a child maps it read-only and reads bit-identical bytes (sha256 of the whole range)
  write_attempts  a child's cuMemcpyHtoD into the read-only range, and a cupy kernel writing it, each in a
                  child of its own (a failed kernel poisons its context): refused, and how; the parent's
                  bytes after each (intact?)
  attach          import+map (VMM) against cudaIpcOpenMemHandle (legacy IPC, a cudaMalloc of the same size),
                  median of --runs fresh processes each, interleaved; and each child's device memory: what
                  cuMemGetInfo's free drops by while the child holds its mapping, and nvidia-smi's figure
  killed_child    a child holds a mapping; the parent frees everything (unmap, cuMemRelease, close): the memory
                  stays in use; the child is SIGKILLed: it returns (cuMemGetInfo)
"""

from __future__ import annotations

import argparse
import array
import hashlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent.parent          # the repository: modelcache imports from here
RESULT_NAME = "check_vmm.json"
CHILD_TIMEOUT_S = 90


# -- pure parts (tested here: benchmarks/tests/test_check_vmm.py) --------------------------------------------

def summary(xs: list) -> dict:
    """Median and spread of samples (None where there are none)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {"n": len(xs), "median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def ratio(a, b):
    return None if a is None or not b else a / b


def write_verdict(attempt: dict, intact: bool | None) -> dict:
    """A write attempt's outcome: refused (the call failed, or the bytes did not change) and the weights intact."""
    attempt = dict(attempt)
    attempt["weights_intact"] = intact
    failed = attempt.get("rc", 0) not in (0, None) or attempt.get("error") is not None or attempt.get("died")
    attempt["refused"] = bool(failed or intact)
    attempt["ok"] = bool(attempt["refused"] and intact)
    return attempt


def attach_verdict(vmm: dict, ipc: dict, device_slack_bytes: int) -> dict:
    """VMM attach against legacy IPC's: time as a ratio of medians; device memory per child, equal within
    `device_slack_bytes` (a granule or two of rounding, and the drift of other processes)."""
    t_vmm, t_ipc = vmm["attach_ms"]["median"], ipc["attach_ms"]["median"]
    m_vmm, m_ipc = vmm["device_bytes"]["median"], ipc["device_bytes"]["median"]
    out = {"attach_ms_ratio_vmm_to_ipc": ratio(t_vmm, t_ipc),
           "device_bytes_difference": None if m_vmm is None or m_ipc is None else m_vmm - m_ipc}
    out["device_memory_equal"] = out["device_bytes_difference"] is not None and \
        abs(out["device_bytes_difference"]) <= device_slack_bytes
    return out


def killed_verdict(free_start: int, free_held: int, free_after_kill: int, size: int, slack: int) -> dict:
    """The memory of a freed allocation that a (then killed) child mapped: held while the child lives, back after."""
    return {"free_start_bytes": free_start, "free_after_daemon_free_bytes": free_held,
            "free_after_kill_bytes": free_after_kill,
            "held_while_child_lives": free_start - free_held >= size - slack,
            "reclaimed_after_kill": free_start - free_after_kill <= slack}


def could_not_run(out_dir: Path, why: str, **extra) -> int:
    write_result(out_dir, {"check": "vmm", "ran": False, "ok": False, "why": why, **extra})
    print(f"check_vmm: could not run: {why}", file=sys.stderr)
    return 2


def write_result(out_dir: Path, result: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RESULT_NAME
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    tmp.replace(path)
    return path


def send_fd(sock: socket.socket, fd: int) -> None:
    sock.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


def recv_fd(sock: socket.socket) -> int:
    _, ancdata, _, _ = sock.recvmsg(1, socket.CMSG_SPACE(4))
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            return array.array("i", data[:4])[0]
    raise RuntimeError("no descriptor came")


# -- the GPU side --------------------------------------------------------------------------------------------

def _sha256_device(cupy, ptr: int, nbytes: int) -> str:
    host = bytearray(nbytes)
    import ctypes
    buf = (ctypes.c_char * nbytes).from_buffer(host)
    cupy.cuda.runtime.memcpy(ctypes.addressof(buf), ptr, nbytes, cupy.cuda.runtime.memcpyDeviceToHost)
    del buf
    return hashlib.sha256(host).hexdigest()


def _nvidia_smi_used(pid: int) -> int | None:
    """nvidia-smi's device memory of process `pid`, bytes (None where it does not list it)."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in r.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid) and parts[1].isdigit():
            return int(parts[1]) << 20
    return None


def child_main(args) -> int:
    """One fresh process: attach as a client does, report one JSON line, then do what the mode says."""
    t_start = time.perf_counter()
    import cupy
    from modelcache.cuda import CudaDriver
    t_import = time.perf_counter()
    cupy.cuda.Device(0).use()
    cupy.cuda.runtime.free(0)                      # the context, as a client's first CUDA call makes it
    t_context = time.perf_counter()
    out = {"mode": args.child, "import_ms": (t_import - t_start) * 1e3, "context_ms": (t_context - t_import) * 1e3}
    size = args.size
    if args.child == "ipc":
        t0 = time.perf_counter()
        ptr = cupy.cuda.runtime.ipcOpenMemHandle(bytes.fromhex(args.ipc_handle))
        out["attach_ms"] = (time.perf_counter() - t0) * 1e3
    else:
        sock = socket.socket(fileno=args.sock_fd)
        fd = recv_fd(sock)
        driver = CudaDriver()
        t0 = time.perf_counter()
        imported = driver.import_fd(fd)
        ptr = driver.map(imported, size, 0, read_only=True)
        driver.release(imported)
        out["attach_ms"] = (time.perf_counter() - t0) * 1e3
        os.close(fd)                               # the mapping holds the memory
    out["sha256"] = _sha256_device(cupy, ptr, size)
    if args.child == "write-memcpy":
        import ctypes
        lib = driver._lib
        lib.cuMemcpyHtoD_v2.argtypes = [ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_size_t]
        lib.cuMemcpyHtoD_v2.restype = ctypes.c_int
        junk = ctypes.create_string_buffer(b"\x5a" * 4096, 4096)
        rc = lib.cuMemcpyHtoD_v2(ptr, junk, 4096)
        sync = cupy.cuda.runtime.deviceSynchronize
        try:
            sync()
            sync_error = None
        except Exception as e:
            sync_error = f"{type(e).__name__}: {e}"
        name = ctypes.c_char_p()
        lib.cuGetErrorName(rc, ctypes.byref(name))
        out["write"] = {"call": "cuMemcpyHtoD_v2", "rc": rc, "name": (name.value or b"").decode(),
                        "sync_error": sync_error}
    elif args.child == "write-kernel":
        arr = cupy.ndarray((4096,), cupy.uint8, cupy.cuda.MemoryPointer(
            cupy.cuda.UnownedMemory(ptr, size, owner=None), 0))
        try:
            arr.fill(0x5A)
            cupy.cuda.runtime.deviceSynchronize()
            out["write"] = {"call": "cupy fill kernel", "error": None}
        except Exception as e:
            out["write"] = {"call": "cupy fill kernel", "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out), flush=True)
    sys.stdin.readline()                           # held until the parent has measured (or kills us)
    return 0


class Parent:
    """The daemon's side: one VMM allocation (and one cudaMalloc for the legacy comparison), the children."""

    def __init__(self, args, cupy, driver):
        self.args, self.cupy, self.driver = args, cupy, driver
        self.rt = cupy.cuda.runtime
        self.granularity = driver.granularity(0)
        self.size = -(-(args.mib << 20) // self.granularity) * self.granularity
        self.deadline = time.monotonic() + args.budget_s

    def free_bytes(self) -> int:
        self.rt.deviceSynchronize()
        return int(self.rt.memGetInfo()[0])

    def allocate_vmm(self, data: bytes) -> tuple[int, int, int]:
        handle = self.driver.create(self.size, 0)
        va = self.driver.map(handle, self.size, 0, read_only=False)
        self.rt.memcpy(va, _host_ptr(data), self.size, self.rt.memcpyHostToDevice)
        fd = self.driver.export_fd(handle)
        return handle, va, fd

    def free_vmm(self, handle: int, va: int, fd: int) -> None:
        os.close(fd)
        self.driver.unmap(va, self.size)
        self.driver.release(handle)

    def child(self, mode: str, fd: int = -1, ipc_handle: bytes = b""):
        """Start a child, give it the descriptor; (process, its report, free bytes while it holds the mapping)."""
        if time.monotonic() > self.deadline:
            raise TimeoutError(f"the check's budget ({self.args.budget_s:g} s) is spent")
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        argv = [sys.executable, str(HERE), "--child", mode, "--size", str(self.size),
                "--sock-fd", str(child_end.fileno())]
        if ipc_handle:
            argv += ["--ipc-handle", ipc_handle.hex()]
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, pass_fds=[child_end.fileno()])
        child_end.close()
        try:
            if fd >= 0:
                send_fd(parent_end, fd)
            line = _readline(proc, CHILD_TIMEOUT_S)
        finally:
            parent_end.close()
        if not line:
            proc.kill()
            _, err = proc.communicate(timeout=30)
            return proc, {"died": True, "rc": proc.returncode, "stderr": err[-2000:]}, None
        report = json.loads(line)
        report["nvidia_smi_bytes"] = _nvidia_smi_used(proc.pid)
        return proc, report, self.free_bytes()

    @staticmethod
    def finish(proc) -> None:
        """Let a child that holds its mapping go (one that died is only reaped)."""
        if proc.poll() is not None:
            return
        try:
            proc.stdin.write("\n")
            proc.stdin.flush()
            proc.wait(30)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()


def _host_ptr(data: bytes) -> int:
    import ctypes
    return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value


def _readline(proc, timeout_s: float) -> str:
    import select
    r, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline() if r else ""


def parent_main(args) -> int:
    out_dir = Path(args.out)
    sys.path.insert(0, str(ROOT))
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:   # ImportError, CUDARuntimeError
        return could_not_run(out_dir, f"no GPU through cupy: {type(e).__name__}: {e}")
    try:
        from modelcache.cuda import (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                                     CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, CudaDriver)
        driver = CudaDriver()
    except Exception as e:   # DeviceError: no libcuda
        return could_not_run(out_dir, f"no CUDA driver: {type(e).__name__}: {e}")
    props = cupy.cuda.runtime.getDeviceProperties(0)
    result = {"check": "vmm", "ran": True, "ok": False, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "device": {"name": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
                         "driver_version": cupy.cuda.runtime.driverGetVersion(),
                         "runtime_version": cupy.cuda.runtime.runtimeGetVersion()},
              "vmm_supported": driver.attribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0),
              "posix_fd_supported":
                  driver.attribute(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, 0),
              "errors": []}
    write_result(out_dir, result)
    if not (result["vmm_supported"] and result["posix_fd_supported"]):
        result["why"] = "the device refuses VMM or POSIX fd handles: modelcache falls back to legacy IPC there"
        write_result(out_dir, result)
        return 0
    cupy.cuda.Device(0).use()
    p = Parent(args, cupy, driver)
    result.update(granularity_bytes=p.granularity, size_bytes=p.size, runs=args.runs)
    data = os.urandom(p.size)
    want = hashlib.sha256(data).hexdigest()
    parts = (("read_only_map", _read_only_map), ("write_attempts", _write_attempts), ("attach", _attach),
             ("killed_child", _killed_child))
    for name, part in parts:
        try:
            result[name] = part(p, data, want)
        except Exception as e:   # each part on its own: the next may still run
            result["errors"].append(f"{name}: {type(e).__name__}: {e}")
        write_result(out_dir, result)   # after every part: a timeout still leaves what ran
    result["ok"] = all(result.get(name, {}).get("ok") for name, _ in parts)
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write_result(out_dir, result)
    print(json.dumps({k: result.get(k) for k in ("ok", "device", "errors")}))
    return 0


def _read_only_map(p: Parent, data: bytes, want: str) -> dict:
    handle, va, fd = p.allocate_vmm(data)
    try:
        proc, report, _ = p.child("vmm", fd)
        p.finish(proc)
    finally:
        p.free_vmm(handle, va, fd)
    return {"child": report, "bit_identical": report.get("sha256") == want,
            "ok": report.get("sha256") == want}


def _write_attempts(p: Parent, data: bytes, want: str) -> dict:
    out = {}
    handle, va, fd = p.allocate_vmm(data)
    try:
        for mode in ("write-memcpy", "write-kernel"):
            proc, report, _ = p.child(mode, fd)
            p.finish(proc)
            intact = _sha256_device(p.cupy, va, p.size) == want
            out[mode] = write_verdict({**report.get("write", {}), "died": report.get("died"),
                                       "child_rc": report.get("rc", proc.returncode),   # -11: SIGSEGV
                                       "child_stderr": report.get("stderr"),
                                       "read_before": report.get("sha256") == want}, intact)
    finally:
        p.free_vmm(handle, va, fd)
    out["ok"] = all(v["ok"] for v in out.values())
    return out


def _attach(p: Parent, data: bytes, want: str) -> dict:
    samples = {"vmm": [], "ipc": []}
    handle, va, fd = p.allocate_vmm(data)
    legacy = p.rt.malloc(p.size)
    try:
        p.rt.memcpy(legacy, _host_ptr(data), p.size, p.rt.memcpyHostToDevice)
        ipc_handle = bytes(p.rt.ipcGetMemHandle(legacy))
        for _ in range(p.args.runs):              # interleaved: drift hits both alike
            for kind in ("vmm", "ipc"):
                before = p.free_bytes()
                proc, report, held = p.child(kind, fd if kind == "vmm" else -1, ipc_handle if kind == "ipc" else b"")
                p.finish(proc)
                report["device_bytes"] = None if held is None else before - held
                report["bit_identical"] = report.get("sha256") == want
                samples[kind].append(report)
    finally:
        p.rt.free(legacy)
        p.free_vmm(handle, va, fd)
    out = {kind: {"attach_ms": summary([r.get("attach_ms") for r in rs]),
                  "context_ms": summary([r.get("context_ms") for r in rs]),
                  "device_bytes": summary([r.get("device_bytes") for r in rs]),
                  "nvidia_smi_bytes": summary([r.get("nvidia_smi_bytes") for r in rs]),
                  "all_bit_identical": all(r.get("bit_identical") for r in rs), "samples": rs}
           for kind, rs in samples.items()}
    out.update(attach_verdict(out["vmm"], out["ipc"], device_slack_bytes=4 * p.granularity + (32 << 20)))
    out["ok"] = out["device_memory_equal"] and out["vmm"]["all_bit_identical"] and out["ipc"]["all_bit_identical"]
    return out


def _killed_child(p: Parent, data: bytes, want: str) -> dict:
    free_start = p.free_bytes()
    handle, va, fd = p.allocate_vmm(data)
    proc, report, _ = p.child("vmm", fd)
    p.free_vmm(handle, va, fd)                    # the daemon frees: the child's mapping keeps the memory
    free_held = p.free_bytes()
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    deadline = time.monotonic() + 10              # the driver reclaims a dead process's memory soon, not at once
    free_after = p.free_bytes()
    while free_start - free_after > p.granularity and time.monotonic() < deadline:
        time.sleep(0.1)
        free_after = p.free_bytes()
    out = killed_verdict(free_start, free_held, free_after, p.size, slack=2 * p.granularity)
    out["child_read_bit_identical"] = report.get("sha256") == want
    out["ok"] = out["held_while_child_lives"] and out["reclaimed_after_kill"] and out["child_read_bit_identical"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="directory for check_vmm.json (required, except in a child)")
    ap.add_argument("--mib", type=int, default=256, help="size of the shared allocation (rounded to the granularity)")
    ap.add_argument("--runs", type=int, default=5, help="fresh processes per attach mode (median kept)")
    ap.add_argument("--budget-s", type=float, default=240.0, help="no child starts after this long")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--sock-fd", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--ipc-handle", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        sys.path.insert(0, str(ROOT))
        return child_main(args)
    if not args.out:
        ap.error("--out DIR is required")
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
