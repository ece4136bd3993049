"""Checksums of a packed model's stored files: what is written at add time and how it is checked.

The hash is xxh3-128 (`xxhash`): on this machine it hashes 14-19 GB/s against 3.2-3.5 for
BLAKE3 (one thread or several: the same here) and 1.2-1.6 for sha256 (`modelcache bench
hashes`, benchmarks/hashes), so promotion can verify every byte it copies; what that costs
is in benchmarks/tiers and tiers/files.copy_hashed. It guards against damage (bit rot, a bad
copy, a truncated write, a hand edit), not against an attacker who can write the repository:
such a person can rewrite the checksums too.

Where each checksum lives (see format.Manifest):
  weights.bin       per tensor (`TensorEntry.xxh3`, checked as promotion copies each one) and
                    whole (`Manifest.files`, checked by `modelcache verify`)
  model.onnx, model.gpu.onnx   whole, in `Manifest.files`
  manifest.json     inside itself: `Manifest.checksum` is the hash of the manifest's canonical
                    form (sorted keys, no whitespace) without that field. One file, so the
                    manifest's rewrites (partition, set_batching) stay one atomic rename; any
                    edit that changes a value or a key changes the canonical form.
Versions packed before this carry none of these (`checksum` empty): they still open, unverified.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import IntegrityError

HASH_NAME = "xxh3_128"
CHUNK = 1 << 22


def new_hasher():
    import xxhash
    return xxhash.xxh3_128()


def digest(data) -> str:
    h = new_hasher()
    h.update(data)
    return h.hexdigest()


def file_digest(path: Path, h=None) -> str:
    """The file's hex digest: xxh3-128, or what the hasher `h` given computes (e.g. hashlib.sha256())."""
    h = h or new_hasher()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def manifest_checksum(fields: dict) -> str:
    """The hash of a manifest's canonical form, its own `checksum` field left out."""
    canonical = {k: v for k, v in fields.items() if k != "checksum"}
    return digest(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode())


def record_files(model_dir: Path, names) -> dict:
    """{file: {"bytes", "xxh3"}} for the files of a version that exist (written into its manifest)."""
    out = {}
    for name in names:
        path = Path(model_dir) / name
        if path.exists():
            out[name] = {"bytes": path.stat().st_size, "xxh3": file_digest(path)}
    return out


def damaged(key: str, fname: str, what: str) -> IntegrityError:
    """The error every integrity check raises: it names the model version and the file."""
    return IntegrityError(f"{key}: {fname} is damaged ({what}); the version is marked corrupt and not served")


def check_size(key: str, path: Path, expected_bytes: int) -> None:
    """The file exists and has its recorded size (a truncated or missing file, said plainly)."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise damaged(key, path.name, "the file is missing") from None
    if size != expected_bytes:
        how = "truncated" if size < expected_bytes else "longer than recorded"
        raise damaged(key, path.name, f"{how}: {size} bytes, {expected_bytes} recorded at add time")


def check_file(key: str, model_dir: Path, fname: str, record: dict) -> None:
    """A whole file against its record in `Manifest.files`."""
    path = Path(model_dir) / fname
    check_size(key, path, record["bytes"])
    got = file_digest(path)
    if got != record["xxh3"]:
        raise damaged(key, fname, f"{HASH_NAME} {got[:12]}..., {record['xxh3'][:12]}... recorded at add time")
