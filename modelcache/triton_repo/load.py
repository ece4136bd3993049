"""Triton's repository load as it serves (model control in explicit mode): `POST v2/repository/models/NAME/load`,
gRPC RepositoryModelLoad, tritonclient's `load_model(name, config=..., files=...)`.

Triton reads the model's directory again at every load: a model copied into the repository since the start is
loaded, one whose config.pbtxt or files changed is reloaded. Two parameters change where it reads from
(model_repository_manager.cc, r24.10): `config`, the configuration as JSON in place of config.pbtxt; and
`file:<path>` (bytes), the model's files, written into a fresh directory in place of the repository's, which
then needs `config`. Here a load imports that one model as `modelcache import-triton` does (importer.py), with
`replace`: a version changed since its import is removed and added again. The daemon's `triton_repository`
is where a load without files reads; a name with no directory there is a model added another way, which a load
only brings into memory (the front's plain load). Runs in a front, on an executor thread (it packs).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..errors import InputError, ModelCacheError, from_code
from .config import parse_config_json

FILE_PREFIX = "file:"


def is_repository_load(name: str, parameters: dict, triton_repository: str) -> bool:
    """Whether a load of `name` reads a model directory (the request's files, or the Triton repository's) rather
    than only bringing a model modelcache has into memory."""
    return bool(parameters) or bool(triton_repository) and (Path(triton_repository) / name).is_dir()


def check_model_name(name: str) -> None:
    """Triton's checks (ValidateModelName), in its words, then modelcache's own rule for a model's name: a load
    writes the request's files under it."""
    from ..store.packing import check_name
    if not name.strip():
        raise InputError("Model name cannot be empty. Please enter a valid name to deploy.")
    if name.strip() == ".." or "/" in name:
        raise InputError(f"invalid model name '{name}', model name must not contain path traversal characters")
    try:
        check_name(name)
    except ModelCacheError as e:
        raise InputError(str(e)) from None


def check_parameters(parameters: dict) -> tuple[object, dict]:
    """(the `config` override as a ModelConfig or None, {relative path: bytes} of the `file:` ones), refused in
    Triton's words: an unknown parameter, a file of the wrong type or outside the model's directory, files
    without a config."""
    config, files = None, {}
    for key, value in parameters.items():
        if key == "config":
            config = parse_config_json(value)
        elif key.startswith(FILE_PREFIX):
            if not isinstance(value, (bytes, bytearray)):
                raise InputError(f"File parameter '{key}' must have bytes type for its value")
            relative = os.path.normpath(key[len(FILE_PREFIX):])
            if os.path.isabs(relative) or relative == "." or relative.split(os.sep)[0] == "..":
                raise InputError(f"Invalid file parameter '{key}' with normalized path '{relative}' must stay "
                                 "within model directory.")
            files[relative] = bytes(value)
        else:
            kind = "string" if isinstance(value, str) else "bytes" if isinstance(value, (bytes, bytearray)) else \
                type(value).__name__
            raise InputError(f"Unrecognized load parameter '{key}' with type '{kind}'")
    if files and config is None:
        raise InputError("Load parameter 'config' must be specified for model file override")
    return config, files


def repository_load(name: str, parameters: dict, settings, triton_repository: str) -> list[str]:
    """Import the model `name` from the request's files or from `triton_repository`, replacing versions changed
    since their import; the importer's lines. An error of the kind that stopped it (an InputError for a refused
    parameter or model, the daemon's own), its text after Triton's words (load_failed), when it was not imported."""
    check_model_name(name)
    try:
        return _load(name, parameters, settings, triton_repository)
    except ModelCacheError as e:   # (its kind kept: a refused input, a model in use, a disk that failed)
        raise from_code(e.code, f"{load_failed(name)}: {e}") from None


def load_failed(name: str) -> str:
    """How Triton's load failures begin (model_repository_manager.cc): clients and its own examples look for it."""
    return f"failed to load '{name}', failed to poll from model repository"


def _load(name: str, parameters: dict, settings, triton_repository: str) -> list[str]:
    from .importer import import_repository
    config, files = check_parameters(parameters)
    lines: list[str] = []
    work = None
    if files:
        work = Path(tempfile.mkdtemp(prefix="modelcache-load-"))
        root = work
    else:
        root = Path(triton_repository) if triton_repository else None
        if root is None or not (root / name).is_dir():   # (a config alone: the files it configures are missing)
            where = f"the Triton repository {root} has no directory {name!r}" if root else \
                "the daemon has no triton_repository"
            raise InputError(f"a config override applies to the model's files, and {where}; send them with it "
                             "(`file:` parameters)")
    try:
        if work is not None:
            _write_files(work / name, files)
        # A version to replace is packed while it serves, then swapped in once what holds it lets go (a front's
        # sessions within its next report); the daemon waits front_hold_s + 1 s for that (daemon/swaps.py).
        report = import_repository(root, settings, only=[name], out=lines.append, replace=True,
                                   overrides=None if config is None else {name: config})
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    if report.failed or report.skipped:   # (the first error's kind: an input refused, a model in use, a full disk)
        code = report.errors[0].code if report.errors else InputError.code
        raise from_code(code, "; ".join(lines[:-1] or lines))
    return lines


def _write_files(model_dir: Path, files: dict) -> None:
    for relative, data in files.items():
        path = model_dir / relative
        if path.parent.exists() and not path.parent.is_dir():
            raise InputError(f"Invalid file parameter '{FILE_PREFIX}{relative}', directory has been created as a "
                             "file")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        except OSError as e:
            raise ModelCacheError(f"cannot write {relative} for the import: {e}") from None
