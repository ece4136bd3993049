"""The GPU tier lending weights by CUDA IPC, with no onnxruntime-gpu: a real daemon, cupy importers, leases, kills.

    python3 benchmarks/gpu/check_ipc.py --out DIR        (checks.py runs it; the contract is there)

A private daemon (its GPU tier: modelcache/tiers/gpu/cuda_memory.py CudaAllocator over cupy) adds ResNet-50 and
promotes it to the GPU. Two fresh processes open it with device="cuda", import the IPC handles with cupy and
read every tensor back: the sha256 of each must be the manifest's (bit-identical bytes). Then: the daemon
counts 2 leases; evicting the model from the GPU is refused and frees nothing; each importer is SIGKILLed
in turn and the daemon drops its lease (after lease_timeout_s without its heartbeat); once none is left,
the eviction goes through and the arena's memory comes back. Device memory (NVML, all processes) is read
throughout: a client importing the weights uses no more than one with a bare CUDA context. Last, without
the daemon: memory a process imported outlives its exporter's cudaFree and exit, and returns only when the
importer exits (shared/GPU.md saw this on an H100; the daemon's rule "never evict what a lease maps" rests
on it).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LIMIT_S = 75
MODEL = "resnet50"
RAW_BYTES = 256 << 20
# Short heartbeats: a killed client's lease goes within ~1 s, not the default 4.
DAEMON_ENV = {"MODELCACHE_HEARTBEAT_INTERVAL_S": "0.25", "MODELCACHE_LEASE_TIMEOUT_S": "1.0",
              "MODELCACHE_SERVE_IDLE_S": "1", "MODELCACHE_GPUS": "auto"}


# -- the child processes ------------------------------------------------------------------------------

def _say(obj) -> None:
    print(json.dumps(obj), flush=True)


def _device_index(uuid: str) -> int:
    from modelcache.tiers.gpu import probe
    return next(d.index for d in probe() if d.uuid == uuid)


def _read_sha256(runtime, base: int, offset: int, nbytes: int) -> str:
    import ctypes
    buf = (ctypes.c_char * max(nbytes, 1))()
    if nbytes:
        runtime.memcpy(ctypes.addressof(buf), base + offset, nbytes, runtime.memcpyDeviceToHost)
    return hashlib.sha256(bytes(buf)[:nbytes]).hexdigest()


def child_importer(socket: str, name: str) -> None:
    """Open `name` on the GPU through the daemon, import its handles with cupy, hash every tensor; then wait."""
    t0 = time.perf_counter()
    from modelcache.client.connection import connect
    client = connect(socket)
    lease = client.open(name, device="cuda")
    t_open = time.perf_counter()
    if lease.ipc_kind == "fake":      # a rehearsal: each handle is a file standing in for device memory
        import ctypes
        from modelcache.cuda import map_fake
        bases = [map_fake(bytes(h).decode())[0] for h in lease.ipc_handles]
        t_ipc = time.perf_counter()
        sha = {t.name: hashlib.sha256(ctypes.string_at(bases[t.index] + t.offset, t.nbytes)).hexdigest()
               for t in lease.tensors}
    else:
        from cupy.cuda import runtime
        runtime.setDevice(_device_index(lease.device_uuid))
        bases = [runtime.ipcOpenMemHandle(bytes(h)) for h in lease.ipc_handles]
        t_ipc = time.perf_counter()
        sha = {t.name: _read_sha256(runtime, bases[t.index], t.offset, t.nbytes) for t in lease.tensors}
    _say({"pid": os.getpid(), "lease": lease.lease_id, "kind": lease.ipc_kind, "handles": len(bases),
          "sha256": sha, "open_ms": (t_open - t0) * 1e3, "ipc_open_ms": (t_ipc - t_open) * 1e3})
    sys.stdin.read()          # until the parent closes our stdin, or kills us


def child_floor() -> None:
    """A bare CUDA context through cupy: what every importer costs before it imports anything."""
    from cupy.cuda import runtime
    runtime.setDevice(0)
    runtime.free(0)
    _say({"pid": os.getpid()})
    sys.stdin.read()


def child_exporter() -> None:
    """cudaMalloc RAW_BYTES, fill, export; on 'free' cudaFree it; on 'exit' leave."""
    import ctypes
    from cupy.cuda import runtime
    runtime.setDevice(0)
    ptr = runtime.malloc(RAW_BYTES)
    pattern = (hashlib.sha256(b"modelcache").digest() * (RAW_BYTES // 32))
    src = ctypes.create_string_buffer(pattern, RAW_BYTES)
    runtime.memcpy(ptr, ctypes.addressof(src), RAW_BYTES, runtime.memcpyHostToDevice)
    _say({"handle": bytes(runtime.ipcGetMemHandle(ptr)).hex(), "sha256": hashlib.sha256(pattern).hexdigest()})
    for line in sys.stdin:
        if line.strip() == "free":
            runtime.free(ptr)
            runtime.deviceSynchronize()
            _say({"freed": True})
        elif line.strip() == "exit":
            return


def child_raw_importer(handle_hex: str) -> None:
    """Import the exporter's allocation; hash it whenever asked ('hash'); leave on EOF."""
    from cupy.cuda import runtime
    runtime.setDevice(0)
    base = runtime.ipcOpenMemHandle(bytes.fromhex(handle_hex))
    _say({"sha256": _read_sha256(runtime, base, 0, RAW_BYTES)})
    for line in sys.stdin:
        if line.strip() == "hash":
            _say({"sha256": _read_sha256(runtime, base, 0, RAW_BYTES)})


# -- the parent (no CUDA context of its own: NVML only) ------------------------------------------------

class Child:
    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, __file__, "--child", *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def read(self, timeout_s: float = 60) -> dict:
        import select
        if not select.select([self.proc.stdout], [], [], timeout_s)[0]:
            raise RuntimeError(f"child {self.proc.args[3:]} said nothing in {timeout_s:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(10)
            raise RuntimeError(f"child {self.proc.args[3:]} died (rc {self.proc.returncode}): "
                               f"{self.proc.stderr.read().strip()[-1500:]}")
        return json.loads(line)

    def tell(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()


def until(predicate, timeout_s: float, step_s: float = 0.05):
    """Poll `predicate` until it returns a true value (returned) or `timeout_s` passes (None)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value or None
        time.sleep(step_s)


def mib(n: float) -> float:
    return round(n / 2**20, 1)


def check(r) -> None:
    from checks import CannotRun
    from modelcache.bench.coldstart_cuda import Nvml, model_row
    from modelcache.measure import ensure_models, managed_daemon
    from modelcache.client.connection import connect
    from modelcache.errors import CapacityError
    from modelcache.store.format import load_manifest

    nvml, env, model = None, dict(DAEMON_ENV), MODEL
    if r.rehearse:     # here, without a GPU: fake devices (files), a tiny model, no device memory to read
        env["MODELCACHE_FAKE_GPUS"], model = "1x256M", "tiny-cnn"
    else:
        try:
            nvml = Nvml()
        except Exception as e:   # OSError: no driver; NoCudaDevice
            raise CannotRun(f"no NVIDIA driver or device here: {e}") from None
    with tempfile.TemporaryDirectory(prefix="modelcache-check-ipc-") as work:
        socket = f"ipc://{work}/daemon.sock"
        children: list[Child] = []
        try:
            with managed_daemon(socket, f"{work}/repo", env=env, log_path=f"{work}/daemon.log"):
                ensure_models(socket, [model], Path(work) / "zoo")
                with connect(socket) as c:
                    gpu = [t for t in c.stats().tiers if t["tier"] == "gpu"]
                    if not gpu:
                        raise CannotRun("the daemon has no GPU tier: cupy sees no device (or cannot be imported)")
                    uuid = gpu[0]["device"]
                    r.set("device", f"{gpu[0]['name']} ({uuid})")
                    r.set("allocator", gpu[0]["kind"])
                    if nvml is not None:
                        used = lambda: nvml.used_bytes(uuid)   # noqa: E731  (every process on the device)
                    else:                                       # the fake device's files
                        used = lambda: next(t for t in c.stats().tiers if t["tier"] == "gpu")["used_bytes"]  # noqa: E731
                    lend(r, c, socket, model, used, children, model_row, load_manifest, CapacityError)
            if nvml is not None:
                raw(r, nvml, uuid, r.data["figures"].get("floor_client_mib", 0) * 2**20)
        finally:
            for child in children:
                child.kill()


def lend(r, c, socket, model, used, children, model_row, load_manifest, CapacityError) -> None:
    """The daemon's part: promote, lend to two importers, count, refuse, kill, release, evict."""
    # The daemon's own CUDA context comes with its first allocation: promote once and demote, so that what
    # follows counts the arena alone.
    c.load(model, tier="gpu")
    c.evict(model, tier="gpu")
    floor_bytes = 0
    if not r.rehearse:
        before_floor = used()
        floor = Child("floor")
        children.append(floor)
        floor.read()
        time.sleep(0.3)
        floor_bytes = used() - before_floor
        r.set("floor_client_mib", mib(floor_bytes))
        floor.close()
        until(lambda: used() <= before_floor + (8 << 20), 10)

    idle = used()
    t = time.perf_counter()
    c.load(model, tier="gpu")
    r.set("load_to_gpu_s", round(time.perf_counter() - t, 3))
    tier = next(t for t in c.stats().tiers if t["tier"] == "gpu")
    r.set("promotion_gb_s", round(tier.get("promotion_bytes_per_s", 0) / 1e9, 2))
    time.sleep(0.2)
    arena = used() - idle
    r.set("arena_mib", mib(arena))
    row = model_row(c, model)
    repository = Path(next(t["path"] for t in c.stats().tiers if t["tier"] == "disk"))
    manifest = load_manifest(repository / model / str(row["version"]))
    expect = {t.name: t.sha256 for t in manifest.gpu_tensors}
    r.set("weights_mib", mib(sum(t.nbytes for t in manifest.gpu_tensors)))

    importers = []
    for _ in range(2):
        child = Child("importer", socket, model)
        children.append(child)
        importers.append((child, child.read()))
    infos = [info for _, info in importers]
    r.set("ipc_kind", infos[0]["kind"])
    r.set("ipc_open_ms", [round(i["ipc_open_ms"], 2) for i in infos])
    same = all(i["sha256"] == expect for i in infos)
    r.set("tensors_checked", len(expect))
    r.set("bytes_identical", same)
    r.require(same, "an importer read bytes whose sha256 differs from the manifest's")
    r.require(infos[0]["kind"] == ("fake" if r.rehearse else "cuda"), f"the GPU tier lent {infos[0]['kind']!r} handles")
    per_client = (used() - idle - arena) / 2
    r.set("importer_client_mib", mib(per_client))
    r.set("import_extra_mib", mib(per_client - floor_bytes))
    r.require(per_client - floor_bytes < 0.05 * arena,
              "an importing client holds more device memory than a bare context + 5 % of the arena")

    leases = lambda: sum(g["leases"] for g in model_row(c, model)["gpu"])   # noqa: E731
    r.set("lease_count_two_clients", leases())
    r.require(leases() == 2, f"the daemon counts {leases()} leases for 2 importing clients")

    held = used()
    try:
        c.evict(model, tier="gpu")
        refused, why = False, "evicted"
    except CapacityError as e:
        refused, why = True, str(e)
    r.set("evict_refused_under_lease", refused)
    r.set("evict_refusal", why[:300])
    r.set("evict_refused_freed_mib", mib(held - used()))
    r.require(refused and held - used() < arena / 2,
              "evicting a leased model from the GPU was not refused, or freed memory")

    released_s = []
    for k, (child, _) in enumerate(importers):
        t = time.monotonic()
        child.kill()
        left = until(lambda: leases() == 1 - k or None, 10)
        released_s.append(round(time.monotonic() - t, 2) if left else None)
    r.set("killed_client_lease_released_s", released_s)
    ok = all(s is not None for s in released_s)
    r.set("killed_client_lease_released", ok)
    r.require(ok, "a SIGKILLed client's lease was not released within 10 s")

    before = used()
    c.evict(model, tier="gpu")
    freed = until(lambda: before - used() if before - used() > arena / 2 else None, 5) or 0
    r.set("memory_returned_after_last_importer_mib", mib(freed))
    r.set("memory_returned", freed > arena / 2)
    r.require(freed > arena / 2, "the arena's memory did not come back after the last importer died and the "
                                 "model was evicted")


def raw(r, nvml, uuid: str, floor_bytes: int) -> None:
    """Without the daemon: an import outlives its exporter's cudaFree and exit; its memory goes with the importer."""
    used = lambda: nvml.used_bytes(uuid)   # noqa: E731
    exporter = Child("exporter")
    importer = None
    try:
        made = exporter.read()
        importer = Child("raw-importer", made["handle"])
        first = importer.read()
        exporter.tell("free")
        exporter.read()
        exporter.tell("exit")
        exporter.proc.wait(10)
        until(lambda: exporter.proc.poll() is not None, 5)
        time.sleep(0.5)
        importer.tell("hash")
        after = importer.read()
        intact = first["sha256"] == made["sha256"] == after["sha256"]
        r.set("raw_bytes_intact_after_exporter_freed_and_exited", intact)
        r.require(intact, "the importer's bytes changed after its exporter freed them and exited")
        with_importer = used()
        importer.close()
        released = until(lambda: with_importer - used() if with_importer - used() > floor_bytes else None, 5) or 0
        r.set("raw_released_when_importer_exits_mib", mib(released))
        held = released - floor_bytes
        r.set("raw_held_by_importer_alone_mib", mib(held))
        r.set("raw_allocation_mib", mib(RAW_BYTES))
        r.require(held > 0.9 * RAW_BYTES, "the allocation did not stay until its last importer exited "
                                          f"({mib(held)} MiB beyond a bare context went with the importer)")
    finally:
        exporter.kill()
        if importer is not None:
            importer.kill()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        {"importer": child_importer, "floor": child_floor, "exporter": child_exporter,
         "raw-importer": child_raw_importer}[sys.argv[2]](*sys.argv[3:])
        sys.exit(0)
    from checks import main_for
    sys.exit(main_for("ipc", check))
