"""Pre-packed MatMul weights that every client shares: made once at add time, mapped from the host tier.

Why: MLAS packs a MatMul's constant B into its kernel's layout once per session ("prepacking");
without it every run packs B again, and a MatMul-heavy model (ViT-B/16) runs ~10 % slower than
plain ORT. Prepacking in each client would give each one a private packed copy of the weights.

How ORT shares them (ORT >= 1.21, read in its source and measured here with 1.32):
  - `session.save_external_prepacked_constant_initializers=1` writes each packed buffer into the
    external data file and names it in the weight's TensorProto: an external_data entry
    `prepacked_<i>` = `<op>+<hash>|<offset>;<length>;0[|...]`, offsets into the weight's own file.
  - A session that loads that weight from external data (not through add_initializer) maps each
    blob and, when the kernel's freshly computed packing hashes to the same key, hands the kernel
    the mapping in place of its own copy (KernelUseSharedPrePackedBuffers): no private copy.
  - ORT still computes the packing once per session to find its key, then frees it: the cost moves
    from warm runs to session creation (benchmarks/prepack has the figures).

So at add time `make` builds the packed skeleton the way clients will (optimizers off), lets ORT
write its blobs, and keeps them in PREPACKED_FILE with one record per weight. The host tier places
each such weight and its blobs together in one segment (a blob must live in its weight's file) and
writes the skeleton's `prepacked_<i>` entries; clients load those weights from the skeleton, with
prepacking on, and hand every other weight over as before.

Packing layouts depend on the CPU's instruction set and on the ORT version: the blobs are used only
where both match what made them (`usable`); elsewhere the model opens without prepacking, as before.
The file and the manifest's records are part of the stored-model format (format.py checks the records).
"""

from __future__ import annotations

import hashlib
import logging
import platform
import shutil
from pathlib import Path

from . import integrity
from .format import ALIGN, PREPACKED_FILE, iter_graphs, tensor_nbytes

log = logging.getLogger("modelcache.prepack")

# Which models get blobs: those whose MatMul weights are at least this share of their weights.
# CNNs' big Gemm heads (VGG16's 400 MB of FC) gain little from prepacking at batch 1 and would
# double their host-tier footprint.
MATMUL_SHARE_MIN = 0.25


def cpu_fingerprint() -> str:
    """What a packed layout depends on: ORT's version and the CPU's model and instruction set."""
    import onnxruntime as ort

    model, flags = platform.machine(), ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model == platform.machine():
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    return f"ort-{ort.__version__}/" + hashlib.sha256(f"{model}|{flags}".encode()).hexdigest()[:16]


def _blob_entries(tensor) -> list[tuple[str, list[tuple[int, int]]]]:
    """The `prepacked_<i>` entries of an ORT-saved TensorProto: [(key, [(offset, length), ...])]."""
    out = []
    for e in tensor.external_data:
        if not e.key.startswith("prepacked"):
            continue
        key, *blobs = e.value.split("|")
        out.append((key, [(int(off), int(n)) for off, n, _ in (b.split(";") for b in blobs)]))
    return out


def make(model_dir: Path, skeleton_file: str, weights_bytes: int, work: Path) -> tuple[list, str]:
    """Write `model_dir/PREPACKED_FILE` for a packed model whose MatMul weights make it worth it.

    Returns (records, fingerprint); ([], "") when it is not worth it (nothing written). A record:
    {"tensor": name, "packs": [[key, [[offset, nbytes, xxh3], ...]], ...]}, offsets into the file."""
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _make(model_dir, skeleton_file, weights_bytes, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _make(model_dir: Path, skeleton_file: str, weights_bytes: int, work: Path) -> tuple[list, str]:
    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL   # as clients build it
    so.optimized_model_filepath = str(work / "prepacked.onnx")
    so.log_severity_level = 3
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "prepacked.data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "0")
    so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    ort.InferenceSession(str(model_dir / skeleton_file), so, providers=["CPUExecutionProvider"])
    saved = onnx.load(str(work / "prepacked.onnx"), load_external_data=False)
    packed = [(t, _blob_entries(t)) for g in iter_graphs(saved.graph) for t in g.initializer]
    packed = [(t, entries) for t, entries in packed if entries]
    matmul_bytes = sum(tensor_nbytes(t) for t, entries in packed if any(k.startswith("MatMul+") for k, _ in entries))
    if not packed or matmul_bytes < MATMUL_SHARE_MIN * max(weights_bytes, 1):
        return [], ""
    records, seen, offset = [], set(), 0
    with open(work / "prepacked.data", "rb") as src, open(model_dir / PREPACKED_FILE, "wb") as dst:
        for t, entries in packed:
            if t.name in seen:     # a weight in sibling subgraphs: ORT shares one blob by key
                continue
            seen.add(t.name)
            packs = []
            for key, blobs in entries:
                placed = []
                for src_off, nbytes in blobs:
                    src.seek(src_off)
                    data = src.read(nbytes)
                    offset = -(-offset // ALIGN) * ALIGN
                    dst.seek(offset)
                    dst.write(data)
                    placed.append([offset, nbytes, integrity.digest(data)])
                    offset += nbytes
                packs.append([key, placed])
            records.append({"tensor": t.name, "packs": packs})
        dst.truncate(offset)
    return records, cpu_fingerprint()


def usable(manifest) -> bool:
    """Whether this machine's clients can use the model's blobs (made here, or on a twin machine)."""
    if not manifest.prepacked:
        return False
    if manifest.prepacked_for != cpu_fingerprint():
        log.info("%s@%s: pre-packed weights were made for %s, not this machine (%s): opened without prepacking",
                 manifest.name, manifest.version, manifest.prepacked_for, cpu_fingerprint())
        return False
    return True


def unit_key(sha256: str, record: dict) -> str:
    """The content address of a weight together with its blobs (what the host tier stores once)."""
    return "prepacked:" + sha256 + ":" + hashlib.sha256(repr(record["packs"]).encode()).hexdigest()[:32]


def external_entries(packs_placed: list) -> list[tuple[str, str]]:
    """ORT's external_data entries for a weight's blobs placed in its segment: [(key, value)]."""
    return [(f"prepacked_{i}", key + "|" + "|".join(f"{off};{n};0" for off, n in blobs))
            for i, (key, blobs) in enumerate(packs_placed)]

