"""Import a Triton model repository: every model directory planned (config.py), then each ONNX model's
versions added with their configuration, through the running daemon or, with none, into the repository.

Idempotent: a version already in modelcache from the same .onnx file (its sha256) with the same completed
configuration is left alone, so the daemon's import at start adds only what is new. A version there from
another file or configuration is refused with a line rather than replaced: removing what clients may be
using is the operator's call (`modelcache rm`). A model is imported whole or not at all: every version is
planned and checked before the first is added, and versions added before a later one fails are removed.
Each model gets its lines: imported, unchanged, skipped (another backend), refused (why), and one warning
listing the configuration fields modelcache does not honour.

A repository load (Triton's model-control API, triton_repo/load.py) imports one model with `replace`: there the
request is the operator's call, so a version whose file changed since its import is packed again and swapped in
for the one serving (daemon/swaps.py), as Triton's reload swaps it, unless a client's session keeps the old one;
one whose configuration alone changed is configured in place.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DaemonUnavailable, InputError, ModelCacheError, ModelNotFound, PermissionDenied
from .config import NotOnnx, ModelPlan, plan_model
from .ensemble import EnsemblePlan, StepNotServed, check_steps

log = logging.getLogger("modelcache.triton")


@dataclass
class Report:
    imported: list = field(default_factory=list)    # "name@version" added now
    unchanged: list = field(default_factory=list)   # "name@version" already there, the same
    skipped: list = field(default_factory=list)     # model names of other backends
    failed: list = field(default_factory=list)      # model names refused or failed
    errors: list = field(default_factory=list)      # the ModelCacheErrors that refused or failed them

    def summary(self, root) -> str:
        return (f"{root}: {len(self.imported)} versions imported, {len(self.unchanged)} unchanged, "
                f"{len(self.skipped)} models skipped (not ONNX), {len(self.failed)} refused")


def import_repository(root, settings, only=None, dry_run: bool = False, out=print, replace: bool = False,
                      overrides: dict | None = None) -> Report:
    """Import every model directory of `root` (or those named in `only`); `out(line)` says what happened.
    `replace`: a version there from another file or configuration is replaced rather than refused.
    `overrides`: {model name: ModelConfig} given in place of those models' config.pbtxt."""
    from ..store.packing import model_io
    root = Path(root)
    if not root.is_dir():
        raise InputError(f"{root} is not a directory: give a Triton model repository (MODEL/config.pbtxt, "
                         "MODEL/VERSION/model.onnx)")
    names = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if only:
        missing = [n for n in only if n not in names]
        if missing:
            raise InputError(f"{root} has no model directory {missing[0]!r}; it has {names}")
        names = [n for n in names if n in only]
    target = None if dry_run else _target(settings)
    report = Report()
    planned: dict = {}        # name -> ModelPlan: the ONNX models imported (or unchanged), for ensembles' steps
    skipped: dict = {}        # name -> what it is (another backend's model)
    ensembles: list = []      # EnsemblePlans, imported once every model they may name is
    try:
        for name in names:
            try:
                plan = plan_model(root / name, lambda path: _by_file(path, "io", model_io),
                                  (overrides or {}).get(name))
            except NotOnnx as e:
                report.skipped.append(name)
                skipped[name] = e.what
                out(str(e))
                continue
            except ModelCacheError as e:
                report.failed.append(name)
                report.errors.append(e)
                out(f"{e}: not imported")
                continue
            if isinstance(plan, EnsemblePlan):
                ensembles.append(plan)
                continue
            planned[name] = plan
            if plan.not_honoured:
                out(f"warning: {name}: config.pbtxt fields modelcache does not honour (served as if absent): "
                    f"{', '.join(plan.not_honoured)}")
            if target is None:
                out(f"{name}: would import version{'s' if len(plan.versions) > 1 else ''} "
                    f"{', '.join(str(v) for v, _ in plan.versions)} ({plan.batching_text()})")
                continue
            _apply(plan, target, report, out, replace)
        for plan in ensembles:
            _apply_ensemble(plan, target, report, out, {n: p for n, p in planned.items() if n not in report.failed},
                            skipped, set(report.failed), replace)
    finally:
        if target is not None:
            target.close()
    out(report.summary(root))
    return report


def _apply(plan: ModelPlan, target, report: Report, out, replace: bool = False) -> None:
    added, adding, replaced, gone = [], None, [], []   # gone: versions replaced, the old one removed
    try:
        todo, reconfigure = [], []
        for version, path in plan.versions:
            key = f"{plan.name}@{version}"
            stored = target.stored(plan.name, version)
            sha = None if stored is None else _sha256(path)
            if stored is None:
                todo.append((version, path))
            elif stored.same(sha, plan):
                report.unchanged.append(key)
                out(f"{key}: unchanged, not imported again")
            elif replace and stored.same_weights(sha, plan):   # (the config alone changed: no pack again)
                reconfigure.append(version)
            elif replace:
                todo.append((version, path))
                replaced.append(version)
            else:
                raise InputError(f"{key} is already in modelcache from another file or configuration; import "
                                 "with --replace (or load it over HTTP or gRPC) to replace it")
        for version, path in todo:
            adding = version
            if version in replaced:   # (refused while in use: then the version stays as it was, served)
                out(f"{plan.name}@{version}: changed since its import; replacing the version imported before")
                target.replace(str(path), plan.name, version, plan.declared, plan.opt_level)
                gone.append(version)
            else:
                target.add(str(path), plan.name, version, plan.declared, plan.opt_level)
            added.append(version)
            report.imported.append(f"{plan.name}@{version}")
        for version in reconfigure:   # (after the adds: a failed add leaves every version as it was)
            adding = version
            target.configure(plan.name, version, plan.declared)
            report.imported.append(f"{plan.name}@{version}")
            out(f"{plan.name}@{version}: its configuration changed since its import, its file did not: the "
                "configuration replaced in place, its packed weights kept")
    except ModelCacheError as e:
        report.errors.append(e)
        for version in added:   # the model whole or not at all
            report.imported.remove(f"{plan.name}@{version}")
            try:
                target.remove(plan.name, version)
            except ModelCacheError as undo:
                out(f"{plan.name}@{version}: could not remove it after the failure: {undo}")
        report.failed.append(plan.name)
        text = str(e)
        if not text.startswith(plan.name):
            text = f"{plan.name}{'' if adding is None else f'@{adding}'}: {text}"
        undone = f" (version{'s' if len(added) > 1 else ''} {', '.join(map(str, added))}, added before it, removed)" \
            if added else ""
        out(f"{text}: not imported{undone}")
        if gone:   # (their old copies were removed before the failure: the repository's files are what remains)
            out(f"{plan.name}: version{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} no longer served "
                "(the copies imported before were replaced); load it again once its files are fixed")
        return
    if added:
        filled = f"; auto-completed: {', '.join(plan.completed)}" if plan.completed else ""
        out(f"{plan.name}: imported version{'s' if len(added) > 1 else ''} {', '.join(map(str, added))} "
            f"({plan.batching_text()}{filled})")
    if replace:
        _retire(plan, target, out)


def _retire(plan: ModelPlan, target, out) -> None:
    """A load's versions the model's version policy no longer serves (its directory gone, a `latest` moved on)
    are removed, as Triton unloads them; only versions imported from a Triton repository, and not one in use
    (it stays, said so, until the next load)."""
    served = {v for v, _ in plan.versions}
    for version in target.imported_versions(plan.name):
        if version in served:
            continue
        try:
            target.remove(plan.name, version)
            out(f"{plan.name}@{version}: no longer served by its version policy; removed")
        except ModelCacheError as e:
            out(f"{plan.name}@{version}: no longer served by its version policy, but left: {e}")


def _apply_ensemble(plan: EnsemblePlan, target, report: Report, out, planned: dict, skipped: dict,
                    refused: set, replace: bool = False) -> None:
    """Check the ensemble's steps, then add its versions (not again when the same configuration is there)."""
    try:
        check_steps(plan, planned, skipped, refused, known=(lambda name: None) if target is None else target.known)
    except StepNotServed as e:
        report.skipped.append(plan.name)
        out(str(e))
        return
    except ModelCacheError as e:
        report.failed.append(plan.name)
        report.errors.append(e)
        out(f"{plan.name}: {e}: not imported")
        return
    versions = ", ".join(map(str, plan.versions))
    if target is None:
        out(f"{plan.name}: would import ensemble version{'s' if len(plan.versions) > 1 else ''} {versions} "
            f"({plan.steps_text()})")
        return
    added = []
    try:
        for version in plan.versions:
            key = f"{plan.name}@{version}"
            stored = target.stored_ensemble(plan.name, version)
            if stored == plan.config:
                report.unchanged.append(key)
                out(f"{key}: unchanged, not imported again")
                continue
            if stored is not None and not replace:
                raise InputError(f"{key} is already in modelcache with another configuration; import with "
                                 "--replace (or load it over HTTP or gRPC) to replace it")
            if stored is not None:
                target.remove(plan.name, version)
            target.add_ensemble(plan.name, version, plan.config)
            added.append(version)
            report.imported.append(key)
    except ModelCacheError as e:
        report.failed.append(plan.name)
        report.errors.append(e)
        out(f"{plan.name}: {e}: not imported")
        return
    if added:
        out(f"{plan.name}: imported ensemble version{'s' if len(added) > 1 else ''} {', '.join(map(str, added))} "
            f"({plan.steps_text()})")


@dataclass
class Stored:
    """What modelcache has of a version, to compare with a plan of it."""
    sha256: str          # of the .onnx file it was packed from
    config: dict         # the completed configuration it was imported with
    labels: dict         # its outputs' class labels
    opt_level: str       # the ORT optimization it was packed with

    def same(self, sha256: str, plan: ModelPlan) -> bool:
        return self.same_weights(sha256, plan) and (self.config, self.labels) == (plan.config, plan.labels)

    def same_weights(self, sha256: str, plan: ModelPlan) -> bool:
        """Packed from the same file as the plan would pack it: only its declared configuration may differ."""
        return self.sha256 == sha256 and plan.opt_level in (None, self.opt_level)


def _sha256(path: Path) -> str:
    """The file's sha256, as packing records it (source_sha256)."""
    from ..store.integrity import file_digest
    return _by_file(path, "sha256", lambda p: file_digest(Path(p), hashlib.sha256()))


# What a file read gave, by the file's identity and times: a front's repository loads read every version of the
# model again (ResNet-50: 0.24 s of parsing and hashing a load), mostly unchanged since the last (as Triton,
# which compares modification times). A file written, renamed over or touched has another key.
_FILE_FACTS: dict = {}
FILE_FACTS_MAX = 256


def _by_file(path, what: str, read):
    st = os.stat(path)
    key = (str(path), what, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _FILE_FACTS:
        if len(_FILE_FACTS) >= FILE_FACTS_MAX:
            del _FILE_FACTS[next(iter(_FILE_FACTS))]   # (the oldest read)
        _FILE_FACTS[key] = read(path)
    return copy.deepcopy(_FILE_FACTS[key])   # (the caller's to change)


def _target(settings):
    """Where versions go: the running daemon, else the repository directly (as `modelcache add` does)."""
    from ..client.connection import connect
    try:
        return _DaemonTarget(connect(settings.socket, timeout_s=settings.add_timeout_s))
    except PermissionDenied:
        raise   # a daemon runs but is not ours to use: writing our own repository instead would mislead
    except DaemonUnavailable:
        return _OfflineTarget(settings)


class _DaemonTarget:
    def __init__(self, client):
        self.client = client

    def _described(self, name: str, version: int | None):
        """The daemon's description of the version (None: its latest); None when it has none."""
        try:
            return self.client.describe(name, version)
        except ModelNotFound:
            return None

    def stored(self, name: str, version: int) -> Stored | None:
        """What the daemon has of the version; None when it has none."""
        d = self._described(name, version)
        if d is None:
            return None
        opt_level = next((m["opt_level"] for m in self.client.listing().models
                          if m["name"] == name and m["version"] == version), "")
        return Stored(d.source_sha256, d.model_config, d.labels, opt_level)

    def configure(self, name: str, version: int, declared: dict) -> None:
        self.client.configure(name, version, declared)

    def add(self, path: str, name: str, version: int, declared: dict, opt_level: str | None) -> None:
        self.client.add(path, name, version, opt_level, declared=declared)

    def replace(self, path: str, name: str, version: int, declared: dict, opt_level: str | None) -> None:
        """Packed while the version imported before serves, then swapped in for it (daemon/swaps.py)."""
        self.client.add(path, name, version, opt_level, declared=declared, replace=True)

    def remove(self, name: str, version: int) -> None:
        self.client.remove(name, version)

    def imported_versions(self, name: str) -> list[int]:
        """The versions of `name` the daemon has from a Triton repository (with a configuration)."""
        versions = [m["version"] for m in self.client.listing().models if m["name"] == name
                    and m["tier"] != "ensemble"]
        return [v for v in versions if (d := self._described(name, v)) is not None and d.model_config]

    def known(self, name: str):
        """(input names, output names) of the daemon's model `name` (its latest version); None when it has none."""
        d = self._described(name, None)
        if d is None:
            return None
        return {i["name"] for i in d.inputs + d.overridable}, {o["name"] for o in d.outputs}

    def stored_ensemble(self, name: str, version: int):
        d = self._described(name, version)
        return None if d is None else d.model_config

    def add_ensemble(self, name: str, version: int, config: dict) -> None:
        self.client.add_ensemble(name, version, config)

    def close(self) -> None:
        self.client.close()


class _OfflineTarget:
    def __init__(self, settings):
        from ..tiers.disk import Repository
        self.settings = settings
        self.repo = Repository(settings.repository_path)

    def stored(self, name: str, version: int) -> Stored | None:
        from ..store.format import MANIFEST_FILE, load_manifest
        d = self.repo.model_dir(name, version)
        if not (d / MANIFEST_FILE).exists():
            return None
        m = load_manifest(d)
        return Stored(m.source_sha256, m.model_config, m.labels, m.opt_level)

    def configure(self, name: str, version: int, declared: dict) -> None:
        import dataclasses
        from ..store.format import load_manifest, write_manifest
        d = self.repo.model_dir(name, version)
        write_manifest(d, dataclasses.replace(load_manifest(d), **declared))

    def add(self, path: str, name: str, version: int, declared: dict, opt_level: str | None) -> None:
        from ..store.packing import pack
        pack(path, self.repo.root, name, version, opt_level or self.settings.opt_level, owner_uid=os.getuid(),
             with_prepacked=self.settings.prepack, declared=declared)

    def remove(self, name: str, version: int) -> None:
        self.repo.remove(name, version)

    def replace(self, path: str, name: str, version: int, declared: dict, opt_level: str | None) -> None:
        """No daemon serves it: the version removed, then added again."""
        self.remove(name, version)
        self.add(path, name, version, declared, opt_level)

    def imported_versions(self, name: str) -> list[int]:
        return [v for _, v, _ in self.repo.version_dirs(name)
                if (stored := self.stored(name, v)) is not None and stored.config]

    def known(self, name: str):
        from ..store.format import load_manifest
        dirs = self.repo.version_dirs(name)
        if not dirs:
            return None
        m = load_manifest(dirs[-1][2])
        return {i.name for i in m.inputs + m.overridable}, {o.name for o in m.outputs}

    def stored_ensemble(self, name: str, version: int):
        from ..daemon.ensembles import EnsembleStore
        e = EnsembleStore(self.repo.root).load().get(name, {}).get(version)
        return None if e is None else e.config

    def add_ensemble(self, name: str, version: int, config: dict) -> None:
        from ..daemon.ensembles import EnsembleStore
        from ..executor.ensemble import Ensemble
        EnsembleStore(self.repo.root).put(Ensemble.of(name, version, config, os.getuid()))

    def close(self) -> None:
        pass
