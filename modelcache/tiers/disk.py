"""The disk tier: a repository of packed models laid out as <root>/<name>/<version>/."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from .. import reservations
from ..packing import MANIFEST_FILE, Manifest, load_manifest

log = logging.getLogger("modelcache.disk")


class Repository:
    def __init__(self, root: Path):
        self.root = Path(root)

    def scan(self) -> list[tuple[Path, Manifest]]:
        """Every complete packed model; half-written ones (a crash during add) are removed."""
        self.root.mkdir(parents=True, exist_ok=True)
        reservations.sweep(self.root)
        found = []
        for manifest_path in sorted(self.root.glob(f"*/*/{MANIFEST_FILE}")):
            model_dir = manifest_path.parent
            try:
                found.append((model_dir, load_manifest(model_dir)))
            except Exception as e:  # a damaged manifest must not keep the daemon from starting
                log.warning("skipping %s: unreadable manifest (%s)", model_dir, e)
        return found

    def model_dir(self, name: str, version: int) -> Path:
        return self.root / name / str(version)

    def remove(self, name: str, version: int) -> None:
        shutil.rmtree(self.model_dir(name, version), ignore_errors=True)
