"""The host tier's skeletons: a packed model's graph rewritten to point at where its weights are resident.

`<model>.onnx` names each external tensor's segment and offset (and a pre-packed weight's blobs);
`<model>.gpu.onnx` points every weight at a sparse stub file, since clients override them all. Written by
the loader thread that writes the promotion (host_plan.py), each whole, 0440, or not at all.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..storage import write_atomic
from ..store import integrity, prepack
from ..store.format import Manifest


def load_skeleton(src: Path, key: str):
    """The packed skeleton's graph; a file that does not parse is a damaged file of `key`, not a decode error."""
    import onnx
    try:
        return onnx.load(str(src), load_external_data=False)
    except FileNotFoundError:
        raise integrity.damaged(key, src.name, "the file is missing") from None
    except Exception as e:  # protobuf's DecodeError, UnicodeDecodeError on a damaged string...
        raise integrity.damaged(key, src.name, f"not an ONNX graph: {type(e).__name__}: {str(e)[:200]}") from None


def write_skeleton(src: Path, dst: Path, locations: dict, key: str, prepacked: dict | None = None) -> None:
    """The packed skeleton with each external tensor pointing at its segment and offset.

    Clients hand ORT most weights with add_initializer, but ORT still checks that the
    external data a skeleton names exists; pointing it at the real bytes keeps the
    skeleton correct on its own as well. A weight in `prepacked` also names its blobs
    (ORT's `prepacked_<i>` entries, offsets in the same segment): clients let ORT map it.
    """
    import onnx
    from ..store.format import iter_graphs

    model = load_skeleton(src, key)
    for graph in iter_graphs(model.graph):
        for t in graph.initializer:
            if t.name in locations and t.data_location == onnx.TensorProto.EXTERNAL:
                seg, offset = locations[t.name]
                for entry in t.external_data:
                    if entry.key == "location":
                        entry.value = seg
                    elif entry.key == "offset":
                        entry.value = str(offset)
                for name, value in prepack.external_entries((prepacked or {}).get(t.name, [])):
                    t.external_data.add(key=name, value=value)
    save_graph(model, dst)


def save_graph(model, dst: Path) -> None:
    """Save an ONNX graph to `dst` whole (0440): written beside it and renamed; a failure leaves no temp file."""
    write_atomic(dst, model.SerializeToString(), mode=0o440)


def write_gpu_skeleton(src: Path, dst: Path, manifest: Manifest, key: str) -> None:
    """The GPU skeleton, its stubs pointing at `<dst>.stub`: a sparse file of zeros as large as the
    largest stub (ORT checks the external data a graph names exists; it never reads it, because
    every stub is overridden by add_initializer). Sparse on tmpfs: it costs no memory."""
    import onnx
    from ..store.format import iter_graphs

    stub = dst.with_suffix(".stub")
    model = load_skeleton(src, key)
    for graph in iter_graphs(model.graph):
        for t in graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                for entry in t.external_data:
                    if entry.key == "location":
                        entry.value = stub.name
    with open(stub, "wb") as f:
        f.truncate(max((t.nbytes for t in manifest.gpu_tensors), default=0))
    os.chmod(stub, 0o440)
    save_graph(model, dst)

