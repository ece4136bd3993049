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
        self._settle_staged()
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

    def _settle_staged(self) -> None:
        """What a daemon that stopped between a replacing pack and its swap left (reservations.STAGED_PREFIX), at
        its next start: a staged version whose version is there was never swapped in, nor its replace answered:
        it goes, the version stays as it was. One whose version is not there stopped between the swap's two
        renames: it goes in."""
        for staged in self.root.glob(f"*/{reservations.STAGED_PREFIX}*"):
            version = staged.name[len(reservations.STAGED_PREFIX):]
            target = staged.parent / version
            if not version.isdigit() or not staged.is_dir():
                continue
            if target.exists():
                error = remove_tree(staged)
                if error is not None:
                    log.warning("could not remove %s, a replacement never swapped in (%s)", staged, error)
            else:
                with storage_errors(f"swapping in {staged.parent.name}@{version}", staged):
                    staged.rename(target)
                log.info("%s@%s: its replacement, packed before the daemon stopped, swapped in",
                         staged.parent.name, version)

    def replace(self, name: str, version: int, staged: Path) -> None:
        """Put a staged pack (reservations.staged_path) in place of the version: the old one renamed aside, then
        the staged one renamed in; on a failure between, the old one goes back (StorageError: as it was). What
        the old one's removal leaves, the next sweep clears. The caller makes sure nothing holds the old one."""
        d = self.model_dir(name, version)
        with storage_errors(f"replacing {name}@{version} in the repository", d):
            aside = self._aside(d) if d.exists() else None
            try:
                staged.rename(d)
            except BaseException:
                if aside is not None:
                    (aside / "v").rename(d)
                    remove_tree(aside)
                raise
        if aside is not None:
            self._tidy(aside, name, version)

    def remove(self, name: str, version: int) -> None:
        """Delete a version; renamed aside first, so a crash halfway leaves a `.tmp-*` that the next
        sweep clears (reservations.py). StorageError (the version still in place) when it cannot be
        renamed aside; once it is, what its files' removal leaves the next sweep clears."""
        d = self.model_dir(name, version)
        if not d.exists():
            return
        with storage_errors(f"removing {name}@{version} from the repository", d):
            aside = self._aside(d)
        self._tidy(aside, name, version)

    def _aside(self, d: Path) -> Path:
        """Rename a version's directory to `<aside>/v`, `<aside>` a `.tmp-*` directory a sweep clears (a crash
        before its removal leaves no half version); returns `<aside>`."""
        aside = Path(tempfile.mkdtemp(prefix=".tmp-removed-", dir=self.root))
        try:
            d.rename(aside / "v")
        except BaseException:
            remove_tree(aside)
            raise
        return aside

    @staticmethod
    def _tidy(aside: Path, name: str, version: int) -> None:
        error = remove_tree(aside)
        if error is not None:
            log.warning("%s@%d removed; %s stays until the next sweep of the repository (%s)", name, version, aside,
                        error)
