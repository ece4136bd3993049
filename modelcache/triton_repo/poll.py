"""Triton's `--model-control-mode=poll`: the repository watched, each model imported again when its directory
changes (`modelcache import-triton REPO --poll SECONDS`; the daemon's `model_control = "poll"`).

Each pass lists the repository's model directories and fingerprints each (every file under it, with its size,
inode and times, as Triton compares modification times); a model whose fingerprint differs from the last pass's,
or that is new, is imported with `replace` (importer.py): a new model added, an edited configuration replaced
in place, a new file packed again once no session holds the version it replaces, versions the policy no longer
serves removed. A model whose import failed is tried again when its directory changes again (a model caught
half copied: the copy's end changes it). A directory that goes is said once and its model left served, where
Triton unloads it: removing a version clients may hold is the operator's call (`modelcache rm`).
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
    """Passes over the repository `root`; `import_models(names)` imports those models (with replace), `out(line)`
    says what a pass found."""

    def __init__(self, root: Path, import_models, out=print):
        self.root = Path(root)
        self.import_models = import_models
        self.out = out
        self.seen: dict = {}       # model name -> its directory's fingerprint at the last pass

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
            self.out(f"{name}: its directory is gone from {self.root}; still served (`modelcache rm {name}` removes it)")
        changed = sorted(name for name, fp in current.items() if self.seen.get(name) != fp)
        if changed:
            try:
                self.import_models(changed)
            except ModelCacheError as e:   # (the daemon restarting, say: the same models are tried next pass)
                self.out(f"{self.root}: {e}; trying again at the next pass")
                for name in changed:
                    current.pop(name)
                    if name in self.seen:
                        current[name] = self.seen[name]
        self.seen = current
        return changed

    def run(self, interval_s: float, sleep=time.sleep, passes: int | None = None) -> None:
        """Pass after pass, `interval_s` apart (from one pass's end to the next's start, as Triton's poll
        thread sleeps); `passes` bounds them (a test's), else until the process is stopped."""
        done = 0
        while passes is None or done < passes:
            self.poll_once()
            done += 1
            if passes is None or done < passes:
                sleep(interval_s)
