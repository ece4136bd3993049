"""The disk tier: a repository of packed models laid out as <root>/<name>/<version>/."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from ..errors import IntegrityError
from ..storage import remove_tree, storage_errors
from ..store import reservations
from ..store.format import Manifest, load_manifest, version_dirs

log = logging.getLogger("modelcache.disk")


class Repository:
    def __init__(self, root: Path):
        self.root = Path(root)
        # (name, version) -> why its manifest cannot be used: versions `scan` found but could not register.
        self.unreadable: dict[tuple[str, int], str] = {}

    def version_dirs(self, name: str | None = None) -> list[tuple[str, int, Path]]:
        """(name, version, directory) of every version directory, complete or not, sorted."""
        return version_dirs(self.root, name)

    def scan(self) -> list[tuple[Path, Manifest]]:
        """Every complete packed model; half-written ones (a crash during add) are removed. A version
        whose manifest is missing or damaged is left in place and listed in `unreadable`."""
        with storage_errors("opening the repository", self.root):
            self.root.mkdir(parents=True, exist_ok=True)
        reservations.sweep(self.root)
        found = []
        self.unreadable = {}
        for name, version, model_dir in self.version_dirs():
            try:
                manifest = load_manifest(model_dir)
                if (manifest.name, manifest.version) != (name, version):
                    raise IntegrityError(f"{name}@{version}: manifest.json is damaged (it names "
                                         f"{manifest.name}@{manifest.version})")
            except IntegrityError as e:  # a damaged manifest must not keep the daemon from starting
                log.error("%s", e)
                self.unreadable[(name, version)] = str(e)
                continue
            found.append((model_dir, manifest))
        return found

    def model_dir(self, name: str, version: int) -> Path:
        return self.root / name / str(version)

    def remove(self, name: str, version: int) -> None:
        """Delete a version; renamed aside first, so a crash halfway leaves a `.tmp-*` that the next
        sweep clears (reservations.py). StorageError (the version still in place) when it cannot be
        renamed aside; once it is, what its files' removal leaves the next sweep clears."""
        d = self.model_dir(name, version)
        if not d.exists():
            return
        with storage_errors(f"removing {name}@{version} from the repository", d):
            aside = Path(tempfile.mkdtemp(prefix=".tmp-removed-", dir=self.root))
            try:
                d.rename(aside / "v")
            except BaseException:
                remove_tree(aside)
                raise
        error = remove_tree(aside)
        if error is not None:
            log.warning("%s@%d removed; %s stays until the next sweep of the repository (%s)", name, version, aside,
                        error)
