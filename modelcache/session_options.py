"""The ONNX Runtime session settings that make a session share the daemon's weights.

Chosen by measurement (`python -m modelcache.bench.binding`, results in benchmarks/binding):
optimizers run once at pack time, so here they are off — an optimizer that rewrites a
weight would silently read its own private copy — and prepacking is off, because a
prepacked weight is a private copy too. ORT then maps each external initializer
read-only from /dev/shm.
"""

from __future__ import annotations


def attach_session_options(base=None, spinning: bool | None = None, prepacked: bool = False):
    """SessionOptions for a session over a packed skeleton; a caller's `base` options are adjusted in place
    (ORT's SessionOptions cannot be copied), so pass a fresh object per session.

    prepacked=True: the skeleton names shared pre-packed blobs for every weight ORT packs (prepack.py),
    so prepacking is on: ORT packs each weight once to find its blob's key, then uses the mapped blob."""
    import onnxruntime as ort

    so = ort.SessionOptions() if base is None else base
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.add_session_config_entry("session.disable_prepacking", "0" if prepacked else "1")
    if spinning is not None:
        # Many client processes on few cores: spinning threads steal each other's cores.
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    return so


def map_readonly(path: str):
    """A read-only, shared mapping of a whole file (a host-tier segment or a serve-mode I/O file)."""
    import mmap
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        return mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)  # the mapping keeps the pages; the descriptor is not needed


MADV_POPULATE_READ = 22   # Linux 5.14+: map a range's pages now, as reads would (mmap has no name for it in 3.11)
PREFAULT_CHUNK = 2 << 20


def prefault(maps: list) -> "threading.Thread | None":
    """Map every page of `maps` into this process on another thread, while ORT builds the session.

    A fresh client's first run otherwise faults in each 4 KiB page of the weights as it reads them:
    42 ms for 512 MiB on /dev/shm here, the same whether done by faults, MAP_POPULATE or
    MADV_POPULATE_READ (bench pagefaults; populate.py beside it). Done up front, the work is no
    cheaper; done on the other core while the session is built (10-20 ms, one thread, the weights
    untouched by then) and ahead of the first run, it leaves that run less to do. The thread holds
    only addresses, never the mappings: closing the session while it runs makes madvise fail on a
    range that is gone, which it ignores. Returns the thread (started), or None where nothing is to
    be done (no weights, no libc, MODELCACHE_PREFAULT=0)."""
    import ctypes
    import os
    import threading

    if not maps or os.environ.get("MODELCACHE_PREFAULT", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        madvise = ctypes.CDLL(None).madvise   # libc, already loaded (find_library would run ldconfig: ~15 ms)
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    ranges = [(_address(m), len(m)) for m in maps]
    started = threading.Event()

    def populate():
        started.set()
        for address, length in ranges:
            # In chunks: madvise holds the process's mmap lock for its whole range, and ORT's allocations
            # while it builds the session wait for that lock (in one 233 MiB call: session +27 ms).
            for at in range(0, length, PREFAULT_CHUNK):
                madvise(address + at, min(PREFAULT_CHUNK, length - at), MADV_POPULATE_READ)   # drops the GIL

    thread = threading.Thread(target=populate, name="modelcache-prefault", daemon=True)
    thread.start()
    started.wait()   # running: the GIL is the session's to take
    return thread


def _address(m) -> int:
    """The start address of an mmap, with no buffer export left behind (an export would make close fail)."""
    import numpy as np
    view = np.frombuffer(m, dtype=np.uint8)   # read-only: ctypes' from_buffer refuses it
    address = view.__array_interface__["data"][0]
    del view
    return address


def bind_weights(so, segment_paths: list, tensors: list) -> tuple[list, list]:
    """Hand each tensor ([name, dtype, shape, segment index, offset, nbytes]) to `so` as an OrtValue over
    a read-only mapping of its segment: no read, no copy. Returns (mappings, values); ORT keeps raw
    pointers, so both must outlive every session built with `so`."""
    import numpy as np
    import onnxruntime as ort

    if not tensors:  # a model with no large weights: its (empty) blob cannot even be mapped
        return [], []
    maps = [map_readonly(p) for p in segment_paths]
    blobs = [np.frombuffer(m, dtype=np.uint8) for m in maps]
    values = []
    for name, dtype, shape, seg, offset, nbytes in tensors:
        value = ort.OrtValue.ortvalue_from_numpy(blobs[seg][offset:offset + nbytes].view(dtype).reshape(shape))
        values.append(value)
        so.add_initializer(name, value)
    return maps, values
