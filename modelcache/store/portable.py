"""The portable skeleton: the packed graph with no path of ours in it, for clients in other mount namespaces.

A host lease names files: the tier's skeleton and segments under /dev/shm, or the repository's files. A
client in another container (its own /dev/shm, no view of the repository: a pod beside the daemon's with
only the socket's directory mounted) cannot open them. Over the lane the daemon passes the lease's files as
descriptors instead (SCM_RIGHTS), and the client maps the weights from those. ORT still wants the graph,
and checks that every external-data file the graph names exists (relative to the model's folder; for a
graph loaded from bytes, to the folder the session's config names) even for a weight add_initializer
overrides, which it never reads. So this skeleton names /dev/zero, which exists in every namespace
(session_options.PORTABLE_*), for every weight: the client reads the skeleton through its descriptor,
hands ORT the bytes, and hands every weight over with add_initializer, as it does over paths.

Written at add time beside model.onnx, with a checksum like every stored file, and checked by building it
the way clients will. A weight left without override would read /dev/zero's nothing, so every external
tensor of the skeleton must be one the manifest lists (and so one a client hands over): else no file.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import onnx
from onnx import TensorProto

from .format import PORTABLE_SKELETON_FILE, SKELETON_FILE, WEIGHTS_FILE, TensorEntry, iter_graphs

log = logging.getLogger("modelcache.packing")


def write(model_dir: Path, tensors: list[TensorEntry]) -> bool:
    """Write `model_dir`/PORTABLE_SKELETON_FILE from its packed skeleton; False, and no file, where a graph
    cannot be made portable or this ORT does not build it."""
    from ..session_options import PORTABLE_LOCATION

    model = onnx.load(str(model_dir / SKELETON_FILE), load_external_data=False)
    listed = {t.name for t in tensors}
    for graph in iter_graphs(model.graph):
        for t in graph.initializer:
            if t.data_location != TensorProto.EXTERNAL:
                continue
            if t.name not in listed:
                log.warning("%s: weight %r is not in the manifest; no portable skeleton", model_dir, t.name)
                return False
            for entry in t.external_data:
                if entry.key == "location":
                    entry.value = PORTABLE_LOCATION
                elif entry.key == "offset":
                    entry.value = "0"
    path = model_dir / PORTABLE_SKELETON_FILE
    path.write_bytes(model.SerializeToString())
    try:
        check_builds(model_dir, tensors)
    except Exception as e:   # an ORT that reads or sizes the external data it is told is overridden
        log.warning("%s: ONNX Runtime does not build the portable skeleton (%s); clients get its files by path",
                    model_dir, str(e).strip()[:300])
        path.unlink()
        return False
    return True


def check_builds(model_dir: Path, tensors: list[TensorEntry]) -> None:
    """Build the portable skeleton as a client given descriptors does: from bytes, every weight handed over by
    add_initializer from a mapping of weights.bin through its descriptor; ORT's error where it does not build."""
    import onnxruntime as ort

    from ..session_options import attach_session_options, bind_weights, portable_session_options, read_whole

    fds = [os.open(model_dir / PORTABLE_SKELETON_FILE, os.O_RDONLY), os.open(model_dir / WEIGHTS_FILE, os.O_RDONLY)]
    try:
        so = portable_session_options(attach_session_options())
        rows = [[t.name, t.dtype, t.shape, 0, t.offset, t.nbytes] for t in tensors]
        maps, values = bind_weights(so, fds[1:], rows)   # (held here while ORT builds over them)
        ort.InferenceSession(read_whole(fds[0]), so, providers=["CPUExecutionProvider"])
    finally:
        for fd in fds:
            os.close(fd)
