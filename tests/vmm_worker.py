"""A client process for tests/test_gpu_vmm.py: open a GPU lease over the lane, map it as a client does, report.

    vmm_worker.py SOCKET NAME MODE [UID GID GROUPS]

MODE: "report" prints one JSON line and exits; "write" prints it, then writes one byte into the first
weight (the test expects SIGSEGV); "hold" prints it, then "OPEN", and waits to be killed. With UID, the
process becomes that user (GID, supplementary GROUPS "0,5" or "") after its imports, as
identity_worker.py does, before it connects.

The JSON: the open's error (type and message) if it failed; else the export kind, how many descriptors
came, the sha256 of each tensor as this process reads it through its mapping, the permissions of that
mapping in /proc/self/maps, whether mprotect could make it writable, and which memfd descriptors are
still open here (none should be: the mapping keeps the memory).
"""

import ctypes
import hashlib
import json
import os
import sys
import time


def memfd_links(pid: int | str = "self") -> list[str]:
    """The modelcache memfds process `pid` holds a descriptor of."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:modelcache"):
            out.append(target)
    return out


def memfd_maps() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line.split()[1] for line in f if "/memfd:modelcache" in line]


def main() -> int:
    import modelcache.client.device as device
    from modelcache.client.leases import LeaseClient

    socket, name, mode = sys.argv[1:4]
    if len(sys.argv) > 4:
        os.setgroups([int(g) for g in sys.argv[6].split(",") if g])
        os.setgid(int(sys.argv[5]))
        os.setuid(int(sys.argv[4]))
    client = LeaseClient(socket, 30.0)
    try:
        lease = client.open(name, device="cuda:fake-0")
    except Exception as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e), "memfds": memfd_links()}), flush=True)
        return 0
    fds = list(getattr(lease, "received_fds", []))
    out = {"kind": lease.ipc_kind, "fds": len(fds), "declared": lease.ipc_fds}
    bases = [device.handle_cache().acquire(lease.ipc_kind, h, 0, fd) for h, fd in zip(lease.ipc_handles, fds)]
    out["sha256"] = {t.name: hashlib.sha256(ctypes.string_at(bases[t.index] + t.offset, t.nbytes)).hexdigest()
                     for t in lease.tensors}
    out["perms"] = memfd_maps()
    out["memfds"] = memfd_links()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    size = device.handle_cache().size_of(lease.ipc_kind, lease.ipc_handles[0])
    rc = libc.mprotect(bases[0], size, 3)     # PROT_READ | PROT_WRITE
    out["mprotect_write"] = "allowed" if rc == 0 else os.strerror(ctypes.get_errno())
    print(json.dumps(out), flush=True)
    if mode == "write":
        first = lease.tensors[0]
        ctypes.memset(bases[first.index] + first.offset, 0x5A, 1)   # the kernel should stop this
        print("WROTE", flush=True)
        return 3
    if mode == "hold":
        print("OPEN", flush=True)
        while True:
            time.sleep(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
