"""Triton's `--model-control-mode=poll`: the repository watched, each model imported again when its directory
changes (`modelcache import-triton REPO --poll SECONDS`; the daemon's `model_control = "poll"`).

Each pass lists the repository's model directories and fingerprints each (every file under it, with its size,
inode and times, as Triton compares modification times); a model whose fingerprint differs from the last pass's,
or that is new, is imported with `replace` (importer.py): a new model added, an edited configuration replaced
in place, a new file packed beside the version and swapped in for it (daemon/swaps.py), versions the policy no
longer serves removed. A model whose import failed is tried again when its directory changes again (a model
caught half copied: the copy's end changes it). A model whose directory goes is unloaded, as Triton unloads it:
not ready, its requests refused at the fronts; its versions stay stored (removing what clients may hold is the
operator's call, `modelcache rm`), and it is loaded again when its directory comes back.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..errors import ModelCacheError


def fingerprint(model_dir: Path) -> tuple:
    """Every file under `model_dir` (links followed: a repository of links, as Triton allows), with its size,
    inode and modification and change times: what a write, a rename over it or a removal changes."""
    entries = []
    for dirpath, dirnames, filenames in os.walk(model_dir, followlinks=True):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            try:
                st = os.stat(path)
            except OSError:   # (removed meanwhile, or a dangling link: the next pass sees the directory as it is)
                continue
            entries.append((os.path.relpath(path, model_dir), st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(entries)


class RepositoryPoller:
    """Passes over the repository `root`; `import_models(names)` imports those models (with replace; it may return
    the importer's Report), `set_unloaded(name, unloaded)` unloads a model whose directory went and loads it again
    when it comes back (None: such a model is only said, and left as it is); `out(line)` says what a pass found."""

    def __init__(self, root: Path, import_models, out=print, set_unloaded=None):
        self.root = Path(root)
        self.import_models = import_models
        self.set_unloaded = set_unloaded
        self.out = out
        self.seen: dict = {}       # model name -> its directory's fingerprint at the last pass
        self.gone: set = set()     # models unloaded because their directory went

    def model_dirs(self) -> dict | None:
        """{name: directory} of the repository's models; None (said) when it cannot be read."""
        try:
            return {d.name: d for d in self.root.iterdir() if d.is_dir() and not d.name.startswith(".")}
        except OSError as e:   # (the repository unmounted for a moment: what was seen stays seen)
            self.out(f"{self.root}: cannot be read: {e}; trying again at the next pass")
            return None

    def poll_once(self) -> list[str]:
        """One pass: the models new or changed since the last, imported; their names."""
        dirs = self.model_dirs()
        if dirs is None:
            return []
        current = {name: fingerprint(d) for name, d in dirs.items()}
        for name in sorted(set(self.seen) - set(current)):
            self._went(name)
        changed = sorted(name for name, fp in current.items() if self.seen.get(name) != fp)
        if changed:
            try:
                report = self.import_models(changed)
            except ModelCacheError as e:   # (the daemon restarting, say: the same models are tried next pass)
                self.out(f"{self.root}: {e}; trying again at the next pass")
                for name in changed:
                    current.pop(name)
                    if name in self.seen:
                        current[name] = self.seen[name]
            else:
                failed = set(getattr(report, "failed", ()))
                for name in sorted(self.gone & set(changed) - failed):
                    self._came_back(name)
        self.seen = current
        return changed

    def _went(self, name: str) -> None:
        where = f"{name}: its directory is gone from {self.root}"
        if self.set_unloaded is None:
            self.out(f"{where}; still served (`modelcache rm {name}` removes it)")
            return
        try:
            self.set_unloaded(name, True)
        except ModelCacheError as e:   # (a model never imported, or the daemon away: said, left as it is)
            self.out(f"{where}; not unloaded: {e}")
            return
        self.gone.add(name)
        self.out(f"{where}: unloaded, as Triton unloads it; its versions stay stored (`modelcache rm {name}` "
                 "removes them), and load again when it comes back")

    def _came_back(self, name: str) -> None:
        try:
            self.set_unloaded(name, False)
        except ModelCacheError as e:
            self.out(f"{name}: back in {self.root}, but not loaded: {e}; trying again at the next change")
            return
        self.gone.discard(name)
        self.out(f"{name}: back in {self.root}: loaded again")

    def run(self, interval_s: float, sleep=time.sleep, passes: int | None = None) -> None:
        """Pass after pass, `interval_s` apart (from one pass's end to the next's start, as Triton's poll
        thread sleeps); `passes` bounds them (a test's), else until the process is stopped."""
        done = 0
        while passes is None or done < passes:
            self.poll_once()
            done += 1
            if passes is None or done < passes:
                sleep(interval_s)
