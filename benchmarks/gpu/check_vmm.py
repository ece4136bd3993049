"""Read-only GPU sharing (issue #36 step 2, gpu_sharing = "vmm-read-only") on the GPU, with no onnxruntime-gpu.

    python3 benchmarks/gpu/check_vmm.py --out DIR [--rehearse]     (checks.py runs it; the contract is there)

Two parts, each in fresh child processes that get their descriptors over a Unix socket (SCM_RIGHTS):

lease (the product's path; rehearsed here over fake devices): a private daemon with gpu_sharing =
  "vmm-read-only" adds a small model and lends it; a child opens it on the lane (client/leases.py) and maps
  it with the client's own code (client/device.py HandleCache: cuMemImportFromShareableHandle, cuMemMap,
  cuMemSetAccess PROT_READ), hashes every tensor, then writes into the first one. Figures: lease_sharing
  (the daemon's: "vmm-read-only", or the legacy fallback and why), lease_kind, lease_bytes_identical,
  lease_write_refused, lease_count.
raw (GPU only): the parent plays the daemon with modelcache's ctypes driver binding (cuda.py CudaDriver, as
  tiers/gpu/cuda_memory.py CudaVmmAllocator does): cuMemCreate of RAW_MIB, its own read-write mapping, the bytes copied
  in, cuMemExportToShareableHandle. Figures, by the keys targets.py reads:
    bytes_identical                    a child's read-only mapping reads the parent's bytes (sha256)
    write_refused, write_memcpy, write_kernel
                                       cuMemcpyHtoD into the read-only range, and a cupy kernel writing it,
                                       each in a child of its own (a failed kernel poisons its context): how
                                       each failed, and the parent's bytes after it (intact?)
    attach_ms_vmm, attach_ms_ipc       import+map against cudaIpcOpenMemHandle of a cudaMalloc of the same
                                       size: RUNS fresh processes each, interleaved (samples, ms)
    device_mib_vmm, device_mib_ipc     what cuMemGetInfo's free drops by while each child holds its mapping
                                       (its context included: the two should be equal); nvidia_smi_mib_*
    killed_client_mapping_released     a child holds a mapping, the parent frees everything (unmap,
                                       cuMemRelease, close): the memory stays in use; the child is
                                       SIGKILLed: it comes back (cuMemGetInfo)
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LIMIT_S = 60
RAW_MIB = 64
RUNS = 3
MODEL = "tiny-cnn"
CHILD_TIMEOUT_S = 30
HERE = Path(__file__).resolve()


# -- pure parts (tested here: benchmarks/tests/test_check_vmm.py) --------------------------------------------

def summary(xs: list) -> dict:
    """Median and spread of samples (None where there are none)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {"n": len(xs), "median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def write_verdict(attempt: dict, intact: bool | None) -> dict:
    """A write attempt's outcome: refused (the call failed, its child died, or nothing changed), and ok when
    refused with the weights intact."""
    attempt = dict(attempt)
    attempt["weights_intact"] = intact
    failed = attempt.get("rc", 0) not in (0, None) or attempt.get("error") is not None or attempt.get("died")
    attempt["refused"] = bool(failed or intact)
    attempt["ok"] = bool(attempt["refused"] and intact)
    return attempt


def killed_verdict(free_start: int, free_held: int, free_after_kill: int, size: int, slack: int) -> dict:
    """A freed allocation that a (then killed) child mapped: held while the child lives, back after it dies."""
    return {"free_start_mib": mib(free_start), "free_after_daemon_free_mib": mib(free_held),
            "free_after_kill_mib": mib(free_after_kill),
            "held_while_child_lives": free_start - free_held >= size - slack,
            "reclaimed_after_kill": free_start - free_after_kill <= slack}


def mib(nbytes) -> float | None:
    return None if nbytes is None else round(nbytes / 2**20, 1)


def send_fd(sock: socket.socket, fd: int) -> None:
    sock.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


def recv_fd(sock: socket.socket) -> int:
    _, ancdata, _, _ = sock.recvmsg(1, socket.CMSG_SPACE(4))
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            return array.array("i", data[:4])[0]
    raise RuntimeError("no descriptor came")


# -- children ------------------------------------------------------------------------------------------------

def _say(obj) -> None:
    print(json.dumps(obj), flush=True)


def _sha256_device(runtime, ptr: int, nbytes: int) -> str:
    buf = (ctypes.c_char * max(nbytes, 1))()
    if nbytes:
        runtime.memcpy(ctypes.addressof(buf), ptr, nbytes, runtime.memcpyDeviceToHost)
    return hashlib.sha256(bytes(buf)[:nbytes]).hexdigest()


def _kernel_write(ptr: int, nbytes: int) -> dict:
    """A cupy kernel writing device memory at `ptr`: what it raised, or None when it went through."""
    import cupy
    arr = cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, nbytes, None), 0))
    try:
        arr.fill(0x5A)
        cupy.cuda.runtime.deviceSynchronize()
        return {"call": "cupy fill kernel", "error": None}
    except Exception as e:   # cupy's CUDARuntimeError: cudaErrorIllegalAddress is the hope
        return {"call": "cupy fill kernel", "error": f"{type(e).__name__}: {e}"[:300]}


def child_lease(address: str, name: str, rehearse: str) -> None:
    """Open `name` on the GPU over the lane and map it as InferenceSession does; hash; then on 'write', write
    into the first tensor (its bytes are checked by another child: a failed kernel poisons this one's context)."""
    from modelcache.client.device import handle_cache
    from modelcache.client.leases import LeaseClient
    t0 = time.perf_counter()
    client = LeaseClient(address, 30.0)
    lease = client.open(name, device="cuda")
    fds = list(getattr(lease, "received_fds", []))
    t_open = time.perf_counter()
    fake = rehearse == "1"
    if fake:
        index, read = 0, lambda ptr, n: hashlib.sha256(ctypes.string_at(ptr, n)).hexdigest()
    else:
        from cupy.cuda import runtime
        from modelcache.tiers.gpu import probe
        index = next(d.index for d in probe() if d.uuid == lease.device_uuid)
        runtime.setDevice(index)
        read = lambda ptr, n: _sha256_device(runtime, ptr, n)   # noqa: E731
    bases = [handle_cache().acquire(lease.ipc_kind, h, index, fd) for h, fd in zip(lease.ipc_handles, fds)]
    t_map = time.perf_counter()
    _say({"kind": lease.ipc_kind, "fds": len(fds), "open_ms": (t_open - t0) * 1e3, "map_ms": (t_map - t_open) * 1e3,
          "sha256": {t.name: read(bases[t.index] + t.offset, t.nbytes) for t in lease.tensors}})
    if sys.stdin.readline().strip() != "write":
        return
    first = lease.tensors[0]
    if fake:
        ctypes.memset(bases[first.index] + first.offset, 0x5A, 1)   # a read-only mapping: SIGSEGV
        _say({"write": {"call": "memset", "error": None}})
    else:
        _say({"write": _kernel_write(bases[first.index] + first.offset, max(first.nbytes, 1))})
    sys.stdin.readline()


def child_raw(mode: str, size: str, sock_fd: str = "-1", ipc_handle: str = "") -> None:
    """A fresh process: attach (VMM: the descriptor from the socket; ipc: the handle), hash, report; in the write
    modes, on 'write', try to write and report how that went; then wait to be let go (or killed)."""
    t_start = time.perf_counter()
    import cupy
    from modelcache.cuda import CudaDriver
    t_import = time.perf_counter()
    size = int(size)
    cupy.cuda.Device(0).use()
    cupy.cuda.runtime.free(0)                  # the context, as a client's first CUDA call makes it
    t_context = time.perf_counter()
    out = {"mode": mode, "import_ms": (t_import - t_start) * 1e3, "context_ms": (t_context - t_import) * 1e3}
    if mode == "ipc":
        t0 = time.perf_counter()
        ptr = cupy.cuda.runtime.ipcOpenMemHandle(bytes.fromhex(ipc_handle))
        out["attach_ms"] = (time.perf_counter() - t0) * 1e3
    else:
        fd = recv_fd(socket.socket(fileno=int(sock_fd)))
        driver = CudaDriver()
        t0 = time.perf_counter()
        imported = driver.import_fd(fd)
        ptr = driver.map(imported, size, 0, read_only=True)
        driver.release(imported)
        out["attach_ms"] = (time.perf_counter() - t0) * 1e3
        os.close(fd)                           # the mapping holds the memory
    out["sha256"] = _sha256_device(cupy.cuda.runtime, ptr, size)
    _say(out)
    if not mode.startswith("write") or sys.stdin.readline().strip() != "write":
        sys.stdin.readline()
        return
    if mode == "write-memcpy":
        lib = driver._lib
        lib.cuMemcpyHtoD_v2.argtypes = [ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_size_t]
        lib.cuMemcpyHtoD_v2.restype = ctypes.c_int
        junk = ctypes.create_string_buffer(b"\x5a" * 4096, 4096)
        rc = lib.cuMemcpyHtoD_v2(ptr, junk, 4096)
        name = ctypes.c_char_p()
        lib.cuGetErrorName(rc, ctypes.byref(name))
        try:
            cupy.cuda.runtime.deviceSynchronize()
            sync_error = None
        except Exception as e:
            sync_error = f"{type(e).__name__}: {e}"[:300]
        _say({"write": {"call": "cuMemcpyHtoD_v2", "rc": rc, "name": (name.value or b"").decode(),
                        "sync_error": sync_error}})
    else:
        _say({"write": _kernel_write(ptr, 4096)})
    sys.stdin.readline()


def _child_class():
    """check_ipc.py's Child (tell, close, kill), started as a child of this script, given a descriptor over a
    socketpair (SCM_RIGHTS), and read so that a child that died is an answer (its write was refused so)."""
    from check_ipc import Child as IpcChild

    class Child(IpcChild):
        def __init__(self, *args: str, fd: int = -1):
            parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            extra = [str(child_end.fileno())] if fd >= 0 else []     # (its last argument: where the fd comes)
            self.proc = subprocess.Popen([sys.executable, str(HERE), "--child", *args, *extra],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True, pass_fds=[child_end.fileno()])
            child_end.close()
            try:
                if fd >= 0:
                    send_fd(parent_end, fd)
            finally:
                parent_end.close()

        def read(self, timeout_s: float = CHILD_TIMEOUT_S) -> dict | None:
            """Its next line; None when it died first (then `died` says how)."""
            import select
            if not select.select([self.proc.stdout], [], [], timeout_s)[0]:
                raise RuntimeError(f"child {self.proc.args[3:]} said nothing in {timeout_s:.0f} s")
            line = self.proc.stdout.readline()
            if line:
                return json.loads(line)
            self.proc.wait(10)
            self.died = {"died": True, "rc": self.proc.returncode, "stderr": self.proc.stderr.read().strip()[-800:]}
            return None

    return Child


# -- the parent ----------------------------------------------------------------------------------------------

def check(r) -> None:
    from checks import CannotRun
    Child = _child_class()
    if not r.rehearse:
        try:
            import cupy
            cupy.cuda.runtime.getDeviceCount()
            from modelcache.cuda import CudaDriver
            driver = CudaDriver()
        except Exception as e:   # ImportError, CUDARuntimeError, DeviceError (no libcuda)
            raise CannotRun(f"no GPU here (cupy and the CUDA driver are both needed): {type(e).__name__}: {e}") \
                from None
    lease(r, Child)
    if r.rehearse:
        r.note("rehearsal: the raw part needs a GPU and was not run")
        return
    raw(r, cupy, driver, Child)


def lease(r, Child) -> None:
    """The daemon's read-only lease, through the client's own mapping code."""
    from modelcache.measure import ensure_models, managed_daemon
    from modelcache.client.connection import connect
    from modelcache.store.format import load_manifest

    env = {"MODELCACHE_GPU_SHARING": "vmm-read-only", "MODELCACHE_GPUS": "auto"}
    if r.rehearse:
        env["MODELCACHE_FAKE_GPUS"] = "1x64M"
    with tempfile.TemporaryDirectory(prefix="modelcache-check-vmm-") as work:
        address = f"ipc://{work}/daemon.sock"
        child = None
        try:
            with managed_daemon(address, f"{work}/repo", env=env, log_path=f"{work}/daemon.log"):
                ensure_models(address, [MODEL], Path(work) / "zoo")
                with connect(address) as c:
                    gpu = [t for t in c.stats().tiers if t["tier"] == "gpu"]
                    if not gpu:
                        r.require(False, "the daemon has no GPU tier (cupy sees no device)")
                        return
                    r.set("device", f"{gpu[0]['name']} ({gpu[0]['device']})")
                    r.set("lease_sharing", gpu[0].get("sharing"))
                    r.set("lease_sharing_note", gpu[0].get("sharing_note"))
                    if not r.require(gpu[0].get("sharing") == "vmm-read-only",
                                     f"the daemon fell back to legacy IPC: {gpu[0].get('sharing_note')}"):
                        return
                    version = next(m["version"] for m in c.list() if m["name"] == MODEL)
                    expect = {t.name: t.sha256 for t in load_manifest(Path(work) / "repo" / MODEL / str(version))
                              .gpu_tensors}
                    rehearse = "1" if r.rehearse else "0"
                    child = Child("lease", address, MODEL, rehearse)
                    got = child.read()
                    r.set("lease_kind", got["kind"])
                    r.set("lease_open_ms", round(got["open_ms"], 2))
                    r.set("lease_map_ms", round(got["map_ms"], 2))
                    r.require(got["kind"] == ("fake-vmm" if r.rehearse else "cuda-vmm"),
                              f"the lease came as {got['kind']!r}")
                    r.set("lease_bytes_identical", got["sha256"] == expect)
                    r.require(got["sha256"] == expect, "the client's read-only mapping read other bytes")
                    r.set("lease_count", next(m for m in c.list() if m["name"] == MODEL)["gpu"][0]["leases"])
                    child.tell("write")
                    wrote = child.read()
                    outcome = child.died if wrote is None else wrote["write"]
                    child.kill()
                    reader = Child("lease", address, MODEL, rehearse)   # what every client reads now
                    again = reader.read()
                    reader.kill()
                    verdict = write_verdict(outcome, again is not None and again["sha256"] == expect)
                    r.set("lease_write", verdict)
                    r.set("lease_write_refused", verdict["ok"])
                    r.require(verdict["ok"], f"a client's write through its read-only lease: {verdict}")
        finally:
            if child is not None:
                child.kill()


def raw(r, cupy, driver, Child) -> None:
    """The VMM calls alone, against legacy IPC: write attempts, attach time, device memory, a killed child."""
    rt = cupy.cuda.runtime
    cupy.cuda.Device(0).use()
    granularity = driver.granularity(0)
    size = -(-(RAW_MIB << 20) // granularity) * granularity
    r.set("granularity_mib", mib(granularity))
    r.set("raw_mib", mib(size))
    data = os.urandom(size)
    want = hashlib.sha256(data).hexdigest()

    def free_bytes() -> int:
        rt.deviceSynchronize()
        return int(rt.memGetInfo()[0])

    def allocate():
        handle = driver.create(size, 0)
        va = driver.map(handle, size, 0, read_only=False)
        rt.memcpy(va, ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value, size, rt.memcpyHostToDevice)
        return handle, va, driver.export_fd(handle)

    def free(handle, va, fd) -> None:
        os.close(fd)
        driver.unmap(va, size)
        driver.release(handle)

    children = []
    try:
        handle, va, fd = allocate()
        try:
            writes = {}
            for mode in ("write-memcpy", "write-kernel"):
                child = Child("raw", mode, str(size), fd=fd)
                children.append(child)
                report = child.read()
                if mode == "write-memcpy":
                    r.set("bytes_identical", report is not None and report["sha256"] == want)
                    r.require(report is not None and report["sha256"] == want,
                              "a child's read-only mapping read other bytes")
                child.tell("write")
                wrote = child.read()
                child.close()
                outcome = child.died if wrote is None else wrote["write"]
                writes[mode] = write_verdict(outcome, _sha256_device(rt, va, size) == want)
                r.set(mode.replace("-", "_"), writes[mode])
            r.set("write_refused", all(w["ok"] for w in writes.values()))
            r.require(all(w["ok"] for w in writes.values()), "a write into a read-only mapping went through")

            legacy = rt.malloc(size)
            try:
                rt.memcpy(legacy, ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value, size,
                          rt.memcpyHostToDevice)
                ipc_handle = bytes(rt.ipcGetMemHandle(legacy)).hex()
                samples = {"vmm": [], "ipc": []}
                for _ in range(RUNS):      # interleaved: drift hits both alike
                    for kind in ("vmm", "ipc"):
                        before = free_bytes()
                        child = Child("raw", kind, str(size), fd=fd) if kind == "vmm" else \
                            Child("raw", kind, str(size), "-1", ipc_handle)
                        children.append(child)
                        report = child.read() or {}
                        held = free_bytes()
                        report["device_bytes"] = before - held
                        report["nvidia_smi_bytes"] = _nvidia_smi_used(child.proc.pid)
                        child.close()
                        samples[kind].append(report)
            finally:
                rt.free(legacy)
            for kind, reports in samples.items():
                r.set(f"attach_ms_{kind}", [round(x["attach_ms"], 3) for x in reports if "attach_ms" in x])
                r.set(f"context_ms_{kind}", [round(x["context_ms"], 1) for x in reports if "context_ms" in x])
                r.set(f"device_mib_{kind}", [mib(x["device_bytes"]) for x in reports])
                r.set(f"nvidia_smi_mib_{kind}", [mib(x["nvidia_smi_bytes"]) for x in reports])
                same = all(x.get("sha256") == want for x in reports)
                r.set(f"attach_bytes_identical_{kind}", same)
                r.require(same, f"a {kind} child read other bytes")
        finally:
            free(handle, va, fd)

        free_start = free_bytes()
        handle, va, fd = allocate()
        child = Child("raw", "vmm", str(size), fd=fd)
        children.append(child)
        child.read()
        free(handle, va, fd)                    # the daemon frees: the child's mapping keeps the memory
        free_held = free_bytes()
        child.kill()
        deadline, free_after = time.monotonic() + 10, free_bytes()
        while free_start - free_after > granularity and time.monotonic() < deadline:
            time.sleep(0.1)                     # the driver reclaims a dead process's memory soon, not at once
            free_after = free_bytes()
        killed = killed_verdict(free_start, free_held, free_after, size, slack=2 * granularity)
        r.set("killed_child", killed)
        ok = killed["held_while_child_lives"] and killed["reclaimed_after_kill"]
        r.set("killed_client_mapping_released", ok)
        r.require(ok, f"a killed child's mapping: {killed}")
    finally:
        for child in children:
            child.kill()


def _nvidia_smi_used(pid: int) -> int | None:
    """nvidia-smi's device memory of process `pid`, bytes (None where it does not list it)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid) and parts[1].isdigit():
            return int(parts[1]) << 20
    return None


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        {"lease": child_lease, "raw": child_raw}[sys.argv[2]](*sys.argv[3:])
        sys.exit(0)
    from checks import main_for
    sys.exit(main_for("vmm", check))
