"""The ONNX Runtime session settings that make a session share the daemon's weights.

Chosen by measurement (benchmarks/binding/run.py, results beside it):
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


def map_readonly(path_or_fd):
    """A read-only, shared mapping of a whole file (a host-tier segment or a serve-mode I/O file), by path or
    by a descriptor (a lease's, passed over the lane: the caller's to close)."""
    import mmap
    import os

    if isinstance(path_or_fd, int):
        return mmap.mmap(path_or_fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
    fd = os.open(path_or_fd, os.O_RDONLY)
    try:
        return mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)  # the mapping keeps the pages; the descriptor is not needed


# A portable skeleton (store/format.py's PORTABLE_SKELETON_FILE) names this file, in this folder, as every
# weight's external data. ORT checks that a graph's external data exists (a graph loaded from bytes: inside
# the folder the session's config names), never reads a weight that add_initializer overrides, and every
# weight of a portable skeleton is overridden: /dev/zero exists in every mount namespace, container or not.
PORTABLE_FOLDER = "/dev"
PORTABLE_LOCATION = "zero"


def portable_session_options(so):
    """`so` set to load a portable skeleton from bytes (every weight then handed over by bind_weights)."""
    so.add_session_config_entry("session.model_external_initializers_file_folder_path", PORTABLE_FOLDER)
    return so


def read_whole(fd: int) -> bytes:
    """A whole file's bytes through its descriptor (a portable skeleton passed over the lane), from offset 0.

    Read at its size, not in fixed chunks: a freed buffer above glibc's mmap threshold (128 KiB) raises the
    threshold, and the process's later frees then stay on its heap (measured: +7 MiB anonymous in a fresh
    client after ResNet-50's first run)."""
    import os

    size = os.fstat(fd).st_size
    data = os.pread(fd, size, 0)
    while len(data) < size:   # (a short read: a file on a network file system, or a signal)
        more = os.pread(fd, size - len(data), len(data))
        if not more:
            break
        data += more
    return data


def bind_weights(so, segment_paths: list, tensors: list) -> tuple[list, list]:
    """Hand each tensor ([name, dtype, shape, segment index, offset, nbytes]) to `so` as an OrtValue over
    a read-only mapping of its segment (a path, or a descriptor: map_readonly): no read, no copy. Returns
    (mappings, values); ORT keeps raw pointers, so both must outlive every session built with `so`."""
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
