"""The ONNX Runtime session settings that make a session share the daemon's weights.

Chosen by measurement (`python -m modelcache.bench.binding`, results in benchmarks/binding):
optimizers run once at pack time, so here they are off — an optimizer that rewrites a
weight would silently read its own private copy — and prepacking is off, because a
prepacked weight is a private copy too. ORT then maps each external initializer
read-only from /dev/shm.
"""

from __future__ import annotations


def attach_session_options(base=None, spinning: bool | None = None):
    """SessionOptions for a session over a packed skeleton; a caller's `base` options are adjusted in place
    (ORT's SessionOptions cannot be copied), so pass a fresh object per session."""
    import onnxruntime as ort

    so = ort.SessionOptions() if base is None else base
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.add_session_config_entry("session.disable_prepacking", "1")
    if spinning is not None:
        # Many client processes on few cores: spinning threads steal each other's cores.
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    return so
