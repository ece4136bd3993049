"""The remote tier: a read-only model store at a URL (file:// or http(s)://), fetched into the repository.

A store is a directory laid out like a repository (`<name>/<version>/{manifest.json,
model.onnx,weights.bin}`, and `model.gpu.onnx` for models packed with a GPU variant) plus an `index.json` that `modelcache publish DIR` writes:
every file with its size and sha256. A fetch downloads into a temporary directory
inside the repository, checks every file's size and sha256, and only then renames
it into place: a corrupt or interrupted download is never visible.
"""

from __future__ import annotations

import hashlib
import json
import time
import urllib.parse
import urllib.request
from pathlib import Path

from ..errors import ModelNotFound, RemoteError
from ..storage import storage_error, storage_errors, write_atomic
from ..store import reservations
from ..store.format import (GPU_SKELETON_FILE, MANIFEST_FILE, PORTABLE_SKELETON_FILE, PREPACKED_FILE, SKELETON_FILE,
                            WEIGHTS_FILE, Manifest, load_manifest, write_gpu_stub)
from ..store.integrity import file_digest

INDEX_FILE = "index.json"
# The GPU skeleton's stub file is not published: it is zeros, made again after a fetch (write_gpu_stub).
FILES = (MANIFEST_FILE, SKELETON_FILE, WEIGHTS_FILE, GPU_SKELETON_FILE, PREPACKED_FILE, PORTABLE_SKELETON_FILE)
# Absent before the GPU variant / before portable skeletons; prepacked: MatMul-heavy models only.
OPTIONAL_FILES = (GPU_SKELETON_FILE, PREPACKED_FILE, PORTABLE_SKELETON_FILE)
CHUNK = 1 << 22


def publish(directory: Path) -> dict:
    """Write `directory/index.json` for the packed models under it; returns the index."""
    models = []
    for manifest_path in sorted(Path(directory).glob(f"*/*/{MANIFEST_FILE}")):
        d = manifest_path.parent
        files = {}
        for f in FILES:
            if f in OPTIONAL_FILES and not (d / f).exists():
                continue
            files[f] = {"bytes": (d / f).stat().st_size, "sha256": file_digest(d / f, hashlib.sha256())}
        models.append({"name": d.parent.name, "version": int(d.name), "files": files})
    index = {"format": 1, "models": models}
    with storage_errors(f"publishing {directory}", Path(directory) / INDEX_FILE):
        write_atomic(Path(directory) / INDEX_FILE, json.dumps(index, indent=1))
    return index


class RemoteStore:
    def __init__(self, url: str, timeout_s: float = 30.0):
        self.url = url.rstrip("/") + "/"
        scheme = urllib.parse.urlparse(self.url).scheme
        if scheme not in ("file", "http", "https"):
            raise RemoteError(f"remote store {url!r}: use a file://, http:// or https:// URL")
        self.timeout_s = timeout_s

    def _open(self, relative: str):
        url = urllib.parse.urljoin(self.url, urllib.parse.quote(relative))
        try:
            return urllib.request.urlopen(url, timeout=self.timeout_s)
        except Exception as e:  # URLError, HTTPError, OSError: all mean "cannot read it"
            raise RemoteError(f"cannot read {url}: {e}") from None

    def index(self) -> list[dict]:
        with self._open(INDEX_FILE) as r:
            try:
                return json.loads(r.read())["models"]
            except (ValueError, KeyError) as e:
                raise RemoteError(f"{self.url}{INDEX_FILE} is not a modelcache index: {e}") from None

    def resolve(self, name: str, version: int | None) -> dict:
        entries = [m for m in self.index() if m["name"] == name]
        if not entries:
            raise ModelNotFound(f"no model named {name!r} locally or in the remote store {self.url}")
        if version is None:
            return max(entries, key=lambda m: m["version"])
        for m in entries:
            if m["version"] == version:
                return m
        raise ModelNotFound(f"model {name!r} has no version {version} locally or in the remote store "
                            f"(remote has {sorted(m['version'] for m in entries)})")

    def fetch(self, entry: dict, repository: Path, progress=None) -> tuple[Path, Manifest, float]:
        """Download one model into the repository, verified. Returns (dir, manifest, seconds)."""
        t0 = time.perf_counter()
        name, version = entry["name"], entry["version"]
        final = repository / name / str(version)
        with storage_errors(f"fetching {name}@{version} from {self.url}", repository):
            reservation = reservations.reserve(repository, name, version)
        tmp = reservation.tmp
        try:
            total = sum(f["bytes"] for f in entry["files"].values())
            done = 0
            for fname, meta in entry["files"].items():
                if fname not in FILES:
                    raise RemoteError(f"index names an unexpected file {fname!r}")
                h = hashlib.sha256()
                size = 0
                with self._open(f"{name}/{version}/{fname}") as r, open(tmp / fname, "wb") as out:
                    while chunk := r.read(CHUNK):
                        h.update(chunk)
                        out.write(chunk)
                        size += len(chunk)
                        done += len(chunk)
                        if progress:
                            progress(done, total)
                if size != meta["bytes"] or h.hexdigest() != meta["sha256"]:
                    raise RemoteError(f"{name}@{version}/{fname} from {self.url} does not match its index "
                                      f"({size} bytes, sha256 {h.hexdigest()[:12]}..., expected {meta['bytes']} "
                                      f"bytes, {meta['sha256'][:12]}...)")
            manifest = load_manifest(tmp, f"{name}@{version} from {self.url}")
            if manifest.gpu_skeleton:
                if GPU_SKELETON_FILE not in entry["files"]:
                    raise RemoteError(f"{name}@{version} in {self.url} has a GPU variant but the index lists no "
                                      f"{GPU_SKELETON_FILE}; publish the store again")
                write_gpu_stub(tmp, manifest)
            with storage_errors(f"fetching {name}@{version} from {self.url}", repository):
                reservations.publish(reservation, final)
            return final, manifest, time.perf_counter() - t0
        except OSError as e:
            # (the error first: it reports the free space, which the cleanup changes)
            error = storage_error(e, f"fetching {name}@{version} from {self.url}", tmp) or e
            reservations.abandon(reservation)
            raise error
        except BaseException:
            reservations.abandon(reservation)
            raise
