"""ONNX file -> packed model: optimized weightless skeleton + one aligned weights blob + manifest.

Why this shape: ONNX Runtime maps external-data initializers straight from the file
(`mmap`, read-only, shared) when the session does not rewrite them. So we let ORT
optimize once, here, and clients later build sessions with every optimizer off over
the skeleton, whose external data points at the weights blob in shared memory: no
read, no parse, no copy of weights in the client (see benchmarks/binding).

The GPU variant (`model.gpu.onnx`) is a second skeleton for ORT's CUDA EP: the graph
after provider-independent rewrites only, each shared weight left as a data-free stub
that a client overrides with `SessionOptions.add_initializer` over device memory the
daemon lends. Its weights live in the same blob, deduplicated against the CPU tensors.

What it writes is the stored-model format (format.py: files, manifest, alignment); readers import that, not this.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import onnx
from onnx import TensorProto

from ..errors import ModelCacheError, PackError, StorageError, from_code
from ..storage import explain_failed_write, remove_tree, storage_error, storage_errors
from . import integrity, portable, prepack, reservations
from .format import (ALIGN, CHECKED_FILES, GPU_SKELETON_FILE, GPU_STUB_FILE, MANIFEST_FILE, PREPACKED_FILE, SKELETON_FILE,
                     WEIGHTS_FILE, IOEntry, Manifest, TensorEntry, iter_graphs, load_manifest, tensor_nbytes,
                     write_gpu_stub)

log = logging.getLogger("modelcache.packing")

# Smaller tensors stay inside the skeleton: shape constants, scalars, biases of tiny layers.
INLINE_MAX_BYTES = 1024
OPT_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC",
              "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}
# Only BASIC rewrites are provider-independent; higher levels (on the CPU build) fuse and lay out for the CPU EP.
GPU_OPT_LEVEL = "basic"
# The fallback when ORT's graph at a level does not load back; last, the source graph as it is, which
# even ORT_DISABLE_ALL's saved copy is not (seen: a Loop over an If that ORT re-saves out of SSA form).
SOURCE_LEVEL = "source"
_LOWER_LEVEL = {"all": "extended", "extended": "basic", "basic": "disable", "disable": SOURCE_LEVEL}
# Lent from device memory: floating weights of at least this many elements (GPU.md, "Measured on an H100").
# Integer tensors stay inline: the CUDA EP reads shape-like inputs (Reshape's shape, Slice's starts) on the host.
GPU_SHARED_DTYPES = frozenset({TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.FLOAT, TensorProto.DOUBLE})
GPU_SHARED_MIN_ELEMENTS = 64
# ORT's Level-4 (ORT_ENABLE_ALL) transformer that replaces each fp16 initializer feeding a Cast to fp32 (the
# Casts InsertCastTransformer adds for ops the CPU EP lacks in fp16) by an fp32 copy named `FusedBack_<name>`.
# Packing keeps it off for models with half-precision weights: see `_half_weight_exclusions`.
HALF_TO_FLOAT_FUSION = "FuseFp16InitializerToFp32NodeTransformer"
HALF_TYPES = (TensorProto.FLOAT16, TensorProto.BFLOAT16)

Progress = Callable[[int, int], None]  # (bytes_done, bytes_total)


def _io_entries(values) -> list[IOEntry]:
    """Name, dtype and shape of each graph input or output. A tensor's dtype is numpy's name; any other
    value (sequence, optional, map) gets ONNX Runtime's type string, e.g. "seq(tensor(float))", no shape."""
    out = []
    for vi in values:
        if vi.type.WhichOneof("value") != "tensor_type" or vi.type.tensor_type.elem_type == TensorProto.UNDEFINED:
            out.append(IOEntry(vi.name, _ort_type_name(vi.type), []))
            continue
        tt = vi.type.tensor_type
        # A negative dim_value is how older exporters wrote "dynamic": ORT reads it as free (None).
        dims = [(d.dim_value if d.dim_value >= 0 else None) if d.HasField("dim_value") else (d.dim_param or None)
                for d in tt.shape.dim]
        out.append(IOEntry(vi.name, onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name, dims))
    return out


def _ort_type_name(tp: onnx.TypeProto) -> str:
    """ONNX Runtime's name of a value type (NodeArg.type): tensor(float), seq(tensor(int64)), ..."""
    kind = tp.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        elem = getattr(tp, kind).elem_type
        name = TensorProto.DataType.Name(elem).lower() if elem else "undefined"
        return f"{kind[:-len('_type')]}({name})"
    if kind == "sequence_type":
        return f"seq({_ort_type_name(tp.sequence_type.elem_type)})"
    if kind == "optional_type":
        return f"optional({_ort_type_name(tp.optional_type.elem_type)})"
    if kind == "map_type":
        key = TensorProto.DataType.Name(tp.map_type.key_type).lower()
        return f"map({key},{_ort_type_name(tp.map_type.value_type)})"
    return "undefined"


def _sha256_file(path: str) -> str:
    return integrity.file_digest(Path(path), hashlib.sha256())


def check_source(src: str) -> None:
    """PackError unless `src` is a file."""
    if not os.path.isfile(src):
        raise PackError(f"{src}: {'a directory, not an .onnx file' if os.path.isdir(src) else 'no such file'}")


def checker_says(src: str) -> str | None:
    """What the ONNX checker has against the file, or None; asked only once ORT or onnx refused the file, to say
    why. Not a refusal of its own: ORT builds models the checker rejects (IR 3 files whose initializers are not
    graph inputs, outputs with no shape), and what ORT builds, modelcache adds. Not asked of a file ORT builds:
    it reads and checks the whole file again, 0.2-0.3 s of ResNet-50's pack (benchmarks/repoload/pack_profile.py)."""
    try:
        onnx.checker.check_model(src)  # by path: works for models over 2 GB with external data
    except Exception as e:  # checker raises ValidationError, protobuf DecodeError, OSError...
        return str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    return None


def optimize(src: str, out_dir: Path, opt_level: str, doing: str = "optimizing",
             disabled_optimizers: tuple[str, ...] = ()) -> Path:
    """Let ORT build and optimize the model once; returns the optimized model path (external data beside it).
    `doing` names the work in a storage error (ORT's own message loses ENOSPC); `disabled_optimizers` are
    ORT transformer names left out (`optimization.disable_specified_optimizers`)."""
    import onnxruntime as ort

    if opt_level not in OPT_LEVELS:
        raise PackError(f"unknown optimization level {opt_level!r}; choose one of {', '.join(OPT_LEVELS)}")
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPT_LEVELS[opt_level])
    so.optimized_model_filepath = str(out_dir / "optimized.onnx")
    so.log_severity_level = 3
    # Always externalize what ORT writes: keeps protobuf under 2 GB whatever the model size.
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                str(INLINE_MAX_BYTES))
    so.add_session_config_entry("session.disable_prepacking", "1")  # nothing here runs; save the memory
    if disabled_optimizers:
        so.add_session_config_entry("optimization.disable_specified_optimizers", ",".join(disabled_optimizers))
    try:
        ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    except Exception as e:
        ort_says = str(e).strip()[:500]
        checker = checker_says(src)
        why = (f"{src} is not a valid ONNX model: {checker}; ONNX Runtime cannot load it either: {ort_says}"
               if checker else f"ONNX Runtime cannot load {src}: {ort_says}")
        raise explain_failed_write(out_dir, doing, _source_bytes(src)) or _failed_write(src, so, out_dir, doing,
                                                                                        ort_says) or PackError(why) from None
    return out_dir / "optimized.onnx"


def _failed_write(src: str, so, out_dir: Path, doing: str, ort_says: str) -> StorageError | None:
    """ORT failed where the file system shows no cause (an I/O error: ORT keeps no errno, and says
    "Protobuf serialization failed"): if the same model builds when nothing is written, its write failed."""
    import onnxruntime as ort
    so.optimized_model_filepath = ""
    try:
        ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    except Exception:
        return None     # the model's own fault: PackError
    return StorageError(f"{doing} failed writing the optimized model under {out_dir}: ONNX Runtime says {ort_says}")


def has_half_weights(model: onnx.ModelProto) -> bool:
    """Whether any (sub)graph holds an fp16 or bf16 initializer or Constant."""
    for graph in iter_graphs(model.graph):
        if any(t.data_type in HALF_TYPES for t in graph.initializer):
            return True
        for node in graph.node:
            if node.op_type == "Constant" and any(a.name == "value" and a.t.data_type in HALF_TYPES
                                                  for a in node.attribute):
                return True
    return False


def _half_weight_exclusions(source: onnx.ModelProto, keep_half_weights: bool = True) -> tuple[str, ...]:
    """The ORT optimizers to leave out so that half-precision weights stay in their dtype: () for other models,
    which pack exactly as they always have.

    Why: the CPU EP lacks fp16 kernels for most ops (MatMul, Conv, ...), so InsertCastTransformer wraps
    them in Casts at every level, and at "all" HALF_TO_FLOAT_FUSION then folds each weight's Cast into an
    fp32 copy. With it on, the host tier held 2x the fp16 bytes (fp32 CPU weights; ViT-B: 3x, the fp16
    originals stayed too), 3x once a GPU open added the GPU skeleton's fp16 weights. With it off, the
    skeleton keeps the fp16 weights and their Casts, every other optimization still runs, the GPU stubs
    dedupe onto the same bytes, and the host tier holds each weight once: 1.00x.

    The price, paid in each attach-mode client: the Casts run on every `run` (fp32 temporaries from ORT's
    arena) and rewrites that need fp32 constant weights (NCHWc on Conv) no longer apply. Measured side by
    side (`modelcache bench halfweights --models resnet50-fp16 vit_b_16-fp16`, benchmarks/halfweights,
    ORT 1.32, 2 shared cores, 3 runs), fp16 kept against the old fp32 weights: warm runs +25-32 % on
    ResNet-50 (1.25-1.45x plain ORT) and +9-10 % on ViT-B/16 (1.16-1.24x), +28 MiB USS per client
    (70-74 vs 42-47 MiB ResNet-50, 87-91 vs 58-62 ViT-B; plain ORT 241-253 and 460-595), session ready
    unchanged (45-140 ms; plain ORT 0.7-3.8 s). The alternative, fp16 in the host tier and each client
    widening the weights privately at open ("fold-at-open" there), keeps the old run time but costs
    145-148 / 390-393 MiB USS and +200-1500 ms at open: every client pays the fp32 copy the cache exists
    to share, so it was not taken. `keep_half_weights=False` restores the old packing.
    """
    return (HALF_TO_FLOAT_FUSION,) if keep_half_weights and has_half_weights(source) else ()


def _source_bytes(src: str) -> int:
    """The model file plus the external-data files it names: about what ORT writes when it saves it."""
    try:
        model = onnx.load(src, load_external_data=False)
    except Exception:  # not a model at all: then ORT wrote nothing, and its size is as good a guess
        return os.path.getsize(src)
    files = {e.value for g in iter_graphs(model.graph) for t in g.initializer for e in t.external_data
             if e.key == "location"}
    base = Path(src).parent
    return os.path.getsize(src) + sum((base / f).stat().st_size for f in files if (base / f).is_file())


def _tensor_bytes(t: TensorProto, base_dir: Path) -> bytes:
    if t.data_location == TensorProto.EXTERNAL:
        info = {e.key: e.value for e in t.external_data}
        with open(base_dir / info["location"], "rb") as f:
            f.seek(int(info.get("offset", 0)))
            return f.read(int(info["length"])) if "length" in info else f.read()
    if t.HasField("raw_data"):
        return t.raw_data
    return onnx.numpy_helper.to_array(t).tobytes()


_DATA_FIELDS = ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data")


def _point_external(t: TensorProto, location: str, offset: int, nbytes: int) -> None:
    """Drop the tensor's data and declare it external at `location`[offset:offset+nbytes]."""
    for fld in _DATA_FIELDS:
        t.ClearField(fld)
    del t.external_data[:]
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(nbytes))):
        t.external_data.add(key=k, value=v)


def model_io(src: str) -> tuple[list[IOEntry], list[IOEntry], list[IOEntry]]:
    """A model file's inputs (those a caller feeds), outputs and overridable initializers, as its manifest
    will list them; PackError when the file is no ONNX model (what `pack` would refuse first)."""
    try:
        model = onnx.load(src, load_external_data=False)
    except Exception as e:  # protobuf DecodeError, a truncated file...
        raise PackError(f"{src} is not a valid ONNX model: {str(e).strip()[:200] or type(e).__name__}") from None
    return manifest_io(model)


def manifest_io(model: onnx.ModelProto) -> tuple[list[IOEntry], list[IOEntry], list[IOEntry]]:
    """(inputs a caller feeds, outputs, overridable initializers) of a loaded model, as its manifest lists them."""
    fed = source_inputs(model)
    return (_io_entries(v for v in model.graph.input if v.name in fed), _io_entries(model.graph.output),
            overridable_entries(model))


def overridable_entries(model: onnx.ModelProto) -> list[IOEntry]:
    """The main graph's inputs that have an initializer (a default): ORT lets a run feed them in its place
    (get_overridable_initializers); IR 3 lists every initializer as an input, and ORT then overrides none."""
    if model.ir_version < 4:
        return []
    init_names = {t.name for t in model.graph.initializer}
    return _io_entries(v for v in model.graph.input if v.name in init_names)


def source_inputs(model: onnx.ModelProto) -> set[str]:
    """The names of the graph inputs a caller must feed: those without an initializer (a default)."""
    init_names = {t.name for t in model.graph.initializer}
    return {vi.name for vi in model.graph.input if vi.name not in init_names}


def drop_inputs_without_values(model: onnx.ModelProto, fed: set[str]) -> onnx.ModelProto:
    """Remove from the main graph's inputs those not `fed` (the source's: `source_inputs`) whose
    initializer ORT's optimizer removed; returns `model`, changed in place.

    Why: in an IR 3 model every initializer is also a graph input, and ORT's optimized copy keeps an
    input whose initializer a rewrite dropped (measured, ORT 1.32: ConstantSharing keeps one of each set
    of equal int64 shape tensors, e.g. ShuffleNet's OC2_DUMMY_*, and removes the others' initializers,
    not their inputs; the nodes read the one kept). Reloaded, those inputs had no default and every run
    asked for them."""
    graph = model.graph
    values = {t.name for t in graph.initializer}
    keep = [vi for vi in graph.input if vi.name in fed or vi.name in values]
    if len(keep) != len(graph.input):
        del graph.input[:]
        graph.input.extend(keep)
    return model


def _externalize(optimized: Path, blob_path: Path, progress: Progress | None,
                 fed: set[str]) -> tuple[onnx.ModelProto, list[TensorEntry], int]:
    """Move every large initializer of every (sub)graph into one page-aligned blob (inputs: see
    drop_inputs_without_values)."""
    model = drop_inputs_without_values(onnx.load(str(optimized), load_external_data=False), fed)
    candidates = []
    for graph in iter_graphs(model.graph):
        for t in graph.initializer:
            if t.data_type == TensorProto.STRING:
                continue  # strings have no fixed-size raw form; they stay inline
            nbytes = tensor_nbytes(t)
            if nbytes >= INLINE_MAX_BYTES or t.data_location == TensorProto.EXTERNAL:
                candidates.append((t, nbytes))
    total = sum(n for _, n in candidates)
    entries: list[TensorEntry] = []
    offset = done = 0
    with open(blob_path, "wb") as blob:
        for t, nbytes in candidates:
            data = _tensor_bytes(t, optimized.parent)
            if len(data) != nbytes:
                raise PackError(f"tensor {t.name!r}: {len(data)} bytes of data for {nbytes} declared")
            offset = -(-offset // ALIGN) * ALIGN
            blob.seek(offset)
            blob.write(data)
            entries.append(TensorEntry(t.name, onnx.helper.tensor_dtype_to_np_dtype(t.data_type).name,
                                       list(t.dims), offset, nbytes, hashlib.sha256(data).hexdigest(),
                                       integrity.digest(data)))
            _point_external(t, WEIGHTS_FILE, offset, nbytes)
            offset += nbytes
            done += nbytes
            if progress:
                progress(done, total)
        blob.truncate(offset)
    return model, entries, offset


def is_gpu_shared_weight(t: TensorProto) -> bool:
    """Whether an initializer's type and size make it a weight the GPU tier lends (else it stays inline)."""
    if t.data_type not in GPU_SHARED_DTYPES:
        return False
    elements = 1
    for d in t.dims:
        elements *= d
    return elements >= GPU_SHARED_MIN_ELEMENTS


def _cpu_only_rewrites(source: onnx.ModelProto, optimized: onnx.ModelProto) -> str | None:
    """Why the CPU build's optimized graph is unfit for the CUDA EP, or None when it is fit.

    ORT's InsertCastTransformer runs at every level on the CPU build and wraps each op the CPU EP
    lacks in fp16 between Casts to fp32 (measured on tiny-fp16 at BASIC, ORT 1.32: MatMul, Relu,
    MatMul became Cast x3, MatMul, Relu, MatMul, Cast; the added nodes are named
    `InsertedPrecisionFreeCast_<input>`). On a GPU those Casts would run the model in fp32.
    """
    def casts(model: onnx.ModelProto) -> list[str]:
        return [n.name for g in iter_graphs(model.graph) for n in g.node if n.op_type == "Cast"]

    added = len(casts(optimized)) - len(casts(source))
    named = sum(name.startswith("InsertedPrecisionFreeCast") for name in casts(optimized))
    if added > 0 or named:
        return f"ORT inserted {max(added, named)} Cast node(s) for the CPU EP"
    half = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
    source_types = {t.name: t.data_type for g in iter_graphs(source.graph) for t in g.initializer}
    widened = [t.name for g in iter_graphs(optimized.graph) for t in g.initializer
               if source_types.get(t.name) in half and t.data_type != source_types[t.name]]
    if widened:
        return f"ORT changed the type of half-precision weights {widened[:3]}"
    return None


@dataclass
class _GpuGraph:
    """The graph chosen for the GPU skeleton, before its weights are written."""
    model: onnx.ModelProto      # loaded without external data
    base_dir: Path              # where its external data lives
    opt_level: str              # "basic" or "disable"
    shared: set                 # names of the initializers that become stubs
    shared_bytes: int           # their bytes, counted once per name


def _choose_gpu_graph(src: str, source: onnx.ModelProto, work: Path, opt_level: str,
                      cpu_optimized: Path, doing: str = "optimizing") -> _GpuGraph:
    """BASIC on the CPU build when its rewrites are provider-independent, else the source graph as it
    is ("disable"): even ORT_DISABLE_ALL inserts the CPU EP's Casts, so no ORT output would do."""
    model = base_dir = None
    if opt_level != "disable":
        if opt_level == GPU_OPT_LEVEL:
            optimized = cpu_optimized  # the CPU skeleton's graph is the same optimization
        else:
            (work / "gpu").mkdir()
            optimized = optimize(src, work / "gpu", GPU_OPT_LEVEL, doing)
        model = drop_inputs_without_values(onnx.load(str(optimized), load_external_data=False),
                                           source_inputs(source))
        base_dir, level = optimized.parent, GPU_OPT_LEVEL
        if _cpu_only_rewrites(source, model) is not None:
            model = None
    if model is None:
        model, base_dir, level = onnx.load(src, load_external_data=False), Path(src).parent, "disable"
    shared = _gpu_shared_names(model, base_dir)
    sizes = {t.name: tensor_nbytes(t) for g in iter_graphs(model.graph) for t in g.initializer if t.name in shared}
    return _GpuGraph(model, base_dir, level, shared, sum(sizes.values()))


def _gpu_shared_names(model: onnx.ModelProto, base_dir: Path) -> set[str]:
    """Names of the initializers that become stubs in the GPU skeleton.

    add_initializer overrides by name in every (sub)graph at once (measured: an If whose two
    branches each hold a different "w" ran both branches with the one override), so a name held
    by tensors that differ, or by one that is not a shared weight, stays inline everywhere.
    """
    by_name: dict[str, list[TensorProto]] = {}
    for graph in iter_graphs(model.graph):
        for t in graph.initializer:
            by_name.setdefault(t.name, []).append(t)
    names = set()
    for name, tensors in by_name.items():
        if not all(is_gpu_shared_weight(t) for t in tensors):
            continue
        first = tensors[0]
        if any(t.data_type != first.data_type or list(t.dims) != list(first.dims)
               or _tensor_bytes(t, base_dir) != _tensor_bytes(first, base_dir) for t in tensors[1:]):
            continue
        names.add(name)
    return names


def _externalize_gpu(model: onnx.ModelProto, base_dir: Path, shared: set[str], blob_path: Path, blob_bytes: int,
                     cpu_tensors: list[TensorEntry],
                     on_tensor_done: Callable[[int], None]) -> tuple[list[TensorEntry], int]:
    """Turn the GPU graph's shared weights into stubs, their bytes into the blob; inline everything else.

    A weight whose bytes the blob already holds (a CPU tensor, or another GPU weight) reuses that
    offset. Returns (gpu tensors, blob size).
    """
    offset_of = {}
    for e in cpu_tensors:
        offset_of.setdefault(e.sha256, e.offset)
    entries: dict[str, TensorEntry] = {}
    with open(blob_path, "r+b") as blob:
        for graph in iter_graphs(model.graph):
            for t in graph.initializer:
                if t.name not in shared:
                    if t.data_location == TensorProto.EXTERNAL:  # not lent (e.g. int8 weights): inline
                        data = _tensor_bytes(t, base_dir)
                        del t.external_data[:]
                        t.data_location = TensorProto.DEFAULT
                        t.raw_data = data
                    continue
                nbytes = tensor_nbytes(t)
                if t.name not in entries:  # a weight repeated in sibling subgraphs is stored and lent once
                    data = _tensor_bytes(t, base_dir)
                    if len(data) != nbytes:
                        raise PackError(f"tensor {t.name!r}: {len(data)} bytes of data for {nbytes} declared")
                    sha = hashlib.sha256(data).hexdigest()
                    offset = offset_of.get(sha)
                    if offset is None:
                        offset = -(-blob_bytes // ALIGN) * ALIGN
                        blob.seek(offset)
                        blob.write(data)
                        blob_bytes = offset + nbytes
                        offset_of[sha] = offset
                    entries[t.name] = TensorEntry(t.name, onnx.helper.tensor_dtype_to_np_dtype(t.data_type).name,
                                                  list(t.dims), offset, nbytes, sha, integrity.digest(data))
                    on_tensor_done(nbytes)
                _point_external(t, GPU_STUB_FILE, 0, nbytes)
    return list(entries.values()), blob_bytes


def _write_gpu_skeleton(gpu: _GpuGraph, model_dir: Path, cpu_tensors: list[TensorEntry], blob_bytes: int,
                        progress: Progress | None) -> tuple[list[TensorEntry], int]:
    """Write GPU_SKELETON_FILE into `model_dir` and the shared weights it lacks into its blob;
    returns (gpu tensors, blob size). Progress continues where the CPU pass (`cpu_tensors`) ended."""
    cpu_bytes = sum(t.nbytes for t in cpu_tensors)
    done = 0

    def on_tensor_done(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress:
            progress(cpu_bytes + done, cpu_bytes + gpu.shared_bytes)

    gpu_tensors, blob_bytes = _externalize_gpu(gpu.model, gpu.base_dir, gpu.shared, model_dir / WEIGHTS_FILE,
                                               blob_bytes, cpu_tensors, on_tensor_done)
    try:
        onnx.save_model(gpu.model, str(model_dir / GPU_SKELETON_FILE))
    except ValueError as e:  # protobuf's 2 GB limit: large non-floating tensors (e.g. int8) stay inline
        raise PackError(f"the GPU skeleton is too large to save: {e}") from None
    return gpu_tensors, blob_bytes


def pack(src: str, repository: Path, name: str, version: int | None, opt_level: str = "all",
         progress: Progress | None = None, owner_uid: int = -1, keep_half_weights: bool = True,
         with_prepacked: bool = False, declared: dict | None = None, replacing: bool = False) -> Manifest:
    """Validate, optimize and pack `src` into `repository/name/version`, atomically; `version`
    None takes the next free one, even with other processes adding the same name at once.
    `keep_half_weights` False lets ORT widen fp16 weights to fp32 as it did before (for benchmarks).
    `with_prepacked` also stores MLAS's packed MatMul weights for clients to share, where the model's
    MatMul weights make it worth it (prepack.py; the `prepack` setting, `add --prepack`).
    `declared`: what the model's source declares beside the file, stored in the manifest as given:
    {"serving": its batching policy, "model_config": its Triton configuration, "labels": its outputs' class labels}
    (`modelcache import-triton`). `replacing`: the version is there already, and this pack replaces it: it is
    published beside it (reservations.staged_path), for the daemon to swap in (Repository.replace).

    A crash at any point leaves at most a `.tmp-*` directory that the next sweep removes
    (modelcache/store/reservations.py); the model appears under its name only through the final rename.
    """
    import onnxruntime as ort

    check_name(name)
    src = os.path.abspath(src)
    check_source(src)
    with storage_errors(f"adding {name} to the repository", repository):
        reservation = reservations.reserve(repository, name, version, replacing=replacing)
    version, tmp = reservation.version, reservation.tmp
    final = reservations.staged_path(repository, name, version) if replacing else repository / name / str(version)
    flusher = _Flusher()
    try:
        work = tmp / "work"
        work.mkdir()
        try:
            source_model = onnx.load(src, load_external_data=False)
        except Exception as e:  # protobuf DecodeError, a truncated file...
            raise PackError(f"{src} is not a valid ONNX model: {checker_says(src) or e}") from None
        doing = f"adding {name}@{version}"
        exclusions = _half_weight_exclusions(source_model, keep_half_weights)
        fed = source_inputs(source_model)
        while True:  # at opt_level, or lower where ORT's optimized graph does not load back
            if opt_level == SOURCE_LEVEL:
                optimized, gpu_level = Path(src), "disable"
            else:
                optimized = optimize(src, _fresh_dir(work / opt_level), opt_level, doing, exclusions)
                gpu_level = opt_level
            gpu = _choose_gpu_graph(src, source_model, _fresh_dir(work / f"{opt_level}-gpu"), gpu_level, optimized,
                                    doing)
            # One progress scale over both passes; the GPU pass's bytes are an upper bound (most dedupe).
            cpu_progress = (lambda done, total: progress(done, total + gpu.shared_bytes)) if progress else None
            skeleton, tensors, weights_bytes = _externalize(optimized, tmp / WEIGHTS_FILE, cpu_progress, fed)
            flusher.flush(tmp / WEIGHTS_FILE)   # (written back during the GPU pass)
            onnx.save_model(skeleton, str(tmp / SKELETON_FILE))
            try:
                _check_loads(tmp, fed)
                break
            except PackError as e:
                lower = _LOWER_LEVEL.get(opt_level)
                if lower is None:
                    raise
                log.warning("%s: ORT's graph at opt level %s does not load back (%s); packing at %s",
                            src, opt_level, str(e)[:300], lower)
                opt_level = lower
        gpu_tensors, weights_bytes = _write_gpu_skeleton(gpu, tmp, tensors, weights_bytes, progress)
        flusher.flush(tmp / WEIGHTS_FILE)   # (its GPU part, during the checks, manifest and hashes below)
        portable.write(tmp, tensors)   # (for clients given their lease's files as descriptors: portable.py)
        error = remove_tree(work)       # (it must go: the version is published as this directory holds it)
        if error is not None:
            raise error
        inputs, outputs, overridable = manifest_io(source_model)
        manifest = Manifest(
            name=name, version=version, inputs=inputs, outputs=outputs, overridable=overridable, tensors=tensors, weights_bytes=weights_bytes, source_sha256=_sha256_file(src),
            ort_version=ort.__version__, opt_level=opt_level, created_unix=time.time(),
            gpu_skeleton=GPU_SKELETON_FILE, gpu_opt_level=gpu.opt_level, gpu_tensors=gpu_tensors,
            owner_uid=owner_uid, serving=dict((declared or {}).get("serving") or {}),
            model_config=dict((declared or {}).get("model_config") or {}),
            labels=dict((declared or {}).get("labels") or {}))
        write_gpu_stub(tmp, manifest)
        check_gpu_skeleton(tmp, manifest)
        if with_prepacked:
            manifest.prepacked, manifest.prepacked_for = prepack.make(tmp, SKELETON_FILE, weights_bytes, tmp / "prepack")
        manifest.files = integrity.record_files(tmp, CHECKED_FILES + (PREPACKED_FILE,))
        (tmp / MANIFEST_FILE).write_text(manifest.to_json())
        flusher.wait()
        for p in tmp.iterdir():  # durable before visible
            _fsync(p)
        with storage_errors(doing, repository):
            if replacing and final.exists():   # (a replace that never swapped: the daemon's start removes those too)
                remove_tree(final)
            reservations.publish(reservation, final)
        return manifest
    except OSError as e:
        flusher.wait_quietly()
        error = storage_error(e, f"adding {name}@{version}", tmp) or e  # before the cleanup frees space
        reservations.abandon(reservation)
        raise error
    except BaseException:
        flusher.wait_quietly()
        reservations.abandon(reservation)
        raise


class _Flusher:
    """fsync on a thread while the pack goes on: the disk writes the weights back while the CPU makes the next
    part (fsync leaves the GIL). Done at the end, before the final fsyncs of every file, which find little
    left to write. Measured on ResNet-50 here: ~0.4 s of fsync, mostly the 187 MiB blob
    (benchmarks/repoload/pack_profile.py). An fsync's OSError is raised by `wait`, as the pack's own."""

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="modelcache-flush")
        self._pending: list = []

    def flush(self, path: Path) -> None:
        self._pending.append(self._pool.submit(_fsync, path))

    def wait(self) -> None:
        for f in self._pending:
            f.result()
        self._pool.shutdown()

    def wait_quietly(self) -> None:
        """On a pack that failed (a flush's error included): its flushes end before its files go."""
        self._pool.shutdown()


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fresh_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _check_loads(model_dir: Path, fed: set[str]) -> None:
    """The packed skeleton builds with optimizers off, the way clients will build it, and asks for
    the inputs the source model does (`fed`), no more."""
    from ..session_options import attach_session_options
    import onnxruntime as ort

    try:
        sess = ort.InferenceSession(str(model_dir / SKELETON_FILE), attach_session_options(),
                                    providers=["CPUExecutionProvider"])
    except Exception as e:
        raise PackError(f"packed model does not load in ONNX Runtime: {str(e).strip()[:500]}") from None
    _check_asks_for(sess, fed, "packed model")


def _check_asks_for(sess, fed: set[str], what: str) -> None:
    """PackError unless the ORT session `sess` takes exactly the inputs `fed` (by name)."""
    extra = sorted(i.name for i in sess.get_inputs() if i.name not in fed)
    if extra:
        raise PackError(f"{what} asks for inputs the source model gives values to: {extra[:5]}")


def check_gpu_skeleton(model_dir: Path, manifest: Manifest) -> None:
    """The GPU skeleton agrees with `manifest.gpu_tensors` and builds, on the CPU, the way GPU clients
    will build it: optimizers off, every stub overridden by add_initializer with an OrtValue over the
    blob (here its host mapping). Raises PackError saying what is wrong.

    The agreement is checked here because ORT checks none of it (measured, ORT 1.32): an override
    of the wrong shape builds, and a stub left without override silently reads the stub file's zeros.
    """
    from ..session_options import attach_session_options, bind_weights
    import onnxruntime as ort

    problems = _gpu_stub_mismatches(onnx.load(str(model_dir / GPU_SKELETON_FILE), load_external_data=False),
                                    manifest.gpu_tensors)
    if problems:
        raise PackError(f"packed GPU skeleton disagrees with its manifest: {'; '.join(problems[:5])}")
    so = attach_session_options()
    try:
        # ORT keeps raw pointers into the mappings: they must outlive the session (both die on return).
        maps, values = bind_weights(so, [str(model_dir / WEIGHTS_FILE)],
                                    [[t.name, t.dtype, t.shape, 0, t.offset, t.nbytes] for t in manifest.gpu_tensors])
        sess = ort.InferenceSession(str(model_dir / GPU_SKELETON_FILE), so, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise PackError(f"packed GPU skeleton does not load in ONNX Runtime: {str(e).strip()[:500]}") from None
    _check_asks_for(sess, {i.name for i in manifest.inputs}, "packed GPU skeleton")


def _gpu_stub_mismatches(skeleton: onnx.ModelProto, gpu_tensors: list[TensorEntry]) -> list[str]:
    """What differs between the skeleton's external initializers and the tensors meant to override them."""
    entries = {t.name: t for t in gpu_tensors}
    problems, stubs = [], set()
    for graph in iter_graphs(skeleton.graph):
        for t in graph.initializer:
            if t.data_location != TensorProto.EXTERNAL:
                continue
            location = {e.key: e.value for e in t.external_data}.get("location")
            entry = entries.get(t.name)
            if location != GPU_STUB_FILE or entry is None:
                problems.append(f"initializer {t.name!r} is external data in {location!r} with no GPU tensor for it")
                continue
            stubs.add(t.name)
            dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).name
            if (entry.dtype, list(entry.shape), entry.nbytes) != (dtype, list(t.dims), tensor_nbytes(t)):
                problems.append(f"{t.name!r} is {dtype}{list(t.dims)} in the skeleton, "
                                f"{entry.dtype}{list(entry.shape)} ({entry.nbytes} bytes) in the manifest")
    problems += [f"GPU tensor {name!r} has no stub in the skeleton" for name in entries if name not in stubs]
    return problems


def check_name(name: str) -> None:
    ok = name and len(name) <= 128 and all(c.isalnum() or c in "-_." for c in name) and not name.startswith(".")
    if not ok:
        raise PackError(f"invalid model name {name!r}: use letters, digits, '-', '_' and '.', not starting with '.'")


def exec_packer(argv: list[str], pass_fds=()):
    """`python -m modelcache.store.packing ARGV` (_main) in a fresh interpreter, its stdout and stderr piped."""
    import subprocess
    import sys
    return subprocess.Popen([sys.executable, "-m", "modelcache.store.packing", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, pass_fds=list(pass_fds))


def pack_in_subprocess(src: str, repository: Path, name: str, version: int, opt_level: str = "all",
                       progress: Progress | None = None, on_start=None, sources: tuple = ((), ()),
                       owner_uid: int = -1, with_prepacked: bool = False, declared: dict | None = None,
                       replacing: bool = False, spawn=exec_packer) -> Manifest:
    """`pack` in a child process: ORT's memory goes back to the OS when it exits, and a model that
    crashes ORT costs that child, not the caller (the daemon). `on_start(proc)` lets the caller kill it.
    `spawn(argv, pass_fds)` starts the child (a Popen): a fresh interpreter (`exec_packer`), or a fork of a
    server that has the imports done (warm_packer.WarmPacker.spawn, the daemon's).

    sources: (descriptors, names) of the model's files as the client opened them (modelcache/store/sources.py);
    the child copies them into a private directory and packs that copy: `src` then only names them."""
    import json

    fds, names = sources
    # What the model declares beside its file (a Triton config, its class labels: 21k ImageNet labels are ~0.5 MB)
    # goes in a memory file, not in argv: an argument is at most 128 KiB (E2BIG), a message to the warm packer
    # a socket buffer (EMSGSIZE).
    declared_fd = os.memfd_create("modelcache-declared")
    try:
        os.write(declared_fd, json.dumps(declared or {}).encode())
        argv = [src, str(repository), name, str(version), opt_level, str(owner_uid),
                "prepack" if with_prepacked else "-", "replacing" if replacing else "-", f"@{declared_fd}",
                *(f"{fd}:{n}" for fd, n in zip(fds, names))]
        proc = spawn(argv, [declared_fd, *fds])
    finally:
        os.close(declared_fd)
    if on_start:
        on_start(proc)
    error, said_ok = None, False
    try:
        for line in proc.stdout:  # "progress DONE TOTAL" lines, then "ok" or "error CODE MESSAGE"
            kind, _, rest = line.rstrip("\n").partition(" ")
            if kind == "progress" and progress:
                done, total = rest.split()
                progress(int(done), int(total))
            elif kind == "error":
                code, _, message = rest.partition(" ")
                error = from_code(code, message)
            elif kind == "ok":
                said_ok = True
        stderr = proc.stderr.read()
    except BaseException:   # (the caller's progress failed): the pack goes with it
        proc.kill()
        proc.wait()
        raise
    finally:
        proc.stdout.close()
        proc.stderr.close()
    rc = proc.wait()
    if error is not None:
        raise error
    if not said_ok:   # (its "ok" is the word: it comes after the publishing rename, whatever the exit says)
        how = f"was killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
        raise PackError(f"packing {src} failed: the packing process {how}. {stderr.strip()[-500:]}")
    return load_manifest(reservations.staged_path(repository, name, version) if replacing else
                         repository / name / str(version))


def _main(argv: list[str]) -> int:
    import json
    src, repository, name, version, opt_level, owner_uid, prepack_flag, replacing, declared, *fd_names = argv
    scratch = copied = None
    try:
        if declared.startswith("@"):   # a memory file's descriptor (pack_in_subprocess)
            from ..session_options import read_whole
            declared = read_whole(int(declared[1:])).decode()
        if fd_names:  # the client's descriptors: pack a private copy, never a path the client named
            from .sources import copy_sources
            fds, names = zip(*((int(fd), n) for fd, _, n in (s.partition(":") for s in fd_names)))
            with storage_errors(f"adding {name}: copying its files into the repository", repository):
                scratch = reservations.scratch(Path(repository))  # (swept like a reservation after a crash)
                copied = str(scratch.tmp)
                path = copy_sources(list(fds), list(names), copied)
        else:
            path = src
        pack(path, Path(repository), name, int(version), opt_level,
             progress=lambda d, t: print(f"progress {d} {t}", flush=True), owner_uid=int(owner_uid),
             with_prepacked=prepack_flag == "prepack", declared=json.loads(declared), replacing=replacing == "replacing")
    except (ModelCacheError, OSError) as e:  # PackError, StorageError...: the parent raises the same type
        code = e.code if isinstance(e, ModelCacheError) else PackError.code
        # Errors name the client's file, not our copy of it.
        text = str(e).replace(copied, os.path.dirname(src)) if copied else str(e)
        print(f"error {code} " + text.replace("\n", " "), flush=True)
        return 2
    finally:
        if scratch is not None:
            reservations.abandon(scratch)
    print("ok", flush=True)
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(_main(sys.argv[1:]))
