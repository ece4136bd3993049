"""`modelcache verify`: check every stored file of every version in a repository against its checksums.

With the daemon down it reads the repository directly. With a daemon running, the daemon scrubs
(the `verify` request, daemon/models.py) so that what it finds counts: a version marked corrupt whose
files are found intact again (repaired, or put back) is served again. The daemon also checks every
byte it promotes from disk, so a damaged file never reaches a client. A scrub is for the operator:
find damage early, know which files, and clear a mark after a repair.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import IntegrityError
from . import integrity
from .format import CHECKED_FILES, WEIGHTS_FILE, Manifest, TensorEntry, iter_graphs, load_manifest, version_dirs

OK, UNVERIFIED, DAMAGED = "ok", "unverified", "DAMAGED"


@dataclass
class VersionReport:
    key: str
    status: str = OK
    problems: list = field(default_factory=list)
    bytes_checked: int = 0
    seconds: float = 0.0

    def line(self) -> str:
        head = f"{self.key:<28} {self.status:<10}"
        if self.status == DAMAGED:
            return head + "\n" + "\n".join(f"    {p}" for p in self.problems)
        note = " (packed before file checksums: tensors checked against their sha256, skeletons parsed)" \
            if self.status == UNVERIFIED else ""
        return head + f" {self.bytes_checked / 2**20:.1f} MiB in {self.seconds:.2f} s{note}"


    def to_wire(self, cleared: bool = False) -> dict:
        """As a VerifyReply carries it; `cleared`: the daemon served it again after this check."""
        return {"key": self.key, "status": self.status, "problems": self.problems,
                "bytes_checked": self.bytes_checked, "seconds": self.seconds, "cleared": cleared}

    @classmethod
    def from_wire(cls, d: dict) -> "VersionReport":
        return cls(d["key"], d["status"], list(d["problems"]), d["bytes_checked"], d["seconds"])


def verify_repository(root: Path, name: str | None = None) -> list[VersionReport]:
    return [verify_version(d, f"{n}@{v}") for n, v, d in version_dirs(root, name)]


def nothing_to_verify(root: Path, name: str | None) -> str:
    """The one line for a scrub that found no version: what was asked, and what the repository has."""
    names = sorted({n for n, _, _ in version_dirs(root)})
    has = f"it has {', '.join(names)}" if names else "it is empty"
    return f"no model named {name!r} in {root}; {has}" if name else f"no model in {root}: {has}"


def verify_version(model_dir: Path, key: str) -> VersionReport:
    report = VersionReport(key)
    t0 = time.perf_counter()
    try:
        manifest = load_manifest(model_dir, key)
        if f"{manifest.name}@{manifest.version}" != key:
            raise integrity.damaged(key, "manifest.json", f"it names {manifest.name}@{manifest.version}")
    except IntegrityError as e:
        report.problems.append(str(e))
    else:
        if manifest.checksum:
            _check_recorded_files(model_dir, key, manifest, report)
        else:
            report.status = UNVERIFIED
            _check_unrecorded_version(model_dir, key, manifest, report)
    if report.problems:
        report.status = DAMAGED
    report.seconds = time.perf_counter() - t0
    return report


def _check_recorded_files(model_dir: Path, key: str, manifest: Manifest, report: VersionReport) -> None:
    for fname, record in manifest.files.items():
        try:
            integrity.check_file(key, model_dir, fname, record)
            report.bytes_checked += record["bytes"]
        except IntegrityError as e:
            report.problems.append(str(e))
            if fname == WEIGHTS_FILE and "missing" not in str(e) and "truncated" not in str(e):
                report.problems += _damaged_tensors(model_dir / fname, manifest.tensors + manifest.gpu_tensors,
                                                    lambda t, data: integrity.digest(data) == t.xxh3)


def _check_unrecorded_version(model_dir: Path, key: str, manifest: Manifest, report: VersionReport) -> None:
    """A version from before file checksums: what can still be checked without them."""
    weights = model_dir / WEIGHTS_FILE
    try:
        integrity.check_size(key, weights, manifest.weights_bytes)
    except IntegrityError as e:
        report.problems.append(str(e))
    else:
        report.problems += _damaged_tensors(weights, manifest.tensors + manifest.gpu_tensors,
                                            lambda t, data: hashlib.sha256(data).hexdigest() == t.sha256)
        report.bytes_checked += manifest.weights_bytes
    import onnx
    for fname in CHECKED_FILES[1:]:
        if (model_dir / fname).exists():
            try:
                list(iter_graphs(onnx.load(str(model_dir / fname), load_external_data=False).graph))
            except Exception as e:  # protobuf's DecodeError, UnicodeDecodeError...: a damaged file
                report.problems.append(str(integrity.damaged(key, fname, f"not an ONNX graph: {type(e).__name__}")))


def _damaged_tensors(weights: Path, tensors: list[TensorEntry], intact) -> list[str]:
    """One line per tensor whose bytes fail `intact(tensor, data)` (each distinct offset read once)."""
    out, seen = [], set()
    with open(weights, "rb") as f:
        for t in tensors:
            if t.offset in seen:
                continue
            seen.add(t.offset)
            f.seek(t.offset)
            if not intact(t, f.read(t.nbytes)):
                out.append(f"  tensor {t.name!r} ({t.nbytes} bytes at offset {t.offset}) differs from add time")
    return out
