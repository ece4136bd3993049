"""The stored-model format: a version's files, its manifest (read, validated, written), and how to walk its graphs.

Everything that only reads a stored model (the tiers, the registry, scrub, the executor's partitioner)
imports this module and never the packer: nothing here imports onnx or onnxruntime, so a reader does not
pay their import. Graph walks and tensor sizes are duck-typed over onnx's protobuf messages (a caller that
has a ModelProto has already imported onnx); the numbers they compare against are the enum values fixed by
onnx.proto.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from ..errors import IntegrityError
from ..storage import storage_errors, write_atomic
from . import integrity

MANIFEST_FORMAT = 1
SKELETON_FILE = "model.onnx"
WEIGHTS_FILE = "weights.bin"
MANIFEST_FILE = "manifest.json"
GPU_SKELETON_FILE = "model.gpu.onnx"
# The stubs' external data: a sparse file of zeros that no session reads (add_initializer overrides them).
GPU_STUB_FILE = "model.gpu.stub"
# MLAS's pre-packed MatMul weights (prepack.py), for MatMul-heavy models packed with them.
PREPACKED_FILE = "prepacked.bin"
# The skeleton that names no file of ours (portable.py): what a client given its lease's files as
# descriptors loads, in any mount namespace. Absent from versions packed before it (their leases go by path).
PORTABLE_SKELETON_FILE = "model.portable.onnx"
# The stored files a version's checksums cover, besides manifest.json (which carries its own).
# The GPU stub is not among them: it is sparse zeros that no session reads, made again after a fetch.
CHECKED_FILES = (WEIGHTS_FILE, SKELETON_FILE, GPU_SKELETON_FILE, PORTABLE_SKELETON_FILE)
# Tensors are page-aligned in the blob: ORT maps each external tensor on its own, and
# a page-aligned offset maps exactly the tensor's pages (and keeps GPU copies aligned).
ALIGN = 4096

# onnx.proto's TensorProto.DataType -> (numpy dtype name, bytes per element as onnx's numpy dtype has it).
# The sub-byte types count one byte per element: what onnx.helper.tensor_dtype_to_np_dtype(..).itemsize says,
# and so what every size the packer ever recorded assumed (tests/test_packing.py checks the table against onnx).
ONNX_ELEMENT_TYPES = {
    1: ("float32", 4), 2: ("uint8", 1), 3: ("int8", 1), 4: ("uint16", 2), 5: ("int16", 2), 6: ("int32", 4),
    7: ("int64", 8), 8: ("object", 8), 9: ("bool", 1), 10: ("float16", 2), 11: ("float64", 8), 12: ("uint32", 4),
    13: ("uint64", 8), 14: ("complex64", 8), 15: ("complex128", 16), 16: ("bfloat16", 2),
    17: ("float8_e4m3fn", 1), 18: ("float8_e4m3fnuz", 1), 19: ("float8_e5m2", 1), 20: ("float8_e5m2fnuz", 1),
    21: ("uint4", 1), 22: ("int4", 1), 23: ("float4_e2m1fn", 1), 24: ("float8_e8m0fnu", 1), 25: ("uint2", 1),
    26: ("int2", 1), 27: ("float6_e2m3fn", 1), 28: ("float6_e3m2fn", 1),
}
# onnx.proto's AttributeProto.AttributeType values of the attributes that hold subgraphs.
_ATTR_GRAPH = 5
_ATTR_GRAPHS = 10


@dataclass
class TensorEntry:
    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int
    sha256: str
    xxh3: str = ""      # integrity.HASH_NAME of the bytes: promotion checks it as it copies ("" before that)


@dataclass
class IOEntry:
    name: str
    dtype: str          # numpy dtype name, e.g. "float32"
    shape: list         # ints for fixed dims, strings (or None) for symbolic ones


@dataclass
class Manifest:
    name: str
    version: int
    inputs: list[IOEntry]
    outputs: list[IOEntry]
    tensors: list[TensorEntry]
    weights_bytes: int
    source_sha256: str
    ort_version: str
    opt_level: str
    created_unix: float
    format: int = MANIFEST_FORMAT
    stage_cuts: list = field(default_factory=list)   # the tensor crossing each cut
    stages: list = field(default_factory=list)       # {file, inputs, outputs, tensors, cost_share} per stage
    batching: dict = field(default_factory=dict)     # calibration profile of these stages (`modelcache calibrate`)
    gpu_skeleton: str = ""       # GPU_SKELETON_FILE; "" for models packed before GPU support
    gpu_opt_level: str = ""      # level of the GPU skeleton's graph: "basic", or "disable" (packing._choose_gpu_graph)
    gpu_tensors: list = field(default_factory=list)  # TensorEntry per stub of the GPU skeleton, offset into weights.bin
    files: dict = field(default_factory=dict)  # stored file -> {"bytes", "xxh3"}; {} for versions packed before
    checksum: str = ""      # of this manifest's canonical form (integrity.manifest_checksum); "" before
    owner_uid: int = -1          # who added it (the kernel's uid of the adding client); -1: unknown, admins only
    prepacked: list = field(default_factory=list)  # per weight, its MatMul blobs in PREPACKED_FILE (prepack.py)
    prepacked_for: str = ""      # prepack.cpu_fingerprint() of the machine that made them
    serving: dict = field(default_factory=dict)  # its own batching policy (calibration.check_serving): from a Triton config
    model_config: dict = field(default_factory=dict)  # the Triton model configuration it was imported with (JSON)
    labels: dict = field(default_factory=dict)   # output -> its classes' labels (a Triton output's label_filename)
    # Initializers that are also graph inputs (IR >= 4): a request may feed them, overriding the stored weight
    # (Triton's ORT backend serves them as optional inputs); [] for versions packed before this was recorded.
    overridable: list = field(default_factory=list)

    def to_json(self) -> str:
        """The manifest as stored, its checksum recomputed: every writer goes through here."""
        fields = json.loads(json.dumps(asdict(self)))   # the values exactly as a reader will parse them
        self.checksum = fields["checksum"] = integrity.manifest_checksum(fields)
        return json.dumps(fields, indent=1)

    @classmethod
    def from_dict(cls, d: dict) -> "Manifest":
        d = dict(d)
        d["inputs"] = [IOEntry(**e) for e in d["inputs"]]
        d["outputs"] = [IOEntry(**e) for e in d["outputs"]]
        d["overridable"] = [IOEntry(**e) for e in d.get("overridable", [])]
        d["tensors"] = [TensorEntry(**e) for e in d["tensors"]]
        d["gpu_tensors"] = [TensorEntry(**e) for e in d.get("gpu_tensors", [])]
        return cls(**d)

    def io_summary(self) -> dict:
        """The part of a manifest a client needs to validate feeds (sent over the wire); built once."""
        cached = self.__dict__.get("_io_summary")
        if cached is None:
            cached = self.__dict__["_io_summary"] = {"inputs": [asdict(e) for e in self.inputs],
                                                     "outputs": [asdict(e) for e in self.outputs],
                                                     "overridable": [asdict(e) for e in self.overridable]}
        return cached


def load_manifest(model_dir: Path, key: str | None = None) -> Manifest:
    """Read and validate a version's manifest; IntegrityError naming the version and the file when it
    is missing, damaged or malformed (never a decode error). `key` names it (default: name@version
    from the directory)."""
    model_dir = Path(model_dir)
    key = key or f"{model_dir.parent.name}@{model_dir.name}"
    try:
        raw = (model_dir / MANIFEST_FILE).read_bytes()
    except FileNotFoundError:
        raise integrity.damaged(key, MANIFEST_FILE, "the file is missing") from None
    return parse_manifest(raw, key)


def parse_manifest(raw: bytes, key: str) -> Manifest:
    def bad(what: str) -> IntegrityError:
        return integrity.damaged(key, MANIFEST_FILE, what)

    try:
        fields = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"not JSON: {e}") from None
    if not isinstance(fields, dict):
        raise bad("not a JSON object")
    stored = fields.get("checksum", "")
    if stored and integrity.manifest_checksum(fields) != stored:
        raise bad("its contents do not match its checksum")
    try:
        manifest = Manifest.from_dict(fields)
    except (TypeError, KeyError, ValueError, AttributeError) as e:
        raise bad(f"malformed: {type(e).__name__}: {e}") from None
    problem = _manifest_problem(manifest)
    if problem:
        raise bad(f"malformed: {problem}")
    return manifest


def _manifest_problem(m: Manifest) -> str | None:
    """What in a parsed manifest cannot be used as it is, or None: the checks a reader would otherwise
    trip over later as a KeyError or a read past the blob's end."""
    def is_int(v) -> bool:
        return type(v) is int

    if not isinstance(m.name, str) or not is_int(m.version) or not is_int(m.weights_bytes) or m.weights_bytes < 0:
        return "name, version or weights_bytes of the wrong type"
    for t in [*m.tensors, *m.gpu_tensors]:
        if not (isinstance(t.name, str) and is_int(t.offset) and is_int(t.nbytes) and t.offset >= 0
                and t.nbytes >= 0 and isinstance(t.shape, list) and all(is_int(d) for d in t.shape)
                and isinstance(t.sha256, str) and isinstance(t.xxh3, str)):
            return f"tensor entry {t.name!r} has a field of the wrong type"
        if t.offset + t.nbytes > m.weights_bytes:
            return f"tensor {t.name!r} ends at {t.offset + t.nbytes}, past the weights' {m.weights_bytes} bytes"
    if not isinstance(m.files, dict) or not all(isinstance(r, dict) and is_int(r.get("bytes"))
                                                and isinstance(r.get("xxh3"), str) for r in m.files.values()):
        return "files has an entry of the wrong type"
    return _prepacked_problem(m)


def _prepacked_problem(manifest: Manifest) -> str | None:
    """What in a manifest's prepack records (prepack.make's) cannot be used as it is, or None."""
    size = manifest.files.get(PREPACKED_FILE, {}).get("bytes", 0) if isinstance(manifest.files, dict) else 0
    if not isinstance(manifest.prepacked, list) or not isinstance(manifest.prepacked_for, str):
        return "prepacked or prepacked_for of the wrong type"
    for r in manifest.prepacked:
        try:
            ok = isinstance(r["tensor"], str) and all(
                isinstance(key, str) and "|" not in key and blobs and all(
                    type(off) is int and type(n) is int and isinstance(x, str) and 0 <= off and 0 < n
                    and off + n <= size for off, n, x in blobs)
                for key, blobs in r["packs"])
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            return f"prepacked record {str(r)[:80]!r} is malformed or reaches past {PREPACKED_FILE}"
    return None


def version_dirs(root: Path, name: str | None = None) -> list[tuple[str, int, Path]]:
    """(name, version, directory) of every version directory of a repository laid out as
    <root>/<name>/<version>/, complete or not, sorted (names starting with "." are work in progress)."""
    found = []
    for d in sorted(Path(root).glob(f"{name or '*'}/*")):
        if d.is_dir() and not d.parent.name.startswith(".") and d.name.isdigit():
            found.append((d.parent.name, int(d.name), d))
    return found


def write_manifest(model_dir: Path, manifest: Manifest, doing: str = "") -> None:
    """Replace a packed model's manifest atomically and durably: a reader sees the old one or the new one.
    A failure is a StorageError naming the version, `doing` (default: rewriting its manifest) and the file."""
    key = f"{manifest.name}@{manifest.version}"
    with storage_errors(doing or f"rewriting the manifest of {key}", Path(model_dir) / MANIFEST_FILE):
        write_atomic(Path(model_dir) / MANIFEST_FILE, manifest.to_json(), durable=True)


def write_gpu_stub(model_dir: Path, manifest: Manifest) -> None:
    """(Re)create the GPU skeleton's stub file: sparse zeros as long as the largest stub, costing no disk.

    For whoever copies a packed model (the remote tier): never copy the stub, make it here.
    """
    size = max((t.nbytes for t in manifest.gpu_tensors), default=0)
    with open(model_dir / GPU_STUB_FILE, "wb") as f:
        os.truncate(f.fileno(), size)


def iter_graphs(graph) -> Iterator:
    """An onnx.GraphProto and every subgraph (If/Loop/Scan bodies), depth first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == _ATTR_GRAPH:
                yield from iter_graphs(attr.g)
            elif attr.type == _ATTR_GRAPHS:
                for g in attr.graphs:
                    yield from iter_graphs(g)


def tensor_nbytes(t) -> int:
    """Bytes of an onnx.TensorProto's data, from its element type and dims (KeyError for an unknown type)."""
    nbytes = ONNX_ELEMENT_TYPES[t.data_type][1]
    for d in t.dims:
        nbytes *= d
    return nbytes
